"""Running a pipeline schedule inside `jax.shard_map`, one stage per device.

Each device holds its stage's parameters as one flat buffer (padded to the
largest stage), and the activations crossing stage boundaries as rows of a
flat `[microbatch, W]` buffer (padded to the widest boundary). At every tick a
`lax.switch` on (action, stage index) runs only the device's own stage, then
the exchange moves activations to the next stage and gradients to the previous
one: in one `ppermute` where each device receives one message at most (a message
may wait on its sender for a later exchange to make it so), in two where a device
receives two messages that cannot wait (`exchange_plan`).

With `SplitLayout`, a stage's linear layers are also split Megatron-style over a
mesh axis (e.g. "model") that the `jax.shard_map` leaves automatic: each device
stores its slice of every split weight, and XLA's SPMD partitioner inserts the
all-reduces the split implies. The per-device params are then a pair of buffers
instead of one; the schedule code treats them as a pytree.

These functions run under `jax.shard_map(..., check_vma=False)`: the stage
functions are slices of a jaxpr traced outside the map, and every reduction is
explicit (gradients come from explicit `jax.vjp` calls, so no transpose can
insert a hidden `psum`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from parstrat._src import hlo_check
from parstrat._src.pipeline import backward_split as backward_split_lib
from parstrat._src.pipeline import partition as partition_lib
from parstrat._src.pipeline import residuals as residuals_lib
from parstrat._src.pipeline import schedule as schedule_lib
from parstrat._src.pipeline.schedule import Action
from parstrat._src.pipeline.schedule import Schedule
from parstrat._src.pipeline.schedule import num_total_iterations


@dataclasses.dataclass(frozen=True)
class FlatLayout:
  """Where each parameter leaf sits in its stage's flat buffer.

  Attributes:
    treedef: the params' tree structure (model layout).
    shapes: the shape of every flattened leaf.
    stage_leaves: the leaves (indices) each stage holds, in buffer order.
    offsets: per stage, the start offset of each of its leaves.
    size: the buffer length, the largest stage's parameter count.
    dtype: the common dtype of all leaves.
    order: the model stage each stored row holds (see `stored_order`).
  """

  treedef: Any
  shapes: tuple[tuple[int, ...], ...]
  stage_leaves: tuple[tuple[int, ...], ...]
  offsets: tuple[tuple[int, ...], ...]
  size: int
  dtype: Any
  order: tuple[int, ...]

  @classmethod
  def build(
    cls, params: Any, stage_leaves: tuple[tuple[int, ...], ...], devices: int | None = None
  ) -> FlatLayout:
    leaves, treedef = jax.tree.flatten(params)
    dtypes = {jnp.dtype(leaf.dtype) for leaf in leaves}
    if len(dtypes) != 1:
      first: dict[str, str] = {}  # a leaf of each dtype, in order
      for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        first.setdefault(str(jnp.dtype(leaf.dtype)), jax.tree_util.keystr(path))
      raise ValueError(
        "Pipelined params must share one dtype (a stage's are stored as one flat buffer), got "
        + ", ".join(f"{dtype} (e.g. {path})" for dtype, path in first.items())
        + "; keep params in one dtype and cast inside the model, or use precision=..."
      )
    owner: dict[int, int] = {}
    for s, group in enumerate(stage_leaves):
      for i in group:
        if i in owner:
          path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(params)[0][i][0])
          raise ValueError(
            f"Parameter {path} is used by stages {owner[i]} and {s}: a pipelined model cannot "
            "share (tie) a weight across stages, e.g. an output head that reuses the "
            "embedding (hk.Embed(...).attend). Cut so that every use is in one stage "
            "(cuts= or stage_boundary markers), untie the weight, or use data_parallel, "
            "fsdp or tensor."
          )
        owner[i] = s
    shapes = tuple(tuple(leaf.shape) for leaf in leaves)
    offsets, sizes = [], []
    for group in stage_leaves:
      starts = np.cumsum([0] + [int(np.prod(shapes[i])) for i in group])
      offsets.append(tuple(int(o) for o in starts[:-1]))
      sizes.append(int(starts[-1]))
    order = stored_order(devices or len(stage_leaves), len(stage_leaves))
    return cls(treedef, shapes, stage_leaves, tuple(offsets), max(sizes), dtypes.pop(), order)

  @property
  def stage_sizes(self) -> list[int]:
    return [sum(int(np.prod(self.shapes[i])) for i in group) for group in self.stage_leaves]

  def to_stored(self, params: Any) -> jax.Array:
    """Model layout -> `[G, size]` stage buffers, in `order`."""
    leaves = jax.tree.leaves(params)
    rows = []
    for stage in self.order:
      flat = [leaves[i].reshape(-1) for i in self.stage_leaves[stage]]
      row = jnp.concatenate(flat) if flat else jnp.zeros((0,), self.dtype)
      rows.append(jnp.pad(row, (0, self.size - row.shape[0])))
    return jnp.stack(rows)

  def stage_params(self, stage: int, row: jax.Array, common: tuple = ()) -> list[jax.Array]:
    """Stage `stage`'s leaves, sliced out of its flat buffer `row`.

    With `common` (the `shared_leaves` of the same row, from `cut_shared`), those
    leaves come from it instead, and only the others are sliced.
    """
    own = dict(zip(self.shared_leaves(), common, strict=True)) if common else {}
    return [
      own[k] if k in own else self.slice_leaf(row, stage, k)
      for k in range(len(self.stage_leaves[stage]))
    ]

  def cut_shared(self, row: jax.Array) -> tuple[jax.Array, ...]:
    """The `shared_leaves` of a device's flat buffer `row`, whatever its stage."""
    return tuple(self.slice_leaf(row, 0, k) for k in self.shared_leaves())

  def owns_unshared(self, stage: int) -> bool:
    """Whether stage `stage` has leaves outside `shared_leaves` (sliced per pass)."""
    return len(self.stage_leaves[stage]) > len(self.shared_leaves())

  def constrain(self, row: jax.Array) -> jax.Array:
    """The identity (a flat row has no layout inside the map); see `SplitLayout`."""
    return row

  def shared_leaves(self) -> tuple[int, ...]:
    """The leaf positions k where every stage's k-th leaf has one shape and one offset.

    Those leaves sit at the same place in every stage's buffer, so one slice
    of a device's row gives its stage's leaf whatever the stage is: a loop
    can cut them once, outside its per-stage branches (all of them when the
    stages are alike, e.g. equal blocks).
    """
    count = min(len(group) for group in self.stage_leaves)
    stages = list(zip(self.stage_leaves, self.offsets, strict=True))
    return tuple(
      k for k in range(count) if len({(self.shapes[g[k]], offs[k]) for g, offs in stages}) == 1
    )

  def slice_leaf(self, row: jax.Array, stage: int, k: int) -> jax.Array:
    """Leaf position k of stage `stage`, sliced out of its flat buffer `row`."""
    shape = self.shapes[self.stage_leaves[stage][k]]
    return lax.dynamic_slice_in_dim(row, self.offsets[stage][k], int(np.prod(shape))).reshape(shape)

  def to_params(self, stored: jax.Array) -> Any:
    """`[G, size]` stage buffers -> model layout."""
    leaves: list[Any] = [None] * len(self.shapes)
    for r, s in enumerate(self.order):
      for i, leaf in zip(self.stage_leaves[s], self.stage_params(s, stored[r]), strict=True):
        leaves[i] = leaf
    return jax.tree.unflatten(self.treedef, leaves)


