"""Comparing pytrees leaf by leaf, with names a user can read."""

from __future__ import annotations

import collections
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


def path_key(entry: Any) -> Any:
  """The key a key-path entry stands for: a dict key, a sequence index or an attribute name.

  Example:
    >>> path_key(jax.tree_util.DictKey(0)), path_key(jax.tree_util.GetAttrKey("mu"))
    (0, 'mu')
  """
  for attribute in ("key", "idx", "name"):
    if hasattr(entry, attribute):
      return getattr(entry, attribute)
  return str(entry)


def leaf_name(path: tuple) -> str:
  """`params['mlp/~/linear_0']['w']` for a key path, whatever the containers are.

  Dict keys, sequence indices and attribute names (a NamedTuple's fields) are
  written alike, so the same leaf has the same name in a `TrainState`, in the
  dict `export_state` returns and in the plain tree orbax reads back.
  """
  keys = [path_key(entry) for entry in path]
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


def dtype_changes(got: Any, want: Any) -> list[str]:
  """`name: got -> want` for each leaf (matched by name, as in `first_mismatch`) whose
  dtype differs; leaves without a dtype, or only in one tree, are left out.

  Example:
    >>> import numpy as np
    >>> dtype_changes({"w": np.zeros(2, np.float32)}, {"w": np.zeros(2, np.float16)})
    ['w: float32 -> float16']
  """
  dtypes = lambda tree: {  # noqa: E731
    leaf_name(p): np.dtype(x.dtype)
    for p, x in jax.tree_util.tree_leaves_with_path(tree)
    if getattr(x, "dtype", None) is not None
  }
  have = dtypes(got)
  return [
    f"{name}: {have[name]} -> {dtype}"
    for name, dtype in dtypes(want).items()
    if name in have and have[name] != dtype
  ]


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


def layer_and_name(path: Sequence[Any]) -> tuple[str, str]:
  """A parameter's layer (the path of the dict holding it) and its name in that layer.

  Haiku's `{module: {name: array}}` gives `(module, name)`; a deeper tree (a
  Flax-style `{"params": {"Dense_0": {"kernel": ...}}}`) its parent path
  joined by "/"; a leaf at the top `(its key, "")`. For a whole tree, use
  `layers_and_names`, which also sees through a variable holding one array.

  Example:
    >>> import jax, numpy as np
    >>> params = {"params": {"Dense_0": {"kernel": np.ones(2)}}, "scale": np.ones(())}
    >>> [layer_and_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    [('params/Dense_0', 'kernel'), ('scale', '')]
  """
  keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
  if len(keys) <= 1:
    return (keys[0] if keys else ""), ""
  return "/".join(keys[:-1]), keys[-1]


def layers_and_names(params: Any) -> list[tuple[str, str]]:
  """`layer_and_name` of each leaf of `params`, in `jax.tree.leaves` order.

  A leaf that is the only array of an object stored under a dict key, reached
  by its attribute `.value` (Flax nnx's `Variable` in an `nnx.State`:
  `{"l1": {"kernel": Variable(value=...)}}`), is named by that key: layer
  "l1", name "kernel", not a layer "l1/kernel" of its own. An array field named
  `value` beside others (an attention block's) keeps its own name.

  Example:
    >>> import jax, numpy as np
    >>> layers_and_names({"mlp": {"w": np.ones(2), "b": np.ones(2)}})
    [('mlp', 'b'), ('mlp', 'w')]
  """
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  holders = collections.Counter(tuple(path[:-1]) for path in paths)  # leaves per object

  def held(path) -> bool:
    return (
      len(path) > 1
      and isinstance(path[-1], jax.tree_util.GetAttrKey)
      and path[-1].name == "value"
      and isinstance(path[-2], jax.tree_util.DictKey)
      and holders[tuple(path[:-1])] == 1
    )

  return [layer_and_name(path[:-1] if held(path) else path) for path in paths]


