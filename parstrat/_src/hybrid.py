"""Hybrid: pipeline stages on mesh axis "stage" inside data-parallel replicas on "data".

With `model=T > 1`, each stage's layers are also split tensor-parallel
over a third mesh axis, "model".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import haiku as hk
import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from parstrat._src import registry
from parstrat._src import tensor_split
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
MODEL = "model"


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
  mesh: Mesh | None = None,
) -> Plan:
  """The `Plan` shared by `PipelineModelParallel` and `Hybrid` on a (data, stage) mesh.

  Params are stored as one flat `[stages, size]` buffer sharded over "stage"
  (replicated over "data"); the batch is split over "data" and each replica
  runs the pipeline schedule over its block; gradients are then averaged over
  "data" only.

  When `mesh` also has a "model" axis of size T > 1, each stage's layers are
  split over "model" as `tensor_split.analyse` says (groups within a stage),
  and `_with_model_axis` runs the plan in a map that leaves "model" to the
  partitioner.
  """
  _check_positive("microbatches", microbatches)
  sched = schedule_lib.build_schedule(schedule, stages, microbatches)

  def apply(params, x):
    return model.apply(params, None, x)

  stage_plan = partition_lib.plan_stages(
    apply, sample_params, sample_inputs, stages, balance=balance, cuts=cuts
  )
  program = partition_lib.stage_program(apply, sample_params, sample_inputs, stage_plan)
  parts = 1 if mesh is None else dict(mesh.shape).get(MODEL, 1)
  notes = ""
  if parts > 1:
    stage_of = {
      stage_plan.layers[k].name: s for s, group in enumerate(stage_plan.stage_layers) for k in group
    }
    split = tensor_split.analyse(apply, sample_params, sample_inputs, parts, stage_of=stage_of)
    notes = split.describe(stage_of)
    layout = engine.SplitLayout.build(
      sample_params, program.stage_leaves, split.split_dims, parts, MODEL
    )
  else:
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

  # Each device's block of the stored buffers has a leading stage axis of 1.
  def row_of(stored):
    return jax.tree.map(lambda x: x[0], stored)

  def loss_and_grad(stored, inputs, labels):
    loss, grads = engine.pipeline_loss_and_grad(
      microbatch_model(inputs),
      sched,
      row_of(stored),
      inputs,
      labels,
      stage_axis=STAGE,
      bubble_value=bubble_value,
    )
    # This replica's loss and gradients; `reduce` averages them over "data".
    return loss, jax.tree.map(lambda g: g[None], grads)

  def forward(stored, inputs):
    return engine.pipeline_forward(
      microbatch_model(inputs), microbatches, row_of(stored), inputs, stage_axis=STAGE
    )

  sizes = layout.stage_sizes
  if parts > 1:
    buffers = (
      f"per-device parameter buffers: {layout.split_size:,} split + "
      f"{layout.replicated_size:,} replicated elements (largest stage {max(sizes):,})\n"
      f"{notes}\n"
    )
  else:
    buffers = (
      f"per-device parameter buffer: {layout.size:,} elements "
      f"(largest stage {max(sizes):,}; padding {layout.size * len(sizes) - sum(sizes):,} in all)\n"
    )
  description = (
    f"{stage_plan}\n"
    f"{buffers}"
    f"schedule: {sched.name}, {microbatches} microbatches, {sched.num_ticks} ticks, "
    f"bubble {sched.bubble_fraction():.3f} (theory {sched.theoretical_bubble():.3f}), "
    f"{sched.num_act_slots} activation slot(s) per device"
  )
  plan = Plan(
    param_spec=P(STAGE),
    batch_spec=P(DATA),
    to_stored=layout.to_stored,
    to_params=layout.to_params,
    loss_and_grad=loss_and_grad,
    reduce=lambda loss_and_grads: average_gradients(loss_and_grads, DATA),
    forward=forward,
    batch_multiple=microbatches,
    check_vma=False,
    description=description,
  )
  return _with_model_axis(plan, mesh) if parts > 1 else plan


def _with_model_axis(plan: Plan, mesh: Mesh) -> Plan:
  """The pipeline `plan` on a (data, stage, model) mesh, with "model" left to the partitioner.

  Stored params are `(split [P, T, S], replicated [P, R])` sharded
  `(P("stage", "model"), P("stage"))`. The plan is a global one (`manual=False`):
  it runs the pipeline under its own `jax.shard_map` that is manual over
  "data" and "stage" only, so inside it every device of a (data, stage) pair
  sees its stage's `[T, S]` block still split over the automatic "model" axis.
  The stage functions rebuild each split weight from that block, pinned split
  along its Megatron dimension, and XLA's SPMD partitioner inserts the
  all-reduces over "model"; as "model" is not manual, no transpose sums a
  gradient over it. Gradients are averaged over "data" explicitly as before.
  """
  manual_axes = frozenset({DATA, STAGE})
  row_spec = (P(STAGE), P(STAGE))

  def local_loss_and_grad(stored, inputs, labels):
    return plan.reduce(plan.loss_and_grad(stored, inputs, labels))

  grad_fn = jax.shard_map(
    local_loss_and_grad,
    mesh=mesh,
    in_specs=(row_spec, P(DATA), P(DATA)),
    out_specs=(P(), row_spec),
    axis_names=manual_axes,
    check_vma=False,
  )
  forward_fn = jax.shard_map(
    plan.forward,
    mesh=mesh,
    in_specs=(row_spec, P(DATA)),
    out_specs=P(DATA),
    axis_names=manual_axes,
    check_vma=False,
  )
  param_spec = (P(STAGE, MODEL), P(STAGE))
  param_shardings = tuple(NamedSharding(mesh, spec) for spec in param_spec)

  def global_loss_and_grad(stored, inputs, labels):
    stored = jax.lax.with_sharding_constraint(stored, param_shardings)
    return grad_fn(stored, inputs, labels)

  def global_forward(stored, inputs):
    return forward_fn(jax.lax.with_sharding_constraint(stored, param_shardings), inputs)

  return dataclasses.replace(
    plan,
    param_spec=param_spec,
    loss_and_grad=global_loss_and_grad,
    forward=global_forward,
    reduce=None,  # done inside the map above
    manual=False,
  )


def _check_positive(what: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{what} must be a positive integer, got {value!r}.")


@registry.register("hybrid")
@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class Hybrid(Strategy):
  """Data x pipeline (x tensor) parallelism on a `data x stages (x model)` mesh.

  Each of the `data` replicas runs the pipeline (`PipelineModelParallel`) over
  its block of the batch; the gradients of each stage are then averaged over
  "data" only (`DataParallel`'s reduction), and activations move over "stage"
  only. `Hybrid(data=D, stages=1)` is data parallelism with a one-stage
  pipeline, and `Hybrid(data=1, stages=P)` is the pipeline.

  With `model=T > 1` the mesh gains a third axis, "model" (axes ("data",
  "stage", "model"); with `model=1` it is just ("data", "stage")), and within
  each stage the layers are split over it by the same dataflow analysis as
  `TensorParallel` (`parstrat._src.tensor_split`): a column-parallel layer is
  paired with the row-parallel layer that consumes its output (attention by
  heads), and a pair, or a group such as query/key/value -> output, never
  straddles a stage cut::

    for each stage s:
      column-parallel: w, b split by output features  (no communication)
      row-parallel:    w split by input features, b whole (all-reduce over "model")
      anything else (not consumed by a linear layer of the same stage through
      element-wise ops, a width T does not divide, LayerNorm, ...): replicated

  Every group is closed (each value it splits ends in one of its row layers),
  so the only collectives inside a stage are all-reduces among the T devices
  of one (data, stage) pair, which all run that stage. Each device then
  stores 1/T of every split weight of its stage (plus the stage's replicated
  leaves); the plan's `description` lists what is split and why.

  Args:
    data: replicas along "data" (default: the devices left after `stages`).
    stages: pipeline stages along "stage" (default: 2 when the device count
      left after `model` is even, else 1; see `default_split`).
    model: tensor-parallel ways along "model" within each stage (default 1:
      no "model" axis).
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
    >>> dict(parstrat.Hybrid(data=2, stages=2, model=2).make_mesh().shape)
    {'data': 2, 'stage': 2, 'model': 2}
  """

  data: int | None = None
  stages: int | None = None
  model: int = 1
  microbatches: int | None = None
  schedule: str = "1f1b"
  balance: str = "params"
  cuts: tuple[int, ...] | None = None
  bubble_value: float = 0.0
  axis_names = (DATA, STAGE, MODEL)

  def resolved_split(self) -> tuple[int | None, int]:
    """(data, stages) after defaults: `data=None` fills the remaining devices."""
    _check_positive("model", self.model)
    if self.stages is not None:
      return self.data, self.stages
    n = len(available_devices(self.devices))
    where = f"the {n} available devices"
    if self.model > 1:
      if n % self.model:
        raise ValueError(f"model={self.model} does not divide {where}.")
      n //= self.model
      where = f"the {n} devices left per model={self.model} group"
    if self.data is not None:
      _check_positive("data", self.data)
      if n % self.data:
        raise ValueError(f"data={self.data} does not divide {where}.")
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
    if self.model == 1:
      return build_mesh({DATA: data, STAGE: stages}, self.devices)
    n = len(available_devices(self.devices))
    if data is None and n % (stages * self.model):
      raise ValueError(
        f"model={self.model} x stages={stages} does not divide the {n} available devices."
      )
    return build_mesh({DATA: data, STAGE: stages, MODEL: self.model}, self.devices)

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
      mesh=mesh,
    )
