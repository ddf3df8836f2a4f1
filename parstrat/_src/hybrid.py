"""Hybrid: pipeline stages on mesh axis "stage" inside data-parallel replicas on "data"."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import haiku as hk
import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from parstrat._src import registry
from parstrat._src.data_parallel import DATA
from parstrat._src.data_parallel import average_gradients
from parstrat._src.pipeline import engine
from parstrat._src.pipeline import partition as partition_lib
from parstrat._src.pipeline import schedule as schedule_lib
from parstrat._src.strategy import LossFn
from parstrat._src.strategy import Params
from parstrat._src.strategy import Plan
from parstrat._src.strategy import Strategy
from parstrat._src.strategy import available_devices
from parstrat._src.strategy import build_mesh

STAGE = "stage"


def default_split(num_devices: int) -> tuple[int, int]:
  """(data, stages) for `num_devices`: two stages when the count is even, else one."""
  stages = 2 if num_devices % 2 == 0 and num_devices >= 2 else 1
  return num_devices // stages, stages


def make_pipeline_plan(
  model: hk.Transformed,
  loss_fn: LossFn,
  sample_params: Params,
  sample_inputs: jax.ShapeDtypeStruct,
  *,
  stages: int,
  microbatches: int,
  schedule: str,
  balance: str,
  cuts: Sequence[int] | None,
  bubble_value: float,
) -> Plan:
  """The `Plan` shared by `PipelineModelParallel` and `Hybrid` on a (data, stage) mesh.

  Params are stored as one flat `[stages, size]` buffer sharded over "stage"
  (replicated over "data"); the batch is split over "data" and each replica
  runs the pipeline schedule over its block; gradients are then averaged over
  "data" only.
  """
  _check_positive("microbatches", microbatches)
  sched = schedule_lib.build_schedule(schedule, stages, microbatches)

  def apply(params, x):
    return model.apply(params, None, x)

  stage_plan = partition_lib.plan_stages(
    apply, sample_params, sample_inputs, stages, balance=balance, cuts=cuts
  )
  program = partition_lib.stage_program(apply, sample_params, sample_inputs, stage_plan)
  layout = engine.FlatLayout.build(sample_params, program.stage_leaves)

  @functools.cache
  def staged_for(shape: tuple[int, ...], dtype) -> engine.StagedModel:
    prog = partition_lib.stage_program(
      apply, sample_params, jax.ShapeDtypeStruct(shape, dtype), stage_plan
    )
    width = max(partition_lib.flat_width(b) for b in prog.boundaries[1:])
    return engine.StagedModel(layout, prog, width, loss_fn)

  def microbatch_model(inputs) -> engine.StagedModel:
    return staged_for((inputs.shape[0] // microbatches, *inputs.shape[1:]), inputs.dtype)

  def loss_and_grad(stored, inputs, labels):
    row = stored[0]
    loss, grads = engine.pipeline_loss_and_grad(
      microbatch_model(inputs),
      sched,
      row,
      inputs,
      labels,
      stage_axis=STAGE,
      bubble_value=bubble_value,
    )
    loss, grads = average_gradients((loss, grads), DATA)
    return loss, grads[None]

  def forward(stored, inputs):
    return engine.pipeline_forward(
      microbatch_model(inputs),
      microbatches,
      stored[0],
      inputs,
      stage_axis=STAGE,
    )

  sizes = layout.stage_sizes
  description = (
    f"{stage_plan}\n"
    f"per-device parameter buffer: {layout.size:,} elements "
    f"(largest stage {max(sizes):,}; padding {layout.size * len(sizes) - sum(sizes):,} in all)\n"
    f"schedule: {sched.name}, {microbatches} microbatches, {sched.num_ticks} ticks, "
    f"bubble {sched.bubble_fraction():.3f} (theory {sched.theoretical_bubble():.3f}), "
    f"{sched.num_act_slots} activation slot(s) per device"
  )
  return Plan(
    param_spec=P(STAGE),
    batch_spec=P(DATA),
    to_stored=layout.to_stored,
    to_params=layout.to_params,
    loss_and_grad=loss_and_grad,
    forward=forward,
    batch_multiple=microbatches,
    check_vma=False,
    description=description,
  )


def _check_positive(what: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{what} must be a positive integer, got {value!r}.")


@registry.register("hybrid")
@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class Hybrid(Strategy):
  """Data x pipeline parallelism on a `data x stages` mesh with axes ("data", "stage").

  Each of the `data` replicas runs the pipeline (`PipelineModelParallel`) over
  its block of the batch; the gradients of each stage are then averaged over
  "data" only (`DataParallel`'s reduction), and activations move over "stage"
  only. `Hybrid(data=D, stages=1)` is data parallelism with a one-stage
  pipeline, and `Hybrid(data=1, stages=P)` is the pipeline.

  Args:
    data: replicas along "data" (default: the devices left after `stages`).
    stages: pipeline stages along "stage" (default: 2 when the device count is
      even, else 1; see `default_split`).
    microbatches: microbatches per replica per step (default: `stages`).
    schedule: "gpipe" or "1f1b".
    balance: what the automatic cut balances, "params" or "flops".
    cuts: layer indices where stages 1.. start, overriding the automatic cut.
    bubble_value: what idle pipeline slots send (tests set NaN).
    devices, debug: see `Strategy`.

  Example:
    >>> import parstrat
    >>> strategy = parstrat.Hybrid(data=2, stages=2, microbatches=4)
    >>> dict(strategy.make_mesh().shape)
    {'data': 2, 'stage': 2}
  """

  data: int | None = None
  stages: int | None = None
  microbatches: int | None = None
  schedule: str = "1f1b"
  balance: str = "params"
  cuts: tuple[int, ...] | None = None
  bubble_value: float = 0.0
  axis_names = (DATA, STAGE)

  def resolved_split(self) -> tuple[int | None, int]:
    """(data, stages) after defaults: `data=None` fills the remaining devices."""
    if self.stages is not None:
      return self.data, self.stages
    n = len(available_devices(self.devices))
    if self.data is not None:
      _check_positive("data", self.data)
      if n % self.data:
        raise ValueError(f"data={self.data} does not divide the {n} available devices.")
      return self.data, n // self.data
    return default_split(n)

  def make_mesh(self) -> Mesh:
    if self.schedule not in schedule_lib.ORDERS:
      raise ValueError(
        f"Unknown schedule {self.schedule!r}; choose one of {sorted(schedule_lib.ORDERS)}."
      )
    data, stages = self.resolved_split()
    _check_positive("stages", stages)
    if self.microbatches is not None:
      _check_positive("microbatches", self.microbatches)
    return build_mesh({DATA: data, STAGE: stages}, self.devices)

  def make_plan(self, model, loss_fn, mesh, sample_params, sample_inputs) -> Plan:
    stages = mesh.shape[STAGE]
    return make_pipeline_plan(
      model,
      loss_fn,
      sample_params,
      sample_inputs,
      stages=stages,
      microbatches=self.microbatches or stages,
      schedule=self.schedule,
      balance=self.balance,
      cuts=self.cuts,
      bubble_value=self.bubble_value,
    )
