"""Keeping a stage's forward residuals for its backward instead of recomputing them.

By default (`activations="recompute"`) the pipeline engine stashes each stage's
input and its backward passes rerun the stage's forward. With "save", a forward
pass keeps what its backward needs (the residuals of `jax.vjp`), so no forward
runs twice; with a `jax.checkpoint_policies` name such as "dots_saveable" it
keeps what that policy saves and the backward recomputes the rest.

Residuals that are the stage's own parameters or its input are not stored
again (both are at hand in the backward); the others are packed into one slot
of a per-device buffer, `Schedule.residual_slots` slots deep: flattened in
their own dtype when all residuals share one (the usual case), else as bytes.
"""

from __future__ import annotations

import dataclasses
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
  """

  treedef: Any
  sources: tuple[int | str | None, ...]
  stored: tuple[jax.ShapeDtypeStruct, ...]

  @property
  def nbytes(self) -> int:
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in self.stored)


def slot_format(residuals: Sequence[Residuals]) -> jax.ShapeDtypeStruct:
  """One residual slot, `[size]` of a dtype, that holds any of the stages' residuals.

  The residuals' own dtype when they all share one, else bytes (uint8).
  """
  dtypes = {jnp.dtype(a.dtype) for r in residuals for a in r.stored}
  if len(dtypes) == 1 and jnp.dtype(jnp.bool_) not in dtypes:
    (dtype,) = dtypes
    size = max(sum(int(np.prod(a.shape)) for a in r.stored) for r in residuals)
    return jax.ShapeDtypeStruct((max(size, 1),), dtype)
  return jax.ShapeDtypeStruct((max([1, *(r.nbytes for r in residuals)]),), jnp.uint8)


def stage_function(staged, stage: int, y, dtype, activations: str):
  """`(leaves, input) -> (padded output, loss)` of one stage, under the remat policy."""

  def f(leaves, inp):
    return staged.apply(stage, leaves, inp, y, dtype)

  if activations in ("recompute", "save"):
    return f
  return jax.checkpoint(f, policy=getattr(jax.checkpoint_policies, activations))


def _split(vjp_fn, leaves, inp) -> tuple[list, Any, tuple[int | str | None, ...]]:
  res, treedef = jax.tree.flatten(vjp_fn)
  known: dict[int, int | str] = {id(leaf): i for i, leaf in enumerate(leaves)}
  known[id(inp)] = _INPUT
  return res, treedef, tuple(known.get(id(r)) for r in res)


def find_residuals(staged, stage: int, row, act, x, y, dtype, activations: str) -> Residuals:
  """The `Residuals` of stage `stage`, traced abstractly from (avals of) its arguments."""
  found = {}

  def probe(row, act, x, y):
    leaves, inp = staged.stage_inputs(stage, row, act, x)
    _, vjp_fn = jax.vjp(stage_function(staged, stage, y, dtype, activations), leaves, inp)
    res, found["treedef"], found["sources"] = _split(vjp_fn, leaves, inp)
    return [r for r, source in zip(res, found["sources"], strict=True) if source is None]

  stored = jax.eval_shape(probe, row, act, x, y)
  return Residuals(found["treedef"], found["sources"], tuple(stored))


def forward_saving(
  staged, stage: int, leaves, inp, y, dtype, activations: str, slot: jax.ShapeDtypeStruct
):
  """Runs the stage forward; returns `(padded output, loss, stored residuals packed in a slot)`."""
  f = stage_function(staged, stage, y, dtype, activations)
  (out, loss), vjp_fn = jax.vjp(f, leaves, inp)
  res, _, sources = _split(vjp_fn, leaves, inp)
  stored = [r for r, source in zip(res, sources, strict=True) if source is None]
  return out, loss, pack(stored, slot)


def pullback(residuals: Residuals, packed: jax.Array, leaves, inp):
  """The stage's vjp function, rebuilt from its stored residuals, params and input."""
  stored = iter(unpack(packed, residuals.stored))
  res = [
    next(stored) if source is None else inp if source == _INPUT else leaves[source]
    for source in residuals.sources
  ]
  return jax.tree.unflatten(residuals.treedef, res)


def _as_bytes(x: jax.Array) -> jax.Array:
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint8).reshape(-1)
  return lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def pack(arrays: Sequence[jax.Array], slot: jax.ShapeDtypeStruct) -> jax.Array:
  """The arrays flattened (as bytes when `slot` is uint8), concatenated, zero-padded to `slot`."""
  as_bytes = slot.dtype == jnp.uint8
  parts = [_as_bytes(x) if as_bytes else x.reshape(-1) for x in arrays]
  flat = jnp.concatenate(parts) if parts else jnp.zeros((0,), slot.dtype)
  return jnp.pad(flat, (0, slot.shape[0] - flat.shape[0]))


def unpack(flat: jax.Array, avals: Sequence[jax.ShapeDtypeStruct]) -> list[jax.Array]:
  """The inverse of `pack` for arrays shaped like `avals`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from parstrat._src.pipeline import residuals
    >>> arrays = [jnp.arange(3.0), jnp.array([True, False])]
    >>> avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    >>> slot = residuals.slot_format([residuals.Residuals(None, (), tuple(avals))])
    >>> slot.dtype, slot.shape  # mixed dtypes: bytes
    (dtype('uint8'), (14,))
    >>> back = residuals.unpack(residuals.pack(arrays, slot), avals)
    >>> [b.tolist() for b in back]
    [[0.0, 1.0, 2.0], [True, False]]
  """
  out, offset = [], 0
  for aval in avals:
    dtype = jnp.dtype(aval.dtype)
    if flat.dtype == dtype:  # stored in its own dtype
      n = int(np.prod(aval.shape))
      out.append(lax.slice_in_dim(flat, offset, offset + n).reshape(aval.shape))
      offset += n
      continue
    n = int(np.prod(aval.shape)) * dtype.itemsize
    chunk = lax.slice_in_dim(flat, offset, offset + n)
    offset += n
    if dtype == jnp.bool_:
      out.append(chunk.reshape(aval.shape) != 0)
    elif dtype.itemsize == 1:
      out.append(lax.bitcast_convert_type(chunk.reshape(aval.shape), dtype))
    else:
      out.append(lax.bitcast_convert_type(chunk.reshape(*aval.shape, dtype.itemsize), dtype))
  return out