def stored_order(devices: int, model_stages: int) -> tuple[int, ...]:
  """The model stage held by each row of the stored `[G, ...]` buffers.

  Rows are device-major, so sharding the rows over the P devices gives device
  s its v = G / P chunks, model stages s, s + P, s + 2P, ... (interleaved
  virtual stages); with v = 1 row s is stage s.
  """
  if model_stages % devices:
    raise ValueError(f"{model_stages} model stages do not split over {devices} devices.")
  v = model_stages // devices
  return tuple(j * devices + s for s in range(devices) for j in range(v))


def to_blocks(leaf: jax.Array, dim: int, parts: int) -> jax.Array:
  """`leaf` cut into `parts` equal slices along `dim`, as `[parts, leaf.size // parts]`.

  Row j is slice j, flattened with `dim` first (how `SplitLayout` stores a
  device's slice of a split leaf, and how `optimizer_view` moves pieces).
  """
  return jnp.moveaxis(leaf, dim, 0).reshape(parts, -1)


def from_blocks(block: jax.Array, shape: tuple[int, ...], dim: int) -> jax.Array:
  """The inverse of `to_blocks`: `[parts, k]` slices (or their rows, flat) -> the leaf of `shape`.

  With one flattened row (`to_blocks(...)[j]`), `shape` is that slice's shape.
  """
  moved = (shape[dim], *shape[:dim], *shape[dim + 1 :])
  return jnp.moveaxis(block.reshape(moved), 0, dim)


