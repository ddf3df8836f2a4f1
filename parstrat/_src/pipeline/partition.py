"""Cutting an unmodified model into contiguous pipeline stages.

The model is only used through its `apply` function: it is traced to a jaxpr,
the parameters are grouped into layers by their top-level key (a Haiku module
name such as ``"mlp/~/linear_1"``), and the jaxpr is cut at points where
exactly one value (the activation) crosses from one layer to the next. Each
stage is then a slice of the jaxpr's equations, evaluated with
`jax.core.eval_jaxpr`, so nothing depends on Haiku's internals.

Two kinds of values never cross a cut: those computed from constants alone (a
causal mask built in `apply`) are folded into constants, and those computed
from the model inputs alone (a padding mask every block reads) are recomputed
by each later stage that reads them, from the inputs every device holds.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

from parstrat._src import jaxpr_calls
from parstrat._src import trees

_MARKER_NAME = "parstrat_stage_boundary"


@functools.partial(jax.jit, inline=False)
def parstrat_stage_boundary(x: jax.Array) -> jax.Array:
  return x


def stage_boundary(x: jax.Array) -> jax.Array:
  """Marks a pipeline cut: a new stage starts right after this point.

  Place it in the model function between layers; it is the identity. When a
  model holds markers, `PipelineModelParallel` cuts exactly there (and the
  number of stages must be the number of markers + 1).

  Example:
    >>> import haiku as hk, jax, parstrat
    >>> def net(x):
    ...   x = jax.nn.swish(hk.Linear(512)(x))
    ...   x = parstrat.pipeline.stage_boundary(x)
    ...   return hk.Linear(10)(x)
    >>> model = hk.transform(net)
  """
  return parstrat_stage_boundary(x)


def _is_marker(eqn) -> bool:
  return eqn.params.get("name") == _MARKER_NAME


@dataclasses.dataclass(frozen=True)
class Layer:
  """One layer of the model: a group of parameters (a Haiku module; in another
  tree, the parameters one dict holds)."""

  name: str
  params: int
  flops: int


@dataclasses.dataclass(frozen=True)
class StagePlan:
  """Which layers each pipeline stage holds, and where the jaxpr is cut.

  Attributes:
    layers: the model's layers in execution order.
    stage_layers: for each stage, the indices of its layers.
    cuts: the equation indices at which stages 1..P-1 start.
    balance: "params", "flops", "markers" or "manual": how the cuts were chosen.
  """

  layers: tuple[Layer, ...]
  stage_layers: tuple[tuple[int, ...], ...]
  cuts: tuple[int, ...]
  balance: str

  @property
  def num_stages(self) -> int:
    return len(self.stage_layers)

  def stage_params(self) -> list[int]:
    return [sum(self.layers[i].params for i in group) for group in self.stage_layers]

  def stage_flops(self) -> list[int]:
    return [sum(self.layers[i].flops for i in group) for group in self.stage_layers]

  def __str__(self) -> str:
    lines = [f"pipeline plan: {self.num_stages} stages, cut by {self.balance}"]
    lines.append(f"{'stage':>5}  {'params':>10}  {'FLOPs/example':>13}  layers")
    for s, group in enumerate(self.stage_layers):
      names = ", ".join(self.layers[i].name for i in group)
      lines.append(f"{s:>5}  {self.stage_params()[s]:>10,}  {self.stage_flops()[s]:>13,}  {names}")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class _Trace:
  jaxpr: Any  # jex.Jaxpr
  consts: list
  param_vars: list  # one var per flattened param leaf
  input_vars: list  # one var per flattened input leaf
  leaf_layer: list[int]  # layer index of each flattened leaf
  layer_names: list[str]
  leaf_names: list[str]  # each flattened leaf's path, e.g. "['mlp/~/linear_0']['w']"


def _trace(apply_fn: Callable, params: Any, inputs: Any) -> _Trace:
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
  leaves = [leaf for _, leaf in leaves_with_path]

  def flat_apply(leaves, x):
    return apply_fn(jax.tree.unflatten(treedef, leaves), x)

  closed = jax.make_jaxpr(flat_apply)(leaves, inputs)
  if any(_call_body(eqn) is not None for eqn in closed.jaxpr.eqns):
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    closed = jax.make_jaxpr(functools.partial(eval_inlined, closed.jaxpr, closed.consts))(*avals)
  jaxpr, consts = _fold_constants(closed.jaxpr, closed.consts)
  jaxpr = jaxpr.replace(
    eqns=_sink_parameter_math(jaxpr.eqns, [*jaxpr.invars[: len(leaves)], *jaxpr.constvars])
  )
  names = []
  leaf_layer = []
  for name, _ in trees.layers_and_names(params):
    if name not in names:
      names.append(name)
    leaf_layer.append(names.index(name))
  return _Trace(
    jaxpr=jaxpr,
    consts=consts,
    param_vars=list(jaxpr.invars[: len(leaves)]),
    input_vars=list(jaxpr.invars[len(leaves) :]),
    leaf_layer=leaf_layer,
    layer_names=names,
    leaf_names=[jax.tree_util.keystr(path) for path, _ in leaves_with_path],
  )


def _call_body(eqn) -> jex.ClosedJaxpr | None:
  """The body of a `jaxpr_calls.WRAPPERS` equation (None for any other, and a marker).

  Those bodies (`jax.checkpoint`, which `hk.remat` uses, and `jax.jit`) are
  inlined before the model is cut, so a layer inside one is a layer like the
  others. Their values are the same either way; the pipeline's own
  `activations` policy decides what its stages keep.
  """
  if eqn.primitive.name not in jaxpr_calls.WRAPPERS or "jaxpr" not in eqn.params:
    return None
  if _is_marker(eqn):
    return None
  body = eqn.params["jaxpr"]
  return body if isinstance(body, jex.ClosedJaxpr) else jex.ClosedJaxpr(body, ())


def eval_inlined(jaxpr, consts, *args) -> list[Any]:
  """`jax.core.eval_jaxpr`, with the bodies of `_call_body` equations evaluated in line."""
  env: dict[Any, Any] = {}

  def read(v):
    return v.val if isinstance(v, jex.Literal) else env[v]

  env.update(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  for eqn in jaxpr.eqns:
    values = [read(v) for v in eqn.invars]
    body = _call_body(eqn)
    if body is not None:
      outs = eval_inlined(body.jaxpr, body.consts, *values)
    else:
      outs = _bind(eqn, values)
    env.update(zip(eqn.outvars, outs, strict=True))
  return [read(v) for v in jaxpr.outvars]


def _bind(eqn, values: Sequence[Any]) -> list[Any]:
  """The outputs of one equation applied to `values`."""
  bound = eqn.primitive.get_bind_params(eqn.params)  # (subfuns, params) before JAX 0.7
  subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
  outs = eqn.primitive.bind(*subfuns, *values, **params)
  return list(outs) if eqn.primitive.multiple_results else [outs]


#: The most elements a value computed from constants alone may have to be folded into
#: a constant of the trace (a causal mask, a position table, a scan's zero carry);
#: larger ones are computed where they are used.
FOLD_LIMIT = 1 << 22


def _fold_constants(jaxpr, consts: Sequence[Any]) -> tuple[Any, list[Any]]:
  """Evaluates the equations that read no input and no parameter; their values become constants.

  A causal mask built inside `apply` (`jnp.tril(jnp.ones((T, T)))`) and read by
  every attention layer would otherwise be a second value live across each
  cut between blocks, so no block boundary could be cut. As a constant, each
  stage that reads it holds its own copy, like any other constant.
  """
  known = dict(zip(jaxpr.constvars, consts, strict=True))
  kept = []
  with jax.ensure_compile_time_eval():  # (also when the pipeline is traced inside a step)
    for eqn in jaxpr.eqns:
      foldable = (
        not eqn.effects
        and not _is_marker(eqn)
        and all(v in known for v in eqn.invars if _is_var(v))
        and all(np.prod(getattr(v.aval, "shape", ())) <= FOLD_LIMIT for v in eqn.outvars)
      )
      if not foldable:
        kept.append(eqn)
        continue
      values = [known[v] if _is_var(v) else v.val for v in eqn.invars]
      known.update(zip(eqn.outvars, _bind(eqn, values), strict=True))
  used = {v for eqn in kept for v in eqn.invars if _is_var(v)}
  used |= {v for v in jaxpr.outvars if _is_var(v)}
  constvars = [v for v in known if v in used]
  return jaxpr.replace(constvars=constvars, eqns=kept), [known[v] for v in constvars]


def _is_var(v) -> bool:
  return not isinstance(v, jex.Literal)


def _computed_from(eqns: Sequence[Any], sources: Sequence[Any]) -> set[Any]:
  """`sources` and the values of the effect-free equations that read only such values."""
  derived = set(sources)
  for eqn in eqns:
    if not eqn.effects and all(v in derived for v in eqn.invars if _is_var(v)):
      derived.update(eqn.outvars)
  return derived


def _sink_parameter_math(eqns: Sequence[Any], sources: Sequence[Any]) -> list[Any]:
  """Moves each equation computed from parameters alone to just before its first use.

  A model may transform its weights up front, e.g. a mixed-precision policy
  casts every parameter to bfloat16 at the start of `apply`; left there, the
  cast weights of later layers would be live across every cut. Sunk to where
  they are used, they join their layer's stage. The order of everything else
  is kept.
  """
  derived = _computed_from(eqns, sources)
  producer: dict[Any, int] = {}
  emitted: set[int] = set()
  out: list[Any] = []

  def emit_inputs(eqn) -> None:
    # The deferred equations `eqn` needs, found without recursion (a weight may
    # pass through a long chain), emitted in their original, valid order.
    needed, stack = set(), [eqn]
    while stack:
      for v in stack.pop().invars:
        i = producer.get(v) if _is_var(v) else None
        if i is not None and i not in emitted and i not in needed:
          needed.add(i)
          stack.append(eqns[i])
    for i in sorted(needed):
      emitted.add(i)
      out.append(eqns[i])

  for i, eqn in enumerate(eqns):
    if not eqn.effects and all(v in derived for v in eqn.invars if _is_var(v)):
      producer.update((v, i) for v in eqn.outvars)
      continue
    emit_inputs(eqn)
    out.append(eqn)
  for i in sorted(set(producer.values()) - emitted):  # feeding the outputs, or nothing
    if i not in emitted:
      emit_inputs(eqns[i])
      emitted.add(i)
      out.append(eqns[i])
  return out


def _eqn_flops(eqn, *, only_dots: bool = False) -> int:
  """2 per multiply-add of a `dot_general` or convolution, else 1 per output element.

  With `only_dots`, the matmuls' and convolutions' alone: what `dots_saveable` keeps.
  """
  if not eqn.outvars:  # e.g. a debug callback
    return 0
  out = eqn.outvars[0].aval
  size = int(np.prod(out.shape)) if hasattr(out, "shape") else 1
  if eqn.primitive.name == "dot_general":
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs_shape = eqn.invars[0].aval.shape
    return 2 * size * int(np.prod([lhs_shape[d] for d in lhs_contract]))
  if eqn.primitive.name == "conv_general_dilated":
    # Each output element takes one kernel slice: the kernel's size over its outputs;
    # a dilated input (a transposed convolution) leaves all but 1 in d^n taps on zeros.
    kernel = eqn.invars[1].aval.shape
    outputs = kernel[eqn.params["dimension_numbers"].rhs_spec[0]]
    zeros = int(np.prod(eqn.params.get("lhs_dilation") or (1,)))
    return 2 * size * (int(np.prod(kernel)) // outputs) // zeros
  inner = [p for p in eqn.params.values() if isinstance(p, jex.ClosedJaxpr)]
  if inner:
    return sum(_eqn_flops(e, only_dots=only_dots) for e in inner[0].jaxpr.eqns)
  return 0 if only_dots else size


@dataclasses.dataclass(frozen=True)
class _Analysis:
  layer_order: list[int]  # original layer index, in order of first use
  first_read: dict[int, int]
  last_read: dict[int, int]
  live: list[list[Any]]  # live[c]: values crossing a cut before eqn c (see `from_inputs`)
  markers: list[int]
  eqn_layer: list[int]  # the (ordered) layer each equation is counted towards
  from_inputs: set[Any]  # values computed from the model inputs and constants alone
  bodied: list[tuple[str, frozenset]]  # see `_bodied_reads`


def _analyse(trace: _Trace) -> _Analysis:
  eqns = trace.jaxpr.eqns
  param_layer = {v: trace.leaf_layer[i] for i, v in enumerate(trace.param_vars)}
  first_read: dict[int, int] = {}
  last_read: dict[int, int] = {}
  # (per leaf: a layer may read some of its parameters and never others)
  read = {v for v in trace.jaxpr.outvars if _is_var(v) and v in param_layer}
  for i, eqn in enumerate(eqns):
    for v in eqn.invars:
      if _is_var(v) and v in param_layer:
        layer = param_layer[v]
        first_read.setdefault(layer, i)
        last_read[layer] = i
        read.add(v)
  unread = [i for i, v in enumerate(trace.param_vars) if v not in read]
  if unread:
    leaves = [trace.leaf_names[i] for i in unread]
    unused = list(dict.fromkeys(trace.layer_names[trace.leaf_layer[i]] for i in unread))
    raise ValueError(
      f"Parameters {', '.join(leaves)} (layer(s) {', '.join(map(repr, unused))}) are never "
      "used by the model's apply; a pipeline gives each parameter to the stage that reads it."
    )
  layer_order = sorted(first_read, key=first_read.get)

  defined = {v: -1 for v in trace.input_vars}
  last_use: dict[Any, int] = {}
  for i, eqn in enumerate(eqns):
    for v in eqn.invars:
      if _is_var(v):
        last_use[v] = i
    for v in eqn.outvars:
      defined[v] = i
  for v in trace.jaxpr.outvars:
    if _is_var(v):
      last_use[v] = len(eqns)
  # Values computed from the model inputs (and constants) alone, such as a padding mask
  # every block reads: each stage that reads one recomputes it from the inputs, which
  # every device holds, so they never cross a cut.
  from_inputs = _computed_from(eqns, [*trace.input_vars, *trace.jaxpr.constvars])
  live = []
  for c in range(len(eqns) + 1):
    live.append(
      [v for v, d in defined.items() if d < c and last_use.get(v, -2) >= c and v not in from_inputs]
    )
  markers = [i for i, eqn in enumerate(eqns) if _is_marker(eqn)]
  rank = {layer: r for r, layer in enumerate(layer_order)}
  eqn_layer = []
  current = 0
  for eqn in eqns:
    for v in eqn.invars:
      if _is_var(v) and v in param_layer:
        current = max(current, rank[param_layer[v]])
    eqn_layer.append(current)
  return _Analysis(
    layer_order, first_read, last_read, live, markers, eqn_layer, from_inputs, _bodied_reads(trace)
  )


def _tied_reason(tied: Sequence[str], layers: Sequence[str], note: str = "") -> str:
  """Why no cut exists before `layers`: the parameters of `tied` are read on both sides."""
  where = (
    f"layer {layers[0]!r}"
    if len(layers) == 1
    else (f"each of the {len(layers)} layers {layers[0]!r} .. {layers[-1]!r}")
  )
  return (
    f"the parameters of {', '.join(map(repr, tied))} are used both before and after {where} "
    + (
      note
      or "(a weight shared or tied across the cut, e.g. an output head that reuses the "
      "embedding); a pipeline cannot split them"
    )
  )


def _separate_leaves_note(trace: _Trace, tied: Sequence[int], at: int) -> str:
  """For tied layers none of whose leaves is read both before equation `at` and from it
  on (a Haiku module, or the top-level "~", holding a position table read first and a
  temperature read last): which leaves are read where, and the fix. Else ""."""
  sides: dict[int, tuple[list[str], list[str]]] = {}
  for i, v in enumerate(trace.param_vars):
    if trace.leaf_layer[i] not in tied:
      continue
    reads = [j for j, eqn in enumerate(trace.jaxpr.eqns) if v in eqn.invars]
    if any(j < at for j in reads) and any(j >= at for j in reads):
      return ""  # one weight read on both sides: shared or tied
    before, after = sides.setdefault(trace.leaf_layer[i], ([], []))
    (before if reads and reads[0] < at else after).append(trace.leaf_names[i])
  parts = [
    f"{trace.layer_names[layer]!r} holds {', '.join(before)} (read before) and "
    f"{', '.join(after)} (read after)"
    for layer, (before, after) in sides.items()
  ]
  return (
    f"(no weight is read on both sides: {'; '.join(parts)}; a pipeline gives each layer, the "
    "module that holds a parameter, to one stage, so create those parameters in different "
    "modules, e.g. under their own `hk.name_scope`)"
  )


def _has_body(eqn) -> bool:
  """Whether `eqn` runs code of its own (a `cond`'s branches, a `while`'s body, ...)."""
  for value in eqn.params.values():
    values = value if isinstance(value, (tuple, list)) else (value,)
    if any(isinstance(v, (jex.ClosedJaxpr, jex.Jaxpr)) for v in values):
      return True
  return False


def _bodied_reads(trace: _Trace) -> list[tuple[str, frozenset]]:
  """Each equation with a body of its own (a `cond`) that takes parameters of more than
  one layer: its primitive's name and those layers (a cast parameter, as under a
  precision policy, counted as its layer's)."""
  layers_of: dict[Any, frozenset] = {
    v: frozenset({trace.leaf_layer[i]}) for i, v in enumerate(trace.param_vars)
  }
  layers_of.update({v: frozenset() for v in trace.jaxpr.constvars})
  found = []
  for eqn in trace.jaxpr.eqns:
    reads = [v for v in eqn.invars if _is_var(v)]
    layers = frozenset().union(*(layers_of.get(v, frozenset()) for v in reads))
    if not eqn.effects and all(v in layers_of for v in reads):
      layers_of.update({v: layers for v in eqn.outvars})
    if len(layers) > 1 and _has_body(eqn):
      found.append((eqn.primitive.name, layers))
  return found


