"""PipelineModelParallel: the model cut into stages, one stage per device."""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from parstrat._src import registry
from parstrat._src.hybrid import Hybrid
from parstrat._src.hybrid import with_activation_candidates
from parstrat._src.pipeline.schedule import Schedule
from parstrat._src.strategy import Plan
from parstrat._src.strategy import Strategy


@registry.register("pipeline")
@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class PipelineModelParallel(Strategy):
  """Pipeline model parallelism over mesh axis "stage".

  The unmodified model is cut into `stages` contiguous stages (balanced by
  parameter count, or at `cuts`, or at `parstrat.pipeline.stage_boundary`
  markers); each device holds only its stage's parameters, and its optimizer
  state (or, for an optimizer that does not act leaf by leaf, such as
  `optax.adamw(mask=...)`, 1/P of every leaf's state in the model's layout:
  see `Plan.optimizer_view`).
  Each step splits the batch into `microbatches` that flow through the stages
  under the `schedule`:

  * "gpipe": all forwards then all backwards (M activations alive per stage);
  * "1f1b": one forward one backward after a warm-up, so at most `stages`
    microbatches of activations are alive per stage;
  * "zb_h1": 1F1B with each backward split into an input-gradient pass and a
    weight-gradient pass, the latter deferred into the bubbles (Qi et al. 2023;
    a third of 1F1B's bubble, each pass recomputes the stage's forward);
  * "interleaved_1f1b": the model cut into `stages * virtual_stages` pieces,
    device s holding pieces s, s + P, ... (Megatron-LM; bubble 1/v of
    1F1B's, more activations alive, v times the messages).

  The devices run in lock-step: they exchange messages (activations on,
  gradients back) every `exchange_every` ticks, and each exchange waits for
  the slowest device. With `exchange_every=1` every pass is followed by one, so
  a 1F1B tick where one device runs a backward lasts a backward on all of them.
  With `exchange_every=2` each device runs up to two passes between exchanges:
  1F1B then takes GPipe's time, (M + P - 1)(F + B), for 2P - 1 activations on
  the first stage instead of P, and interleaved 1F1B gets faster at the same
  memory (`parstrat.pipeline.Schedule.lockstep_time` gives each in forwards).
  So the default is 2 for "interleaved_1f1b" and 1 for the other schedules.

  The training step's ticks run in a `lax.fori_loop` by default. With
  `unroll=True` they are traced as straight-line code: each tick's `lax.switch`
  holds only the passes some device runs in it, its row of the tick table is a
  constant (indexed by the device's stage), and each exchange runs the
  `ppermute`s it needs, with no switch around them. On 8 virtual devices with a
  core each that made ZB-H1 "save" 0.95x as long a step, 1F1B and ZB-H1 0.98x,
  and interleaved at `exchange_every=1` no faster; compiling takes several times
  longer, more so as M grows (see the README's "Unrolled ticks"). The
  forward-only pass (`apply`) keeps its loop.

  This is `Hybrid` with one data replica.

  Args:
    stages: the number of stages P (default 2).
    microbatches: microbatches M per step (default: P). M must divide the batch.
    schedule: "gpipe", "1f1b" (default), "zb_h1", "interleaved_1f1b", or a
      `parstrat.pipeline.Schedule` for `stages` devices (e.g. one read by
      `parstrat.pipeline.from_csv`; `microbatches` defaults to its M).
    virtual_stages: model chunks per device for "interleaved_1f1b" (default 2).
    activations: what each stage keeps from its forward for its backward:
      "recompute" (default: only its input; the backward reruns the forward),
      "save" (every residual of the forward: no rerun, more memory), or a
      `jax.checkpoint_policies` name in between ("dots_saveable",
      "dots_with_no_batch_dims_saveable": keep matmul outputs, rerun the rest;
      "nothing_saveable").
    exchange_every: the ticks (passes) each device runs between two exchanges
      of messages, 1 or more (default: 2 for "interleaved_1f1b", else 1).
    unroll: trace the ticks as straight-line code instead of a loop (default
      False): a faster step, a longer compilation.
    balance: "params" (default) or "flops": what the automatic cut balances.
    cuts: layer indices at which stages 1..P-1 start.
    bubble_value: what idle slots send (tests fill bubbles with NaN).
    devices, debug: see `Strategy`.

  Example:
    >>> import parstrat
    >>> parstrat.get("pipeline", stages=4, microbatches=8, schedule="gpipe")
    PipelineModelParallel(stages=4, microbatches=8, schedule='gpipe')
  """

  stages: int = 2
  microbatches: int | None = None
  schedule: str | Schedule = "1f1b"
  virtual_stages: int | None = None
  activations: str = "recompute"
  exchange_every: int | None = None
  unroll: bool = False
  balance: str = "params"
  cuts: tuple[int, ...] | None = None
  bubble_value: float = 0.0
  axis_names = ("stage",)

  @classmethod
  def candidates_for(cls, axis_sizes, devices=None):
    """Each default configuration under each `residuals.AUTO_CANDIDATES` policy, for "auto"."""
    return with_activation_candidates(super().candidates_for(axis_sizes, devices))

  def as_hybrid(self) -> Hybrid:
    """The equivalent `Hybrid` with one data replica."""
    return Hybrid(
      data=1,
      stages=self.stages,
      microbatches=self.microbatches,
      schedule=self.schedule,
      virtual_stages=self.virtual_stages,
      activations=self.activations,
      exchange_every=self.exchange_every,
      unroll=self.unroll,
      balance=self.balance,
      cuts=self.cuts,
      bubble_value=self.bubble_value,
      devices=self.devices,
      debug=self.debug,
    )

  def make_mesh(self) -> Mesh:
    return self.as_hybrid().make_mesh()

  def make_plan(self, model, loss_fn, mesh, sample_params, sample_inputs) -> Plan:
    return self.as_hybrid().make_plan(model, loss_fn, mesh, sample_params, sample_inputs)
