"""Splitting a stage's backward into an input-gradient pass and a weight-gradient pass.

Zero-bubble schedules (ZB-H1, Qi et al. 2023) run a stage's backward as two
passes: I, the gradient of the stage's input (what the previous stage waits
for), and W, the gradients of its weights (which nothing waits for, so it
fills a bubble). In the paper, I keeps what W needs, so that W is only the
weight-gradient products (dW = X^T dY for a linear layer): it reruns no
forward and no part of I.

`split_backward` does that for any stage, whatever its layers: it traces the
stage's whole backward (`(inputs) -> (weight gradients, input gradient)`) to
one flat jaxpr and cuts its equations in two:

* I: every equation the input gradient depends on;
* W: every other equation the weight gradients depend on, reading the values
  I computed that it needs (the "handoff": for a linear layer, its input X
  when the forward was rerun, and its output's gradient dY).

A value both passes read that W can get by moving data only (slicing,
reshaping, casting the pass's own inputs, e.g. a weight cut from the stage's
flat parameter row or a residual unpacked from its slot) is recomputed in W,
not handed off, so no parameter-sized value waits in a slot. Likewise an
equation of I with an output only W reads (the transpose of a `lax.scan` over
stacked layers yields the stack's weight gradient with the input gradient) is
rerun in W from its operands, not handed off, where its operands are the
smaller of the two.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from parstrat._src.pipeline import backward_split
  >>> def backward(w1, w2, x, dy):  # two linear layers: gradients of (w1, w2) and of x
  ...   f = lambda w1, w2, x: jnp.tanh(x @ w1) @ w2
  ...   dw1, dw2, dx = jax.vjp(f, w1, w2, x)[1](dy)
  ...   return (dw1, dw2), dx
  >>> avals = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(4, 8), (8, 2), (3, 4), (3, 2)]]
  >>> split = backward_split.split_backward(backward, *avals)
  >>> [h.shape for h in split.handoff]  # layer 1's dY and layer 2's X
  [(3, 8), (3, 8)]
  >>> w1, w2, x, dy = (jnp.ones(a.shape) for a in avals)
  >>> dx, handoff = split.input_pass(w1, w2, x, dy)
  >>> (dw1, dw2) = split.weight_pass(handoff, w1, w2, x, dy)
  >>> bool(jnp.allclose(dw1, backward(w1, w2, x, dy)[0][0]))
  True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
from jax.extend import core as jex

from parstrat._src.pipeline import partition as partition_lib

#: Primitives that only move or cast data: a value computed from a pass's own inputs
#: through these alone is recomputed in W rather than handed off to it.
_DATA_MOVES = frozenset(
  (
    "slice",
    "dynamic_slice",
    "reshape",
    "squeeze",
    "expand_dims",
    "broadcast_in_dim",
    "convert_element_type",
    "transpose",
    "copy",
    "copy_p",
    "pad",
    "concatenate",
    "iota",
  )
)


@dataclasses.dataclass(frozen=True)
class BackwardSplit:
  """A backward cut into its input-gradient pass and its weight-gradient pass.

  Attributes:
    input_pass: `(*args) -> (input gradient (None unless asked for), handoff list)`.
    weight_pass: `(handoff, *args) -> weight gradients` (the pytree the traced
      backward returned first), from the same `args` the input pass got.
    handoff: the shapes and dtypes of what the input pass hands to the weight
      pass, in order.
  """

  input_pass: Callable[..., tuple[Any, list[jax.Array]]]
  weight_pass: Callable[..., Any]
  handoff: tuple[jax.ShapeDtypeStruct, ...]


def _is_var(v) -> bool:
  return not isinstance(v, jex.Literal)


def _needed(
  eqns: Sequence[Any], outs: Sequence[Any], keep: bool = False
) -> tuple[set[int], set[Any]]:
  """The indices of the equations `outs` depend on (and, with `keep`, of those with
  effects), and the variables they read."""
  need = {v for v in outs if _is_var(v)}
  kept = set()
  for i in range(len(eqns) - 1, -1, -1):
    if any(v in need for v in eqns[i].outvars) or (keep and eqns[i].effects):
      kept.add(i)
      need.update(v for v in eqns[i].invars if _is_var(v))
  return kept, need


def _sub_jaxpr(jaxpr, invars, outvars, eqns, name: str):
  return jex.Jaxpr(
    constvars=jaxpr.constvars,
    invars=list(invars),
    outvars=list(outvars),
    eqns=list(eqns),
    effects=frozenset().union(*(eqn.effects for eqn in eqns)),
    debug_info=jex.DebugInfo(
      "parstrat backward split",
      name,
      tuple(f"in{i}" for i in range(len(invars))),
      tuple(f"out{i}" for i in range(len(outvars))),
    ),
  )


def split_backward(
  backward: Callable[..., tuple[Any, Any]], *args: Any, input_gradient: bool = True
) -> BackwardSplit:
  """Cuts `backward` into the input-gradient pass and the weight-gradient pass.

  Args:
    backward: `(*args) -> (weight gradients, input gradient)`, each a pytree.
    *args: its arguments, as arrays or `jax.ShapeDtypeStruct` pytrees (only
      their shapes and dtypes are used: it is traced, not run).
    input_gradient: whether the input pass returns the input gradient. Without
      it (a first stage, whose input is the batch), the input pass computes only
      what the input gradient shares with the weight gradients (each layer's
      output gradient), not the input's own products, and returns None for it.

  Returns:
    The `BackwardSplit`. An equation with side effects (a callback, a print)
    runs in the input pass, as in a backward that is not split, and never in
    the weight pass.
  """
  flat_args, in_tree = jax.tree.flatten(args)
  out_tree = {}

  def flat_backward(*flat):
    weights, d_input = backward(*jax.tree.unflatten(in_tree, flat))
    leaves, out_tree["weights"] = jax.tree.flatten(weights)
    input_leaves, out_tree["input"] = jax.tree.flatten(d_input)
    out_tree["num_weights"] = len(leaves)
    return [*leaves, *input_leaves]

  avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in flat_args]
  closed = jax.make_jaxpr(flat_backward)(*avals)
  # Inlined, so a `jax.checkpoint` or `jax.jit` around a layer is not one indivisible equation.
  closed = jax.make_jaxpr(lambda *a: partition_lib.eval_inlined(closed.jaxpr, closed.consts, *a))(
    *avals
  )
  jaxpr, consts = closed.jaxpr, closed.consts
  eqns = jaxpr.eqns
  weight_outs = jaxpr.outvars[: out_tree["num_weights"]]
  input_outs = jaxpr.outvars[out_tree["num_weights"] :]
  in_input, input_reads = _needed(eqns, input_outs, keep=True)
  in_weight, weight_reads = _needed(eqns, weight_outs)
  # Values W can rebuild from its own inputs by moving data only.
  free = set(jaxpr.invars) | set(jaxpr.constvars)
  for eqn in eqns:
    if eqn.primitive.name in _DATA_MOVES and all(v in free for v in eqn.invars if _is_var(v)):
      free.update(eqn.outvars)

  # An I equation with an output only W reads computes weight gradients together with
  # the input gradient: a `lax.scan` over stacked layers (its transpose is one scan
  # yielding both), a `lax.cond`, a `lax.while_loop`. Handing that output off keeps a
  # weight-sized value per handoff slot; W reruns the equation instead, from its
  # operands, where those are smaller (a stack of layers: its residuals are a batch of
  # activations per layer), not where they are larger (a long scan over time with a
  # small weight, whose residuals grow with the sequence).
  def nbytes(values) -> int:
    return sum(v.aval.size * v.aval.dtype.itemsize for v in set(values))

  def cheaper_to_rerun(eqn) -> bool:
    handed = [v for v in eqn.outvars if v in weight_reads and v not in input_reads]
    operands = [v for v in eqn.invars if _is_var(v) and v not in free]
    return bool(handed) and nbytes(operands) < nbytes(handed)

  rerun = {i for i in in_input & in_weight if not eqns[i].effects and cheaper_to_rerun(eqns[i])}
  if not input_gradient:
    # Only what both gradients need (and what effects need): the input's own products
    # go, and so does an equation W reruns unless the rest of I reads it.
    shared = (in_input & in_weight) - rerun
    reads = [v for i in shared for v in eqns[i].invars if _is_var(v)]
    in_input = shared | _needed(eqns, reads)[0] | _needed(eqns, [], keep=True)[0]
    input_outs = []

  weight_eqns = [
    i
    for i in sorted(in_weight)
    if i not in in_input or i in rerun or all(v in free for v in eqns[i].outvars)
  ]
  computed_in_w = {v for i in weight_eqns for v in eqns[i].outvars}
  handoff: list[Any] = []
  for v in [*(v for i in weight_eqns for v in eqns[i].invars), *weight_outs]:
    if _is_var(v) and v not in free and v not in computed_in_w and v not in handoff:
      handoff.append(v)
  input_jaxpr = _sub_jaxpr(
    jaxpr, jaxpr.invars, [*input_outs, *handoff], [eqns[i] for i in sorted(in_input)], "I pass"
  )
  weight_jaxpr = _sub_jaxpr(
    jaxpr, [*handoff, *jaxpr.invars], weight_outs, [eqns[i] for i in weight_eqns], "W pass"
  )
  num_inputs = len(input_outs)

  def input_pass(*args):
    outs = jax.core.eval_jaxpr(input_jaxpr, consts, *jax.tree.leaves(args))
    values = outs[num_inputs:]
    if not input_gradient:
      return None, values
    return jax.tree.unflatten(out_tree["input"], outs[:num_inputs]), values

  def weight_pass(values, *args):
    leaves = jax.core.eval_jaxpr(weight_jaxpr, consts, *values, *jax.tree.leaves(args))
    return jax.tree.unflatten(out_tree["weights"], leaves)

  return BackwardSplit(
    input_pass,
    weight_pass,
    tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in handoff),
  )