def _across_reason(
  trace: _Trace, analysis: _Analysis, earlier: Sequence[int], later: Sequence[int]
) -> str | None:
  """Why no cut exists between `earlier` and `later` layers where one equation with a
  body (a `cond`) takes parameters of both: the cut cannot split what it reads."""
  for primitive, layers in analysis.bodied:
    if layers & set(earlier) and layers & set(later):
      names = ", ".join(repr(trace.layer_names[x]) for x in [*earlier, *later] if x in layers)
      return (
        f"one `{primitive}` equation (hk.cond, hk.switch, lax.cond or a loop given the "
        f"parameters) takes the parameters of layers {names} at once, so which of them its "
        "body reads where is not known to the cut; keep such a branch within one layer's "
        "module, or compute both sides and pick with jnp.where"
      )
  return None


def _summary(reasons: dict[int, tuple[str, tuple[str, ...], str, str]]) -> str:
  """The reasons no cut exists, tied weights first and each tied group in one sentence."""
  tied: dict[tuple[str, ...], list[str]] = {}
  notes: dict[tuple[str, ...], str] = {}
  other = []
  for why, again, layer, note in reasons.values():
    if again:
      tied.setdefault(again, []).append(layer)
      notes.setdefault(again, note)
    else:
      other.append(why)
  other = list(dict.fromkeys(other))  # (one equation across every cut is said once)
  return "; ".join(
    [_tied_reason(names, layers, notes[names]) for names, layers in tied.items()] + other
  )


