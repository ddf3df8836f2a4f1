"""Running a pipeline schedule inside `jax.shard_map`, one stage per device.

Each device holds its stage's parameters as one flat buffer (padded to the
largest stage), and the activations crossing stage boundaries as rows of a
flat `[microbatch, W]` buffer (padded to the widest boundary). At every tick a
`lax.switch` on (action, stage index) runs only the device's own stage, then
one `ppermute` moves activations to the next stage and one moves gradients to
the previous stage.

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

from parstrat._src.pipeline import partition as partition_lib
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
  """

  treedef: Any
  shapes: tuple[tuple[int, ...], ...]
  stage_leaves: tuple[tuple[int, ...], ...]
  offsets: tuple[tuple[int, ...], ...]
  size: int
  dtype: Any

  @classmethod
  def build(cls, params: Any, stage_leaves: tuple[tuple[int, ...], ...]) -> FlatLayout:
    leaves, treedef = jax.tree.flatten(params)
    dtypes = {jnp.dtype(leaf.dtype) for leaf in leaves}
    if len(dtypes) != 1:
      raise ValueError(f"Pipelined params must share one dtype, got {sorted(map(str, dtypes))}.")
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
    return cls(treedef, shapes, stage_leaves, tuple(offsets), max(sizes), dtypes.pop())

  @property
  def stage_sizes(self) -> list[int]:
    return [sum(int(np.prod(self.shapes[i])) for i in group) for group in self.stage_leaves]

  def to_stored(self, params: Any) -> jax.Array:
    """Model layout -> `[P, size]` stage buffers."""
    leaves = jax.tree.leaves(params)
    rows = []
    for group in self.stage_leaves:
      flat = [leaves[i].reshape(-1) for i in group]
      row = jnp.concatenate(flat) if flat else jnp.zeros((0,), self.dtype)
      rows.append(jnp.pad(row, (0, self.size - row.shape[0])))
    return jnp.stack(rows)

  def stage_params(self, stage: int, row: jax.Array) -> list[jax.Array]:
    """Stage `stage`'s leaves, sliced out of its flat buffer `row`."""
    return [
      lax.dynamic_slice_in_dim(row, off, int(np.prod(self.shapes[i]))).reshape(self.shapes[i])
      for i, off in zip(self.stage_leaves[stage], self.offsets[stage], strict=True)
    ]

  def constrain(self, row: jax.Array) -> jax.Array:
    """The identity (a flat row has no layout inside the map); see `SplitLayout`."""
    return row

  def to_params(self, stored: jax.Array) -> Any:
    """`[P, size]` stage buffers -> model layout."""
    leaves: list[Any] = [None] * len(self.shapes)
    for s, group in enumerate(self.stage_leaves):
      for i, leaf in zip(group, self.stage_params(s, stored[s]), strict=True):
        leaves[i] = leaf
    return jax.tree.unflatten(self.treedef, leaves)


def _to_block(leaf: jax.Array, dim: int, parts: int) -> jax.Array:
  """`leaf` cut into `parts` equal slices along `dim`, as `[parts, leaf.size // parts]`."""
  return jnp.moveaxis(leaf, dim, 0).reshape(parts, -1)


