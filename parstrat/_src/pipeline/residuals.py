"""Keeping a stage's forward residuals for its backward instead of recomputing them.

By default (`activations="recompute"`) the pipeline engine stashes each stage's
input and its backward passes rerun the stage's forward. With "save", a forward
pass keeps what its backward needs (the residuals of `jax.vjp`), so no forward
runs twice; with a `jax.checkpoint_policies` name such as "dots_saveable" it
keeps what that policy saves and the backward recomputes the rest.

Residuals that are the stage's own parameters or its input are not stored
again (both are at hand in the backward); the others are packed into one slot
of per-device buffers, `Schedule.residual_slots` slots deep: one flat buffer
per dtype (float32 activations, and the int32 indices and bool masks of a
loss's backward), each residual in its own dtype, never bitcast to bytes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

#: What a pipeline can do with each stage's forward activations.
ACTIVATIONS = (
  "recompute",
  "save",
  "dots_saveable",
  "dots_with_no_batch_dims_saveable",
  "nothing_saveable",
)

#: What the backward passes rerun of each stage's forward under each `ACTIVATIONS`
#: value: all of it, its element-wise work (the "dots" policies keep the matmul
#: outputs), or nothing.
RERUNS = {
  "recompute": "all",
  "save": "nothing",
  "dots_saveable": "elementwise",
  "dots_with_no_batch_dims_saveable": "elementwise",
  "nothing_saveable": "all",
}

#: The policies "auto" measures for a pipeline: both ends of the trade and one between.
AUTO_CANDIDATES = ("recompute", "dots_saveable", "save")

_INPUT = "input"


def check_activations(activations: str) -> None:
  """Raises ValueError naming the choices if `activations` is not one of `ACTIVATIONS`."""
  if activations not in ACTIVATIONS:
    raise ValueError(f"Unknown activations {activations!r}; choose one of {list(ACTIVATIONS)}.")


@dataclasses.dataclass(frozen=True)
class Residuals:
  """What one stage's backward needs from its forward, found by tracing (no compute).

  Attributes:
    treedef: the structure of the stage's `jax.vjp` function (a pytree).
    sources: per residual leaf, the index of the stage parameter it is, "input"
      for the stage input, or None when it is stored.
    stored: the shapes and dtypes of the stored residuals, in order.
    through_input: whether the vjp is taken with respect to the stage's input
      too (always but on a stage 0 whose inputs autodiff cannot cross).
  """

  treedef: Any
  sources: tuple[int | str | None, ...]
  stored: tuple[jax.ShapeDtypeStruct, ...]
  through_input: bool = True


def slot_format(residuals: Sequence[Residuals]) -> tuple[jax.ShapeDtypeStruct, ...]:
  """One residual slot: per dtype any stage stores, a `[size]` array large enough for each.

  Sorted by dtype name; a single float32 `[1]` array when nothing is stored.
  """
  sizes: dict[np.dtype, int] = {}
  for r in residuals:
    for dtype, n in _sizes(r.stored).items():
      sizes[dtype] = max(sizes.get(dtype, 0), n)
  if not sizes:
    return (jax.ShapeDtypeStruct((1,), jnp.float32),)
  return tuple(jax.ShapeDtypeStruct((sizes[d],), d) for d in sorted(sizes, key=str))


def _sizes(avals: Sequence[Any]) -> dict[np.dtype, int]:
  sizes: dict[np.dtype, int] = {}
  for a in avals:
    dtype = jnp.dtype(a.dtype)
    sizes[dtype] = sizes.get(dtype, 0) + int(np.prod(a.shape))
  return sizes


def stage_function(staged, stage: int, x, y, dtype, activations: str):
  """`(leaves, input) -> (padded output, loss)` of one stage, under the remat policy."""

  def f(leaves, inp):
    return staged.apply(stage, leaves, inp, y, dtype, x)

  if activations in ("recompute", "save"):
    return f
  return jax.checkpoint(f, policy=getattr(jax.checkpoint_policies, activations))


def _vjp(f, leaves, inp, through_input: bool):
  """`jax.vjp` of a stage function over its parameters and input, or its parameters alone."""
  if through_input:
    return jax.vjp(f, leaves, inp)
  return jax.vjp(lambda leaves: f(leaves, inp), leaves)


def with_input_gradient(residuals: Residuals, gradients: tuple) -> tuple:
  """`(d leaves, d input)` from a `pullback`'s result (d input None without `through_input`)."""
  return gradients if residuals.through_input else (gradients[0], None)


