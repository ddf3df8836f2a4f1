"""Layouts that shard the parameters themselves: FSDP and tensor parallelism.

Both are expressed as shardings on global arrays (`Plan(manual=False)`): the
step is written for one device and XLA's SPMD partitioner inserts the
all-gathers, reduce-scatters and all-reduces that the shardings imply, as
MaxText and praxis do.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from parstrat._src.strategy import Plan


def global_plan(model, loss_fn, param_spec: Any, batch_spec: P, description: str) -> Plan:
  """A plan on global arrays: the model's own layout, sharded by `param_spec`.

  The loss and gradients are written as for one device; XLA partitions them.
  """

  def loss_and_grad(params, inputs, labels):
    return jax.value_and_grad(lambda p: loss_fn(model.apply(p, None, inputs), labels))(params)

  return Plan(
    param_spec=param_spec,
    batch_spec=batch_spec,
    to_stored=lambda params: params,
    to_params=lambda stored: stored,
    loss_and_grad=loss_and_grad,
    forward=lambda params, inputs: model.apply(params, None, inputs),
    manual=False,
    description=description,
  )


def fsdp_spec(shape: tuple[int, ...], axis: str, size: int) -> P:
  """Shards the largest dimension divisible by `size` over `axis` (else replicates)."""
  candidates = [d for d in np.argsort(shape)[::-1] if shape[d] % size == 0 and shape[d] >= size]
  if not candidates:
    return P()
  spec = [None] * len(shape)
  spec[int(candidates[0])] = axis
  return P(*spec)
