"""The seed's global normalisation: arr = 0..199 divided by its sum, with psum over ("p", "v").

The array is spread over devices ("p") and, within each device, over a vmapped
axis ("v"); one `lax.psum` over the tuple of both axis names sums over all of
them at once. Shown three ways, each checked against `arr / arr.sum()`:

1. `jax.pmap` of a `jax.vmap` (the seed's way; pmap is kept here for teaching).
2. `jax.shard_map` on a 2-D mesh ("p", "v") (today's way).
3. `parstrat.collectives.normalize_on_mesh`, the library helper.

Run: python examples/global_normalization.py
"""

import parstrat.testing

parstrat.testing.use_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import parstrat  # noqa: E402


def main() -> dict[str, float]:
  arr = jnp.arange(200, dtype=jnp.float32)
  expected = arr / arr.sum()
  devices = jax.device_count()
  results = {}

  # 1. pmap over devices ("p") of a vmap over lanes ("v"): [8, 25].
  per_lane = jax.vmap(lambda x: parstrat.collectives.global_normalize(x, ("p", "v")), axis_name="v")
  out = jax.pmap(per_lane, axis_name="p")(arr.reshape(devices, 25, 1))
  results["pmap(vmap)"] = out.reshape(-1)

  # 2. a 4 x 2 mesh ("p", "v"): each device holds a [1, 25] block of [4, 50] and
  # divides it by one psum over both axis names, written out with jax.shard_map.
  mesh = jax.make_mesh((4, 2), ("p", "v"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  spec = P("p", "v")
  normalize = jax.shard_map(
    lambda block: block / lax.psum(block.sum(), ("p", "v")), mesh=mesh, in_specs=spec,
    out_specs=spec,
  )  # fmt: skip
  out = jax.jit(normalize)(jax.device_put(arr.reshape(4, 50), NamedSharding(mesh, spec)))
  results["shard_map on a 4x2 mesh"] = out.reshape(-1)

  # 3. the library helper, which does the same.
  out = parstrat.collectives.normalize_on_mesh(arr.reshape(4, 50), mesh)
  results["normalize_on_mesh"] = out.reshape(-1)

  errors = {}
  for name, value in results.items():
    total = float(value.sum())
    error = float(jnp.abs(value - expected).max())
    errors[name] = error
    print(f"{name:24} sum {total:.6f}  max |diff| vs arr / arr.sum(): {error:.2e}")
  for value in results.values():
    np.testing.assert_allclose(value, expected, rtol=1e-6)
  return errors


if __name__ == "__main__":
  main()