def _split(vjp_fn, leaves, inp) -> tuple[list, Any, tuple[int | str | None, ...]]:
  res, treedef = jax.tree.flatten(vjp_fn)
  known: dict[int, int | str] = {id(leaf): i for i, leaf in enumerate(leaves)}
  known[id(inp)] = _INPUT
  return res, treedef, tuple(known.get(id(r)) for r in res)


def find_residuals(staged, stage: int, row, act, x, y, dtype, activations: str) -> Residuals:
  """The `Residuals` of stage `stage`, traced abstractly from (avals of) its arguments.

  The backward is traced too, so a stage autodiff cannot cross fails here. Stage
  0's input is the batch, whose gradient only ZB-H1's split reads (to find the
  gradient chain its I pass runs): where autodiff cannot cross the inputs (a
  `while_loop` or `pure_callback` on them), stage 0 is differentiated with
  respect to its parameters alone, as under "recompute".
  """
  found = {}

  def probe(row, act, x, y, through_input):
    leaves, inp = staged.stage_inputs(stage, row, act, x)
    f = stage_function(staged, stage, x, y, dtype, activations)
    outputs, vjp_fn = _vjp(f, leaves, inp, through_input)
    vjp_fn(jax.tree.map(jnp.zeros_like, outputs))  # (traced only: fails where autodiff does)
    res, found["treedef"], found["sources"] = _split(vjp_fn, leaves, inp)
    return [r for r, source in zip(res, found["sources"], strict=True) if source is None]

  for through_input in (True, False) if stage == 0 else (True,):
    try:
      stored = jax.eval_shape(functools.partial(probe, through_input=through_input), row, act, x, y)
      break
    except Exception:
      if not through_input:
        raise
  return Residuals(found["treedef"], found["sources"], tuple(stored), through_input)


def forward_saving(
  staged, stage: int, residuals: Residuals, leaves, inp, x, y, dtype, activations: str, slot
):
  """Runs the stage forward; returns `(padded output, loss, stored residuals packed in a slot)`."""
  f = stage_function(staged, stage, x, y, dtype, activations)
  (out, loss), vjp_fn = _vjp(f, leaves, inp, residuals.through_input)
  res, _, sources = _split(vjp_fn, leaves, inp)
  stored = [r for r, source in zip(res, sources, strict=True) if source is None]
  return out, loss, pack(stored, slot)


def pullback(residuals: Residuals, packed: Sequence[jax.Array], leaves, inp):
  """The stage's vjp function, rebuilt from its stored residuals, params and input."""
  stored = iter(unpack(packed, residuals.stored))
  res = [
    next(stored) if source is None else inp if source == _INPUT else leaves[source]
    for source in residuals.sources
  ]
  return jax.tree.unflatten(residuals.treedef, res)


def pack(arrays: Sequence[jax.Array], slot: Sequence[jax.ShapeDtypeStruct]) -> tuple:
  """The arrays flattened and concatenated per dtype, each zero-padded to its part of `slot`."""
  out = []
  for part in slot:
    flat = [x.reshape(-1) for x in arrays if jnp.dtype(x.dtype) == jnp.dtype(part.dtype)]
    flat = jnp.concatenate(flat) if flat else jnp.zeros((0,), part.dtype)
    out.append(jnp.pad(flat, (0, part.shape[0] - flat.shape[0])))
  return tuple(out)


def unpack(packed: Sequence[jax.Array], avals: Sequence[jax.ShapeDtypeStruct]) -> list[jax.Array]:
  """The inverse of `pack` for arrays shaped like `avals`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from parstrat._src.pipeline import residuals
    >>> arrays = [jnp.arange(3.0), jnp.array([True, False]), jnp.ones((2, 2))]
    >>> avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    >>> slot = residuals.slot_format([residuals.Residuals(None, (), tuple(avals))])
    >>> [(part.dtype.name, part.shape) for part in slot]  # one flat array per dtype
    [('bool', (2,)), ('float32', (7,))]
    >>> back = residuals.unpack(residuals.pack(arrays, slot), avals)
    >>> [b.tolist() for b in back]
    [[0.0, 1.0, 2.0], [True, False], [[1.0, 1.0], [1.0, 1.0]]]
  """
  parts = {jnp.dtype(p.dtype): p for p in packed}
  offsets = dict.fromkeys(parts, 0)
  out = []
  for aval in avals:
    dtype, n = jnp.dtype(aval.dtype), int(np.prod(aval.shape))
    start = offsets[dtype]
    out.append(lax.slice_in_dim(parts[dtype], start, start + n).reshape(aval.shape))
    offsets[dtype] = start + n
  return out
