"""Which parameters tensor parallelism splits, read off the model's dataflow.

One analysis serves `TensorParallel` and `Hybrid(model>1)`. The model's
`apply` is traced to a jaxpr (nested `jit` and `custom_jvp` calls inlined) and
followed value by value:

* A *linear* weight is a 2-D parameter used exactly once, as `x @ w` (one
  axis of the input, usually its last, against the weight's rows), like
  `hk.Linear`'s `w`, or as `w @ x.T` (the weight's columns against one axis of
  the input, the output features leading), as an equinox `Linear`'s
  `weight @ x` is under `jax.vmap` (its input's last axis, or its leading one
  when the input is the `[features, batch]` output of the layer before, as in
  bias-less `Linear`s under one `vmap`). Either of the weight's dimensions may
  be the one contracted, and the weight may be transposed first (a
  PyTorch-style `[out, in]` weight in `x @ w.T` or `einsum("bi,oi->bo", x,
  w)`); its output features are its other dimension, and
  land on the output's last axis for `x @ w`, its leading one for `w @ x.T`.
  A weight of more dimensions may contract several with as many of the
  input's (Flax's attention: `[in, heads, head_dim]` kernels, and an output
  kernel `[heads, head_dim, out]` over the heads and head_dim); its output
  features are the first dimension it leaves free (the heads), and a bias of
  as many dimensions (`[heads, head_dim]`) is split along the one that lands
  on the split axis.
* A linear layer whose output width `T` divides is tried *column-parallel*:
  its output is split by features. The split is followed forward through
  element-wise ops (activations, bias adds, which split the bias too, scaling
  by constants, dropout masks), reshapes that keep the split features
  leading (`[.., H * D] -> [.., H, D]`: attention heads, when `T` divides
  `H`), transposes, reductions over other axes (a softmax over keys) and
  matmuls that keep the split axis as a batch axis (attention scores).
* The split ends at the linear layer that *consumes* it (`h @ w2`, contracting
  the split features, maybe with others): that layer is *row-parallel*, split
  along the dimension contracted with the split one, and its output needs one
  all-reduce over "model" (its bias is added after it, whole).
* Column layers whose splits meet (query, key and value meeting in the
  scores) form one group with all the row layers that end them. A group is
  kept only when it is closed: every value it splits ends in one of its row
  layers. Anything else a split value reaches (a reduction over the split
  features such as LayerNorm, a residual add with an unsplit value, a
  permutation of the features, a reshape that mixes them, a model output, a
  stage cut) drops the group; its layers are then tried again in the next
  round (the next layer may start a pair of its own).

Everything not in a kept group is replicated, and every parameter carries the
reason. The partitioner then needs exactly one all-reduce per group forward
(and one per distinct input of its column layers backward), with no
all-gather: a group is closed, so no split value meets an unsplit one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex
from jax.sharding import PartitionSpec as P

from parstrat._src import jaxpr_calls
from parstrat._src import trees

_UNARY = frozenset(
  """neg sign floor ceil round is_finite exp exp2 log log1p expm1 tanh logistic sin cos tan
  asin acos atan sinh cosh asinh acosh atanh abs sqrt rsqrt cbrt integer_pow square
  convert_element_type reduce_precision copy copy_p stop_gradient not erf erfc erf_inv lgamma
  digamma real imag conj population_count clz optimization_barrier""".split()
)
_NARY = frozenset(
  """add add_any sub mul div rem pow max min atan2 nextafter and or xor eq ne lt le gt ge
  select_n clamp shift_left shift_right_logical shift_right_arithmetic""".split()
)
_REDUCE = frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or".split())
_ARG_REDUCE = frozenset(("argmax", "argmin"))
_CUMULATIVE = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())
_VIEW = frozenset(("convert_element_type", "copy", "copy_p", "reduce_precision"))
#: Call-like primitives whose body is inlined for the analysis.
_INLINE = jaxpr_calls.WRAPPERS | jaxpr_calls.CUSTOM_DERIVATIVES


@dataclasses.dataclass(frozen=True)
class LeafSplit:
  """What tensor parallelism does with one parameter leaf.

  Attributes:
    layer: the leaf's layer (its top-level key, a Haiku module name).
    name: the leaf's key within the layer (e.g. "w"), "" for a top-level leaf.
    shape: the leaf's shape.
    dim: the dimension split over the "model" axis, or None (replicated).
    reason: why.
  """

  layer: str
  name: str
  shape: tuple[int, ...]
  dim: int | None
  reason: str

  @property
  def path(self) -> str:
    return f"{self.layer}/{self.name}" if self.name else self.layer


@dataclasses.dataclass(frozen=True)
class SplitGroup:
  """Column-parallel layers and the row-parallel layers that consume their split.

  Attributes:
    columns: the column-parallel layers (weights split by output features).
    rows: the row-parallel layers (weights split by input features); each
      output is all-reduced once in the forward pass.
    reduce_widths: elements per example all-reduced forward (the rows'
      outputs) and backward (the gradients of the columns' distinct inputs,
      0 for the model's own input, which needs none).
  """

  columns: tuple[str, ...]
  rows: tuple[str, ...]
  reduce_widths: tuple[int, int]

  def __str__(self) -> str:
    return (
      f"column-parallel {', '.join(self.columns)} -> row-parallel {', '.join(self.rows)} "
      f"({len(self.rows)} all-reduce(s) forward)"
    )


@dataclasses.dataclass(frozen=True)
class TensorSplit:
  """The tensor-parallel plan of a model: per leaf, a split dimension and a reason.

  `str(plan)` lists the groups and every layer with what is done to it.

  Attributes:
    parts: the size of the "model" axis the plan is for.
    leaves: one `LeafSplit` per flattened parameter leaf, in tree order.
    groups: the column/row groups that are split.
    split_flops: forward FLOPs per example inside the groups (the only ones
      the "model" axis divides).
    treedef: the params' tree structure.
  """

  parts: int
  leaves: tuple[LeafSplit, ...]
  groups: tuple[SplitGroup, ...]
  split_flops: int
  treedef: Any

  @property
  def split_dims(self) -> tuple[int | None, ...]:
    """Per flattened leaf, the split dimension or None."""
    return tuple(leaf.dim for leaf in self.leaves)

  def specs(self, axis: str) -> Any:
    """A `PartitionSpec` per leaf (the params' tree), split over `axis`."""

    def spec(leaf: LeafSplit) -> P:
      if leaf.dim is None:
        return P()
      return P(*[axis if d == leaf.dim else None for d in range(len(leaf.shape))])

    return jax.tree.unflatten(self.treedef, [spec(leaf) for leaf in self.leaves])

  def lines(self, stage_of: Mapping[str, int] | None = None) -> list[str]:
    """One line per layer (or per leaf where a layer's leaves differ).

    With `stage_of` (layer -> pipeline stage), each line starts with the stage.
    """
    by_layer: dict[str, list[LeafSplit]] = {}
    for leaf in self.leaves:
      by_layer.setdefault(leaf.layer, []).append(leaf)
    order = sorted(by_layer, key=lambda name: stage_of[name]) if stage_of else list(by_layer)
    out = []
    for layer in order:
      leaves = by_layer[layer]
      where = f"stage {stage_of[layer]}: " if stage_of else ""
      reasons = {leaf.reason for leaf in leaves}
      if len(reasons) == 1:
        out.append(f"{where}{layer}: {reasons.pop()}")
      else:
        out.extend(f"{where}{leaf.path}: {leaf.reason}" for leaf in leaves)
    return out

  def describe(self, stage_of: Mapping[str, int] | None = None) -> str:
    """The groups, then a line per layer (see `lines`)."""
    head = [f"tensor-parallel plan over model={self.parts}: {len(self.groups)} split group(s)"]
    head += [f"  group {i}: {g}" for i, g in enumerate(self.groups)]
    return "\n".join(head + [f"  {line}" for line in self.lines(stage_of)])

  def __str__(self) -> str:
    return self.describe()


class _Op:
  """One equation of the inlined jaxpr."""

  __slots__ = ("prim", "params", "ins", "outs")

  def __init__(self, prim: str, params: Mapping[str, Any], ins: list, outs: list):
    self.prim, self.params, self.ins, self.outs = prim, params, ins, outs


def _is_var(v) -> bool:
  return not isinstance(v, jex.Literal)


def _sub_jaxpr(eqn) -> tuple[Any, list] | None:
  """(jaxpr, consts) of an inlinable call, or None."""
  if eqn.primitive.name not in _INLINE:
    return None
  for value in eqn.params.values():
    if isinstance(value, jex.ClosedJaxpr):
      jaxpr, consts = value.jaxpr, list(value.consts)
    elif isinstance(value, jex.Jaxpr):
      jaxpr, consts = value, []
    else:
      continue
    if len(jaxpr.invars) == len(eqn.invars) and len(jaxpr.outvars) == len(eqn.outvars):
      return jaxpr, consts
  return None


class _Value:
  """A fresh variable for one inlined call's result (a jaxpr may be called twice)."""

  __slots__ = ("aval",)

  def __init__(self, aval):
    self.aval = aval


def _inline(jaxpr, env: dict, consts: set, ops: list[_Op], top: bool = True) -> None:
  """Appends `jaxpr`'s equations to `ops`, inlining calls; `env` renames variables."""

  def read(v):
    return env.get(v, v) if _is_var(v) else v

  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    sub = _sub_jaxpr(eqn)
    if sub is None:
      outs = list(eqn.outvars)
      if not top:  # a called jaxpr's variables are shared by its calls: rename them
        outs = [_Value(v.aval) for v in outs]
        env.update(zip(eqn.outvars, outs, strict=True))
      ops.append(_Op(eqn.primitive.name, eqn.params, ins, outs))
      continue
    inner, inner_consts = sub
    inner_env = dict(zip(inner.invars, ins, strict=True))
    consts.update(inner.constvars)
    del inner_consts
    _inline(inner, inner_env, consts, ops, top=False)
    for out, inner_out in zip(eqn.outvars, inner.outvars, strict=True):
      env[out] = inner_env.get(inner_out, inner_out) if _is_var(inner_out) else inner_out


class _UnionFind:
  def __init__(self):
    self.parent: dict[int, int] = {}

  def find(self, x: int) -> int:
    self.parent.setdefault(x, x)
    while self.parent[x] != x:
      self.parent[x] = self.parent[self.parent[x]]
      x = self.parent[x]
    return x

  def union(self, a: int, b: int) -> int:
    a, b = self.find(a), self.find(b)
    if a != b:
      self.parent[max(a, b)] = min(a, b)
    return min(a, b)


@dataclasses.dataclass(frozen=True)
class _Linear:
  """How a linear weight is multiplied.

  Attributes:
    side: its operand (1 for `x @ w`, 0 for `w @ x.T`); its input is the other.
    transposed: a 2-D view of it with its two dimensions swapped (`x @ w.T`).
    out_dim: the leaf's dimension split when it is column-parallel: its first one
      left free by the product (the output features; a `[in, heads, head_dim]`
      kernel's heads).
    out_axis: the product's axis that dimension lands on.
  """

  side: int
  transposed: bool
  out_dim: int
  out_axis: int

  def leaf_dim(self, operand_dim: int) -> int:
    """The leaf's dimension that is dimension `operand_dim` of the multiplied operand."""
    return 1 - operand_dim if self.transposed else operand_dim


def _reshaped_axes(in_shape, out_shape) -> tuple[int | None, ...] | None:
  """For a reshape that only adds or drops axes of size 1, the output axis each input
  axis lands on (None for a dropped one); None for any other reshape."""
  kept_in = [k for k, n in enumerate(in_shape) if n != 1]
  kept_out = [k for k, n in enumerate(out_shape) if n != 1]
  if [in_shape[k] for k in kept_in] != [out_shape[k] for k in kept_out]:
    return None
  where = dict(zip(kept_in, kept_out, strict=True))
  return tuple(where.get(k) for k in range(len(in_shape)))


@dataclasses.dataclass
class _Group:
  columns: set[int] = dataclasses.field(default_factory=set)  # leaf indices
  rows: set[int] = dataclasses.field(default_factory=set)
  biases: dict[int, int] = dataclasses.field(default_factory=dict)  # leaf -> its split dim
  row_dims: dict[int, int] = dataclasses.field(default_factory=dict)  # row leaf -> split dim
  row_out: int = 0
  column_inputs: dict = dataclasses.field(default_factory=dict)  # var -> elements per example
  flops: int = 0
  failure: str = ""


def _reshape_split(in_shape, out_shape, d: int, parts: int) -> int | None:
  """The output axis a split of input axis `d` lands on, if the reshape keeps it whole.

  The features of axis `d` are cut into `parts` contiguous blocks; they stay
  blocks of one output axis `j` when the axes before `d` and before `j` hold as
  many elements and `parts` divides `out_shape[j]`.
  """
  before = math.prod(in_shape[:d])
  for j in range(len(out_shape)):
    if math.prod(out_shape[:j]) == before and out_shape[j] > 1:
      if out_shape[j] % parts == 0:
        return j
      return None
  return None


class _Analysis:
  """The dataflow state of one round (a fixed set of column candidates)."""

  def __init__(self, ops, kinds, origin, bias_dim, linear, slot, columns, parts, outputs, batch):
    self.ops, self.kinds, self.origin, self.bias_dim = ops, kinds, origin, bias_dim
    self.linear, self.columns, self.parts, self.outputs = linear, columns, parts, outputs
    self.slot = slot  # leaf -> `_Linear`
    self.batch = batch
    self.split: dict[Any, int] = {}  # var -> split axis
    self.owner: dict[Any, int] = {}  # var -> group id (a column leaf)
    self.uf = _UnionFind()
    self.groups: dict[int, _Group] = {}
    self.used_as_row: set[int] = set()
    # var -> the axes along which it only repeats one value (broadcast there), so
    # meeting a split along one of them needs nothing split (a padding mask
    # broadcast over the heads before it masks the split attention scores).
    self.uniform: dict[Any, frozenset[int]] = {}

  def group(self, v) -> _Group:
    return self.groups[self.uf.find(self.owner[v])]

  def merge(self, vs) -> int:
    roots = {self.uf.find(self.owner[v]) for v in vs}
    root = min(roots)
    for r in roots - {root}:
      self.uf.union(root, r)
      g, other = self.groups[root], self.groups.pop(r)
      g.columns |= other.columns
      g.rows |= other.rows
      g.biases.update(other.biases)
      g.row_dims.update(other.row_dims)
      g.row_out += other.row_out
      g.column_inputs.update(other.column_inputs)
      g.flops += other.flops
      g.failure = g.failure or other.failure
    return root

  def fail(self, root: int, why: str) -> None:
    g = self.groups[root]
    g.failure = g.failure or why

  def mark(self, out, dim: int, root: int, flops: int = 0) -> None:
    self.split[out] = dim
    self.owner[out] = root
    self.groups[root].flops += flops

  def _note_uniform(self, op: _Op) -> None:
    if not op.outs or not op.ins or not _is_var(op.ins[0]):
      return
    x, out = op.ins[0], op.outs[0]
    if op.prim == "broadcast_in_dim":
      dims = op.params["broadcast_dimensions"]
      axes = {k for k in range(len(out.aval.shape)) if k not in dims}
      axes |= {dims[i] for i, n in enumerate(x.aval.shape) if n == 1}
      axes |= {dims[i] for i in self.uniform.get(x, ())}
      self.uniform[out] = frozenset(axes)
    elif (op.prim in _UNARY or op.prim in _VIEW) and x in self.uniform:
      self.uniform[out] = self.uniform[x]

  def run(self) -> None:
    for op in self.ops:
      self._note_uniform(op)
      start = self.linear.get(id(op))
      if start is not None and start in self.columns and not self._split(self._input(op)):
        out = op.outs[0]
        g = self.groups.setdefault(start, _Group())
        g.columns.add(start)
        x = self._input(op)
        # Its batch is the first axis it does not contract (1 for a [features, batch] input).
        contracted = self._input_axes(op)
        batch_axis = next(k for k in range(len(x.aval.shape) + 1) if k not in contracted)
        g.column_inputs[x] = 0 if self.kinds.get(x) == "input" else self._width(x, batch_axis)
        self.mark(out, self.slot[start].out_axis, self.uf.find(start), _flops(op))
        continue
      split_ins = [v for v in op.ins if self._split(v)]
      if split_ins:
        self._follow(op, split_ins)
    for v in self.outputs:
      if self._split(v):
        self.fail(self.uf.find(self.owner[v]), "it is an output of the model")

  def _split(self, v) -> bool:
    return _is_var(v) and v in self.split

  def _input(self, op: _Op):
    """A linear layer's input: the operand that is not its weight."""
    return op.ins[1 - self.slot[self.linear[id(op)]].side]

  def _input_axes(self, op: _Op) -> tuple[int, ...]:
    """The axes a linear layer contracts on its input (its input features)."""
    (lc, rc), _ = op.params["dimension_numbers"]
    return tuple((lc, rc)[1 - self.slot[self.linear[id(op)]].side])

  def _width(self, v, batch_axis: int = 0) -> int:
    """Elements per example of `v`: its size over the batch, if `batch_axis` is that long."""
    shape, size = v.aval.shape, int(np.prod(v.aval.shape))
    if len(shape) > batch_axis and shape[batch_axis] == self.batch:
      return size // self.batch
    return size

  def _follow(self, op: _Op, split_ins: list) -> None:  # noqa: PLR0911 - one rule per op
    reads = {frozenset(self.group(v).column_inputs) for v in split_ins}
    root = self.merge(split_ins)
    if len(reads) > 1 and op.prim in _NARY:
      return self.fail(
        root,
        f"`{op.prim}` combines split outputs of layers that read different inputs "
        "(e.g. a residual connection)",
      )
    prim, d = op.prim, self.split[split_ins[0]]
    out = op.outs[0] if op.outs else None
    what = f"`{prim}`"
    if prim in _UNARY:
      self.mark(out, d, root, _flops(op))
    elif prim in _NARY:
      shape = out.aval.shape
      for v in op.ins:
        if self._split(v):
          if self.split[v] != d:
            return self.fail(root, f"{what} combines values split along different axes")
          continue
        if not _is_var(v) or not v.aval.shape or self.kinds.get(v, "const") == "const":
          continue
        if self.kinds.get(v) == "param":
          if d in self.uniform.get(v, ()):
            continue  # a parameter broadcast along the split axis (a [1] gain): whole
          leaf, axes = self.bias_dim.get(v, (None, ()))
          if leaf is None and v.aval.shape[d] == 1:
            continue  # broadcast along the split axis: nothing to split
          if leaf is None:
            return self.fail(root, f"{what} combines it with a parameter that is not a bias")
          if d in axes:  # (split along the leaf's dimension that lands on axis d)
            self.groups[root].biases[leaf] = axes.index(d)
          continue
        if v.aval.shape[d] == 1 and shape[d] != 1:
          continue  # an activation broadcast along the split axis (e.g. a norm's scale)
        if d in self.uniform.get(v, ()):
          continue  # broadcast along it beforehand (e.g. a padding mask over the heads)
        return self.fail(
          root, f"{what} combines it with an unsplit activation (e.g. a residual connection)"
        )
      self.mark(out, d, root, _flops(op))
    elif prim == "broadcast_in_dim":
      self.mark(out, op.params["broadcast_dimensions"][d], root)
    elif prim == "squeeze":
      dims = op.params["dimensions"]
      self.mark(out, d - sum(1 for k in dims if k < d), root)
    elif prim == "transpose":
      self.mark(out, list(op.params["permutation"]).index(d), root)
    elif prim == "reshape":
      j = _reshape_split(op.ins[0].aval.shape, out.aval.shape, d, self.parts)
      if j is None:
        return self.fail(
          root,
          f"`reshape` {tuple(op.ins[0].aval.shape)} -> {tuple(out.aval.shape)} mixes the split "
          f"features (e.g. heads not divisible by model={self.parts})",
        )
      self.mark(out, j, root)
    elif prim in _REDUCE or prim in _ARG_REDUCE:
      axes = op.params["axes"]
      if d in axes:
        return self.fail(
          root, f"{what} reduces over the split features (e.g. LayerNorm or a mean over them)"
        )
      self.mark(out, d - sum(1 for k in axes if k < d), root, _flops(op))
    elif prim in _CUMULATIVE:
      if op.params["axis"] == d:
        return self.fail(root, f"{what} runs along the split features")
      self.mark(out, d, root, _flops(op))
    elif prim == "dot_general":
      self._dot(op, root, d)
    else:
      self.fail(root, f"it reaches {what}, which tensor parallelism does not split")

  def _dot(self, op: _Op, root: int, d: int) -> None:  # noqa: PLR0911 - one rule per case
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lhs, rhs = op.ins
    out = op.outs[0]
    row = self.linear.get(id(op))
    if row is not None:  # a linear layer contracting the split features: row-parallel
      side = self.slot[row].side  # the weight's operand
      x, x_contract, w = op.ins[1 - side], (lc, rc)[1 - side], op.ins[side]
      if self._split(x) and not self._split(w) and d in x_contract:
        g = self.groups[root]
        g.rows.add(row)
        # The weight's dimension contracted with the split one (its input features; a
        # head's `[heads, head_dim, out]` kernel: its heads).
        g.row_dims[row] = self.slot[row].leaf_dim((lc, rc)[side][list(x_contract).index(d)])
        # The output is the operands' free axes, lhs first: `x @ w` [batch, .., out],
        # `w @ x.T` [out, batch, ..] (whichever axis of `x` held the features).
        g.row_out += self._width(out, batch_axis=1 - side)
        g.flops += _flops(op)
        self.used_as_row.add(row)
        return None
    if self._split(lhs) and self._split(rhs):
      dl, dr = self.split[lhs], self.split[rhs]
      if dl in lb and dr in rb and list(lb).index(dl) == list(rb).index(dr):
        return self.mark(out, list(lb).index(dl), root, _flops(op))
      return self.fail(root, "`dot_general` of two split values does not keep the split axis")
    side, other, contract, batch = (lhs, rhs, lc, lb) if self._split(lhs) else (rhs, lhs, rc, rb)
    if d in contract:
      return self.fail(
        root,
        "`dot_general` contracts the split features with something other than a linear "
        "layer's weight used once (e.g. a tied or shared weight)",
      )
    if _is_var(other) and self.kinds.get(other, "const") != "const":
      return self.fail(root, "`dot_general` multiplies it with an unsplit value")
    # A free (or batch) axis of one operand against a constant: it stays split.
    free = [k for k in range(len(side.aval.shape)) if k not in contract and k not in batch]
    if d in batch:
      return self.mark(out, list(batch).index(d), root, _flops(op))
    offset = len(batch) + (0 if side is lhs else len(op.ins[0].aval.shape) - len(lc) - len(lb))
    return self.mark(out, offset + free.index(d), root, _flops(op))


def _flops(op: _Op) -> int:
  if not op.outs:
    return 0
  aval = op.outs[0].aval
  size = int(np.prod(aval.shape)) if hasattr(aval, "shape") else 1
  if op.prim == "dot_general":
    (lc, _), _ = op.params["dimension_numbers"]
    shape = op.ins[0].aval.shape
    return 2 * size * int(np.prod([shape[k] for k in lc]))
  return size


def analyse(
  apply_fn: Callable[[Any, Any], Any],
  params: Any,
  inputs: Any,
  parts: int,
  *,
  stage_of: Mapping[str, int] | None = None,
) -> TensorSplit:
  """Decides, for every parameter leaf, whether and how it is split `parts` ways.

  See the module docstring for the rules.

  Args:
    apply_fn: `(params, inputs) -> outputs` (any pytree of outputs).
    params: the params (arrays or `jax.ShapeDtypeStruct`s).
    inputs: abstract inputs (a pytree of arrays or `jax.ShapeDtypeStruct`s).
    parts: the size of the "model" axis.
    stage_of: for a pipeline, the stage of each layer; a group must lie in one
      stage (it never straddles a cut).

  Returns:
    The `TensorSplit`.

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp
    >>> from parstrat._src import tensor_split
    >>> model = hk.transform(lambda x: hk.nets.MLP([16, 16, 10])(x))
    >>> x = jnp.zeros((1, 8))
    >>> params = model.init(jax.random.key(0), x)
    >>> plan = tensor_split.analyse(lambda p, x: model.apply(p, None, x), params, x, 2)
    >>> [leaf.dim for leaf in plan.leaves]
    [0, 1, None, 0, None, None]
  """
  leaves, treedef = jax.tree.flatten(params)
  names = trees.layers_and_names(params)
  closed = jax.make_jaxpr(lambda leaves, x: apply_fn(jax.tree.unflatten(treedef, leaves), x))(
    leaves, inputs
  )
  jaxpr = closed.jaxpr
  n = len(leaves)
  ops: list[_Op] = []
  env: dict = {}
  consts: set = set(jaxpr.constvars)
  _inline(jaxpr, env, consts, ops)
  outputs = [env.get(v, v) for v in jaxpr.outvars if _is_var(v)]
  outputs = [v for v in outputs if _is_var(v)]
  input_vars = jaxpr.invars[n:]
  batch = input_vars[0].aval.shape[0] if input_vars and input_vars[0].aval.shape else 1

  # What each value is made of: inputs (activations), parameters alone, or constants.
  kinds: dict[Any, str] = {v: "param" for v in jaxpr.invars[:n]}
  kinds.update({v: "input" for v in input_vars})
  origin: dict[Any, int] = {v: i for i, v in enumerate(jaxpr.invars[:n])}  # a view of leaf i
  # A bias broadcast for `x + b`: (leaf, the axis each of the leaf's dimensions lands on).
  bias_dim: dict[Any, tuple[int, tuple[int | None, ...]]] = {}
  uses: dict[int, list[_Op]] = {i: [] for i in range(n)}
  transposed: set[Any] = set()  # views of a 2-D leaf with its two dimensions swapped
  for op in ops:
    in_kinds = {kinds.get(v, "const") for v in op.ins if _is_var(v)}
    # (a value made of the inputs alone stays "input": it needs no gradient, e.g. `x.T`)
    kind = (
      "input"
      if in_kinds - {"const"} == {"input"}
      else "act"
      if in_kinds & {"act", "input"}
      else "param"
      if "param" in in_kinds
      else "const"
    )
    for v in op.outs:
      kinds[v] = kind
    viewed = [origin[v] for v in op.ins if _is_var(v) and v in origin]
    if op.prim in _VIEW and len(op.ins) == 1 and viewed:
      origin[op.outs[0]] = viewed[0]
      if op.ins[0] in transposed:
        transposed.add(op.outs[0])
      continue
    if op.prim == "transpose" and viewed and tuple(op.params["permutation"]) == (1, 0):
      origin[op.outs[0]] = viewed[0]  # (`x @ w.T`, as PyTorch's `F.linear` is ported)
      if op.ins[0] not in transposed:  # (transposed twice: the leaf's own order again)
        transposed.add(op.outs[0])
      continue
    # (a bias of any rank: a `[heads, head_dim]` one beside a `[in, heads, head_dim]` kernel)
    if op.prim == "broadcast_in_dim" and viewed and op.ins[0] in origin:
      bias_dim[op.outs[0]] = (viewed[0], tuple(op.params["broadcast_dimensions"]))
    elif op.prim == "broadcast_in_dim" and _is_var(op.ins[0]) and op.ins[0] in bias_dim:
      leaf, axes = bias_dim[op.ins[0]]  # (of a reshaped bias, below)
      dims = op.params["broadcast_dimensions"]
      bias_dim[op.outs[0]] = (leaf, tuple(None if a is None else dims[a] for a in axes))
    elif op.prim == "reshape" and viewed and op.ins[0] in origin:
      # A bias reshaped to [1, ..., N] (or [1, .., H, D]) for `x + b` to broadcast it
      # (Flax's Dense and DenseGeneral, nnx's Linear): its axes longer than 1, in order.
      axes = _reshaped_axes(op.ins[0].aval.shape, op.outs[0].aval.shape)
      if axes is not None:
        bias_dim[op.outs[0]] = (viewed[0], axes)
    for i in viewed:
      uses[i].append(op)

  # Linear weights: leaves of 2 or more dimensions used exactly once, as `x @ w` or
  # `w @ x.T`, contracting some of the input's axes (its last, the leading one of a
  # [features, batch] input, a head's `[.., heads, head_dim]`) with as many of theirs.
  linear: dict[int, int] = {}  # id(dot op) -> leaf
  slot: dict[int, _Linear] = {}  # leaf -> how it is multiplied
  why_not: dict[int, str] = {}
  for i, leaf in enumerate(leaves):
    shape = tuple(leaf.shape)
    found = uses[i]
    if len(shape) < 2:
      why_not[i] = "replicated (a bias or scale, not a linear layer's weight matrix)"
      continue
    if len(found) != 1:
      others = sorted({op.prim for op in found if op.prim != "dot_general"})
      products = sum(op.prim == "dot_general" for op in found)
      why_not[i] = (
        f"replicated (used {len(found)} times: a shared or tied weight)"
        if products > 1 or not others
        else f"replicated (used {len(found)} times: read by "
        f"{', '.join(f'`{p}`' for p in others)} besides its product, as a weight norm is)"
      )
      continue
    (op,) = found
    pair = op.prim == "dot_general" and len(op.ins) == 2
    side = next((k for k in (1, 0) if pair and origin.get(op.ins[k]) == i), None)
    if side is None:
      why_not[i] = f"replicated (used by `{op.prim}`, not as `x @ w` or `w @ x.T`)"
      continue
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    w_contract, x_contract = (rc, lc) if side == 1 else (lc, rc)
    free = [k for k in range(len(shape)) if k not in w_contract]
    if lb or rb or not free:
      why_not[i] = (
        "replicated (not used as `x @ w` or `w @ x.T`: a product over batch axes, or one "
        "that leaves none of its dimensions free)"
      )
      continue
    linear[id(op)] = i
    x_free = len(op.ins[1 - side].aval.shape) - len(x_contract)
    view = _Linear(side, op.ins[side] in transposed, 0, x_free if side == 1 else 0)
    slot[i] = dataclasses.replace(view, out_dim=view.leaf_dim(free[0]))

  columns = {i for i in linear.values() if leaves[i].shape[slot[i].out_dim] % parts == 0}
  for i in set(linear.values()) - columns:
    width = leaves[i].shape[slot[i].out_dim]
    why_not[i] = f"replicated (its {width} outputs are not divisible by model={parts})"
  dropped: dict[int, str] = {}
  while True:
    state = _Analysis(ops, kinds, origin, bias_dim, linear, slot, columns, parts, outputs, batch)
    state.run()
    bad = {}
    for root, g in state.groups.items():
      why = g.failure or ("" if g.rows else "no linear layer consumes its split output")
      if not why and stage_of is not None:
        layers = {names[i][0] for i in g.columns | g.rows | set(g.biases)}
        stages = sorted({stage_of[name] for name in layers})
        if len(stages) > 1:
          why = f"its group ({', '.join(sorted(layers))}) would straddle stages {stages}"
      if why:
        bad[root] = why
    if not bad:
      break
    for root, why in bad.items():
      for i in state.groups[root].columns:
        dropped[i] = why
      columns -= state.groups[root].columns

  dims: list[int | None] = [None] * n
  reasons = [""] * n
  groups = []
  position = {linear[id(op)]: k for k, op in enumerate(ops) if id(op) in linear}
  for g in sorted(state.groups.values(), key=lambda g: min(position[i] for i in g.columns)):
    col_layers = tuple(dict.fromkeys(names[i][0] for i in sorted(g.columns)))
    row_layers = tuple(dict.fromkeys(names[i][0] for i in sorted(g.rows)))
    partners = ", ".join(row_layers)
    for i in g.columns | set(g.biases):
      dims[i] = slot[i].out_dim if i in g.columns else g.biases[i]
      reasons[i] = f"column-parallel (split by output features; consumed by {partners})"
    for i in g.rows:
      dims[i] = g.row_dims[i]  # its input features
    backward = sum(g.column_inputs.values())
    groups.append(SplitGroup(col_layers, row_layers, (g.row_out, backward)))
  row_leaves = {i for g in state.groups.values() for i in g.rows}
  row_layers = {names[i][0] for i in row_leaves}
  for i in range(n):
    layer = names[i][0]
    if i in row_leaves or (layer in row_layers and len(leaves[i].shape) == 1):
      reasons[i] = "row-parallel (split by input features; output all-reduced over model)"
    elif dims[i] is not None:
      continue
    elif i in dropped:
      reasons[i] = f"replicated (not split: {dropped[i]})"
    elif i in linear.values() and i in columns:
      reasons[i] = "replicated (no linear layer consumes its split output)"
    else:
      reasons[i] = why_not.get(i, "replicated (not part of a column/row pair)")
  # A replicated layer's leaves share its weight matrix's reason.
  for layer in {name for name, _ in names}:
    members = [i for i in range(n) if names[i][0] == layer]
    weights = [i for i in members if i in slot] or [i for i in members if len(leaves[i].shape) == 2]
    if len(weights) == 1 and all(dims[i] is None for i in members):
      for i in members:
        reasons[i] = reasons[weights[0]]
  split_flops = sum(g.flops for g in state.groups.values()) // max(batch, 1)
  return TensorSplit(
    parts=parts,
    leaves=tuple(
      LeafSplit(names[i][0], names[i][1], tuple(leaves[i].shape), dims[i], reasons[i])
      for i in range(n)
    ),
    groups=tuple(groups),
    split_flops=int(split_flops),
    treedef=treedef,
  )


def tensor_split_plan(model, sample_inputs: Any, model_parallel: int = 2) -> TensorSplit:
  """The tensor-parallel plan of a Haiku model; `print` it to see what is split and why.

  The same analysis `TensorParallel(model=T)` and `Hybrid(model=T)` use (for
  `Hybrid`, groups are also kept within a stage).

  Args:
    model: an `hk.Transformed` or `hk.TransformedWithState` (one that draws
      randomness is traced with a fixed key, as the trainer's analysis does).
    sample_inputs: example inputs (arrays or `jax.ShapeDtypeStruct`s).
    model_parallel: the size T of the "model" axis.

  Returns:
    The `TensorSplit`.

  Raises:
    TypeError: if `model` is not an `hk.Transformed` (no `init` and `apply`).
    ValueError: if `model_parallel` is not an integer >= 1.

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp, parstrat
    >>> def net(x):
    ...   h = jax.nn.relu(hk.Linear(16, name="up")(x))
    ...   return hk.Linear(10, name="head")(hk.Linear(8, name="down")(h))
    >>> print(parstrat.tensor_split_plan(hk.transform(net), jnp.zeros((1, 8)), 2))
    tensor-parallel plan over model=2: 1 split group(s)
      group 0: column-parallel up -> row-parallel down (1 all-reduce(s) forward)
      down: row-parallel (split by input features; output all-reduced over model)
      head: replicated (not split: it is an output of the model)
      up: column-parallel (split by output features; consumed by down)
  """
  if not (hasattr(model, "init") and hasattr(model, "apply")):
    raise TypeError(
      f"model must be an hk.Transformed (with init and apply), got {type(model).__name__}."
    )
  if isinstance(model_parallel, bool) or not isinstance(model_parallel, int) or model_parallel < 1:
    raise ValueError(f"model_parallel must be an integer >= 1, got {model_parallel!r}.")
  # The trainer's view of the model: a key for one that draws randomness, its state for
  # an `hk.transform_with_state` one (imported here: the strategies import this module).
  from parstrat._src.strategy import as_stateful  # noqa: PLC0415
  from parstrat._src.strategy import outputs_fn  # noqa: PLC0415

  stateful = as_stateful(model)
  params, state = jax.eval_shape(stateful.init, jax.random.key(0), sample_inputs)
  return analyse(outputs_fn(stateful, state), params, sample_inputs, model_parallel)
