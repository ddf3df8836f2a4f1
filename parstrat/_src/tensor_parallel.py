"""TensorParallel: Megatron-style splitting of linear layers over mesh axis "model"."""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from parstrat._src import registry
from parstrat._src import tensor_split
from parstrat._src.sharded_params import global_plan
from parstrat._src.strategy import Plan
from parstrat._src.strategy import Strategy
from parstrat._src.strategy import build_mesh

MODEL = "model"


@registry.register("tensor")
@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class TensorParallel(Strategy):
  """Tensor parallelism over mesh axis "model", on the unmodified Haiku model.

  `parstrat._src.tensor_split` reads the model's dataflow: a linear layer
  whose output is consumed, through element-wise ops only, by another linear
  layer is split column-parallel (weight and bias by output features) and
  its consumer row-parallel (weight by input features), so the hidden
  activation between them stays split and the pair needs one all-reduce
  forward and one backward. Attention is split by heads: query, key and value
  column-parallel, the output projection row-parallel, one all-reduce per
  block. Everything else (a layer followed by LayerNorm, a residual stream, a
  bias-only layer, a width T does not divide, embeddings, convolutions) is
  replicated, with the reason in the plan's `description`. Each device holds
  1/T of every split weight; the batch is replicated over "model".

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

  def make_mesh(self) -> Mesh:
    return build_mesh({MODEL: self.model}, self.devices)

  def make_plan(self, model, loss_fn, mesh, sample_params, sample_inputs) -> Plan:
    split = tensor_split.analyse(
      lambda p, x: model.apply(p, None, x), sample_params, sample_inputs, mesh.shape[MODEL]
    )
    return global_plan(model, loss_fn, split.specs(MODEL), P(), split.describe())