def _boundary_cut(
  trace: _Trace, analysis: _Analysis, k: int
) -> tuple[int | None, str, tuple[str, ...], str]:
  """The latest single-value cut between ordered layers k-1 and k, or why none exists.

  Returns:
    `(cut, why, tied, note)`: the equation index of the cut (None when there is
    none), the reason when there is none, the earlier layers whose
    parameters are read on both sides (a shared or tied weight; else empty),
    and, for those, what `_separate_leaves_note` says (else "").
  """
  order = analysis.layer_order
  across = _across_reason(trace, analysis, order[:k], order[k:])
  if across is not None:  # (its reads would look tied, interleaved or a skip connection)
    return None, across, (), ""
  before = max(analysis.last_read[layer] for layer in order[:k])
  after = min(analysis.first_read[layer] for layer in order[k:])
  a, b = trace.layer_names[order[k - 1]], trace.layer_names[order[k]]
  if before >= after:
    back = [x for x in order[:k] if analysis.last_read[x] >= after]
    again = [trace.layer_names[x] for x in back]
    # An earlier layer comes back (a shared or tied weight), or the one before the cut
    # is read again once the next is done (a head reusing the embedding just before it);
    # else the two alternate (a, b, a, b).
    if again != [a] or analysis.last_read[order[k - 1]] > analysis.last_read[order[k]]:
      note = _separate_leaves_note(trace, back, after)
      return None, _tied_reason(again, [b], note), tuple(again), note
    return (
      None,
      f"layers {a!r} and {b!r} are used interleaved (equations {after}..{before})",
      (),
      "",
    )
  # (a stage boundary carries one batch-leading value: [B, ...], not a time-major [T, B, ...])
  batch = trace.input_vars[0].aval.shape[0] if trace.input_vars[0].aval.shape else None
  single = [c for c in range(after, before, -1) if len(analysis.live[c]) == 1]
  for c in single:
    shape = analysis.live[c][0].aval.shape
    if shape and shape[0] == batch:
      return c, "", (), ""
  if single:
    shape = analysis.live[single[0]][0].aval.shape
    return (
      None,
      f"between layers {a!r} and {b!r} the one activation that crosses has shape "
      f"{tuple(shape)}, without the batch ({batch}) as its leading axis (e.g. time-major "
      "[T, B, ...], or feature-major [F, B] from matmuls chained inside one `jax.vmap`, as "
      "bias-less equinox `Linear`s give: `jax.vmap` each layer on its own)",
      (),
      "",
    )
  fewest = min(range(before + 1, after + 1), key=lambda c: len(analysis.live[c]))
  values = ", ".join(v.aval.str_short() for v in analysis.live[fewest])
  return (
    None,
    f"between layers {a!r} and {b!r} there is no point where a single activation "
    f"crosses ({len(analysis.live[fewest])} or more values are live, e.g. a skip connection: "
    f"{values})",
    (),
    "",
  )


