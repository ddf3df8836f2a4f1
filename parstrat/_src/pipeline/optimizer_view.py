"""The pipeline's parameters in the model's own layout, for a per-leaf optimizer.

A pipeline stores each stage's parameters as one flat buffer, a row of
`[G, size]` sharded over the stage axis (`FlatLayout`). An element-wise
optimizer (SGD, Adam, `clip_by_global_norm`) runs on those rows as it would
on the model's leaves; a per-leaf one (`optax.adamw(mask=...)`,
`optax.multi_transform`, LAMB's trust ratios, adafactor's factored moments)
does not. For those, the trainer runs the optimizer on the model's layout,
each leaf of its own shape, sharded over the stage axis ZeRO-style:

    to_view (stored rows -> model leaves, per device s):
      send[j] = the j-th slice (along the leaf's split dimension) of every
                leaf of s's own stages, side by side     # [P, C]
      recv    = all_to_all(send)                          # recv[s'] from device s'
      leaf i  = recv[owner(i)][its columns], reshaped      # device j: slice j
      (leaves with no dimension divisible by P: all_gather, replicated)
    from_view: the same, backwards (all_to_all, then each device reassembles
      its own stages' rows).

Each device holds 1/P of every leaf's optimizer state (about 1/P of the
whole, where a flat row holds its stage's: the same but for imbalance
between stages), and each step moves the gradients and params into that
layout and the updates back: two all-to-alls of a row each, and one of
updates, where the element-wise path moves nothing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec


@dataclasses.dataclass(frozen=True)
class _Leaf:
  """Where one parameter leaf lives in the stored rows and in the view.

  Attributes:
    shape: the leaf's shape.
    device: the stage-axis index of the device whose row holds it.
    row: which of that device's rows (its virtual stage, 0 .. v-1).
    offset: its start in that row.
    dim: the dimension it is split along in the view (None: replicated).
    column: its start in the send buffer of `device` (split leaves) or in the
      replicated segment of `device` (the others).
  """

  shape: tuple[int, ...]
  device: int
  row: int
  offset: int
  dim: int | None
  column: int

  @property
  def size(self) -> int:
    return math.prod(self.shape)


def _split_dim(shape: tuple[int, ...], parts: int) -> int | None:
  """The largest dimension of `shape` that `parts` divides (None: none, or empty)."""
  if not shape or math.prod(shape) == 0:
    return None
  best = None
  for d, n in enumerate(shape):
    if n % parts == 0 and (best is None or n > shape[best]):
      best = d
  return best


def _blocks(leaf: jax.Array, dim: int, parts: int) -> jax.Array:
  """`leaf` as `[parts, size // parts]`: row j is its j-th slice along `dim`, flattened."""
  return jnp.moveaxis(leaf, dim, 0).reshape(parts, -1)


def _slice_of(flat: jax.Array, shape: tuple[int, ...], dim: int, parts: int) -> jax.Array:
  """One flattened slice of `_blocks` back to the leaf's slice along `dim`."""
  moved = (shape[dim] // parts, *shape[:dim], *shape[dim + 1 :])
  return jnp.moveaxis(flat.reshape(moved), 0, dim)


@dataclasses.dataclass(frozen=True)
class ModelLayoutView:
  """Moves a pipeline's flat stage rows to the model's layout and back.

  Build it with `ModelLayoutView.build(layout, mesh, axis)`; `spec` gives
  each leaf's `PartitionSpec` in the view; `to_view` and `from_view` run
  under `jax.jit` on global arrays (each is one `jax.shard_map`).

  Attributes:
    mesh: the trainer's mesh.
    axis: the stage axis the rows are sharded over.
    treedef: the params' tree structure.
    leaves: where each leaf lives (`_Leaf`), in tree order.
    stage_rows: per device and row, the leaves it holds in row order.
    size: a row's length.
    columns: the send buffers' width (the largest device's).
    replicated: the replicated segments' length (the largest device's).
    dtype: the rows' dtype.
  """

  mesh: Mesh
  axis: str
  treedef: Any
  leaves: tuple[_Leaf, ...]
  stage_rows: tuple[tuple[tuple[int, ...], ...], ...]
  size: int
  columns: int
  replicated: int
  dtype: Any

  @classmethod
  def build(cls, layout: Any, mesh: Mesh, axis: str) -> ModelLayoutView:
    """The view of `layout` (a `FlatLayout`) on `mesh`, whose rows lie along `axis`."""
    parts = mesh.shape[axis]
    rows_per_device = len(layout.order) // parts
    placed: dict[int, tuple[int, int, int]] = {}
    stage_rows = []
    for device in range(parts):
      rows = []
      for k in range(rows_per_device):
        stage = layout.order[device * rows_per_device + k]
        group = layout.stage_leaves[stage]
        for i, offset in zip(group, layout.offsets[stage], strict=True):
          placed[i] = (device, k, offset)
        rows.append(tuple(group))
      stage_rows.append(tuple(rows))
    used_columns, used_replicated = [0] * parts, [0] * parts
    leaves = []
    for i, shape in enumerate(layout.shapes):
      device, k, offset = placed[i]
      dim = _split_dim(shape, parts)
      if dim is None:
        column = used_replicated[device]
        used_replicated[device] += math.prod(shape)
      else:
        column = used_columns[device]
        used_columns[device] += math.prod(shape) // parts
      leaves.append(_Leaf(tuple(shape), device, k, offset, dim, column))
    return cls(
      mesh,
      axis,
      layout.treedef,
      tuple(leaves),
      tuple(stage_rows),
      layout.size,
      max(used_columns),
      max(used_replicated),
      layout.dtype,
    )

  @property
  def parts(self) -> int:
    return self.mesh.shape[self.axis]

  def spec(self) -> Any:
    """The view's `PartitionSpec` per leaf: split along `dim` over `axis`, or replicated."""
    specs = []
    for leaf in self.leaves:
      entries = [None] * len(leaf.shape)
      if leaf.dim is not None:
        entries[leaf.dim] = self.axis
      specs.append(PartitionSpec(*entries))
    return jax.tree.unflatten(self.treedef, specs)

  def _per_device(self, fn, in_specs, out_specs):
    return jax.shard_map(
      fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )

  def to_view(self, stored: jax.Array) -> Any:
    """`[G, size]` rows (sharded over `axis`) -> the params' tree, laid out by `spec`."""
    parts, leaves = self.parts, self.leaves

    def branch(device):
      def build(block):  # this device's `[v, size]` rows -> send buffer, replicated segment
        send, segment = [], []
        for leaf in leaves:
          if leaf.device != device:
            continue
          flat = lax.slice_in_dim(block[leaf.row], leaf.offset, leaf.offset + leaf.size)
          if leaf.dim is None:
            segment.append(flat)
          else:
            send.append(_blocks(flat.reshape(leaf.shape), leaf.dim, parts))
        send_buffer = jnp.concatenate(send, axis=1) if send else jnp.zeros((parts, 0), self.dtype)
        segment_buffer = jnp.concatenate(segment) if segment else jnp.zeros((0,), self.dtype)
        return (
          jnp.pad(send_buffer, ((0, 0), (0, self.columns - send_buffer.shape[1]))),
          jnp.pad(segment_buffer, (0, self.replicated - segment_buffer.shape[0])),
        )

      return build

    def local(block):
      send, segment = lax.switch(
        lax.axis_index(self.axis), [branch(d) for d in range(parts)], block
      )
      received = lax.all_to_all(send, self.axis, 0, 0, tiled=True) if self.columns else send
      gathered = lax.all_gather(segment, self.axis) if self.replicated else None
      out = []
      for leaf in leaves:
        if leaf.dim is None:
          flat = lax.slice_in_dim(gathered[leaf.device], leaf.column, leaf.column + leaf.size)
          out.append(flat.reshape(leaf.shape))
        else:
          width = leaf.size // parts
          flat = lax.slice_in_dim(received[leaf.device], leaf.column, leaf.column + width)
          out.append(_slice_of(flat, leaf.shape, leaf.dim, parts))
      return jax.tree.unflatten(self.treedef, out)

    return self._per_device(local, PartitionSpec(self.axis), self.spec())(stored)

  def from_view(self, tree: Any) -> jax.Array:
    """The inverse of `to_view`: the params' tree (laid out by `spec`) -> `[G, size]` rows."""
    parts, leaves = self.parts, self.leaves

    def branch(device):
      def build(received, local_leaves):  # slices from every device -> this device's rows
        rows = []
        for group in self.stage_rows[device]:
          flat = []
          for i in group:
            leaf = leaves[i]
            if leaf.dim is None:
              flat.append(local_leaves[i].reshape(-1))
              continue
            width = leaf.size // parts
            slices = lax.slice_in_dim(received, leaf.column, leaf.column + width, axis=1)
            whole = jnp.concatenate(
              [_slice_of(slices[j], leaf.shape, leaf.dim, parts) for j in range(parts)],
              axis=leaf.dim,
            )
            flat.append(whole.reshape(-1))
          row = jnp.concatenate(flat) if flat else jnp.zeros((0,), self.dtype)
          rows.append(jnp.pad(row.astype(self.dtype), (0, self.size - row.shape[0])))
        return jnp.stack(rows)

      return build

    def local(*local_leaves):
      send = []
      for device in range(parts):  # what goes to `device`: its leaves' slices held here
        pieces = [
          jnp.moveaxis(local_leaves[i], leaf.dim, 0).reshape(-1)
          for i, leaf in enumerate(leaves)
          if leaf.device == device and leaf.dim is not None
        ]
        row = jnp.concatenate(pieces) if pieces else jnp.zeros((0,), self.dtype)
        send.append(jnp.pad(row.astype(self.dtype), (0, self.columns - row.shape[0])))
      send_buffer = jnp.stack(send)
      received = (
        lax.all_to_all(send_buffer, self.axis, 0, 0, tiled=True) if self.columns else send_buffer
      )
      return lax.switch(
        lax.axis_index(self.axis), [branch(d) for d in range(parts)], received, local_leaves
      )

    specs = tuple(jax.tree.leaves(self.spec(), is_leaf=lambda x: isinstance(x, PartitionSpec)))
    return self._per_device(local, specs, PartitionSpec(self.axis))(*jax.tree.leaves(tree))