def map_param_like(tree: Any, like: Any, fn: Callable[[Any], Any]) -> Any:
  """Applies `fn` to every subtree of `tree` shaped like `like` (e.g. Adam's mu, nu).

  A subtree is param-like when it has `like`'s structure and leaf shapes; other
  subtrees (counters, empty states) are kept as they are. A subtree of `like`'s
  structure whose leaves all have one leading axis more, of one size, is a
  stack of param-like trees (`optax.lbfgs`'s last updates): `fn` is applied to
  each (by `jax.vmap`).

  Args:
    tree: e.g. an optimizer state.
    like: e.g. the params the state was built for.
    fn: maps a param-like subtree, e.g. from one layout to another.

  Returns:
    `tree` with every param-like subtree replaced by `fn(subtree)`.

  Example:
    >>> import numpy as np
    >>> state = {"count": np.int32(0), "mu": {"w": np.ones(2)}, "memory": {"w": np.ones((3, 2))}}
    >>> mapped = map_param_like(state, {"w": np.zeros(2)}, lambda p: {"w": p["w"] * 3})
    >>> mapped["mu"], mapped["memory"]["w"].shape
    ({'w': array([3., 3.])}, (3, 2))
  """
  like_structure = jax.tree.structure(like)
  like_shapes = [np.shape(x) for x in jax.tree.leaves(like)]

  def kind(node) -> str | None:
    if node is None or jax.tree.structure(node) != like_structure:
      return None
    shapes = [np.shape(x) for x in jax.tree.leaves(node)]
    if shapes == like_shapes:
      return "param"
    if shapes and all(
      len(a) == len(b) + 1 and a[1:] == b for a, b in zip(shapes, like_shapes, strict=True)
    ):
      return "stack" if len({a[0] for a in shapes}) == 1 else None
    return None

  def map_node(node):
    found = kind(node)
    return fn(node) if found == "param" else jax.vmap(fn)(node) if found == "stack" else node

  return jax.tree.map(map_node, tree, is_leaf=lambda node: kind(node) is not None)


def _shape(x: Any) -> tuple[int, ...]:
  shape = getattr(x, "shape", None)
  return tuple(int(d) for d in (np.shape(x) if shape is None else shape))


def replicated_norm(tree: Any, axes: tuple[str, ...]) -> jax.Array:
  """Inside `jax.shard_map`: the global norm of a tree every device along `axes` holds alike.

  Equal to `optax.tree_utils.tree_norm(tree)` on every device, but each of the
  N devices squares and sums only its 1/N of every leaf whose size N divides
  (a leaf N does not divide counts 1/N of its sum on each), and one scalar
  `psum` over `axes` adds the parts. On replicated gradients this reads each
  gradient once across the mesh instead of once per device.

  Args:
    tree: a pytree of arrays, the same on every device along `axes` (e.g.
      gradients after their `pmean`).
    axes: the manual mesh axes the tree is replicated over.

  Returns:
    A scalar: the 2-norm of all leaves together, the same on every device.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, parstrat
    >>> from jax.sharding import PartitionSpec as P
    >>> from parstrat._src.trees import replicated_norm
    >>> mesh = jax.make_mesh((4,), ("data",))
    >>> tree = {"w": jnp.arange(8.0), "b": jnp.ones(3)}
    >>> norm = jax.shard_map(lambda t: replicated_norm(t, ("data",)), mesh=mesh,
    ...                      in_specs=P(), out_specs=P())(tree)
    >>> bool(np.isclose(norm, np.sqrt(140.0 + 3.0)))
    True
  """
  size = int(np.prod([jax.lax.axis_size(a) for a in axes]))
  index = jax.lax.axis_index(axes)
  sliced, whole = [], []
  for leaf in jax.tree.leaves(tree):
    if leaf.size % size == 0 and leaf.size >= size:
      rows = leaf.reshape(size, leaf.size // size)
      sliced.append(jax.lax.dynamic_index_in_dim(rows, index, keepdims=False))
    else:
      whole.append(leaf)
  squares = optax.tree_utils.tree_norm(sliced, squared=True)
  if whole:
    squares = squares + optax.tree_utils.tree_norm(whole, squared=True) / size
  return jnp.sqrt(jax.lax.psum(squares, axes))