@dataclasses.dataclass(frozen=True)
class SplitLayout:
  """Stage buffers where some leaves are split `parts` ways over a mesh axis.

  Stored params are a pair `(split, replicated)`:

  * `split [P, parts, split_size]`, sharded `P(stage_axis, axis)`: row `[s, t]`
    holds slice t (along its split dimension) of every split leaf of stage s,
    flattened and concatenated, zero-padded to the largest stage.
  * `replicated [P, replicated_size]`, sharded `P(stage_axis)`: the other
    leaves of each stage, flattened like `FlatLayout`.

  A device of the pipeline sees `(split[s], replicated[s])`, a `[parts, k]`
  block still split over `axis` (automatic inside the map) and a flat row.

  Attributes:
    treedef, shapes, stage_leaves, dtype: as for `FlatLayout`.
    split_dims: per flattened leaf, the dimension split over `axis`, or None.
    parts: the size of `axis`.
    axis: the mesh axis the split leaves are sharded over.
    offsets: per stage, the start of each of its leaves in the buffer it
      lives in (in elements of one `[parts, k]` row for split leaves).
    split_size: the length of one split row (largest stage, at least 1).
    replicated_size: the length of a replicated row (largest stage, at least 1).
    order: the model stage each stored row holds (see `stored_order`).
  """

  treedef: Any
  shapes: tuple[tuple[int, ...], ...]
  stage_leaves: tuple[tuple[int, ...], ...]
  split_dims: tuple[int | None, ...]
  parts: int
  axis: str
  offsets: tuple[tuple[int, ...], ...]
  split_size: int
  replicated_size: int
  dtype: Any
  order: tuple[int, ...]

  @classmethod
  def build(
    cls,
    params: Any,
    stage_leaves: tuple[tuple[int, ...], ...],
    split_dims: tuple[int | None, ...],
    parts: int,
    axis: str,
    devices: int | None = None,
  ) -> SplitLayout:
    flat = FlatLayout.build(params, stage_leaves, devices)  # checks dtypes and ownership
    if len(split_dims) != len(flat.shapes):
      raise ValueError(f"split_dims has {len(split_dims)} entries for {len(flat.shapes)} leaves.")
    for i, dim in enumerate(split_dims):
      if dim is not None and flat.shapes[i][dim] % parts:
        raise ValueError(
          f"Parameter leaf {i} of shape {flat.shapes[i]} cannot be split {parts} ways "
          f"along dimension {dim}."
        )
    offsets, split_sizes, replicated_sizes = [], [], []
    for group in stage_leaves:
      split_end, replicated_end, starts = 0, 0, []
      for i in group:
        size = int(np.prod(flat.shapes[i]))
        if split_dims[i] is None:
          starts.append(replicated_end)
          replicated_end += size
        else:
          starts.append(split_end)
          split_end += size // parts
      offsets.append(tuple(starts))
      split_sizes.append(split_end)
      replicated_sizes.append(replicated_end)
    return cls(
      flat.treedef,
      flat.shapes,
      tuple(stage_leaves),
      tuple(split_dims),
      parts,
      axis,
      tuple(offsets),
      max(1, *split_sizes),
      max(1, *replicated_sizes),
      flat.dtype,
      flat.order,
    )

  @property
  def stage_sizes(self) -> list[int]:
    """Parameters per stage (whole, not per device)."""
    return [sum(int(np.prod(self.shapes[i])) for i in group) for group in self.stage_leaves]

  @property
  def per_device_size(self) -> int:
    """Elements each device stores: its split row plus its replicated row."""
    return self.split_size + self.replicated_size

  def to_stored(self, params: Any) -> tuple[jax.Array, jax.Array]:
    """Model layout -> `(split [G, parts, split_size], replicated [G, replicated_size])`."""
    leaves = jax.tree.leaves(params)
    split_rows, replicated_rows = [], []
    for group in (self.stage_leaves[stage] for stage in self.order):
      blocks = [
        to_blocks(leaves[i], self.split_dims[i], self.parts)
        for i in group
        if self.split_dims[i] is not None
      ]
      flat = [leaves[i].reshape(-1) for i in group if self.split_dims[i] is None]
      block = jnp.concatenate(blocks, axis=1) if blocks else jnp.zeros((self.parts, 0), self.dtype)
      row = jnp.concatenate(flat) if flat else jnp.zeros((0,), self.dtype)
      split_rows.append(jnp.pad(block, ((0, 0), (0, self.split_size - block.shape[1]))))
      replicated_rows.append(jnp.pad(row, (0, self.replicated_size - row.shape[0])))
    return jnp.stack(split_rows), jnp.stack(replicated_rows)

  def shared_leaves(self) -> tuple[int, ...]:
    """No leaf: every leaf is sliced per pass, where its sharding constraint is set."""
    return ()

  def cut_shared(self, row: tuple[jax.Array, jax.Array]) -> tuple[()]:
    """Nothing to cut (see `shared_leaves`)."""
    return ()

  def owns_unshared(self, stage: int) -> bool:
    """Always: every leaf is sliced per pass."""
    return True

  def stage_params(
    self,
    stage: int,
    row: tuple[jax.Array, jax.Array],
    common: tuple[()] = (),
    *,
    constrain: bool = True,
  ) -> list[jax.Array]:
    """Stage `stage`'s leaves from its `([parts, split_size], [replicated_size])` buffers.

    With `constrain` (inside the map), each split leaf is pinned to be sharded
    over `axis` along its split dimension, so the partitioner keeps it split.
    `common` is always empty (no `shared_leaves`).
    """
    block, flat = row
    out = []
    for i, off in zip(self.stage_leaves[stage], self.offsets[stage], strict=True):
      shape, dim = self.shapes[i], self.split_dims[i]
      size = int(np.prod(shape))
      if dim is None:
        out.append(lax.dynamic_slice_in_dim(flat, off, size).reshape(shape))
        continue
      leaf = from_blocks(lax.slice_in_dim(block, off, off + size // self.parts, axis=1), shape, dim)
      if constrain:
        spec = [None] * len(shape)
        spec[dim] = self.axis
        leaf = lax.with_sharding_constraint(leaf, PartitionSpec(*spec))
      out.append(leaf)
    return out

  def constrain(self, row: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Pins `[..., parts, split_size]` blocks (params or gradients) to be split over `axis`."""
    block, flat = row
    spec = PartitionSpec(*([None] * (block.ndim - 2)), self.axis, None)
    return lax.with_sharding_constraint(block, spec), flat

  def to_params(self, stored: tuple[jax.Array, jax.Array]) -> Any:
    """`(split, replicated)` stage buffers -> model layout."""
    split, replicated = stored
    leaves: list[Any] = [None] * len(self.shapes)
    for r, s in enumerate(self.order):
      row = (split[r], replicated[r])
      for i, leaf in zip(
        self.stage_leaves[s], self.stage_params(s, row, constrain=False), strict=True
      ):
        leaves[i] = leaf
    return jax.tree.unflatten(self.treedef, leaves)


@dataclasses.dataclass(frozen=True)
class StagedModel:
  """The model cut for one microbatch shape, on flat buffers.

  `forward(stage, row, act, x, y)` runs stage `stage` (a Python int) on its
  params `row` (a flat buffer for `FlatLayout`, a pair for `SplitLayout`); its
  input is the microbatch's model inputs `x` (any pytree) for stage 0 and the
  padded activation `act` otherwise. It returns the padded output and the
  microbatch loss `loss_fn(outputs, y)` with the microbatch's targets `y` (any
  pytree) on the last stage, 0 elsewhere.
  """

  layout: FlatLayout | SplitLayout
  program: partition_lib.StageProgram
  width: int
  loss_fn: Callable[[jax.Array, Any], jax.Array]

  @property
  def num_stages(self) -> int:
    return len(self.program.stage_fns)

  @property
  def act_dtype(self):
    """The dtype activations cross stage boundaries in: the boundary values' own.

    Under mixed precision that is the compute dtype (e.g. bfloat16), not the
    params' dtype, so the stash and the ppermutes move half the bytes.
    """
    between = self.program.boundaries[1:-1] or self.program.boundaries[-1:]
    return jnp.result_type(*[b.dtype for b in between])

  def stage_input(self, stage: int, act, x):
    """The stage's unpadded input: the microbatch's model inputs `x` for stage 0, else `act`."""
    return x if stage == 0 else partition_lib.unpad(act, self.program.boundaries[stage])

  def stage_inputs(self, stage: int, row, act, x, common=()):
    """The stage's parameter leaves (from `row` and `common`) and its unpadded input."""
    return self.layout.stage_params(stage, row, common), self.stage_input(stage, act, x)

  def reads_inputs(self, stage: int) -> bool:
    """Whether stage `stage` reads the microbatch's model inputs (stage 0 always does)."""
    return stage == 0 or self.program.reads_inputs[stage]

  def output(self, stage: int, row, act, x):
    """Stage `stage`'s output, unpadded, in its own dtype."""
    return self.program.stage_fns[stage](*self.stage_inputs(stage, row, act, x), x)

  def forward(self, stage: int, row, act, x, y, common=()):
    return self.apply(stage, *self.stage_inputs(stage, row, act, x, common), y, act.dtype, x)

  def apply(self, stage: int, leaves, inp, y, dtype, x=None):
    """Stage `stage` on its leaves and unpadded input: (padded output, microbatch loss).

    `x`, the microbatch's model inputs, is read by a later stage with
    `reads_inputs` (it recomputes values from them), else ignored.
    """
    out = self.program.stage_fns[stage](leaves, inp, x)
    if stage == self.num_stages - 1:
      loss = self.loss_fn(out, y).astype(jnp.float32)
    else:
      loss = jnp.zeros((), jnp.float32)
    return partition_lib.pad_to(out, self.width).astype(dtype), loss


def _store(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
  """Writes `value` into `buffer[slot]`, or nothing when `slot < 0`."""
  index = jnp.maximum(slot, 0)
  kept = lax.dynamic_index_in_dim(buffer, index, keepdims=False)
  return lax.dynamic_update_index_in_dim(buffer, jnp.where(slot >= 0, value, kept), index, 0)


def _put(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
  """Writes `value` into `buffer[slot]`, or into the spare last slot when `slot < 0`.

  One in-place slot write either way, where `_store` reads and selects the slot it
  keeps: for the buffers of a tick loop that write most ticks.
  """
  return lax.dynamic_update_index_in_dim(
    buffer, value, jnp.where(slot < 0, buffer.shape[0] - 1, slot), 0
  )


def _read(buffer: jax.Array, slot: jax.Array) -> jax.Array:
  return lax.dynamic_index_in_dim(buffer, jnp.maximum(slot, 0), keepdims=False)


def microbatches(tree: Any, count: int) -> Any:
  """Every leaf `[B, ...]` of `tree` as `[count, B // count, ...]`: microbatch m is row m."""
  return jax.tree.map(lambda x: x.reshape(count, x.shape[0] // count, *x.shape[1:]), tree)


def _microbatch(tree: Any, m: jax.Array) -> Any:
  """Microbatch `m` (traced) of a tree from `microbatches`."""
  return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, m, keepdims=False), tree)


def _shift(
  value: jax.Array, axis: str, stages: int, direction: int, cyclic: bool = False
) -> jax.Array:
  """Sends `value` one device forward (+1) or back (-1).

  With `cyclic` (virtual stages) the ends wrap around: device P-1 sends to
  device 0 and back; otherwise the far end gets zeros.
  """
  if stages == 1:
    return value if cyclic else jnp.zeros_like(value)
  pairs = [
    (s, (s + direction) % stages) for s in range(stages) if cyclic or 0 <= s + direction < stages
  ]
  return lax.ppermute(value, axis, perm=pairs)


def _traces(fn: Callable[..., Any], *args) -> bool:
  """Whether `fn` can be traced on these abstract arguments."""
  try:
    jax.eval_shape(fn, *args)
  except Exception:
    return False
  return True


def _chunk(block, j: int):
  """Chunk `j`'s row of a device's `[v, ...]` params (or gradients) block."""
  return jax.tree.map(lambda b: b[j], block)


def _add_chunk(grads, chunk: int, d_row):
  """`grads[chunk] += d_row` on a `[v, ...]` block (a pytree for `SplitLayout`)."""
  return jax.tree.map(lambda g, d: g.at[chunk].add(d), grads, d_row)


def cut_common(layout: FlatLayout | SplitLayout, block) -> tuple[tuple[jax.Array, ...], ...]:
  """Per chunk j of a device's `[v, ...]` params block, its `shared_leaves`, as arrays.

  Cut once per step: each pass then reads its stage's shared leaves from here
  instead of slicing them out of its row again. (Separate arrays, not `[v, ...]`
  stacks: a pass reading a stack's row would copy it again.)
  """
  v = jax.tree.leaves(block)[0].shape[0]
  return tuple(layout.cut_shared(_chunk(block, j)) for j in range(v))


def branch_table(schedule: Schedule) -> tuple[list[tuple[Action, int]], np.ndarray]:
  """The distinct (action, model stage) pairs a schedule runs, and `[T, P]` indices into them.

  Entry 0 is (IDLE, -1). Only the pairs the table uses get a branch, so a
  schedule without W passes compiles no W branch.
  """
  stage = schedule.model_stage
  used = sorted(
    {
      (Action(int(a)), int(g))
      for a, g in zip(schedule.action.flat, stage.flat, strict=True)
      if g >= 0
    }
  )
  keys = [(Action.IDLE, -1), *used]
  index = {key: i for i, key in enumerate(keys)}
  table = np.zeros(schedule.action.shape, np.int32)
  for (t, s), a in np.ndenumerate(schedule.action):
    if a != Action.IDLE:
      table[t, s] = index[(Action(int(a)), int(stage[t, s]))]
  return keys, table


def _sends(schedule: Schedule) -> np.ndarray:
  """`[2, T, P]`: whether each tick's pass sends an activation on (row 0) or a gradient back."""
  stage = np.maximum(schedule.model_stage, 0)
  return np.stack(np.vectorize(schedule_lib.sends)(schedule.action, stage, schedule.model_stages))


#: An exchange whose messages no one permutation moves: activations on and gradients
#: back, in two `ppermute`s.
BOTH_WAYS = "both ways"

#: How an exchange moves its messages: the (sender, receiver) pairs of one `ppermute`
#: (`()`: nothing moves, no collective), or `BOTH_WAYS`.
Way = tuple[tuple[int, int], ...] | str


@dataclasses.dataclass(frozen=True, eq=False)
class ExchangePlan:
  """How the engine moves a schedule's messages, exchange by exchange.

  Attributes:
    ways: the distinct `Way`s, `()` first.
    way_index: `[E]` the way of each exchange e, as `ways[way_index[e]]`.
    recv_act_slot: `[E, P]` the stash slot where the activation arriving in
      exchange e is stored (-1: none arrives).
    recv_grad_slot: `[E, P]` likewise for gradients.
    waits: whether some message waits on its sender past the exchange after
      its tick (then each device keeps its last message in an outbox).
  """

  ways: tuple[Way, ...]
  way_index: np.ndarray
  recv_act_slot: np.ndarray
  recv_grad_slot: np.ndarray
  waits: bool


def exchange_plan(schedule: Schedule) -> ExchangePlan:
  """When and how each of the schedule's messages moves: one `ppermute` an exchange where it can.

  A collective is a rendezvous of every device, so each one costs a wait. At
  K = 1 a device sends one message a tick, to one neighbour. Where each device
  also receives one at most, the exchange's messages form one permutation of
  the devices and one `ppermute` moves them, where sending activations on and
  gradients back takes two. That is every GPipe and 1F1B exchange as the table
  has it. Where a device would receive from both neighbours at once, one
  message may wait on its sender for a later exchange: until the tick before
  its receiver reads it, and before its sender sends again (a device keeps one
  message, its last, in an outbox). Exchange by exchange, the messages that
  cannot wait go, and those that can go too where their receiver is free;
  only where two that cannot wait reach one device does the exchange take two
  `ppermute`s. That leaves none in ZB-H1 (whose W passes send nothing: the I
  pass's gradient waits through them; 8 of its 27 exchanges at P=4, M=8
  would otherwise take two) and 2 of interleaved 1F1B's 38 at P=4, M=8 (its
  devices send in every tick of its steady state, so nothing waits there; at
  P=4, M=4 one message waits and none takes two). Every device runs the same
  exchange at the same time (the way depends on the exchange only), so all
  devices meet in whichever collective it runs.

  At K > 1 every exchange is `BOTH_WAYS` and moves what its ticks sent: a
  device may send a message each way (half of 1F1B's 14 exchanges at P=4,
  M=8, K=2 need two `ppermute`s), and a switch over ways held one more message
  buffer (0.25 MiB more temporaries at P=4, M=16 in the benchmark) for a gain
  within the noise (2% in one A/B run on 13 cores, against 6-12% at K = 1).

  Args:
    schedule: the tick table (checked: every message has a reader).

  Returns:
    The `ExchangePlan`.

  Example:
    >>> from parstrat._src.pipeline import engine, schedule
    >>> plan = engine.exchange_plan(schedule.build_schedule("1f1b", 2, 2))
    >>> [plan.ways[i] for i in plan.way_index]
    [((0, 1),), ((0, 1),), ((1, 0),), (), ((1, 0),), ()]
  """
  K, T = schedule.exchange_every, schedule.num_ticks
  if K > 1:
    last = slice(K - 1, T, K)  # (a message arrives after its exchange's last tick)
    return ExchangePlan(
      (BOTH_WAYS,),
      np.zeros(schedule.num_exchanges, np.int32),
      schedule.recv_act_slot[last],
      schedule.recv_grad_slot[last],
      False,
    )
  P = schedule.stages
  sends = _sends(schedule).any(axis=0)  # ([T, P]: a device's pass sends a message)
  tables = {
    "activation": (schedule.recv_act_slot, schedule.act_slot),
    "gradient": (schedule.recv_grad_slot, schedule.grad_slot),
  }
  receive = {kind: np.full((T, P), -1, np.int32) for kind in tables}
  ways: list[Way] = [()]
  way = np.zeros(T, np.int32)
  # (the last exchange it can move in, sender, receiver, kind, receiver's slot)
  waiting: list[tuple[int, int, int, str, int]] = []
  for e, messages in enumerate(schedule.messages()):
    for sender, receiver, kind in messages:
      recv_slot, read_slot = tables[kind]
      slot = int(recv_slot[e, receiver])
      read = next((u for u in range(e + 1, T) if read_slot[u, receiver] == slot), T)
      resend = next((u for u in range(e + 1, T) if sends[u, sender]), T)
      waiting.append((min(read, resend) - 1, sender, receiver, kind, slot))
    waiting.sort()
    due = [m for m in waiting if m[0] == e]
    if len({m[2] for m in due}) < len(due):  # (a device receives two that cannot wait)
      moving, this_way = waiting, BOTH_WAYS
    else:
      moving, busy = list(due), {m[2] for m in due}
      for m in waiting:
        if m[0] > e and m[2] not in busy:
          moving.append(m)
          busy.add(m[2])
      this_way = tuple(sorted((m[1], m[2]) for m in moving))
    for _, _, receiver, kind, slot in moving:
      receive[kind][e, receiver] = slot
    waiting = [m for m in waiting if m not in moving]
    if this_way not in ways:
      ways.append(this_way)
    way[e] = ways.index(this_way)
  waits = any(not np.array_equal(receive[kind], tables[kind][0]) for kind in tables)
  return ExchangePlan(tuple(ways), way, receive["activation"], receive["gradient"], waits)


def pipeline_loss_and_grad(
  staged: StagedModel,
  schedule: Schedule,
  block,
  inputs: Any,
  targets: Any,
  *,
  stage_axis: str,
  bubble_value: float = 0.0,
  activations: str = "recompute",
  unroll: bool = False,
) -> tuple[jax.Array, Any]:
  """One device's share of a pipelined forward and backward over its batch block.

  Pseudo-code, for device `s` (its chunk j is model stage g = j P + s)::

    split the batch block into M microbatches
    common[j] = the leaves every stage holds at the same place, cut once from
                params[j] (the others are sliced from params[j] per pass)
    for e in range(T // K):                   # K = schedule.exchange_every; a
                                              # fori_loop, or unrolled (`unroll`)
      for t in range(e K, e K + K):           # T = schedule.num_ticks
        match schedule.action[t, s] (of chunk j, microbatch m):
          FORWARD:  y = stage_g(params[j], stash[slot] or x[m]); send y on;
                    unless activations is "recompute", write its residuals
                    into saved[slot] in place
          BACKWARD: recompute stage_g at stash[slot] (or, unless activations
                    is "recompute", rebuild its vjp from the residuals its
                    forward kept in saved[slot]), pull back the gradient that
                    arrived from stage g+1 (or the loss / M on the last stage),
                    add d params[j] to the gradients in place, send d input back
          BACKWARD_INPUT:  only the part of the backward that d input needs
                    (stage 0: the gradient chain, without the input's own
                    products); write into pending[slot] the values the rest
                    reads of it (e.g. every linear layer's dY, and its X when
                    the forward was rerun)
          BACKWARD_WEIGHT: the rest: d params[j] from pending[slot] (dW = X^T dY),
                    no forward and no gradient chain rerun
          IDLE:     nothing
      exchange: send the exchange's one activation on and one gradient back
      (`bubble_value` where its ticks computed none; at K = 1 the device's last
      message, kept in an outbox where the plan lets messages wait, goes both
      ways), in one `ppermute` where the messages the plan moves in exchange e
      form one permutation of the devices (`exchange_plan`: picked by e, the
      same on every device), else in two; store what arrived from device
      s-1 / s+1 into the slots the plan names (a correct schedule reads
      nothing else)
    add the gradients of common[j] into the row layout of d params[j]
    loss = psum over stages of the last stage's summed microbatch losses / M

  Activations go to device s+1 and gradients to s-1; with virtual stages the
  ends wrap (device P-1's chunk j feeds device 0's chunk j+1).

  Args:
    staged: the model cut into the schedule's P * v model stages.
    schedule: the tick table.
    block: this device's params (device-varying), one row per chunk: `[v, size]`
      for `FlatLayout`, or a pair `([v, parts, split_size], [v, replicated_size])`.
    inputs: this device's block of the model inputs, a pytree of `[B, ...]`
      leaves; stage 0 reads microbatch m's rows of every leaf.
    targets: this device's block of what the loss takes besides the outputs
      (labels, or the whole batch), a pytree of `[B, ...]` leaves; the last
      stage computes `loss_fn(outputs, targets of microbatch m)`.
    stage_axis: the mesh axis the devices of the pipeline lie along.
    bubble_value: what idle ticks send; NaN in tests proves bubbles never leak.
    activations: "recompute" (stash each stage input, rerun the forward in the
      backward), "save" (keep the forward's residuals in slots, no rerun), or a
      `jax.checkpoint_policies` name in between; see `residuals.ACTIVATIONS`.
    unroll: trace every exchange into straight-line code instead of a
      `lax.fori_loop` over them: each tick's switch then holds only the passes
      run in that tick, its row of the tables is a constant (indexed by the
      device's stage), and each exchange's `ppermute` is the one its way
      needs, picked at trace time. A step up to a few percent faster for a
      longer compilation (it grows with the number of ticks).

  Returns:
    `(loss, grads)`: this replica's mean loss (same on every stage) and the
    gradient of it with respect to `block` (shaped like it), not yet averaged
    over data replicas.
  """
  P, M, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
  G = schedule.model_stages
  if staged.num_stages != G:
    raise ValueError(f"The model is cut into {staged.num_stages} stages; the schedule runs {G}.")
  mb = jax.tree.leaves(inputs)[0].shape[0] // M
  xs, ys = microbatches(inputs, M), microbatches(targets, M)
  W, dtype = staged.width, staged.act_dtype
  layout = staged.layout
  stage = lax.axis_index(stage_axis)
  keys, branch_index = branch_table(schedule)
  fill = jnp.full((mb, W), bubble_value, dtype)
  zero_act = jnp.zeros((mb, W), dtype)
  zero_loss = jnp.zeros((), jnp.float32)
  loss_cotangent = jnp.asarray(1.0 / M, jnp.float32)

  # activations != "recompute": forwards keep residuals in slots of `saved`.
  residuals: dict[int, residuals_lib.Residuals] = {}
  res_slot, num_res = np.full(schedule.action.shape, -1, np.int32), 1
  if activations != "recompute":
    residuals_lib.check_activations(activations)
    res_slot, num_res = schedule.residual_slots()
    avals = [
      jax.tree.map(lambda b: jax.ShapeDtypeStruct(b.shape[1:], b.dtype), block),
      jax.ShapeDtypeStruct((mb, W), dtype),
      jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), xs),
      jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), ys),
    ]
    for g in sorted({g for _, g in keys if g >= 0}):
      residuals[g] = residuals_lib.find_residuals(staged, g, *avals, dtype, activations)
  slot = residuals_lib.slot_format(list(residuals.values()))

  def saved_pullback(g, row, common, act, res, x):
    """(d row, d common, d unpadded input) of model stage g from its saved residuals."""
    leaves, inp = staged.stage_inputs(g, row, act, x, common)
    vjp_fn = residuals_lib.pullback(residuals[g], res, leaves, inp)

    def pull(cotangents):
      d_leaves, d_inp = residuals_lib.with_input_gradient(residuals[g], vjp_fn(cotangents))
      _, to_params = jax.vjp(lambda r, c: layout.stage_params(g, r, c), row, common)
      return *to_params(d_leaves), d_inp

    return pull

  def as_message(d_act):
    """An input's gradient as the buffer it travels in: an integer input has none
    (JAX's `float0`), and sends zeros of the buffer's dtype, as a saved pullback does."""
    return zero_act if d_act.dtype == jax.dtypes.float0 else d_act

  def stage_cotangents(g, grad):
    return (zero_act if g == G - 1 else grad, loss_cotangent)

  def backward(action: Action, g: int, row, common, act, grad, res, x, y):
    """(d row, d common, d padded input) of a B, I or W pass of model stage g.

    Each may be unused: an I pass needs only d input, a W pass only the others.
    """
    cotangents = stage_cotangents(g, grad)
    if g in residuals:
      d_row, d_common, d_inp = saved_pullback(g, row, common, act, res, x)(cotangents)
      return d_row, d_common, fill if g == 0 else partition_lib.pad_to(d_inp, W).astype(dtype)

    def f(row, common, act):
      return staged.forward(g, row, act, x, y, common)

    if action == Action.BACKWARD:
      d_row, d_common, d_act = jax.vjp(f, row, common, act)[1](cotangents)
      return d_row, d_common, as_message(d_act)
    if action == Action.BACKWARD_INPUT:
      _, pullback = jax.vjp(lambda act: f(row, common, act), act)
      return None, None, as_message(pullback(cotangents)[0])
    _, pullback = jax.vjp(lambda row, common: f(row, common, act), row, common)
    return *pullback(cotangents), fill

  # The leaves every stage holds at the same place (all of them for equal blocks) are
  # cut once per step (`cut_common`), not sliced out of the row in every pass; their
  # gradients accumulate per chunk and leaf beside the rows' (which exist only if
  # some stage has other leaves) and go back into the row layout after the loop.
  common = cut_common(layout, block)
  sliced = any(layout.owns_unshared(g) for g in range(G))

  def first_stage_backward(row, common, act, grad, res, x, y):
    """Model stage 0's whole backward, also with respect to its float model inputs.

    Their gradient is never used: it shows `split_backward` the gradient chain
    through the stage (each layer's output gradient), which its I pass then
    computes, leaving W only the weight-gradient products.
    """
    cotangents = stage_cotangents(0, grad)
    if 0 in residuals:
      d_row, d_common, d_x = saved_pullback(0, row, common, act, res, x)(cotangents)
    else:
      forward = lambda row, common, x: staged.forward(0, row, act, x, y, common)
      d_row, d_common, d_x = jax.vjp(forward, row, common, x)[1](cotangents)
    return (d_row, d_common), [d for d in jax.tree.leaves(d_x) if d.dtype != jax.dtypes.float0]

  # Split I and W passes (ZB-H1): every model stage's whole backward is cut into the
  # part the input gradient needs (I) and the rest (W), and I hands W the values W reads
  # of its part (`backward_split`): W then runs only the weight-gradient products, not
  # the forward and the gradient chain again. Stage 0's I computes no input gradient
  # (the batch has none), only the chain its weight gradients share with it.
  splits: dict[int, backward_split_lib.BackwardSplit] = {}
  micro = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tree)
  for action, g in keys:
    if action == Action.BACKWARD_INPUT:

      def whole_backward(row, common, act, grad, res, x, y, g=g):
        d_row, d_common, d_act = backward(Action.BACKWARD, g, row, common, act, grad, res, x, y)
        return (d_row, d_common), d_act

      j = g // P
      abstract = (
        _chunk(block, j),
        common[j],
        zero_act,
        zero_act,
        tuple(slot) if g in residuals else None,
        micro(xs) if staged.reads_inputs(g) else None,
        micro(ys) if g == G - 1 else None,
      )
      if g > 0:
        splits[g] = backward_split_lib.split_backward(whole_backward, *abstract)
        continue
      try:
        split = backward_split_lib.split_backward(
          first_stage_backward, *abstract, input_gradient=False
        )
      except Exception:
        # The batch itself may not be differentiable (a `pure_callback` or a
        # `while_loop` on the inputs, which the weights' gradient never crosses):
        # then stage 0 keeps its unsplit backward (I idle, W the whole backward).
        # Any other failure is re-raised.
        if _traces(first_stage_backward, *abstract):
          raise
        continue
      # A first stage fed only integers (tokens) has no gradient chain for I to run.
      if split.handoff:
        splits[g] = split

  def handoff_format(parts):
    return residuals_lib.slot_format(
      [residuals_lib.Residuals(None, (), split.handoff) for split in parts]
    )

  def sizes(parts):
    return [(a.shape, a.dtype) for a in handoff_format(parts)]

  # Stage 0 is cut only where its handoff fits the slots the other stages need: where
  # its activations are the largest (a CNN at full resolution), cutting it would grow
  # every device's handoff slots, and it keeps its unsplit backward instead.
  later = [split for g, split in splits.items() if g > 0]
  if 0 in splits and later and sizes(later) != sizes(splits.values()):
    del splits[0]
  handoff_slot, num_handoff = schedule.handoff_slots()
  handoff = handoff_format(splits.values())

  # Each branch takes the gradient accumulators and the residual slots and returns
  # them, adding its chunk's gradient in place in B and W passes only, writing a
  # residual slot in place in F passes only: no tick adds or builds a zero buffer the
  # size of the params or of a slot. (The step compiles with copy insertion's region
  # analysis, `STEP_COMPILER_OPTIONS`, so a branch that hands an operand back
  # unchanged without reading it does not copy it. The residual slots are read in
  # B passes and written in F passes, and XLA:CPU still copies all of them in each
  # such branch: 7.3 MB a tick for 1F1B "save" in the benchmark. A toy loop of 22
  # ticks over slots of that size, on 2 cores, ran in 3.6-4.3 ms so, and in 6.5-9.9
  # ms with the slot written outside the switch (no copy of the whole buffer, but a
  # slot-sized write every tick); so they stay inside.) The stash and the inbox are
  # read-only operands, written once per exchange.
  def branch(action: Action, g: int):
    def run(block, common, grads, stash, inbox, saved, pending, slots, xs, ys):
      if action == Action.IDLE:
        return fill, grads, saved, pending, zero_loss
      a_slot, g_slot, r_slot, h_slot, m = slots
      # Only the first stage reads the microbatch's inputs, only the last its targets.
      x = _microbatch(xs, m) if staged.reads_inputs(g) else None
      y = _microbatch(ys, m) if g == G - 1 else None
      j = g // P
      row, own_common = _chunk(block, j), common[j]
      act = _read(stash, a_slot)
      if action == Action.FORWARD:
        if g not in residuals:
          out, loss = staged.forward(g, row, act, x, y, own_common)
          return out, grads, saved, pending, loss
        leaves, inp = staged.stage_inputs(g, row, act, x, own_common)
        out, loss, res = residuals_lib.forward_saving(
          staged, g, residuals[g], leaves, inp, x, y, dtype, activations, slot
        )
        saved = tuple(
          lax.dynamic_update_index_in_dim(part, r, r_slot, 0)
          for part, r in zip(saved, res, strict=True)
        )
        return out, grads, saved, pending, loss
      grad = _read(inbox, g_slot)
      res = tuple(_read(part, r_slot) for part in saved) if g in residuals else None
      args = (row, own_common, act, grad, res, x, y)
      if action == Action.BACKWARD_INPUT and g in splits:
        d_act, values = splits[g].input_pass(*args)
        d_act = fill if d_act is None else d_act  # (stage 0: the batch has no gradient)
        pending = tuple(
          lax.dynamic_update_index_in_dim(part, value, h_slot, 0)
          for part, value in zip(pending, residuals_lib.pack(values, handoff), strict=True)
        )
        return d_act, grads, saved, pending, zero_loss
      if action == Action.BACKWARD_WEIGHT and g in splits:
        packed = tuple(_read(part, h_slot) for part in pending)
        values = residuals_lib.unpack(packed, splits[g].handoff)
        (d_row, d_common), d_act = splits[g].weight_pass(values, *args), None
      else:
        d_row, d_common, d_act = backward(action, g, *args)
      if action != Action.BACKWARD_INPUT:
        row_grads, common_grads = grads
        if layout.owns_unshared(g):
          row_grads = layout.constrain(_add_chunk(row_grads, j, d_row))
        added = jax.tree.map(jnp.add, common_grads[j], d_common)
        grads = row_grads, (*common_grads[:j], added, *common_grads[j + 1 :])
      if action == Action.BACKWARD_WEIGHT:
        d_act = fill
      return d_act, grads, saved, pending, zero_loss

    return run

  branches = [branch(action, g) for action, g in keys]
  cyclic = v > 1
  K = schedule.exchange_every
  # [8, T, P]: per tick and device, its branch, microbatch, the activation, gradient,
  # residual and handoff slots it reads or writes, and whether it sends on / back.
  tables = np.concatenate(
    [
      np.stack([branch_index, np.maximum(schedule.microbatch, 0)]),
      np.stack([schedule.act_slot, schedule.grad_slot, res_slot]),
      _sends(schedule).astype(np.int32),
      handoff_slot[None],
    ]
  )
  traced_tables = jnp.asarray(tables)

  def tick(t):
    """(the tick's branches, this device's row of the tables at tick t).

    A traced t reads the whole table. A static one (`unroll`) reads the tick's
    column alone, and the tick's switch holds only the passes some device runs in it.
    """
    if not unroll:
      return branches, [traced_tables[i, t, stage] for i in range(len(tables))]
    here = sorted(set(tables[0, t].tolist()))
    local = np.asarray([here.index(i) for i in tables[0, t]], np.int32)
    column = [jnp.asarray(local), *(jnp.asarray(tables[i, t]) for i in range(1, len(tables)))]
    return [branches[i] for i in here], [c[stage] for c in column]

  def move(way):
    """(what arrives from device s-1, from s+1) in an exchange moving messages `way`."""

    def run(send_act, send_grad):
      if way == BOTH_WAYS:
        return (
          _shift(send_act, stage_axis, P, +1, cyclic),
          _shift(send_grad, stage_axis, P, -1, cyclic),
        )
      if not way:
        return fill, fill
      if all(sender == receiver for sender, receiver in way):  # (P = 1: chunk to chunk)
        return send_act, send_act
      # (only at K = 1, where a device's one message goes on or back: send_act is send_grad)
      arrived = lax.ppermute(send_act, stage_axis, perm=list(way))
      return arrived, arrived  # (kept where the receiver's table names a slot)

    return run

  plan = exchange_plan(schedule)
  moves, way_index = [move(way) for way in plan.ways], jnp.asarray(plan.way_index)
  receive = jnp.asarray(np.stack([plan.recv_act_slot, plan.recv_grad_slot]))

  def exchange(e, carry):
    """Ticks e K .. e K + K - 1, then the exchange: activations on, gradients back.

    `e` is traced in a `lax.fori_loop`, or a Python int when the ticks are unrolled.
    """
    stash, inbox, saved, pending, grads, loss, outbox = carry
    send_act = send_grad = fill if outbox is None else outbox
    for k in range(K):
      tick_branches, row = tick(e * K + k)
      index, m, a_slot, g_slot, r_slot, sends_act, sends_grad, h_slot = row
      # A pass sends at most one message (an activation on or a gradient back).
      message, grads, saved, pending, d_loss = lax.switch(
        index,
        tick_branches,
        block,
        common,
        grads,
        stash,
        inbox,
        saved,
        pending,
        (a_slot, g_slot, r_slot, h_slot, m),
        xs,
        ys,
      )
      loss = loss + d_loss
      if K == 1 and outbox is None:  # (both ways: kept where the receiver's table says)
        send_act = send_grad = message
      elif K == 1:  # (the last message sent waits in the outbox until it moves)
        send_act = send_grad = jnp.where(sends_act + sends_grad > 0, message, send_act)
      else:  # (a device sends at most one of each per exchange)
        send_act = jnp.where(sends_act > 0, message, send_act)
        send_grad = jnp.where(sends_grad > 0, message, send_grad)
    if unroll:  # (e is static: this exchange's own way, no switch)
      from_prev, from_next = moves[plan.way_index[e]](send_act, send_grad)
    elif len(plan.ways) == 1:
      from_prev, from_next = moves[0](send_act, send_grad)
    else:  # (every device takes the same branch: see `hlo_check.UNIFORM_SCOPE`)
      with jax.named_scope(hlo_check.UNIFORM_SCOPE):
        from_prev, from_next = lax.switch(way_index[e], moves, send_act, send_grad)
    stash = _put(stash, receive[0, e, stage], from_prev)
    inbox = _put(inbox, receive[1, e, stage], from_next)
    return stash, inbox, saved, pending, grads, loss, None if outbox is None else send_act

  carry = (
    jnp.full((schedule.num_act_slots + 1, mb, W), bubble_value, dtype),  # (+ a spare:
    jnp.full((schedule.num_grad_slots + 1, mb, W), bubble_value, dtype),  # see `_put`)
    tuple(jnp.zeros((num_res, *part.shape), part.dtype) for part in slot),
    tuple(jnp.zeros((num_handoff, *part.shape), part.dtype) for part in handoff),
    (
      layout.constrain(jax.tree.map(jnp.zeros_like, block)) if sliced else None,
      jax.tree.map(jnp.zeros_like, common),
    ),
    zero_loss,
    fill if plan.waits else None,  # (the outbox)
  )
  if unroll:  # (straight-line code: every tick and exchange index above is static)
    for e in range(schedule.num_exchanges):
      carry = exchange(e, carry)
  else:
    carry = lax.fori_loop(0, schedule.num_exchanges, exchange, carry)
  _, _, _, _, (row_grads, common_grads), loss, _ = carry
  loss = lax.psum(loss, stage_axis) / M
  if not jax.tree.leaves(common):
    return loss, row_grads
  grads = jax.vjp(lambda b: cut_common(layout, b), block)[1](common_grads)[0]
  if sliced:
    grads = jax.tree.map(jnp.add, grads, row_grads)
  return loss, layout.constrain(grads)


