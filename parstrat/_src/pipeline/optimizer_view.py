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

from parstrat._src.pipeline import engine


@dataclasses.dataclass(frozen=True)
class _Leaf:
  """Where one parameter leaf lives in the stored rows and in the view.

  A device holds a piece of each of its stages' leaves: the whole leaf, or,
  in a `SplitLayout`, its slice along `model_dim` for the device's index on the
  "model" axis. The view moves these pieces, called local leaves here.

  Attributes:
    shape: the leaf's shape.
    local: the shape of the piece a device holds (`shape`, or its model slice).
    model_dim: the dimension split over the "model" axis (None: not split).
    buffer: which stored buffer holds it (0: the only one, or the split one).
    device: the stage-axis index of the device whose rows hold it.
    row: which of that device's rows (its virtual stage, 0 .. v-1).
    offset: its start in that row.
    dim: the dimension of `local` split over the stage axis in the view (None:
      the local piece is whole on every device of the stage axis).
    column: its start in the send buffer of `device` (`dim` set) or in the
      replicated segment of `device` (the others).
  """

  shape: tuple[int, ...]
  local: tuple[int, ...]
  model_dim: int | None
  buffer: int
  device: int
  row: int
  offset: int
  dim: int | None
  column: int

  @property
  def size(self) -> int:
    """Elements of the local piece."""
    return math.prod(self.local)

  def piece(self, parts: int) -> tuple[int, ...]:
    """The shape of the local piece's slice a device holds in the view."""
    return _local_shape(self.local, self.dim, parts)


def _split_dim(shape: tuple[int, ...], parts: int) -> int | None:
  """The largest dimension of `shape` that `parts` divides (None: none, or empty)."""
  if not shape or math.prod(shape) == 0:
    return None
  best = None
  for d, n in enumerate(shape):
    if n % parts == 0 and (best is None or n > shape[best]):
      best = d
  return best


