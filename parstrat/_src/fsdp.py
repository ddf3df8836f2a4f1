"""FSDP (ZeRO-3): parameters, gradients and optimizer state sharded over "data"."""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from parstrat._src import registry
from parstrat._src.data_parallel import DATA
from parstrat._src.sharded_params import fsdp_spec
from parstrat._src.sharded_params import global_plan
from parstrat._src.strategy import Plan
from parstrat._src.strategy import Strategy
from parstrat._src.strategy import build_mesh


@registry.register("fsdp")
@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class FSDP(Strategy):
  """Fully sharded data parallelism (ZeRO-3) over mesh axis "data".

  Like `DataParallel` the batch is split over "data", but each parameter is
  also split over "data" along its largest dimension that the axis size divides
  (tiny leaves such as a 10-wide bias stay replicated), and so are its gradient
  and optimizer state. The step is written on global arrays; XLA all-gathers
  each weight just before it is used and reduce-scatters its gradient, so each
  device holds about 1/N of the parameters and optimizer state.

  Args:
    data: devices on the "data" axis (default: all).
    devices, debug: see `Strategy`.

  Example:
    >>> import parstrat
    >>> dict(parstrat.get("fsdp", data=4).make_mesh().shape)
    {'data': 4}
  """

  data: int | None = None
  axis_names = (DATA,)

  def make_mesh(self) -> Mesh:
    return build_mesh({DATA: self.data}, self.devices)

  def make_plan(self, model, loss_fn, mesh, sample_params, sample_inputs) -> Plan:
    size = mesh.shape[DATA]
    specs = jax.tree.map(lambda p: fsdp_spec(p.shape, DATA, size), sample_params)

    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    sharded = sum(1 for spec in leaves if spec != P())
    description = f"{sharded} of {len(leaves)} parameter leaves sharded over 'data'; batch split"
    return global_plan(model, loss_fn, specs, P(DATA), description)