def pipeline_forward(
  staged: StagedModel,
  num_microbatches: int,
  block,
  inputs: Any,
  *,
  stage_axis: str,
  virtual_stages: int = 1,
) -> jax.Array:
  """A forward-only pipelined pass; returns the `[B, out...]` outputs on every stage.

  `inputs` is this device's block of the model inputs (any pytree of `[B, ...]`).

  In round j (one per chunk), device s runs model stage j P + s on
  microbatch `t - s` at tick t (M + P - 1 ticks); the last device collects the
  round's outputs, which feed device 0 in the next round. A `psum` over the
  stage axis then replicates the final outputs.
  """
  G, M, v = staged.num_stages, num_microbatches, virtual_stages
  P = G // v
  mb = jax.tree.leaves(inputs)[0].shape[0] // M
  xs = microbatches(inputs, M)
  W, dtype = staged.width, staged.act_dtype
  stage = lax.axis_index(stage_axis)
  out_aval = staged.program.boundaries[-1]
  out_width = partition_lib.flat_width(out_aval)
  no_act = jnp.zeros((mb, W), dtype)
  no_out = jnp.zeros((mb, out_width), out_aval.dtype)

  def branch(g):  # (activation sent on, or the model's output on the last model stage)
    def run(block, act, x):
      out = staged.output(g, _chunk(block, g // P), act, x)
      if g == G - 1:
        return no_act, partition_lib.pad_to(out, out_width).astype(out_aval.dtype)
      return partition_lib.pad_to(out, W).astype(dtype), no_out

    return run

  feed = None
  for j in range(v):
    branches = [branch(j * P + s) for s in range(P)]

    def tick(t, carry, branches=branches, feed=feed, final=j == v - 1):
      act, sent, outputs = carry
      m = t - stage
      active = (m >= 0) & (m < M)
      index = jnp.clip(m, 0, M - 1)
      x = _microbatch(xs, index)
      if feed is not None:  # device 0 continues from the previous round's last activations
        act = jnp.where(stage == 0, lax.dynamic_index_in_dim(feed, index, keepdims=False), act)
      send, out = lax.switch(stage, branches, block, act, x)
      send = jnp.where(active, send, jnp.zeros_like(send))
      last = jnp.where(active & (stage == P - 1), m, -1)
      if final:
        outputs = _store(outputs, last, out)
      else:
        sent = _store(sent, last, send)
      return _shift(send, stage_axis, P, +1), sent, outputs

    sent = jnp.zeros((M if j < v - 1 else 1, mb, W), dtype)
    carry = (no_act, sent, jnp.zeros((M if j == v - 1 else 1, mb, out_width), out_aval.dtype))
    _, sent, outputs = lax.fori_loop(0, num_total_iterations(P, M), tick, carry)
    feed = _shift(sent, stage_axis, P, +1, cyclic=True)
  outputs = lax.psum(outputs, stage_axis).reshape(M * mb, out_width)
  return partition_lib.unpad(
    outputs, jax.ShapeDtypeStruct((M * mb, *out_aval.shape[1:]), out_aval.dtype)
  )