def _from_block(block: jax.Array, shape: tuple[int, ...], dim: int) -> jax.Array:
  """The inverse of `_to_block`: `[parts, k]` slices -> the leaf of `shape`."""
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

  @classmethod
  def build(
    cls,
    params: Any,
    stage_leaves: tuple[tuple[int, ...], ...],
    split_dims: tuple[int | None, ...],
    parts: int,
    axis: str,
  ) -> SplitLayout:
    flat = FlatLayout.build(params, stage_leaves)  # checks dtypes and ownership
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
    """Model layout -> `(split [P, parts, split_size], replicated [P, replicated_size])`."""
    leaves = jax.tree.leaves(params)
    split_rows, replicated_rows = [], []
    for group in self.stage_leaves:
      blocks = [
        _to_block(leaves[i], self.split_dims[i], self.parts)
        for i in group
        if self.split_dims[i] is not None
      ]
      flat = [leaves[i].reshape(-1) for i in group if self.split_dims[i] is None]
      block = jnp.concatenate(blocks, axis=1) if blocks else jnp.zeros((self.parts, 0), self.dtype)
      row = jnp.concatenate(flat) if flat else jnp.zeros((0,), self.dtype)
      split_rows.append(jnp.pad(block, ((0, 0), (0, self.split_size - block.shape[1]))))
      replicated_rows.append(jnp.pad(row, (0, self.replicated_size - row.shape[0])))
    return jnp.stack(split_rows), jnp.stack(replicated_rows)

  def stage_params(
    self, stage: int, row: tuple[jax.Array, jax.Array], *, constrain: bool = True
  ) -> list[jax.Array]:
    """Stage `stage`'s leaves from its `([parts, split_size], [replicated_size])` buffers.

    With `constrain` (inside the map), each split leaf is pinned to be sharded
    over `axis` along its split dimension, so the partitioner keeps it split.
    """
    block, flat = row
    out = []
    for i, off in zip(self.stage_leaves[stage], self.offsets[stage], strict=True):
      shape, dim = self.shapes[i], self.split_dims[i]
      size = int(np.prod(shape))
      if dim is None:
        out.append(lax.dynamic_slice_in_dim(flat, off, size).reshape(shape))
        continue
      leaf = _from_block(lax.slice_in_dim(block, off, off + size // self.parts, axis=1), shape, dim)
      if constrain:
        spec = [None] * len(shape)
        spec[dim] = self.axis
        leaf = lax.with_sharding_constraint(leaf, PartitionSpec(*spec))
      out.append(leaf)
    return out

  def constrain(self, row: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Pins a `[parts, split_size]` block (params or gradients) to be split over `axis`."""
    block, flat = row
    return lax.with_sharding_constraint(block, PartitionSpec(self.axis, None)), flat

  def to_params(self, stored: tuple[jax.Array, jax.Array]) -> Any:
    """`(split, replicated)` stage buffers -> model layout."""
    split, replicated = stored
    leaves: list[Any] = [None] * len(self.shapes)
    for s, group in enumerate(self.stage_leaves):
      row = (split[s], replicated[s])
      for i, leaf in zip(group, self.stage_params(s, row, constrain=False), strict=True):
        leaves[i] = leaf
    return jax.tree.unflatten(self.treedef, leaves)


@dataclasses.dataclass(frozen=True)
class StagedModel:
  """The model cut for one microbatch shape, on flat buffers.

  `forward(stage, row, act, x, y)` runs stage `stage` (a Python int) on its
  params `row` (a flat buffer for `FlatLayout`, a pair for `SplitLayout`); its
  input is `x` for stage 0 and the padded activation `act` otherwise. It
  returns the padded output and the microbatch loss (0 except on the last
  stage).
  """

  layout: FlatLayout | SplitLayout
  program: partition_lib.StageProgram
  width: int
  loss_fn: Callable[[jax.Array, jax.Array], jax.Array]

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

  def output(self, stage: int, row, act, x):
    """Stage `stage`'s output, unpadded, in its own dtype."""
    program = self.program
    inp = x if stage == 0 else partition_lib.unpad(act, program.boundaries[stage])
    return program.stage_fns[stage](self.layout.stage_params(stage, row), inp)

  def forward(self, stage: int, row, act, x, y):
    out = self.output(stage, row, act, x)
    if stage == self.num_stages - 1:
      loss = self.loss_fn(out, y).astype(jnp.float32)
    else:
      loss = jnp.zeros((), jnp.float32)
    return partition_lib.pad_to(out, self.width).astype(act.dtype), loss


def _store(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
  """Writes `value` into `buffer[slot]`, or nothing when `slot < 0`."""
  index = jnp.maximum(slot, 0)
  kept = lax.dynamic_index_in_dim(buffer, index, keepdims=False)
  return lax.dynamic_update_index_in_dim(buffer, jnp.where(slot >= 0, value, kept), index, 0)


def _read(buffer: jax.Array, slot: jax.Array) -> jax.Array:
  return lax.dynamic_index_in_dim(buffer, jnp.maximum(slot, 0), keepdims=False)


def _shift(value: jax.Array, axis: str, stages: int, direction: int) -> jax.Array:
  """Sends `value` one stage forward (+1) or back (-1); the far end gets zeros."""
  if stages == 1:
    return jnp.zeros_like(value)
  pairs = [(s, s + direction) for s in range(stages) if 0 <= s + direction < stages]
  return lax.ppermute(value, axis, perm=pairs)


def pipeline_loss_and_grad(
  staged: StagedModel,
  schedule: Schedule,
  row: jax.Array,
  inputs: jax.Array,
  labels: jax.Array,
  *,
  stage_axis: str,
  bubble_value: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
  """One device's share of a pipelined forward and backward over its batch block.

  Pseudo-code, for the device holding stage `s`::

    split the batch block into M microbatches
    for t in range(T):                        # T = schedule.num_ticks
      match schedule.action[t, s]:
        FORWARD m:  y = stage_s(params, stash[slot] or x[m]); send y to s+1
        BACKWARD m: recompute stage_s at stash[slot], pull back the gradient
                    arriving from s+1 (or the loss / M on the last stage),
                    accumulate d params, send d input to s-1
        IDLE:       send `bubble_value` (never read by a correct schedule)
      store what arrived from s-1 / s+1 into the slots the schedule names
    loss = psum over stages of the last stage's summed microbatch losses / M

  Args:
    staged: the model cut into stages.
    schedule: the tick table.
    row: this device's stage params (device-varying): a `[size]` flat buffer,
      or for `SplitLayout` a pair `([parts, split_size], [replicated_size])`.
    inputs: this device's batch block `[B, ...]`.
    labels: `[B, ...]`.
    stage_axis: the mesh axis the stages lie along.
    bubble_value: what idle ticks send; NaN in tests proves bubbles never leak.

  Returns:
    `(loss, grads)`: this replica's mean loss (same on every stage) and the
    gradient of it with respect to `row` (shaped like it), not yet averaged
    over data replicas.
  """
  P, M = schedule.stages, schedule.microbatches
  mb = inputs.shape[0] // M
  xs = inputs.reshape(M, mb, *inputs.shape[1:])
  ys = labels.reshape(M, mb, *labels.shape[1:])
  W, dtype = staged.width, staged.act_dtype
  stage = lax.axis_index(stage_axis)
  tables = jnp.asarray(
    np.stack(
      [
        schedule.action,
        np.maximum(schedule.microbatch, 0),
        schedule.act_slot,
        schedule.grad_slot,
        schedule.recv_act_slot,
        schedule.recv_grad_slot,
      ]
    )
  )
  fill = jnp.full((mb, W), bubble_value, dtype)
  zero_act = jnp.zeros((mb, W), dtype)
  zero_row = staged.layout.constrain(jax.tree.map(jnp.zeros_like, row))
  zero_loss = jnp.zeros((), jnp.float32)

  def idle(row, act, grad, x, y):
    del row, act, grad, x, y
    return fill, fill, zero_row, zero_loss

  def forward_branch(s):
    def run(row, act, grad, x, y):
      del grad
      out, loss = staged.forward(s, row, act, x, y)
      return out, fill, zero_row, loss

    return run

  def backward_branch(s):
    def run(row, act, grad, x, y):
      def f(row, act):
        return staged.forward(s, row, act, x, y)

      _, pullback = jax.vjp(f, row, act)
      out_cotangent = zero_act if s == P - 1 else grad
      d_row, d_act = pullback((out_cotangent, jnp.asarray(1.0 / M, jnp.float32)))
      return fill, d_act, d_row, zero_loss

    return run

  branches = [idle] + [forward_branch(s) for s in range(P)] + [backward_branch(s) for s in range(P)]

  def tick(t, carry):
    stash, inbox, grads, loss = carry
    action, m, a_slot, g_slot, ra_slot, rg_slot = (tables[k, t, stage] for k in range(6))
    index = jnp.where(
      action == Action.FORWARD, 1 + stage, jnp.where(action == Action.BACKWARD, 1 + P + stage, 0)
    )
    send_act, send_grad, d_row, d_loss = lax.switch(
      index,
      branches,
      row,
      _read(stash, a_slot),
      _read(inbox, g_slot),
      lax.dynamic_index_in_dim(xs, m, keepdims=False),
      lax.dynamic_index_in_dim(ys, m, keepdims=False),
    )
    stash = _store(stash, ra_slot, _shift(send_act, stage_axis, P, +1))
    inbox = _store(inbox, rg_slot, _shift(send_grad, stage_axis, P, -1))
    grads = staged.layout.constrain(jax.tree.map(jnp.add, grads, d_row))
    return stash, inbox, grads, loss + d_loss

  carry = (
    jnp.full((schedule.num_act_slots, mb, W), bubble_value, dtype),
    jnp.full((schedule.num_grad_slots, mb, W), bubble_value, dtype),
    zero_row,
    zero_loss,
  )
  _, _, grads, loss = lax.fori_loop(0, schedule.num_ticks, tick, carry)
  loss = lax.psum(loss, stage_axis) / M
  return loss, grads


def pipeline_forward(
  staged: StagedModel,
  microbatches: int,
  row: jax.Array,
  inputs: jax.Array,
  *,
  stage_axis: str,
) -> jax.Array:
  """A forward-only pipelined pass; returns the `[B, out...]` outputs on every stage.

  Stage s runs microbatch `t - s` at tick t (M + P - 1 ticks); the last stage
  collects the outputs, which a `psum` over the stage axis then replicates.
  """
  P, M = staged.num_stages, microbatches
  mb = inputs.shape[0] // M
  xs = inputs.reshape(M, mb, *inputs.shape[1:])
  W, dtype = staged.width, staged.act_dtype
  stage = lax.axis_index(stage_axis)
  out_aval = staged.program.boundaries[-1]
  out_width = partition_lib.flat_width(out_aval)
  no_act = jnp.zeros((mb, W), dtype)
  no_out = jnp.zeros((mb, out_width), out_aval.dtype)

  def branch(s):  # (activation sent on, or the model's output on the last stage)
    def run(row, act, x):
      out = partition_lib.pad_to(staged.output(s, row, act, x), out_width if s == P - 1 else W)
      return (no_act, out.astype(out_aval.dtype)) if s == P - 1 else (out.astype(dtype), no_out)

    return run

  def tick(t, carry):
    act, outputs = carry
    m = t - stage
    active = (m >= 0) & (m < M)
    x = lax.dynamic_index_in_dim(xs, jnp.clip(m, 0, M - 1), keepdims=False)
    send, out = lax.switch(stage, [branch(s) for s in range(P)], row, act, x)
    send = jnp.where(active, send, jnp.zeros_like(send))
    outputs = _store(outputs, jnp.where(active & (stage == P - 1), m, -1), out)
    return _shift(send, stage_axis, P, +1), outputs

  carry = (no_act, jnp.zeros((M, mb, out_width), out_aval.dtype))
  _, outputs = lax.fori_loop(0, num_total_iterations(P, M), tick, carry)
  outputs = lax.psum(outputs, stage_axis).reshape(M * mb, out_width)
  return partition_lib.unpad(
    outputs, jax.ShapeDtypeStruct((M * mb, *out_aval.shape[1:]), out_aval.dtype)
  )
