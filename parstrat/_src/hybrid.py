"""Hybrid: pipeline stages on mesh axis "stage" inside data-parallel replicas on "data".

With `model=T > 1`, each stage's layers are also split tensor-parallel
over a third mesh axis, "model".
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Sequence
from typing import Any

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
from parstrat._src.pipeline import optimizer_view as optimizer_view_lib
from parstrat._src.pipeline import partition as partition_lib
from parstrat._src.pipeline import residuals as residuals_lib
from parstrat._src.pipeline import schedule as schedule_lib
from parstrat._src.strategy import LossFn
from parstrat._src.strategy import Params
from parstrat._src.strategy import Plan
from parstrat._src.strategy import Strategy
from parstrat._src.strategy import available_devices
from parstrat._src.strategy import build_mesh
from parstrat._src.strategy import outputs_fn

STAGE = "stage"
MODEL = "model"


def default_split(num_devices: int) -> tuple[int, int]:
  """(data, stages) for `num_devices`: two stages when the count is even, else one."""
  stages = 2 if num_devices % 2 == 0 and num_devices >= 2 else 1
  return num_devices // stages, stages


def make_pipeline_plan(
  model: hk.TransformedWithState,
  loss_fn: LossFn,
  sample_params: Params,
  sample_inputs: Any,
  *,
  stages: int,
  microbatches: int,
  schedule: str | schedule_lib.Schedule,
  balance: str,
  cuts: Sequence[int] | None,
  bubble_value: float,
  mesh: Mesh | None = None,
  virtual_stages: int | None = None,
  activations: str = "recompute",
  exchange_every: int | None = None,
  unroll: bool = False,
) -> Plan:
  """The `Plan` shared by `PipelineModelParallel` and `Hybrid` on a (data, stage) mesh.

  Params are stored as one flat `[stages * v, size]` buffer sharded over
  "stage" (replicated over "data"), so each device holds its v chunks' rows
  (v = virtual_stages, 1 but for "interleaved_1f1b"); the batch is split over
  "data" and each replica runs the pipeline schedule over its block;
  gradients are then averaged over "data" only.

  When `mesh` also has a "model" axis of size T > 1, each stage's layers are
  split over "model" as `tensor_split.analyse` says (groups within a stage),
  and `_with_model_axis` runs the plan in a map that leaves "model" to the
  partitioner.
  """
  _check_positive("microbatches", microbatches)
  sched = schedule_for(schedule, stages, microbatches, virtual_stages, exchange_every)
  v = sched.virtual_stages

  # The trainer refuses models with state or randomness for the pipeline, so
  # the model's outputs are a function of the params and inputs alone.
  apply = outputs_fn(model)

  try:
    stage_plan = partition_lib.plan_stages(
      apply, sample_params, sample_inputs, stages * v, balance=balance, cuts=cuts
    )
  except ValueError as e:
    if v == 1 or "never used" in str(e):  # (only the cutting depends on v)
      raise
    raise ValueError(
      f"{e} (With virtual stages the model is cut into stages x virtual_stages = {stages} x "
      f"{v} = {stages * v} model stages; fewer virtual_stages need fewer cuts.)"
    ) from None
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
      sample_params, program.stage_leaves, split.split_dims, parts, MODEL, devices=stages
    )
  else:
    layout = engine.FlatLayout.build(sample_params, program.stage_leaves, devices=stages)

  @functools.cache
  def staged_for(treedef, leaves: tuple[tuple[tuple[int, ...], Any], ...]) -> engine.StagedModel:
    abstract = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(*leaf) for leaf in leaves])
    prog = partition_lib.stage_program(apply, sample_params, abstract, stage_plan)
    width = max(partition_lib.flat_width(b) for b in prog.boundaries[1:])
    return engine.StagedModel(layout, prog, width, loss_fn)

  def microbatch_model(inputs) -> engine.StagedModel:
    """The model cut for one microbatch of `inputs` (any pytree of `[B, ...]` leaves)."""
    leaves, treedef = jax.tree.flatten(inputs)
    shapes = tuple(((x.shape[0] // microbatches, *x.shape[1:]), x.dtype) for x in leaves)
    return staged_for(treedef, shapes)

  # Each device's block of the stored buffers holds its v chunks' rows.
  def loss_and_grad(stored, inputs, targets, rng, model_state):
    del rng  # unread: a model that reads its key is refused by the trainer (no supports_rng)
    loss, grads = engine.pipeline_loss_and_grad(
      microbatch_model(inputs),
      sched,
      stored,
      inputs,
      targets,
      stage_axis=STAGE,
      bubble_value=bubble_value,
      activations=activations,
      unroll=unroll,
    )
    # This replica's loss and gradients; `reduce` averages them over "data".
    return loss, grads, model_state

  def forward(stored, inputs, rng, model_state):
    del rng, model_state  # unread, empty: the trainer refuses models that need them
    return engine.pipeline_forward(
      microbatch_model(inputs),
      microbatches,
      stored,
      inputs,
      stage_axis=STAGE,
      virtual_stages=v,
    )

  sizes = layout.stage_sizes
  if parts > 1:
    # (the split buffer keeps at least one element, also with nothing split)
    split = layout.split_size if any(d is not None for d in layout.split_dims) else 0
    buffers = (
      f"per-device parameter buffers: {split:,} split + "
      f"{layout.replicated_size:,} replicated elements (largest stage {max(sizes):,})\n"
      f"{notes}\n"
    )
  else:
    rows = f"{v} x " if v > 1 else ""
    buffers = (
      f"per-device parameter buffer: {rows}{layout.size:,} elements "
      f"(largest stage {max(sizes):,}; padding {layout.size * len(sizes) - sum(sizes):,} in all)\n"
    )
  chunks = f", {v} virtual stages per device" if v > 1 else ""
  every = sched.exchange_every
  ticks = f"{sched.num_ticks} ticks" + (f" (an exchange every {every})" if every > 1 else "")
  ticks += ", unrolled" if unroll else ""
  description = (
    f"{stage_plan}\n"
    f"{buffers}"
    f"schedule: {sched.name}{chunks}, {microbatches} microbatches, {ticks}, "
    f"{sched.bubble_text()}, "
    f"{sched.num_act_slots} activation slot(s) per device, activations: {activations}"
  )
  replicas = 1 if mesh is None else dict(mesh.shape).get(DATA, 1)

  def reduce(loss_and_grads):
    """The mean over data replicas: none with one (XLA would still run a no-op all-reduce)."""
    return loss_and_grads if replicas == 1 else average_gradients(loss_and_grads, DATA)

  plan = Plan(
    param_spec=P(STAGE),
    batch_spec=P(DATA),
    to_stored=layout.to_stored,
    to_params=layout.to_params,
    loss_and_grad=loss_and_grad,
    reduce=reduce,
    forward=forward,
    batch_multiple=microbatches,
    check_vma=False,
    description=description,
    # Stage branches with a partitioned "model" axis: the compiled step is read
    # before its first run, and refused if a collective in a branch leaves "model".
    branch_axes=(MODEL,) if parts > 1 else None,
    # Where the trainer runs an optimizer that does not act leaf by leaf.
    optimizer_view=None
    if mesh is None
    else optimizer_view_lib.ModelLayoutView.build(layout, mesh, STAGE),
  )
  return _with_model_axis(plan, mesh) if parts > 1 else plan


def default_exchange_every(schedule: str) -> int:
  """The ticks between two message exchanges when `exchange_every` is not given.

  2 for "interleaved_1f1b": a forward and a backward between exchanges shortens its
  lock-step time (38 stage forwards instead of 49 at P=4, M=8, v=2 under
  "recompute") with fewer exchanges and no more live activations or slots
  (`tests/test_schedule.py::test_interleaved_gains_from_two_ticks_per_exchange_at_no_memory_cost`).
  1 for the others, where 2 keeps more activations alive (1F1B: 2P - 1 on the
  first stage instead of P).
  """
  return 2 if schedule == "interleaved_1f1b" else 1


def schedule_for(
  schedule: str | schedule_lib.Schedule,
  stages: int,
  microbatches: int,
  virtual_stages: int | None,
  exchange_every: int | None = None,
) -> schedule_lib.Schedule:
  """The named schedule built for (P, M, v, K), or a given `Schedule` checked, and against them.

  Raises:
    ValueError: naming the size that differs, or what `check_schedule` found wrong.
  """
  if not isinstance(schedule, schedule_lib.Schedule):
    return schedule_lib.build_schedule(
      schedule,
      stages,
      microbatches,
      virtual_stages=virtual_stages,
      exchange_every=default_exchange_every(schedule) if exchange_every is None else exchange_every,
    )
  for what, want, have in (
    ("stages", stages, schedule.stages),
    ("microbatches", microbatches, schedule.microbatches),
    ("virtual_stages", virtual_stages or schedule.virtual_stages, schedule.virtual_stages),
    ("exchange_every", exchange_every or schedule.exchange_every, schedule.exchange_every),
  ):
    if want != have:
      raise ValueError(f"The {schedule.name!r} schedule runs {what}={have}, not {want}.")
  try:  # (a `Schedule` is plain data: one edited by hand would run wrong without a word)
    schedule_lib.check_schedule(schedule)
  except AssertionError as e:
    raise ValueError(f"The {schedule.name!r} schedule does not check: {e}") from None
  return schedule


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

  def local_loss_and_grad(stored, inputs, targets):
    loss, grads, _ = plan.loss_and_grad(stored, inputs, targets, None, {})
    return plan.reduce((loss, grads))

  grad_fn = jax.shard_map(
    local_loss_and_grad,
    mesh=mesh,
    in_specs=(row_spec, P(DATA), P(DATA)),
    out_specs=(P(), row_spec),
    axis_names=manual_axes,
    check_vma=False,
  )
  forward_fn = jax.shard_map(
    lambda stored, inputs: plan.forward(stored, inputs, None, {}),
    mesh=mesh,
    in_specs=(row_spec, P(DATA)),
    out_specs=P(DATA),
    axis_names=manual_axes,
    check_vma=False,
  )
  param_spec = (P(STAGE, MODEL), P(STAGE))
  param_shardings = tuple(NamedSharding(mesh, spec) for spec in param_spec)

  def global_loss_and_grad(stored, inputs, targets, rng, model_state):
    del rng  # unread: a model that reads its key is refused by the trainer
    stored = jax.lax.with_sharding_constraint(stored, param_shardings)
    return (*grad_fn(stored, inputs, targets), model_state)

  def global_forward(stored, inputs, rng, model_state):
    del rng, model_state  # unread, empty: the trainer refuses models that need them
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


def with_activation_candidates(strategies):
  """Each strategy with more than one stage under every `residuals.AUTO_CANDIDATES` policy.

  "auto" then measures the memory each keeps (compiled) and prices the forward
  work each reruns (`residuals.RERUNS`), and keeps what the budget allows.
  """
  out = []
  for strategy in strategies:
    if (strategy.stages or 1) > 1:
      out += [dataclasses.replace(strategy, activations=a) for a in residuals_lib.AUTO_CANDIDATES]
    else:
      out.append(strategy)
  return out


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
    schedule: "gpipe", "1f1b" (default), "zb_h1", "interleaved_1f1b", or a
      `parstrat.pipeline.Schedule` (e.g. read by `from_csv`); see
      `PipelineModelParallel`.
    virtual_stages: model chunks per device for "interleaved_1f1b" (default 2).
    activations: "recompute" (default), "save" or a `jax.checkpoint_policies`
      name; see `PipelineModelParallel`.
    exchange_every: the ticks each device runs between two exchanges of
      messages (default 2 for "interleaved_1f1b", else 1); see
      `PipelineModelParallel`.
    unroll: trace the schedule's ticks as straight-line code instead of a loop
      (default False); see `PipelineModelParallel`.
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
  schedule: str | schedule_lib.Schedule = "1f1b"
  virtual_stages: int | None = None
  activations: str = "recompute"
  exchange_every: int | None = None
  unroll: bool = False
  balance: str = "params"
  cuts: tuple[int, ...] | None = None
  bubble_value: float = 0.0
  axis_names = (DATA, STAGE, MODEL)

  @classmethod
  def candidates_for(cls, axis_sizes, devices=None):
    """Each default configuration under each `residuals.AUTO_CANDIDATES` policy, for "auto"."""
    return with_activation_candidates(super().candidates_for(axis_sizes, devices))

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

  def _cuts(self) -> tuple[int, ...] | None:
    """`cuts` as a tuple of ints (a list, range or NumPy array of them is fine).

    Raises:
      ValueError: if `cuts` is not a sequence of integers.
    """
    if self.cuts is None:
      return None
    try:
      if isinstance(self.cuts, (str, bytes)) or any(isinstance(c, bool) for c in self.cuts):
        raise TypeError
      return tuple(operator.index(c) for c in self.cuts)
    except TypeError:
      raise ValueError(f"cuts must be a tuple of layer indices, got {self.cuts!r}.") from None

  def _microbatches(self, stages: int) -> int:
    """M after the default: the given schedule's M, else one per stage."""
    return self.microbatches or getattr(self.schedule, "microbatches", stages)

  def make_mesh(self) -> Mesh:
    if not isinstance(self.schedule, schedule_lib.Schedule):
      schedule_lib.resolve_virtual_stages(self.schedule, self.virtual_stages)
    residuals_lib.check_activations(self.activations)
    if self.exchange_every is not None:
      _check_positive("exchange_every", self.exchange_every)
    if not isinstance(self.unroll, bool):
      raise ValueError(f"unroll must be True or False, got {self.unroll!r}.")
    self._cuts()
    data, stages = self.resolved_split()
    _check_positive("stages", stages)
    if self.microbatches is not None:
      _check_positive("microbatches", self.microbatches)
    if isinstance(self.schedule, schedule_lib.Schedule):
      schedule_for(
        self.schedule,
        stages,
        self._microbatches(stages),
        self.virtual_stages,
        self.exchange_every,
      )
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
      microbatches=self._microbatches(stages),
      schedule=self.schedule,
      balance=self.balance,
      cuts=self._cuts(),
      bubble_value=self.bubble_value,
      mesh=mesh,
      virtual_stages=self.virtual_stages,
      activations=self.activations,
      exchange_every=self.exchange_every,
      unroll=self.unroll,
    )
