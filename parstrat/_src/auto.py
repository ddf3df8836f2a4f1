"""Auto: choose a registered strategy and mesh shape from measured memory and a cost model.

For every registered strategy that declares mesh axes, and every way to lay
those axes over the devices, "auto" builds the trainer abstractly (no array is
allocated), compiles its step for the real batch and reads the per-device
memory from `compiled.memory_analysis()`. Candidates over `memory_budget` are
dropped; the rest are ranked by an estimated step time:

    time = compute + communication + latency

    compute       = 3 * (F - F_pairs + F_pairs / T) * B / (D * S)   (forward + backward)
                    x (M + S - 1) / M              (pipeline bubble, S > 1)
                    x (1 + R / 3)                  (S > 1: the share R of each stage
                                                    forward its backward reruns: 1 under
                                                    activations="recompute", the
                                                    element-wise share under
                                                    "dots_saveable", 0 under "save")
    communication = bytes moved per device / bytes_per_second, summing
      "data"  : gradient_traffic * (D - 1) / D * gradient bytes per device, per
                reduction (2 for DataParallel's all-reduce, 3 for ZeRO-3 and
                ZeRO-1; k reductions with `accumulate=k` on a plan that
                reduces in every microstep)
      "model" : per column/row pair, an all-reduce of the pair's output in
                the forward pass and of its input's gradient in the backward
                pass (none for the first layer's input), 2 (T - 1) / T * bytes,
                divided by S (a stage holds about 1/S of the pairs)
      "stage" : each microbatch's activation forward and its gradient back
                across the widest stage boundary; with an optimizer that does
                not act leaf by leaf (it runs on the model's layout), three
                all-to-alls of a device's params, (S - 1) / S of them each
    latency       = collective_latency * collectives per step

with D, S, T the "data", "stage" and "model" axis sizes, B the global batch,
M the microbatches, F the forward FLOPs per example and F_pairs those of the
layers tensor parallelism splits. FLOPs come from the model's jaxpr (2 per multiply-add
of a matmul, 1 per element otherwise). The device constants are assumptions a
user can change; the ranking depends on their ratios, not on a clock.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from parstrat._src import messages
from parstrat._src import registry
from parstrat._src import tensor_split
from parstrat._src.pipeline import partition as partition_lib
from parstrat._src.pipeline import residuals as residuals_lib
from parstrat._src.strategy import Strategy
from parstrat._src.strategy import Trainer
from parstrat._src.strategy import as_stateful
from parstrat._src.strategy import available_devices
from parstrat._src.strategy import axis_field
from parstrat._src.strategy import bind_axes
from parstrat._src.strategy import is_unbound_axis
from parstrat._src.strategy import outputs_fn
from parstrat._src.strategy import unbound_axis_message

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(value: int | str | None) -> int | None:
  """`1_000_000`, "512MiB", "2GB", "1.5 GiB" -> bytes; None stays None.

  Raises:
    ValueError: for a number below 1, inf or NaN, or text that is not a size.
  """
  if value is None:
    return None
  if isinstance(value, str):
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
      raise ValueError(
        f"memory_budget must be a number of bytes or a size like '512MiB' or '2GB', got {value!r}."
      )
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
      raise ValueError(f"memory_budget must be a positive size, got {value!r}.")
    return size
  if (
    isinstance(value, bool)
    or not isinstance(value, (int, float, np.integer, np.floating))
    or not math.isfinite(value)
    or value < 1
  ):  # (0.5 bytes would be 0, read as "no limit"; inf and NaN have no int)
    raise ValueError(f"memory_budget must be a positive number of bytes, got {value!r}.")
  return int(value)


def format_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(n) < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  return f"{n:.2f} GiB"


@dataclasses.dataclass(frozen=True)
class ModelStats:
  """What the cost model needs to know about the model.

  Attributes:
    param_bytes: bytes of all parameters.
    flops_per_example: forward FLOPs per example.
    boundary_widths: elements per example crossing each cuttable layer boundary.
    tensor_pairs: for tensor parallelism, per split group (a column/row pair,
      or an attention block), the elements per example all-reduced in the
      backward pass (the gradient of the group's input; 0 for the model's own
      input) and in the forward pass (the row-parallel output).
    tensor_split_flops: forward FLOPs per example inside those groups (the
      only ones a "model" axis divides).
    dot_flops_per_example: the part of `flops_per_example` in matmuls
      (`dot_general`); the rest is element-wise work.
  """

  param_bytes: int
  flops_per_example: int
  boundary_widths: tuple[int, ...]
  tensor_pairs: tuple[tuple[int, int], ...]
  tensor_split_flops: int = 0
  dot_flops_per_example: int = 0

  def rerun_fraction(self, activations: str) -> float:
    """The share of the forward a pipeline's backward reruns under `activations`."""
    rerun = residuals_lib.RERUNS[activations]
    if rerun == "all":
      return 1.0
    if rerun == "nothing" or not self.flops_per_example:
      return 0.0
    return 1.0 - self.dot_flops_per_example / self.flops_per_example

  @classmethod
  def of(
    cls,
    model,
    sample_params,
    sample_inputs: Any,
    parts: int = 2,
    model_state: Any = None,
  ) -> ModelStats:
    """Reads the stats off the model's jaxpr.

    Only the FLOP count is required; the layer analysis (cut widths) is best
    effort, as a model the pipeline cannot analyse may still suit other
    strategies: then those terms are left empty. The tensor-parallel terms
    come from `tensor_split.analyse` for a "model" axis of `parts`.

    Args:
      model: an `hk.Transformed` or `hk.TransformedWithState`.
      sample_params: abstract params.
      sample_inputs: abstract model inputs (a pytree of batch-leading values).
      parts: the size of the "model" axis the tensor terms are for.
      model_state: the state of a stateful model (arrays; default empty).
    """
    apply = outputs_fn(as_stateful(model), model_state)
    batch = max(int(jax.tree.leaves(sample_inputs)[0].shape[0]), 1)
    closed = jax.make_jaxpr(apply)(sample_params, sample_inputs)
    flops = sum(partition_lib._eqn_flops(eqn) for eqn in closed.jaxpr.eqns)  # noqa: SLF001
    dots = sum(partition_lib._eqn_flops(e, only_dots=True) for e in closed.jaxpr.eqns)  # noqa: SLF001
    leaves = jax.tree.leaves(sample_params)
    widths = []
    try:
      trace = partition_lib._trace(apply, sample_params, sample_inputs)  # noqa: SLF001
      analysis = partition_lib._analyse(trace)  # noqa: SLF001
      for k in range(1, len(analysis.layer_order)):
        cut, _, _, _ = partition_lib._boundary_cut(trace, analysis, k)  # noqa: SLF001
        if cut is not None:
          widths.append(partition_lib.flat_width(analysis.live[cut][0].aval))
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
      widths = []  # not a stack of layers the pipeline's analysis follows
    split = tensor_split.analyse(apply, sample_params, sample_inputs, parts)
    return cls(
      param_bytes=sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves),
      flops_per_example=flops // batch,
      dot_flops_per_example=dots // batch,
      boundary_widths=tuple(widths),
      tensor_pairs=tuple(g.reduce_widths[::-1] for g in split.groups),
      tensor_split_flops=split.split_flops,
    )


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One strategy on one mesh, as measured and estimated.

  Attributes:
    name: the registered name.
    strategy: the configured strategy (None for a strategy listed because it
      offers no configuration: an axis no dataclass field takes).
    mesh: axis name -> size.
    peak_bytes: per-device memory of the compiled step (arguments + outputs not
      aliased to them + temporaries), or None if it could not be built.
    state_bytes: per-device bytes of params and optimizer state.
    compute_s, comm_bytes, comm_s, latency_s, time_s: the cost model's terms.
    problem: why the candidate cannot run (empty when it can).
    per_device_state: whether the model keeps state (BatchNorm) that this
      candidate updates per device from its own rows, then averages.
    batch_refused: whether it could not run only because its layout cannot
      split the batch measured (a `BatchSizeError`).
  """

  name: str
  strategy: Strategy
  mesh: dict[str, int]
  peak_bytes: int | None = None
  state_bytes: int | None = None
  compute_s: float = math.inf
  comm_bytes: float = math.inf
  comm_s: float = math.inf
  latency_s: float = math.inf
  time_s: float = math.inf
  problem: str = ""
  per_device_state: bool = False
  batch_refused: bool = False

  @property
  def label(self) -> str:
    extra = ""
    zero = getattr(self.strategy, "zero", None)
    if zero is not None:
      extra = f" zero={zero}"
    activations = getattr(self.strategy, "activations", "recompute")
    if activations != "recompute":
      extra += f" activations={activations}"
    mesh = ", ".join(f"{axis}={size}" for axis, size in self.mesh.items())
    return f"{self.name}{extra} [{mesh}]"


@dataclasses.dataclass(frozen=True)
class Choice:
  """What "auto" chose and why; `str(choice)` is the ranked table."""

  strategy: Strategy
  ranked: tuple[Candidate, ...]
  budget: int | None
  reason: str

  def __str__(self) -> str:
    return format_table(self.ranked, self.budget, self.reason)


def format_table(ranked: Sequence[Candidate], budget: int | None, reason: str) -> str:
  """The ranked candidates as a table, then `reason`.

  A problem already given in full on an earlier row of the same strategy (apart
  from the strategy's repr in it) is said as `same as #k`: a pipeline's refusal is the same under
  each of its activation policies, and can run to many lines' worth of text.

  Args:
    ranked: the candidates, in the order to list them.
    budget: the memory budget in bytes per device, or None.
    reason: the last line (why the first was chosen, or that none was).

  Returns:
    The table's lines, joined.
  """
  shown = "none" if budget is None else format_bytes(budget)
  first_row_saying: dict[tuple[str, str], int] = {}  # (strategy, reason) -> its row
  lines = [f"parstrat auto: {len(ranked)} candidates, memory budget {shown} per device"]
  lines.append(
    f"{'#':>2}  {'candidate':<60} {'peak/device':>12} {'state/device':>12} "
    f"{'compute':>9} {'comm':>11} {'est. step':>10}  note"
  )
  for i, c in enumerate(ranked, 1):
    problem = c.problem
    # (the same apart from the strategy's own repr, which a refusal may begin with; a
    # row points only at one of its own strategy's: a pipeline's not at a hybrid's)
    said = (c.name, problem.replace(repr(c.strategy), "the strategy") if c.strategy else problem)
    if said in first_row_saying:
      problem = f"same as #{first_row_saying[said]}"
    elif problem:
      first_row_saying[said] = i
    if c.problem and c.peak_bytes is None:
      lines.append(
        f"{i:>2}  {c.label:<60} {'-':>12} {'-':>12} {'-':>9} {'-':>11} {'-':>10}  {problem}"
      )
      continue
    lines.append(
      f"{i:>2}  {c.label:<60} {format_bytes(c.peak_bytes):>12} "
      f"{format_bytes(c.state_bytes):>12} {c.compute_s * 1e6:>7.1f}us "
      f"{format_bytes(c.comm_bytes):>11} {c.time_s * 1e6:>8.1f}us  {problem}"
    )
  lines.append(reason)
  return "\n".join(lines)


def enumerate_meshes(axes: Sequence[str], devices: int) -> list[dict[str, int]]:
  """Every way to give `axes` sizes whose product is `devices`.

  With several axes, shapes where fewer than two axes are longer than 1 are
  left out: they are another (single-axis) strategy's candidates.
  """
  divisors = [d for d in range(1, devices + 1) if devices % d == 0]
  shapes = []
  for sizes in itertools.product(divisors, repeat=len(axes)):
    if math.prod(sizes) != devices:
      continue
    if len(axes) > 1 and sum(s > 1 for s in sizes) < 2:
      continue
    shapes.append(dict(zip(axes, sizes, strict=True)))
  return shapes


@dataclasses.dataclass(frozen=True)
class CostModel:
  """The device constants the estimate is made with (documented in the module)."""

  flops_per_second: float = 1e14
  bytes_per_second: float = 1e11
  collective_latency: float = 1e-5

  def estimate(
    self,
    strategy: Strategy,
    mesh: dict[str, int],
    stats: ModelStats,
    batch: int,
    *,
    reductions: int = 1,
    batch_axes: Sequence[str] | None = None,
    optimizer_view: bool = False,
  ) -> dict[str, float]:
    """The cost model's terms (see the module docstring) for `strategy` on `mesh`.

    Args:
      strategy: the candidate (read: `gradient_traffic`, `microbatches`).
      mesh: axis name -> size. "stage" pipelines and "model" divides the
        tensor-parallel groups; the axes in `batch_axes` split the batch.
      stats: the model's `ModelStats`.
      batch: the global batch.
      reductions: how many times per step the gradients cross the batch axes
        (k with gradient accumulation on a plan that reduces in every microstep).
      batch_axes: the mesh axes the batch is split over (the plan's
        `batch_spec`); default: "data" when the mesh has it.
      optimizer_view: whether the optimizer runs on the plan's view of the
        params in the model's layout (`Plan.optimizer_view`): a pipeline's
        gradients and params moved there and the updates back each step.

    Returns:
      `{"compute_s", "comm_bytes", "comm_s", "latency_s", "redundant"}`:
      `redundant` is the number of devices that redo the same work because
      an axis divides nothing (1 when every axis divides the step).
    """
    if batch_axes is None:
      batch_axes = [a for a in ("data",) if a in mesh]
    ways = math.prod(mesh.get(a, 1) for a in batch_axes)
    stages, tensor = mesh.get("stage", 1), mesh.get("model", 1)
    split = stats.tensor_split_flops
    flops = stats.flops_per_example - split + split / tensor  # only split groups divide
    compute = 3 * flops * batch / (ways * stages)
    # Axes that divide no work: every device along them repeats the same step.
    redundant = math.prod(
      size
      for axis, size in mesh.items()
      if axis not in batch_axes and axis != "stage" and not (axis == "model" and split)
    )
    collectives = 0.0
    comm = 0.0
    micro = 1
    if stages > 1:
      micro = getattr(strategy, "microbatches", None) or stages
      # The bubble, and what the backward reruns of the stage forwards (a backward
      # costs two forwards: all of the forward rerun adds a third).
      rerun = stats.rerun_fraction(getattr(strategy, "activations", "recompute"))
      compute *= (micro + stages - 1) / micro * (1 + rerun / 3)
      width = max(stats.boundary_widths, default=0)
      comm += 2 * (batch / ways) * width * 4
      collectives += 2 * (micro + stages - 1)
      if optimizer_view:  # gradients and params to the view, the updates back
        comm += 3 * (stages - 1) / stages * stats.param_bytes / (stages * tensor)
        collectives += 3
    if ways > 1:
      traffic, count = strategy.gradient_traffic
      comm += reductions * traffic * (ways - 1) / ways * stats.param_bytes / (stages * tensor)
      collectives += reductions * count
    if tensor > 1:
      ring = 2 * (tensor - 1) / tensor
      for width_in, width_out in stats.tensor_pairs:  # a stage holds about 1/S of the groups
        comm += ring * (batch / ways) * (width_in + width_out) * 4 / stages
        collectives += (2 if width_in else 1) * micro / stages
    return {
      "compute_s": compute / self.flops_per_second,
      "comm_bytes": comm,
      "comm_s": comm / self.bytes_per_second,
      "latency_s": collectives * self.collective_latency,
      "redundant": redundant,
    }


def measure_memory(
  trainer: Trainer,
  sample_inputs,
  batch: int,
  label_shape=(),
  label_dtype="int32",
  sample_batch: Any = None,
):
  """(peak bytes, state bytes) per device of `trainer`'s compiled step, allocating nothing.

  The step is lowered for a batch of `batch` rows shaped like `sample_batch`
  (any pytree; needed with `model_inputs`), or else like `(inputs, labels)`
  with inputs like `sample_inputs` and labels of `label_shape` and `label_dtype`.
  """
  state = trainer.init_abstract(jax.random.key(0), sample_inputs)
  rows = lambda x: jax.ShapeDtypeStruct((batch, *x.shape[1:]), x.dtype)  # noqa: E731
  if sample_batch is not None:
    abstract_batch = jax.tree.map(rows, sample_batch)
  elif trainer.model_inputs is not None:
    raise ValueError(
      "With model_inputs, 'auto' needs the batch's layout: pass "
      "trainer.init(rng, sample_inputs, sample_batch=...)."
    )
  else:
    labels = jax.ShapeDtypeStruct((batch, *label_shape), label_dtype)
    abstract_batch = (jax.tree.map(rows, sample_inputs), labels)
  compiled = trainer.lower(state, abstract_batch).compile()
  memory = compiled.memory_analysis()
  peak = (
    memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    - memory.alias_size_in_bytes
    + memory.temp_size_in_bytes
  )
  state_bytes = sum(_per_device_bytes(x) for x in jax.tree.leaves((state.params, state.opt_state)))
  return int(peak), int(state_bytes)


def _per_device_bytes(x: jax.ShapeDtypeStruct) -> int:
  shard = x.sharding.shard_shape(x.shape)
  return int(np.prod(shard)) * x.dtype.itemsize


@registry.register("auto")
@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class Auto(Strategy):
  """Chooses a registered strategy and mesh shape when the trainer is initialised.

  `trainer.init` measures every candidate (each registered strategy with mesh
  axes, on each mesh shape over the devices, in each configuration its
  `candidates_for` offers: FSDP's ZeRO stages, a pipeline's activation
  policies "recompute", "dots_saveable" and "save"): the per-device memory of its
  compiled step, from XLA's memory analysis, and an estimated step time from
  the cost model in this module's docstring. Among those within
  `memory_budget` the fastest estimate wins (ties: less memory, then a
  built-in strategy before a registered one of the user's, then name);
  the ranked table and the reason are printed (`verbose`) and kept in
  `trainer.choice`. The trainer then runs the winner as if it had been asked
  for by name.

  Args:
    memory_budget: bytes per device (an int or a size such as "512MiB");
      None: no limit.
    batch_size: the global batch `step` will get (default: the batch size of
      the samples given to `init`, the larger of `sample_inputs` and
      `sample_batch`).
    candidates: registered names to consider (default: every registered
      strategy that declares mesh axes).
    label_shape, label_dtype: the per-example shape and dtype of the labels
      the steps are measured with (default: integer class ids, as the default
      loss takes); set them for a custom `loss_fn`.
    cost_model: the device constants of the estimate.
    verbose: print the ranked table at `init`.
    devices: the devices to lay out over (default: all).
    debug: passed on to every candidate (and so to the one chosen).

  Raises:
    ValueError (at `init`): when no candidate fits the budget; the message
      holds the table.

  Example:
    >>> import parstrat
    >>> parstrat.get("auto", memory_budget="64MiB")
    Auto(memory_budget='64MiB')
  """

  memory_budget: int | str | None = None
  batch_size: int | None = None
  candidates: tuple[str, ...] | None = None
  label_shape: tuple[int, ...] = ()
  label_dtype: str = "int32"
  cost_model: CostModel = CostModel()
  verbose: bool = True
  deferred = True

  def __post_init__(self):
    parse_bytes(self.memory_budget)
    if self.batch_size is not None and (
      isinstance(self.batch_size, bool)
      or not isinstance(self.batch_size, int | np.integer)
      or self.batch_size < 1
    ):
      raise ValueError(f"batch_size must be a positive integer, got {self.batch_size!r}.")
    for name in self.candidates or ():
      if name == "auto":
        raise ValueError("'auto' cannot be its own candidate.")
      registry.lookup(name)

  def make_mesh(self):
    raise ValueError(
      "'auto' chooses its mesh when the trainer is initialised: call "
      "strategy(model, optimizer).init(rng, sample_inputs)."
    )

  def make_plan(self, model, loss_fn, mesh, sample_params, sample_inputs):
    raise ValueError("'auto' has no plan of its own; it runs the strategy it chooses.")

  def resolve(self, trainer: Trainer, sample_inputs) -> Strategy:
    choice = self.choose(
      trainer.model,
      trainer.optimizer,
      sample_inputs,
      loss_fn=trainer.loss_fn,
      model_inputs=trainer.model_inputs,
      precision=trainer.policy,
      accumulate=trainer.accumulate,
      skip_nonfinite=trainer.skip_nonfinite,
      sample_batch=trainer.sample_batch,
    )
    trainer.choice = choice
    if self.verbose:
      print(choice)
    return choice.strategy

  def choose(self, model, optimizer, sample_inputs, **trainer_options: Any) -> Choice:
    """Measures and ranks the candidates for `model`; see the class docstring.

    Args:
      model: an `hk.Transformed` or `hk.TransformedWithState`.
      optimizer: an optax optimizer.
      sample_inputs: example model inputs, a pytree of `[B, ...]` arrays (B,
        or the `sample_batch`'s if larger, is the batch size unless
        `batch_size` is set).
      **trainer_options: `loss_fn`, `model_inputs`, `precision`, `accumulate`,
        as for the trainer, and `sample_batch` as for `init`.

    Returns:
      A `Choice`: the winning strategy, the ranked candidates and the reason.

    Raises:
      ValueError: if no candidate fits `memory_budget` (or none can run).
    """
    measured = self.measure(model, optimizer, sample_inputs, **trainer_options)
    hint = self._small_batch_hint(measured, sample_inputs, trainer_options.get("sample_batch"))
    try:
      choice = rank(measured, self.memory_budget)
    except ValueError as e:
      if not hint:
        raise
      head, _, table = str(e).partition("\n")
      raise ValueError(f"{head[:-1]}; {hint}.\n{table}") from None
    if hint:
      warnings.warn(
        f"{choice.reason}; {hint}", UserWarning, stacklevel=messages.stacklevel_outside()
      )
      choice = dataclasses.replace(choice, reason=f"{choice.reason}; {hint}")
    return choice

  def _measuring_batch(self, sample_inputs: Any, sample_batch: Any) -> int:
    """The batch size the candidates are measured at: `batch_size`, or the samples' larger."""
    rows = [
      int(np.shape(jax.tree.leaves(sample)[0])[0])
      for sample in (sample_inputs, sample_batch)
      if sample is not None and np.ndim(jax.tree.leaves(sample)[0]) > 0
    ]
    return self.batch_size or max(rows, default=1)

  def _small_batch_hint(self, measured, sample_inputs: Any, sample_batch: Any) -> str:
    """What to pass when candidates failed only for the samples' batch size, or ""."""
    split = [c for c in measured if c.batch_refused]
    if self.batch_size is not None or sample_batch is not None or not split:
      return ""  # (measured at a batch given as such: its refusals are the real batch's)
    batch = self._measuring_batch(sample_inputs, sample_batch)
    return (
      f"{len(split)} candidate(s) could not split the {batch} row(s) of the samples given to "
      "init, which are the batch measured: pass Auto(batch_size=...) or init(..., "
      "sample_batch=<a whole batch>)"
    )

  def _check_labels(self, loss_fn, model, abstract_params, abstract_state, sample) -> None:
    """Raises a ValueError if a custom `loss_fn` cannot take the labels auto measures with.

    Without a `sample_batch`, every candidate's step is lowered on labels of
    `label_shape` and `label_dtype`; a loss over other labels (per position,
    one-hot, ...) would fail identically in every candidate.
    """
    # Two rows: a loss that broadcasts wrong labels against [1, ...] outputs still fails.
    inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct((2, *x.shape[1:]), x.dtype), sample)
    labels = jax.ShapeDtypeStruct((2, *self.label_shape), self.label_dtype)
    shape = ", ".join(map(str, ("B", *self.label_shape)))
    apply = outputs_fn(as_stateful(model), abstract_state)
    try:
      jax.eval_shape(lambda p, x, y: loss_fn(apply(p, x), y), abstract_params, inputs, labels)
    except Exception as e:  # noqa: BLE001 - the user's loss failed: say on what, in one line
      first = str(e).splitlines()[0] if str(e) else ""
      raise ValueError(
        f"'auto' measures each candidate's step on labels shaped [{shape}] "
        f"{self.label_dtype} (its label_shape and label_dtype), and the loss_fn fails on them "
        f"({type(e).__name__}: {first}). Pass sample_batch=(inputs, labels) to init, or "
        "Auto(label_shape=..., label_dtype=...)."
      ) from e

  def measure(
    self,
    model,
    optimizer,
    sample_inputs,
    *,
    loss_fn=None,
    model_inputs=None,
    precision: Any = None,
    accumulate: int = 1,
    skip_nonfinite: bool = False,
    sample_batch: Any = None,
  ) -> list[Candidate]:
    """Builds, compiles and estimates every candidate; `rank` then picks one.

    Candidates that cannot run (a mesh the model cannot be cut for, a batch
    that does not split) come back with `problem` saying why.
    """
    devices = available_devices(self.devices)
    batch = self._measuring_batch(sample_inputs, sample_batch)
    sample = jax.tree.map(lambda x: np.zeros((1, *x.shape[1:]), x.dtype), sample_inputs)
    # Traced here outside any mesh. A model whose collectives name an axis some strategy
    # runs it over (a sync BatchNorm's "data") is traced with those axes bound (not
    # otherwise: the binding adds equations to what `ModelStats` counts); each
    # candidate's own `init` refuses what it cannot run.
    host = as_stateful(model)
    try:
      abstract_params, abstract_state = jax.eval_shape(host.init, jax.random.key(0), sample)
    except NameError as e:
      if not is_unbound_axis(e):
        raise
      axes = {
        a for n in registry.available() for a in getattr(registry.lookup(n), "model_axes", ())
      }
      host = bind_axes(host, sorted(axes))
      try:
        abstract_params, abstract_state = jax.eval_shape(host.init, jax.random.key(0), sample)
      except NameError:  # an axis no strategy runs the model over
        raise ValueError(unbound_axis_message(self, e)) from None
    batch_inputs = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((batch, *x.shape[1:]), x.dtype), sample
    )
    model_state = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract_state)
    if loss_fn is not None and model_inputs is None and sample_batch is None:
      self._check_labels(loss_fn, host, abstract_params, abstract_state, sample)
    stats_for = functools.cache(
      lambda parts: ModelStats.of(host, abstract_params, batch_inputs, parts, model_state)
    )
    options = dict(
      loss_fn=loss_fn,
      model_inputs=model_inputs,
      precision=precision,
      accumulate=accumulate,
      skip_nonfinite=skip_nonfinite,
    )
    measured = []
    for name in self.candidates or registry.available():
      cls = registry.lookup(name)
      if getattr(cls, "deferred", False) or not cls.axis_names:
        continue
      offered = False
      for mesh in enumerate_meshes(cls.axis_names, len(devices)):
        for strategy in cls.candidates_for(mesh, devices):
          offered = True
          if self.debug and dataclasses.is_dataclass(strategy):
            strategy = dataclasses.replace(strategy, debug=True)
          candidate = Candidate(name, strategy, mesh)
          try:
            trainer = strategy(model, optimizer, **options)
            peak, state_bytes = measure_memory(
              trainer,
              sample,
              batch,
              label_shape=self.label_shape,
              label_dtype=self.label_dtype,
              sample_batch=sample_batch,
            )
          except Exception as e:  # noqa: BLE001 - reported in the table, not fatal
            # Layout errors (a mesh the model cannot use, a batch that does not
            # split) are expected; the type name keeps anything else visible.
            first = str(e).splitlines()[0] if str(e) else ""
            measured.append(
              dataclasses.replace(
                candidate,
                problem=f"cannot run: {type(e).__name__}: {first}".rstrip(": "),
                batch_refused=isinstance(e, messages.BatchSizeError),
              )
            )
            continue
          plan = trainer.plan
          reduces_once = plan.manual and plan.reduce is not None
          estimate = self.cost_model.estimate(
            strategy,
            mesh,
            stats_for(mesh.get("model", 2)),
            batch,
            reductions=1 if reduces_once else accumulate,
            batch_axes=batch_axes(plan.batch_spec),
            optimizer_view=plan.optimizer_view is not None,
          )
          redundant = estimate.pop("redundant")
          time_s = estimate["compute_s"] + estimate["comm_s"] + estimate["latency_s"]
          problem = ""
          if redundant > 1:
            idle = [a for a in mesh if a not in batch_axes(plan.batch_spec) and a != "stage"]
            problem = (
              f"redundant: {', '.join(map(repr, idle))} splits no work, so {redundant} "
              "devices redo the same step"
            )
          measured.append(
            dataclasses.replace(
              candidate,
              peak_bytes=peak,
              state_bytes=state_bytes,
              time_s=time_s,
              problem=problem,
              # (the model runs per device on its rows: its state, e.g. BatchNorm's
              # statistics, is each device's, averaged; not the whole batch's)
              per_device_state=bool(jax.tree.leaves(abstract_state))
              and plan.manual
              and bool(batch_axes(plan.batch_spec)),
              **estimate,
            )
          )
      missing = [axis for axis in cls.axis_names if axis_field(cls, axis) is None]
      if not offered and missing:  # (listed: a strategy of one's own must not vanish)
        measured.append(
          Candidate(
            name,
            None,
            {},
            problem=f"no configuration: no dataclass field {missing[0]!r} or "
            f"{missing[0] + 's'!r} takes the size of its axis {missing[0]!r}: add one, or "
            "override candidates_for",
          )
        )
    return measured


