"""Comparing pytrees leaf by leaf, with names a user can read."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def leaf_name(path: tuple) -> str:
  """`params['mlp/~/linear_0']['w']` for a key path, whatever the containers are.

  Dict keys, sequence indices and attribute names (a NamedTuple's fields) are
  written alike, so the same leaf has the same name in a `TrainState`, in the
  dict `export_state` returns and in the plain tree orbax reads back.
  """
  keys = []
  for entry in path:
    for attribute in ("key", "idx", "name"):
      if hasattr(entry, attribute):
        keys.append(getattr(entry, attribute))
        break
    else:
      keys.append(str(entry))
  if not keys:
    return "<root>"
  head, rest = keys[0], keys[1:]
  return str(head) + "".join(f"[{k!r}]" for k in rest)


def first_mismatch(got: Any, want: Any) -> str | None:
  """Describes the first leaf of `want` that `got` lacks or holds with another shape.

  Leaves are matched by name (`leaf_name`), so the containers may differ (a
  NamedTuple in one tree, a dict or list in the other). `None` leaves are
  ignored; any leaf with a `.shape` (arrays, `jax.ShapeDtypeStruct`, orbax's
  array metadata) or a scalar can be compared.

  Args:
    got: the tree to check.
    want: the tree it should match.

  Returns:
    `None` when every leaf matches in name and shape; otherwise one sentence
    naming the first leaf (in `want`'s order) that differs, or the first extra
    leaf of `got`.

  Example:
    >>> import numpy as np
    >>> first_mismatch({"w": np.zeros((2, 3))}, {"w": np.zeros((2, 4))})
    'w: shape (2, 3), expected (2, 4)'
  """
  got_shapes = {leaf_name(p): _shape(x) for p, x in jax.tree_util.tree_leaves_with_path(got)}
  want_shapes = {leaf_name(p): _shape(x) for p, x in jax.tree_util.tree_leaves_with_path(want)}
  for name, shape in want_shapes.items():
    if name not in got_shapes:
      return f"{name} is missing (expected shape {shape})"
    if got_shapes[name] != shape:
      return f"{name}: shape {got_shapes[name]}, expected {shape}"
  for name, shape in got_shapes.items():
    if name not in want_shapes:
      return f"{name} (shape {shape}) is not expected"
  return None


def all_finite(tree: Any) -> jax.Array:
  """A scalar bool: every floating-point leaf of `tree` is free of NaN and infinity.

  Integer leaves (e.g. an optimizer's step count) are always finite. Traceable.

  Example:
    >>> import jax.numpy as jnp
    >>> bool(all_finite({"w": jnp.ones(3), "count": jnp.int32(1)}))
    True
  """
  checks = [
    jnp.all(jnp.isfinite(x))
    for x in jax.tree.leaves(tree)
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
  ]
  return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)


def _shape(x: Any) -> tuple[int, ...]:
  shape = getattr(x, "shape", None)
  return tuple(int(d) for d in (np.shape(x) if shape is None else shape))
