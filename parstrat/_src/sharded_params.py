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

from parstrat._src.pipeline import partition as partition_lib
from parstrat._src.strategy import Plan
from parstrat._src.strategy import model_loss
from parstrat._src.strategy import outputs_fn


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


def fsdp_spec(shape: tuple[int, ...], axis: str, size: int) -> P:
  """Shards the largest dimension divisible by `size` over `axis` (else replicates)."""
  candidates = [d for d in np.argsort(shape)[::-1] if shape[d] % size == 0 and shape[d] >= size]
  if not candidates:
    return P()
  spec = [None] * len(shape)
  spec[int(candidates[0])] = axis
  return P(*spec)


def layer_order(model, sample_params: Any, sample_inputs: Any) -> list[str]:
  """The model's layers (top-level param keys) in the order its `apply` uses them."""
  trace = partition_lib._trace(outputs_fn(model), sample_params, sample_inputs)  # noqa: SLF001
  analysis = partition_lib._analyse(trace)  # noqa: SLF001
  return [trace.layer_names[k] for k in analysis.layer_order]


def megatron_specs(
  sample_params: dict, order: list[str], axis: str, size: int
) -> tuple[dict, list[str]]:
  """Column- then row-parallel specs for consecutive pairs of linear layers.

  Layer 2k's `w [in, out]` is split by columns and its `b [out]` likewise; layer
  2k+1's `w [in, out]` is split by rows and its bias kept whole, so each pair
  needs one all-reduce in the forward pass and one in the backward pass. A lone
  last layer, a non-linear layer or a width that `size` does not divide is
  replicated.

  Returns:
    (specs shaped like `sample_params`, a line per layer saying what was done).
  """
  specs = {name: {k: P() for k in leaves} for name, leaves in sample_params.items()}
  notes = []
  i = 0
  while i < len(order):
    first = order[i]
    second = order[i + 1] if i + 1 < len(order) else None
    linear = lambda name: (
      name is not None
      and set(sample_params[name]) <= {"w", "b"}
      and (  # noqa: E731
        len(sample_params[name]["w"].shape) == 2
      )
    )
    if (
      second is not None
      and linear(first)
      and linear(second)
      and sample_params[first]["w"].shape[1] % size == 0
    ):
      specs[first]["w"] = P(None, axis)
      if "b" in specs[first]:
        specs[first]["b"] = P(axis)
      specs[second]["w"] = P(axis, None)
      notes.append(f"{first}: column-parallel; {second}: row-parallel (one all-reduce)")
      i += 2
    else:
      notes.append(f"{first}: replicated")
      i += 1
  return specs, notes
