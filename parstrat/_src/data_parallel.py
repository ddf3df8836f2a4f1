"""DataParallel: the same model on every device, the batch split, gradients averaged."""

from __future__ import annotations

import dataclasses
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from parstrat._src import registry
from parstrat._src.strategy import LossFn
from parstrat._src.strategy import Params
from parstrat._src.strategy import Plan
from parstrat._src.strategy import Strategy
from parstrat._src.strategy import build_mesh
from parstrat._src.strategy import model_loss

DATA = "data"


def average_gradients(tree: Any, axes: str | tuple[str, ...] = DATA) -> Any:
  """Averages per-device values (losses, gradients) over the mesh `axes`.

  Floats narrower than 32 bits (bfloat16 params' gradients) are summed in
  float32 and cast back: a sum of bfloat16 parts loses their low bits, and
  XLA's CPU backend aborts on a bfloat16 `pmean` over "data" inside a
  `shard_map` that leaves "model" to the partitioner (`Hybrid(model>1)`).
  """
  narrow = lambda x: jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32  # noqa: E731
  wide = jax.tree.map(lambda x: x.astype(jnp.float32) if narrow(x) else x, tree)
  return jax.tree.map(lambda mean, x: mean.astype(x.dtype), lax.pmean(wide, axes), tree)


@registry.register("data_parallel")
@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class DataParallel(Strategy):
  """Data parallelism: params replicated over mesh axis "data", the batch split.

  Each device computes the loss and gradients of its slice of the global batch;
  the gradients are averaged with `lax.pmean` over "data" and every replica
  applies the same optimizer update, so all replicas stay identical and the
  run matches single-device training on the whole batch.

  A model that draws randomness gets, on each device, the step's key folded
  with the device's index along "data" (so its dropout masks differ from one
  device's on the whole batch; with rate 0 the run is identical). A model's
  state (`hk.transform_with_state`) is updated by each device from its own
  block and then averaged over "data" (`pmean`; integer leaves: the floor of
  the mean): exact for a state that is an affine function of batch means,
  while BatchNorm's statistics become the mean of the per-device statistics.

  Args:
    data: the number of devices on the "data" axis (default: all devices).
    devices: the devices to use (default: `jax.devices()`).
    debug: check replica consistency after every step.

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp, optax, parstrat
    >>> model = hk.transform(lambda x: hk.nets.MLP([16, 10])(x))
    >>> trainer = parstrat.DataParallel(data=4)(model, optax.adam(1e-3))
    >>> dict(trainer.mesh.shape)
    {'data': 4}
  """

  data: int | None = None
  axis_names = (DATA,)
  supports_rng = True
  supports_state = True
  model_axes = (DATA,)

  def make_mesh(self) -> Mesh:
    return build_mesh({DATA: self.data}, self.devices)

  def make_plan(
    self,
    model: hk.TransformedWithState,
    loss_fn: LossFn,
    mesh: Mesh,
    sample_params: Params,
    sample_inputs: Any,
  ) -> Plan:
    del mesh, sample_params, sample_inputs
    local_loss = jax.value_and_grad(model_loss(model, loss_fn), has_aux=True)

    def loss_and_grad(params, inputs, targets, rng, model_state):  # this device's own
      (loss, model_state), grads = local_loss(params, inputs, targets, rng, model_state)
      return loss, grads, model_state

    def forward(params, inputs, rng, model_state):
      return model.apply(params, model_state, rng, inputs)[0]

    return Plan(
      param_spec=P(),
      batch_spec=P(DATA),
      to_stored=lambda params: params,
      to_params=lambda stored: stored,
      loss_and_grad=loss_and_grad,
      reduce=lambda loss_and_grads: average_gradients(loss_and_grads, DATA),
      forward=forward,
      description="params replicated over 'data'; batch split over 'data'",
      # Every reduction is the explicit `average_gradients`: without the varying-axes
      # check the gradient of the replicated params is each device's own. With it, a
      # model's `lax.scan` over a carry it starts from constants (an LSTM's zero
      # state under `hk.dynamic_unroll`) fails to trace: the carry becomes varying.
      check_vma=False,
    )