def _local_shape(shape: tuple[int, ...], model_dim: int | None, parts: int) -> tuple[int, ...]:
  if model_dim is None:
    return tuple(shape)
  return tuple(n // parts if d == model_dim else n for d, n in enumerate(shape))


@dataclasses.dataclass(frozen=True)
class ModelLayoutView:
  """Moves a pipeline's flat stage rows to the model's layout and back.

  Build it with `ModelLayoutView.build(layout, mesh, axis)`; `spec` gives
  each leaf's `PartitionSpec` in the view; `to_view` and `from_view` run
  under `jax.jit` on global arrays (each is one `jax.shard_map`, manual over
  every mesh axis).

  With a `SplitLayout` (a "model" axis), each device's piece of a split leaf
  is its slice along the Megatron dimension; the view keeps that split and
  moves only the pieces, each over the stage axis as above: a leaf split
  along one dimension over both axes gets `("model", "stage")` there.

  Attributes:
    mesh: the trainer's mesh.
    axis: the stage axis the rows are sharded over.
    model_axis: the axis split leaves are split over (None: a `FlatLayout`).
    model_parts: that axis's size (1 for a `FlatLayout`).
    treedef: the params' tree structure.
    leaves: where each leaf lives (`_Leaf`), in tree order.
    stage_rows: per device, per row, per buffer: the leaves it holds in row order.
    sizes: each stored buffer's row length.
    columns: the send buffers' width (the largest device's).
    replicated: the replicated segments' length (the largest device's).
    dtype: the rows' dtype.
  """

  mesh: Mesh
  axis: str
  model_axis: str | None
  model_parts: int
  treedef: Any
  leaves: tuple[_Leaf, ...]
  stage_rows: tuple[tuple[tuple[tuple[int, ...], ...], ...], ...]
  sizes: tuple[int, ...]
  columns: int
  replicated: int
  dtype: Any

  @classmethod
  def build(cls, layout: Any, mesh: Mesh, axis: str) -> ModelLayoutView:
    """The view of `layout` (a `FlatLayout` or `SplitLayout`) on `mesh`, rows along `axis`."""
    parts = mesh.shape[axis]
    split_dims = getattr(layout, "split_dims", None)
    model_axis = layout.axis if split_dims is not None else None
    model_parts = layout.parts if split_dims is not None else 1
    if split_dims is None:
      split_dims, sizes = (None,) * len(layout.shapes), (layout.size,)
    else:
      sizes = (layout.split_size, layout.replicated_size)
    buffer_of = [0 if dim is not None or len(sizes) == 1 else 1 for dim in split_dims]
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
        rows.append(tuple(tuple(i for i in group if buffer_of[i] == b) for b in range(len(sizes))))
      stage_rows.append(tuple(rows))
    used_columns, used_replicated = [0] * parts, [0] * parts
    leaves = []
    for i, shape in enumerate(layout.shapes):
      device, k, offset = placed[i]
      local = _local_shape(shape, split_dims[i], model_parts)
      dim = _split_dim(local, parts)
      if dim is None:
        column = used_replicated[device]
        used_replicated[device] += math.prod(local)
      else:
        column = used_columns[device]
        used_columns[device] += math.prod(local) // parts
      leaves.append(
        _Leaf(tuple(shape), local, split_dims[i], buffer_of[i], device, k, offset, dim, column)
      )
    return cls(
      mesh,
      axis,
      model_axis,
      model_parts,
      layout.treedef,
      tuple(leaves),
      tuple(stage_rows),
      tuple(sizes),
      max(used_columns),
      max(used_replicated),
      layout.dtype,
    )

  @property
  def parts(self) -> int:
    return self.mesh.shape[self.axis]

  def spec(self) -> Any:
    """The view's `PartitionSpec` per leaf: split over `axis` along `dim`, or not."""
    specs = []
    for leaf in self.leaves:
      entries: list[Any] = [None] * len(leaf.shape)
      if leaf.model_dim is not None:
        entries[leaf.model_dim] = self.model_axis
      if leaf.dim is not None:
        here = entries[leaf.dim]
        entries[leaf.dim] = self.axis if here is None else (here, self.axis)
      specs.append(PartitionSpec(*entries))
    return jax.tree.unflatten(self.treedef, specs)

  def _stored_specs(self) -> Any:
    if self.model_axis is None:
      return PartitionSpec(self.axis)
    return (PartitionSpec(self.axis, self.model_axis), PartitionSpec(self.axis))

  def _rows(self, stored: Any) -> tuple[jax.Array, ...]:
    """A device's block of the stored buffers as `[v, size]` rows, one per buffer."""
    if self.model_axis is None:
      return (stored,)
    split, replicated = stored
    return split[:, 0, :], replicated  # (its one "model" slice: [v, 1, split_size])

  def _stored(self, rows: tuple[jax.Array, ...]) -> Any:
    """The inverse of `_rows`."""
    if self.model_axis is None:
      return rows[0]
    return rows[0][:, None, :], rows[1]

  def _per_device(self, fn, in_specs, out_specs):
    return jax.shard_map(
      fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )

  def to_view(self, stored: Any) -> Any:
    """Stored rows (sharded as the plan stores them) -> the params' tree, laid out by `spec`."""
    parts, leaves = self.parts, self.leaves

    def branch(device):
      def build(rows):  # this device's rows -> send buffer, replicated segment
        send, segment = [], []
        for leaf in leaves:
          if leaf.device != device:
            continue
          row = rows[leaf.buffer][leaf.row]
          flat = lax.slice_in_dim(row, leaf.offset, leaf.offset + leaf.size)
          if leaf.dim is None:
            segment.append(flat)
          else:
            send.append(engine.to_blocks(self._local(flat, leaf), leaf.dim, parts))
        send_buffer = jnp.concatenate(send, axis=1) if send else jnp.zeros((parts, 0), self.dtype)
        segment_buffer = jnp.concatenate(segment) if segment else jnp.zeros((0,), self.dtype)
        return (
          jnp.pad(send_buffer, ((0, 0), (0, self.columns - send_buffer.shape[1]))),
          jnp.pad(segment_buffer, (0, self.replicated - segment_buffer.shape[0])),
        )

      return build

    def local(stored):
      send, segment = lax.switch(
        lax.axis_index(self.axis), [branch(d) for d in range(parts)], self._rows(stored)
      )
      received = lax.all_to_all(send, self.axis, 0, 0, tiled=True) if self.columns else send
      gathered = lax.all_gather(segment, self.axis) if self.replicated else None
      out = []
      for leaf in leaves:
        if leaf.dim is None:
          flat = lax.slice_in_dim(gathered[leaf.device], leaf.column, leaf.column + leaf.size)
          out.append(self._local(flat, leaf))
        else:
          width = leaf.size // parts
          flat = lax.slice_in_dim(received[leaf.device], leaf.column, leaf.column + width)
          out.append(engine.from_blocks(flat, leaf.piece(parts), leaf.dim))
      return jax.tree.unflatten(self.treedef, out)

    return self._per_device(local, (self._stored_specs(),), self.spec())(stored)

  def _local(self, flat: jax.Array, leaf: _Leaf) -> jax.Array:
    """A local piece from its stored form (a split leaf's slice: a `to_blocks` row)."""
    if leaf.model_dim is None:
      return flat.reshape(leaf.local)
    return engine.from_blocks(flat, leaf.local, leaf.model_dim)

  @staticmethod
  def _flat(piece: jax.Array, leaf: _Leaf) -> jax.Array:
    """The inverse of `_local`: a local piece in its stored form."""
    if leaf.model_dim is None:
      return piece.reshape(-1)
    return engine.to_blocks(piece, leaf.model_dim, 1).reshape(-1)

  def from_view(self, tree: Any) -> Any:
    """The inverse of `to_view`: the params' tree (laid out by `spec`) -> the stored rows."""
    parts, leaves = self.parts, self.leaves

    def branch(device):
      def build(received, local_leaves):  # pieces from every device -> this device's rows
        buffers = []
        for b, size in enumerate(self.sizes):
          rows = []
          for groups in self.stage_rows[device]:
            flat = []
            for i in groups[b]:
              leaf = leaves[i]
              if leaf.dim is None:
                flat.append(self._flat(local_leaves[i], leaf))
                continue
              width = leaf.size // parts
              pieces = lax.slice_in_dim(received, leaf.column, leaf.column + width, axis=1)
              flat.append(self._flat(engine.from_blocks(pieces, leaf.local, leaf.dim), leaf))
            row = jnp.concatenate(flat) if flat else jnp.zeros((0,), self.dtype)
            rows.append(jnp.pad(row.astype(self.dtype), (0, size - row.shape[0])))
          buffers.append(jnp.stack(rows))
        return self._stored(tuple(buffers))

      return build

    def local(*local_leaves):
      send = []
      for device in range(parts):  # what goes to `device`: its leaves' pieces held here
        pieces = [
          engine.to_blocks(local_leaves[i], leaf.dim, 1).reshape(-1)
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
    return self._per_device(local, specs, self._stored_specs())(*jax.tree.leaves(tree))
