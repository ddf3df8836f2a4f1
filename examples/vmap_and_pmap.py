"""vmap vectorises over an axis of one device; pmap maps over devices. Side by side.

Both take an `axis_name`, and collectives (`psum`, `pmean`) reduce over the axis
with that name. The seed's snippets used `jax.pmap` on an array whose leading
axis was not the device count, which fails; here the leading axis is always
the device count for pmap, and any size for vmap.

Run: python examples/vmap_and_pmap.py
"""

import parstrat.testing

parstrat.testing.use_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402


def main() -> dict[str, float]:
  n = jax.device_count()
  x = jnp.arange(n * 4, dtype=jnp.float32).reshape(n, 4)

  def centre(row, axis_name):
    """Subtracts the mean over the named axis: a collective, not a local op."""
    return row - lax.pmean(row, axis_name)

  by_vmap = jax.vmap(lambda r: centre(r, "rows"), axis_name="rows")(x)  # one device
  by_pmap = jax.pmap(lambda r: centre(r, "devices"), axis_name="devices")(x)  # n devices
  total = jax.pmap(lambda r: lax.psum(r.sum(), "devices"), axis_name="devices")(x)
  results = {
    "max |vmap - pmap|": float(jnp.abs(by_vmap - by_pmap).max()),
    "max |vmap - (x - x.mean(0))|": float(jnp.abs(by_vmap - (x - x.mean(0))).max()),
    "psum over devices": float(total[0]),
    "x.sum()": float(x.sum()),
    "pmap output devices": float(len(by_pmap.sharding.device_set)),
  }
  for name, value in results.items():
    print(f"{name}: {value:g}")
  return results


if __name__ == "__main__":
  main()
