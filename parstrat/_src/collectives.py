"""Collectives over several named axes at once, as the seed teaches them."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P


def global_normalize(x: jax.Array, axis_name: str | Sequence[str]) -> jax.Array:
  """Divides `x` by the sum of all its elements over every device along `axis_name`.

  Call it inside `jax.shard_map`, `jax.pmap` or `jax.vmap` (or any nesting of
  them); `axis_name` may be a tuple, e.g. `("p", "v")` for a `pmap` of a
  `vmap`, and `lax.psum` then reduces over all those axes at once.

  Args:
    x: this device's (or this vmapped lane's) block.
    axis_name: one mapped axis name or a tuple of them.

  Returns:
    `x / total`, where `total` is the global sum; the blocks sum to 1.

  Example:
    >>> import jax, jax.numpy as jnp, parstrat
    >>> arr = jnp.arange(8.0).reshape(2, 4)
    >>> out = jax.vmap(jax.vmap(lambda v: parstrat.collectives.global_normalize(v, ("p", "v")),
    ...                         axis_name="v"), axis_name="p")(arr)
    >>> float(out.sum())
    1.0
  """
  names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else axis_name
  return x / lax.psum(x.sum(), names)


def normalize_on_mesh(arr: jax.Array, mesh: jax.sharding.Mesh) -> jax.Array:
  """Normalises `arr` to sum 1 with its leading axes spread over a 2-D mesh.

  `arr` of shape `[a, b, ...]` is split with `a` along the mesh's first axis and
  `b` along its second; each device sums its block and one `psum` over both
  axis names gives the total.

  Args:
    arr: an array whose first two dimensions divide the mesh's two axis sizes.
    mesh: a mesh with two named axes.

  Returns:
    `arr / arr.sum()`, sharded like the input.

  Raises:
    ValueError: if the mesh is not 2-D or the array does not split over it.
  """
  if len(mesh.axis_names) != 2:
    raise ValueError(f"normalize_on_mesh needs a 2-D mesh, got axes {mesh.axis_names}.")
  first, second = mesh.axis_names
  if arr.ndim < 2 or arr.shape[0] % mesh.shape[first] or arr.shape[1] % mesh.shape[second]:
    raise ValueError(
      f"An array of shape {tuple(arr.shape)} does not split over the mesh "
      f"{dict(mesh.shape)} (its first two dimensions must divide the axis sizes)."
    )
  spec = P(first, second)
  fn = jax.shard_map(
    lambda block: global_normalize(block, (first, second)),
    mesh=mesh,
    in_specs=spec,
    out_specs=spec,
  )
  return jax.jit(fn)(jax.device_put(np.asarray(arr), jax.sharding.NamedSharding(mesh, spec)))
