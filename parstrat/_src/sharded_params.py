"""Layouts that shard the parameters themselves: FSDP and tensor parallelism.

Both are expressed as shardings on global arrays (`Plan(manual=False)`): the
step is written for one device and XLA's SPMD partitioner inserts the
all-gathers, reduce-scatters and all-reduces that the shardings imply, as
MaxText and praxis do.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from parstrat._src.strategy import Plan
from parstrat._src.strategy import model_loss


def global_plan(model, loss_fn, param_spec: Any, batch_spec: P, description: str) -> Plan:
  """A plan on global arrays: the model's own layout, sharded by `param_spec`.

  The loss and gradients are written as for one device; XLA partitions them.
  So a model that draws randomness gets the step's one key for the whole
  global batch (JAX's partitionable threefry draws the same values however
  the batch is laid out), and its state is updated from the whole batch:
  both exactly as on one device.
  """
  loss = jax.value_and_grad(model_loss(model, loss_fn), has_aux=True)

  def loss_and_grad(params, inputs, targets, rng, model_state):
    (value, model_state), grads = loss(params, inputs, targets, rng, model_state)
    return value, grads, model_state

  def forward(params, inputs, rng, model_state):
    return model.apply(params, model_state, rng, inputs)[0]

  return Plan(
    param_spec=param_spec,
    batch_spec=batch_spec,
    to_stored=lambda params: params,
    to_params=lambda stored: stored,
    loss_and_grad=loss_and_grad,
    forward=forward,
    manual=False,
    description=description,
  )


def fsdp_spec(shape: tuple[int, ...], axis: str, size: int, replicate_below: int = 0) -> P:
  """Shards the largest dimension divisible by `size` over `axis` (else replicates).

  A leaf of fewer than `replicate_below` elements is replicated whatever its shape.
  """
  if math.prod(shape) < replicate_below:
    return P()
  candidates = [d for d in np.argsort(shape)[::-1] if shape[d] % size == 0 and shape[d] >= size]
  if not candidates:
    return P()
  spec = [None] * len(shape)
  spec[int(candidates[0])] = axis
  return P(*spec)