def _min_max_partition(costs: Sequence[int], allowed: set[int], stages: int) -> list[int]:
  """Splits `costs` into `stages` contiguous groups minimising the largest sum.

  Boundaries (group start indices) must be in `allowed`. Returns the starts of
  groups 1..stages-1.
  """
  n = len(costs)
  prefix = np.concatenate([[0], np.cumsum(costs)])
  inf = float("inf")
  best = [[inf] * (n + 1) for _ in range(stages + 1)]
  arg = [[-1] * (n + 1) for _ in range(stages + 1)]
  best[0][0] = 0
  for s in range(1, stages + 1):
    for j in range(1, n + 1):
      if j < n and j not in allowed:
        continue
      for i in range(s - 1, j):
        if i != 0 and i not in allowed:
          continue
        cost = max(best[s - 1][i], prefix[j] - prefix[i])
        if cost < best[s][j]:
          best[s][j], arg[s][j] = cost, i
  starts = []
  j = n
  for s in range(stages, 0, -1):
    i = arg[s][j]
    starts.append(i)
    j = i
  return sorted(starts)[1:]


def plan_stages(
  apply_fn: Callable,
  params: Any,
  inputs: jax.ShapeDtypeStruct,
  stages: int,
  *,
  balance: str = "params",
  cuts: Sequence[int] | None = None,
) -> StagePlan:
  """Cuts the model into `stages` contiguous stages.

  Args:
    apply_fn: `(params, inputs) -> outputs`.
    params: the params pytree (arrays or `jax.ShapeDtypeStruct`).
    inputs: abstract inputs (a pytree of batch-leading values).
    stages: the number of stages P.
    balance: "params" (default) or "flops": what the automatic cut balances.
    cuts: layer indices at which stages 1..P-1 start, overriding the automatic
      cut (e.g. `(1,)` puts layer 0 on stage 0 and the rest on stage 1).

  Returns:
    The `StagePlan`.

  Raises:
    ValueError: if `stages` exceeds the number of layers, the cuts are invalid,
      or the model cannot be cut into that many stages (naming where).
  """
  if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
    raise ValueError(f"stages must be a positive integer, got {stages!r}.")
  if balance not in ("params", "flops"):
    raise ValueError(f"balance must be 'params' or 'flops', got {balance!r}.")
  trace = _trace(apply_fn, params, inputs)
  outputs = jax.eval_shape(apply_fn, params, inputs)
  if not isinstance(outputs, jax.ShapeDtypeStruct):  # also a one-leaf dict or tuple
    structure = jax.tree.structure(outputs)
    raise ValueError(
      f"A pipelined model must return one array (the logits); it returns a pytree of "
      f"{len(trace.jaxpr.outvars)} output(s), {structure}. The pipeline carries "
      "one array out of its last stage: use data_parallel, fsdp or tensor for models with "
      "several outputs, or return the array itself."
    )
  rows = jax.tree.leaves(inputs)[0].shape[0]
  one_more = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows + 1, *x.shape[1:]), x.dtype), inputs)
  for count, out in ((rows, outputs), (rows + 1, jax.eval_shape(apply_fn, params, one_more))):
    # (traced at a second size: a time-major [T, B, ...] whose T equals B fails there)
    if not out.shape or out.shape[0] != count:
      raise ValueError(
        f"A pipelined model's output must have the batch as its first axis (the pipeline "
        f"carries each microbatch's rows to the last stage and joins their outputs along "
        f"it); on {count} rows it has shape {tuple(out.shape)}. Return it batch-first (a "
        "time-major [T, B, ...] can be transposed in the loss_fn), or use data_parallel, "
        "fsdp or tensor."
      )
  analysis = _analyse(trace)
  order = analysis.layer_order
  n = len(order)
  leaves = jax.tree.leaves(params)
  size = [0] * len(trace.layer_names)
  for leaf, layer in zip(leaves, trace.leaf_layer, strict=True):
    size[layer] += int(np.prod(leaf.shape))
  flops = [0] * n
  first_input = jax.tree.leaves(inputs)[0]
  batch = first_input.shape[0] if first_input.shape else 1
  for eqn, layer in zip(trace.jaxpr.eqns, analysis.eqn_layer, strict=True):
    flops[layer] += _eqn_flops(eqn)
  layers = tuple(
    Layer(trace.layer_names[order[r]], size[order[r]], flops[r] // max(batch, 1)) for r in range(n)
  )
  names = [layer.name for layer in layers]

  if analysis.markers:
    if cuts is not None:
      raise ValueError("The model has stage_boundary markers; do not also pass cuts.")
    eqn_cuts = [m + 1 for m in analysis.markers]
    if len(eqn_cuts) + 1 != stages:
      raise ValueError(
        f"The model has {len(eqn_cuts)} stage_boundary marker(s), so it has "
        f"{len(eqn_cuts) + 1} stages, but stages={stages} was asked for."
      )
    for m, c in zip(analysis.markers, eqn_cuts, strict=True):
      if len(analysis.live[c]) != 1:
        raise ValueError(
          f"The stage_boundary marker at equation {m} cannot be cut: "
          f"{len(analysis.live[c])} values cross it (e.g. a skip connection)."
        )
    # A stage starts at the first layer read after its marker (the equation
    # right after a marker may be parameter-free, e.g. an activation).
    order = analysis.layer_order
    starts = []
    for m, c in zip(analysis.markers, eqn_cuts, strict=True):
      after = [r for r, layer in enumerate(order) if analysis.first_read[layer] >= c]
      if not after or any(analysis.last_read[layer] >= c for layer in order[: after[0]]):
        raise ValueError(
          f"The stage_boundary marker at equation {m} does not fall between layers: "
          + ("no layer follows it." if not after else "a layer before it is used after it.")
        )
      starts.append(after[0])
    if starts != sorted(set(starts)) or starts[0] == 0:
      raise ValueError("Every stage_boundary marker needs at least one layer on each side of it.")
    groups = _groups_from_starts(starts, n)
    return StagePlan(layers, groups, tuple(eqn_cuts), "markers")

  if stages > n:
    raise ValueError(
      f"stages={stages} exceeds the model's {n} layers ({', '.join(names)}); "
      f"use at most {n} stages."
    )
  boundary = {}
  reasons = {}
  for k in range(1, n):
    c, why, tied, note = _boundary_cut(trace, analysis, k)
    if c is None:
      reasons[k] = (why, tied, names[k], note)
    else:
      boundary[k] = c
  if cuts is not None:
    starts = list(cuts)
    if (
      len(starts) != stages - 1
      or any(isinstance(s, bool) or not isinstance(s, int) for s in starts)
      or starts != sorted(set(starts))
      or (starts and (starts[0] < 1 or starts[-1] > n - 1))
    ):
      raise ValueError(
        f"cuts must be {stages - 1} increasing layer indices in 1..{n - 1} "
        f"(where stages 1..{stages - 1} start), got {tuple(cuts)}."
      )
    bad = [k for k in starts if k not in boundary]
    if bad:
      raise ValueError(f"Cannot cut before layer {bad[0]}: {reasons[bad[0]][0]}.")
    how = "manual cut points"
  else:
    if len(boundary) < stages - 1:
      detail = _summary(reasons)
      raise ValueError(
        f"The model cannot be cut into {stages} stages: only {len(boundary)} of its "
        f"{n - 1} layer boundaries are cuttable ({detail})."
      )
    costs = [layer.params if balance == "params" else layer.flops for layer in layers]
    starts = _min_max_partition(costs, set(boundary), stages)
    how = f"balanced {balance}"
  groups = _groups_from_starts(starts, n)
  return StagePlan(layers, groups, tuple(boundary[k] for k in starts), how)


def _groups_from_starts(starts: Sequence[int], n: int) -> tuple[tuple[int, ...], ...]:
  bounds = [0, *starts, n]
  return tuple(tuple(range(bounds[s], bounds[s + 1])) for s in range(len(bounds) - 1))


@dataclasses.dataclass(frozen=True)
class StageProgram:
  """The model cut into stage functions for one (micro)batch shape.

  Attributes:
    stage_fns: `stage_fns[s](leaves, x, inputs=None) -> y`, where `leaves` are
      that stage's parameter leaves (in `stage_leaves[s]` order) and `x` the
      model's inputs (any pytree) for stage 0, the activation entering stage s
      otherwise; a later stage with `reads_inputs[s]` also takes the model's
      `inputs`.
    stage_leaves: indices into the flattened params of each stage's leaves.
    boundaries: the abstract value entering each stage (`boundaries[0]` is the
      inputs pytree) plus the output (`boundaries[P]`).
    reads_inputs: per stage, whether a stage after the first recomputes values
      from the model inputs (a padding mask read by every block).
  """

  stage_fns: tuple[Callable[..., jax.Array], ...]
  stage_leaves: tuple[tuple[int, ...], ...]
  boundaries: tuple[jax.ShapeDtypeStruct, ...]
  reads_inputs: tuple[bool, ...]


def _cuts_at(trace: _Trace, analysis: _Analysis, plan: StagePlan) -> list[int]:
  """The equations at which `plan`'s stages 1..P-1 start in this trace of the model.

  `plan.cuts` index the equations of the trace `plan_stages` made, at the sample's
  rows; a trace at other rows (a microbatch) may hold other equations (JAX emits no
  `broadcast_in_dim` for a `jnp.broadcast_to` to the shape a value already has, as a
  class token's `[1, 1, D]` at one row), so the cuts are found again between the same
  layers, or at the same markers.
  """
  if plan.balance == "markers":
    cuts = [m + 1 for m in analysis.markers]
    if len(cuts) != len(plan.cuts) or any(len(analysis.live[c]) != 1 for c in cuts):
      raise ValueError(
        f"The model's stage_boundary markers cut it into {len(plan.cuts) + 1} stages at the "
        f"sample's rows but not at {_rows(trace)} rows."
      )
    return cuts
  cuts = []
  for group in plan.stage_layers[1:]:
    cut, why, _, _ = _boundary_cut(trace, analysis, group[0])
    if cut is None:
      raise ValueError(
        f"The pipeline's cut before layer {plan.layers[group[0]].name!r}, found at the sample's "
        f"rows, does not exist at {_rows(trace)} rows (a microbatch): {why}. The model traces "
        "differently at another batch size; pass init a sample with a microbatch's rows."
      )
    cuts.append(cut)
  return cuts


def _rows(trace: _Trace) -> int | None:
  shape = trace.input_vars[0].aval.shape if trace.input_vars else ()
  return shape[0] if shape else None


def stage_program(apply_fn: Callable, params: Any, inputs: Any, plan: StagePlan) -> StageProgram:
  """Traces the model at `inputs`' shape and cuts it where `plan` says.

  Raises:
    ValueError: if a cut activation does not keep the batch as its leading axis.
  """
  trace = _trace(apply_fn, params, inputs)
  eqns = trace.jaxpr.eqns
  analysis = _analyse(trace)
  cuts = _cuts_at(trace, analysis, plan)
  bounds = [0, *cuts, len(eqns)]
  live_in = [trace.input_vars] + [[analysis.live[c][0]] for c in cuts]
  live_out = [v[0] for v in live_in[1:]] + [trace.jaxpr.outvars[0]]
  param_index = {v: i for i, v in enumerate(trace.param_vars)}
  const_index = {v: i for i, v in enumerate(trace.jaxpr.constvars)}
  producer = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}
  fns, leaves_per_stage, boundaries, reads_inputs = [], [], [], []
  batch = jax.tree.leaves(inputs)[0].shape[0]
  for s in range(len(bounds) - 1):
    segment = eqns[bounds[s] : bounds[s + 1]]
    # What it reads of the values computed from the inputs before it, it recomputes.
    todo = [
      v
      for eqn in segment
      for v in eqn.invars
      if _is_var(v) and v in analysis.from_inputs and producer.get(v, bounds[s]) < bounds[s]
    ]
    earlier: set[int] = set()
    while todo:
      i = producer.get(todo.pop())
      if i is not None and i not in earlier:
        earlier.add(i)
        todo.extend(v for v in eqns[i].invars if _is_var(v))
    segment = [eqns[i] for i in sorted(earlier)] + list(segment)
    reads = s > 0 and any(
      v in trace.input_vars for eqn in segment for v in eqn.invars if _is_var(v)
    )
    used = []
    consts_used = []
    for eqn in segment:
      for v in eqn.invars:
        if _is_var(v) and v in param_index and v not in used:
          used.append(v)
        if _is_var(v) and v in const_index and v not in consts_used:
          consts_used.append(v)
    used.sort(key=param_index.get)
    if s == 0:
      boundaries.append(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), inputs))
    else:
      aval = live_in[s][0].aval
      if not aval.shape or aval.shape[0] != batch:
        raise ValueError(
          f"The activation entering stage {s} has shape {aval.shape}; a pipeline cut needs "
          f"the batch ({batch}) as its leading axis."
        )
      boundaries.append(jax.ShapeDtypeStruct(aval.shape, aval.dtype))
    sub = jex.Jaxpr(
      constvars=consts_used,
      invars=[*used, *live_in[s], *(trace.input_vars if reads else [])],
      outvars=[live_out[s]],
      eqns=segment,
      effects=jex.no_effects,
      debug_info=jex.DebugInfo(
        "parstrat pipeline stage",
        f"stage {s}",
        tuple(f"param{i}" for i in range(len(used)))
        + tuple(f"input{i}" for i in range(len(live_in[s])))
        + tuple(f"model_input{i}" for i in range(len(trace.input_vars) if reads else 0)),
        ("output",),
      ),
    )
    consts = [trace.consts[const_index[v]] for v in consts_used]

    def run(leaves, x, inputs=None, _sub=sub, _consts=consts, _reads=reads):
      model_inputs = jax.tree.leaves(inputs) if _reads else []
      (out,) = jax.core.eval_jaxpr(_sub, _consts, *leaves, *jax.tree.leaves(x), *model_inputs)
      return out

    fns.append(run)
    leaves_per_stage.append(tuple(param_index[v] for v in used))
    reads_inputs.append(reads)
  out = trace.jaxpr.outvars[0].aval
  boundaries.append(jax.ShapeDtypeStruct(out.shape, out.dtype))
  return StageProgram(tuple(fns), tuple(leaves_per_stage), tuple(boundaries), tuple(reads_inputs))


def flat_width(aval: jax.ShapeDtypeStruct) -> int:
  """Elements per example of a batch-leading value."""
  return int(np.prod(aval.shape[1:]))


def pad_to(x: jax.Array, width: int) -> jax.Array:
  """Flattens `[B, ...]` to `[B, width]`, zero-padding the features."""
  flat = x.reshape(x.shape[0], -1)
  return jnp.pad(flat, ((0, 0), (0, width - flat.shape[1])))


def unpad(x: jax.Array, aval: jax.ShapeDtypeStruct) -> jax.Array:
  """The inverse of `pad_to` for a value shaped like `aval`."""
  return x[:, : flat_width(aval)].reshape(aval.shape).astype(aval.dtype)
