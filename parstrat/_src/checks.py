"""Assertions about how values are laid out across devices."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def _index_key(index: tuple[slice, ...]) -> tuple:
  return tuple((s.start, s.stop, s.step) for s in index)


def assert_replicas_equal(tree: Any, *, atol: float = 0.0) -> None:
  """Asserts that every replica of every array in `tree` is identical.

  A replicated (or partly replicated) `jax.Array` keeps one copy of each block
  per device. Devices holding the same block of the global array (the same
  `shard.index`) must hold the same numbers; a data-parallel run whose
  gradients were not averaged over an axis fails this.

  Args:
    tree: a pytree of arrays, e.g. a `TrainState`. Non-`jax.Array` leaves are
      ignored.
    atol: the largest absolute difference allowed between replicas (default:
      exactly equal, bit for bit).

  Raises:
    AssertionError: naming the first leaf, block and devices that differ.

  Example:
    >>> import jax, jax.numpy as jnp, parstrat
    >>> x = jax.device_put(jnp.arange(4.0), jax.devices()[0])
    >>> parstrat.checks.assert_replicas_equal({"x": x})
  """
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  for path, leaf in leaves:
    if not isinstance(leaf, jax.Array):
      continue
    groups: dict[tuple, list[jax.Shard]] = {}
    for shard in leaf.addressable_shards:
      groups.setdefault(_index_key(shard.index), []).append(shard)
    for shards in groups.values():
      reference = np.asarray(shards[0].data)
      for other in shards[1:]:
        data = np.asarray(other.data)
        if atol == 0.0:
          same = np.array_equal(reference, data, equal_nan=True)
        else:
          same = np.allclose(reference, data, rtol=0.0, atol=atol, equal_nan=True)
        if not same:
          diff = np.max(np.abs(reference.astype(np.float64) - data.astype(np.float64)))
          raise AssertionError(
            f"Replicas of {jax.tree_util.keystr(path) or 'the value'} differ: block "
            f"{shards[0].index} on {shards[0].device} and on {other.device} differ by up "
            f"to {diff:.3g} (atol={atol})."
          )
