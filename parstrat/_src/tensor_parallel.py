"""TensorParallel: Megatron-style splitting of linear layers over mesh axis "model"."""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from parstrat._src import registry
from parstrat._src.sharded_params import global_plan
from parstrat._src.sharded_params import layer_order
from parstrat._src.sharded_params import megatron_specs
from parstrat._src.strategy import Plan
from parstrat._src.strategy import Strategy
from parstrat._src.strategy import build_mesh

MODEL = "model"


@registry.register("tensor")
@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class TensorParallel(Strategy):
  """Tensor parallelism over mesh axis "model", on the unmodified Haiku MLP.

  Consecutive pairs of linear layers (in the order `apply` uses them) are split
  column-parallel then row-parallel: the first layer's weight and bias by
  output columns, the second's weight by input rows, so the hidden activation
  between them stays split and each pair needs one all-reduce forward and one
  backward. A lone last layer is replicated. Each device holds 1/T of every
  split weight; the batch is replicated over "model".

  Args:
    model: devices on the "model" axis (default: all).
    devices, debug: see `Strategy`.

  Example:
    >>> import parstrat
    >>> dict(parstrat.get("tensor", model=2).make_mesh().shape)
    {'model': 2}
  """

  model: int | None = None
  axis_names = (MODEL,)
  supports_rng = True

  def make_mesh(self) -> Mesh:
    return build_mesh({MODEL: self.model}, self.devices)

  def make_plan(self, model, loss_fn, mesh, sample_params, sample_inputs) -> Plan:
    order = layer_order(model, sample_params, sample_inputs)
    specs, notes = megatron_specs(sample_params, order, MODEL, mesh.shape[MODEL])

    return global_plan(model, loss_fn, specs, P(), "\n".join(notes))