def batch_axes(batch_spec) -> tuple[str, ...]:
  """The mesh axes a plan's `batch_spec` splits the batch's leading axis over."""
  axes = batch_spec[0] if len(batch_spec) else None
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def _built_in(candidate: Candidate) -> bool:
  """True for a strategy parstrat ships (ties go to it rather than to one of a user's)."""
  if candidate.strategy is None:  # (listed only, never chosen)
    return True
  return type(candidate.strategy).__module__.startswith("parstrat.")


def rank(candidates: Sequence[Candidate], memory_budget: int | str | None) -> Choice:
  """Chooses among measured candidates: the fastest estimate within the budget.

  Ties go to less memory, then to the label, so the choice is a pure function
  of the measurements.

  Raises:
    ValueError: if no candidate fits `memory_budget`; the message holds the table.
  """
  budget = parse_bytes(memory_budget)

  def over(c: Candidate) -> bool:
    return budget is not None and c.peak_bytes > budget

  # A redundant candidate (an axis that divides no work) is listed, never chosen.
  runnable = [c for c in candidates if c.peak_bytes is not None and not c.problem]
  speed = lambda c: (c.time_s, c.peak_bytes, not _built_in(c), c.label)  # noqa: E731
  redundant = sorted((c for c in candidates if c.peak_bytes is not None and c.problem), key=speed)
  fits = sorted((c for c in runnable if not over(c)), key=speed)
  too_big = sorted(
    (
      dataclasses.replace(c, problem=f"over budget by {format_bytes(c.peak_bytes - budget)}")
      for c in runnable
      if over(c)
    ),
    key=lambda c: (c.peak_bytes, c.label),
  )
  failed = sorted((c for c in candidates if c.peak_bytes is None), key=lambda c: c.label)
  table = (*fits, *too_big, *redundant, *failed)
  if not fits and not too_big and not redundant:  # (not a matter of memory)
    first = failed[0] if failed else None
    raise ValueError(
      "No candidate strategy can run this model: no candidate could be built"
      + (f" (the first, {first.label}: {first.problem})" if first else "")
      + ".\n"
      + format_table(table, budget, "nothing chosen")
    )
  if not fits:
    detail = (
      f"the smallest, {too_big[0].label}, needs {format_bytes(too_big[0].peak_bytes)} per device"
      if too_big
      else "every candidate that could be built is redundant"
    )
    raise ValueError(
      f"No strategy fits memory_budget={memory_budget!r} "
      f"({format_bytes(budget) if budget else 'no limit'} per device): {detail}.\n"
      + format_table(table, budget, "nothing chosen")
    )
  winner = fits[0]
  reason = f"chose {winner.label}: the fastest estimated step"
  if budget is None:
    reason += " (no memory budget)"
  else:
    reason += f" of the {len(fits)} candidate(s) within the budget"
  if len(fits) > 1:
    reason += f"; next, {fits[1].label}, is {fits[1].time_s / winner.time_s:.2f}x slower"
  if winner.per_device_state:
    whole = next((c for c in fits if not c.per_device_state), None)
    reason += (
      "; the model's state (BatchNorm's statistics) is then each device's, averaged, not the "
      "whole batch's" + (f" ({whole.label} computes it on the whole batch)" if whole else "")
    )
  fastest = min(runnable, key=speed)
  if over(fastest):
    reason += (
      f"; the fastest overall, {fastest.label}, needs {format_bytes(fastest.peak_bytes)} per device"
    )
  return Choice(winner.strategy, table, budget, reason)
