"""Pipeline schedules as plain data: who does what at every tick.

A schedule is a table `tick -> stage -> action` (idle, forward of microbatch m,
backward of microbatch m). It is built by small pure functions and can be
printed, checked and drawn without any device. One tick is one stage
computation. Devices exchange messages every `exchange_every` ticks (K, 1 by
default): a value sent in the K ticks t .. t + K - 1 of one exchange is usable
from tick t + K on, and the K ticks in between run on each device without
waiting for the others.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import numpy as np


class Action(enum.IntEnum):
  """What a device does in one tick.

  `BACKWARD` computes both gradients of a stage. Zero-bubble schedules split it
  into `BACKWARD_INPUT` (the gradient w.r.t. the stage input, on the critical
  path) and `BACKWARD_WEIGHT` (the gradient w.r.t. the stage's params, which can
  wait). The letters are torch.distributed.pipelining's: F, B, I, W.
  """

  IDLE = 0
  FORWARD = 1
  BACKWARD = 2
  BACKWARD_INPUT = 3
  BACKWARD_WEIGHT = 4

  @property
  def letter(self) -> str:
    return ".FBIW"[self]


#: Each kind of work as messages name it.
_PASS_NAMES = {
  Action.FORWARD: "forward (F)",
  Action.BACKWARD: "backward (B)",
  Action.BACKWARD_INPUT: "input backward (I)",
  Action.BACKWARD_WEIGHT: "weight backward (W)",
}


# (action, microbatch, chunk): `chunk` is which of the device's virtual stages runs
# (0 unless virtual_stages > 1); device s's chunk j is model stage j * P + s.
Op = tuple[Action, int, int]


def num_total_iterations(stages: int, microbatches: int) -> int:
  """Ticks of a forward-only pass: M + P - 1."""
  return microbatches + stages - 1


def theoretical_bubble(stages: int, microbatches: int) -> float:
  """The idle fraction of a flush pipeline: (P - 1) / (M + P - 1)."""
  return (stages - 1) / (microbatches + stages - 1)


def gpipe_order(
  stages: int, microbatches: int, stage: int, virtual_stages: int = 1, exchange_every: int = 1
) -> list[Op]:
  """GPipe: every forward, then every backward."""
  del stages, stage, virtual_stages, exchange_every
  return [(Action.FORWARD, m, 0) for m in range(microbatches)] + [
    (Action.BACKWARD, m, 0) for m in range(microbatches)
  ]


def one_f_one_b_order(
  stages: int, microbatches: int, stage: int, virtual_stages: int = 1, exchange_every: int = 1
) -> list[Op]:
  """1F1B (PipeDream-flush): P-1-s warm-up forwards, then alternate, then drain.

  With `exchange_every=K` > 1 the warm-up is K (P-1-s) forwards: a message then
  takes one exchange (K ticks) per hop, so a microbatch's gradient comes back
  to stage s 2 (P-1-s) exchanges after its forward, and with K = 2 the steady
  state runs one forward and one backward per exchange on every device.
  """
  del virtual_stages
  warmup = min(exchange_every * (stages - 1 - stage), microbatches)
  ops: list[Op] = [(Action.FORWARD, m, 0) for m in range(warmup)]
  for i in range(microbatches - warmup):
    ops += [(Action.FORWARD, warmup + i, 0), (Action.BACKWARD, i, 0)]
  ops += [(Action.BACKWARD, m, 0) for m in range(microbatches - warmup, microbatches)]
  return ops


def zb_h1_order(
  stages: int, microbatches: int, stage: int, virtual_stages: int = 1, exchange_every: int = 1
) -> list[Op]:
  """ZB-H1 (Qi et al. 2023): 1F1B with the backward split, weight passes deferred.

  The forwards and input-gradient passes (I) run in 1F1B order; stage s keeps
  its last s weight passes (W) pending and runs each one after a later I, the
  remaining ones at the end, where they fill the drain bubble. With F, I and W
  one tick each and M >= P this takes 3M + P - 1 ticks: a bubble of
  (P - 1) / (3M + P - 1), a third of 1F1B's, with at most P microbatches
  between their forward and their W on any stage (1F1B's activation count).
  With `exchange_every=K` the warm-up and the pending W passes scale by K, as
  for 1F1B.
  """
  del virtual_stages
  K = exchange_every
  warmup = min(K * (stages - 1 - stage), microbatches)
  ops: list[Op] = [(Action.FORWARD, m, 0) for m in range(warmup)]
  pending: list[int] = []

  def input_grad(m: int) -> None:
    ops.append((Action.BACKWARD_INPUT, m, 0))
    pending.append(m)
    if len(pending) > K * stage:
      ops.append((Action.BACKWARD_WEIGHT, pending.pop(0), 0))

  for i in range(microbatches - warmup):
    ops.append((Action.FORWARD, warmup + i, 0))
    input_grad(i)
  for m in range(microbatches - warmup, microbatches):
    input_grad(m)
  return ops + [(Action.BACKWARD_WEIGHT, m, 0) for m in pending]


def interleaved_1f1b_order(
  stages: int, microbatches: int, stage: int, virtual_stages: int = 2, exchange_every: int = 1
) -> list[Op]:
  """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): v chunks per device.

  The model is cut into P * v stages; device s holds stages s, s + P, ...
  (its chunks 0..v-1). Microbatches go through in groups of P: a device runs
  the group's forwards on chunk 0, then chunk 1, ..., and the backwards with
  the chunks reversed. It warms up with 2 (P - 1 - s) + (v - 1) P forwards and
  then alternates one forward, one backward. With M a multiple of P this takes
  2 v M + 2 (P - 1) ticks of one chunk each: a bubble of (P - 1) / (v M + P - 1),
  1/v of 1F1B's, for more activations alive at once. The order does not
  depend on `exchange_every`: with K = 2 a device runs one forward and one
  backward chunk per exchange, at the same activation count.

  Raises:
    ValueError: if M is not a multiple of P.
  """
  P, v = stages, virtual_stages
  if microbatches % P:
    raise ValueError(
      f"interleaved_1f1b needs microbatches to be a multiple of stages, got "
      f"microbatches={microbatches} with stages={P}."
    )
  n = v * microbatches

  def forward(k: int) -> Op:
    return (Action.FORWARD, (k // (P * v)) * P + k % P, (k // P) % v)

  def backward(k: int) -> Op:
    return (Action.BACKWARD, (k // (P * v)) * P + k % P, v - 1 - (k // P) % v)

  del exchange_every
  warmup = min(n, 2 * (P - 1 - stage) + (v - 1) * P)
  ops = [forward(k) for k in range(warmup)]
  for i in range(n - warmup):
    ops += [forward(warmup + i), backward(i)]
  return ops + [backward(k) for k in range(n - warmup, n)]


ORDERS: dict[str, Callable[[int, int, int, int], list[Op]]] = {
  "gpipe": gpipe_order,
  "1f1b": one_f_one_b_order,
  "zb_h1": zb_h1_order,
  "interleaved_1f1b": interleaved_1f1b_order,
}


class Theory(NamedTuple):
  """The idle share a schedule's paper gives; one tick is one F, B, I or W of one chunk.

  Attributes:
    formula: the formula, in words ("(P-1)/(M+P-1)").
    bubble: its value for (P, M, v).
    for_m_at_least_p: whether it holds only for M >= P (ZB-H1: with fewer
      microbatches the deferred W passes cannot fill the drain).
  """

  formula: str
  bubble: Callable[[int, int, int], float]
  for_m_at_least_p: bool = False

  def holds(self, stages: int, microbatches: int) -> bool:
    return microbatches >= stages or not self.for_m_at_least_p


THEORY: dict[str, Theory] = {
  "gpipe": Theory("(P-1)/(M+P-1)", lambda P, M, v: theoretical_bubble(P, M)),
  "1f1b": Theory("(P-1)/(M+P-1)", lambda P, M, v: theoretical_bubble(P, M)),
  "zb_h1": Theory("(P-1)/(3M+P-1)", lambda P, M, v: (P - 1) / (3 * M + P - 1), True),
  "interleaved_1f1b": Theory("(P-1)/(vM+P-1)", lambda P, M, v: (P - 1) / (v * M + P - 1)),
}

#: What each pass costs on the engine, in forwards of one stage (a backward
#: costs about two forwards, and B and I first rerun the forward; W runs only the
#: weight-gradient products, from what I handed it: `backward_split`).
RECOMPUTE_COST = {
  Action.FORWARD: 1.0,
  Action.BACKWARD: 3.0,
  Action.BACKWARD_INPUT: 2.0,
  Action.BACKWARD_WEIGHT: 1.0,
}

#: The same with activations="save": no pass reruns the forward (I and W each
#: cost about one forward: one of the two products of every matmul's backward).
SAVED_COST = {
  Action.FORWARD: 1.0,
  Action.BACKWARD: 2.0,
  Action.BACKWARD_INPUT: 1.0,
  Action.BACKWARD_WEIGHT: 1.0,
}

#: Pass costs by `activations` name (for `Schedule.lockstep_time`).
PASS_COSTS = {"recompute": RECOMPUTE_COST, "save": SAVED_COST}


def pass_costs(cost: dict[Action, float] | str | None) -> dict[Action, float]:
  """`cost` itself, or the `PASS_COSTS` of a name ("recompute" for None).

  Raises:
    ValueError: for a name that is not in `PASS_COSTS`.
  """
  if isinstance(cost, dict):
    return cost
  name = "recompute" if cost is None else cost
  if name not in PASS_COSTS:
    raise ValueError(f"Unknown pass costs {cost!r}; give a dict or one of {sorted(PASS_COSTS)}.")
  return PASS_COSTS[name]


#: The virtual stages each schedule uses when none are given.
DEFAULT_VIRTUAL_STAGES = {"interleaved_1f1b": 2}


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Schedule:
  """A pipeline schedule and the buffer slots it needs.

  Model stage g (of G = P * v) runs on device g % P as its chunk g // P.
  Schedules compare (and hash) by identity, so a strategy can hold one.

  Attributes:
    name: "gpipe", "1f1b", "zb_h1", "interleaved_1f1b", or an imported name.
    stages: P, the devices along the pipeline.
    microbatches: M.
    action: `[T, P]` int array of `Action` values.
    microbatch: `[T, P]` microbatch of each action (-1 when idle).
    act_slot: `[T, P]` stash slot holding the input activation the action reads
      (-1 for model stage 0, which reads its microbatch from the batch).
    grad_slot: `[T, P]` slot holding the incoming gradient a backward (B, I or
      W) reads (-1 for the last model stage, whose gradient starts at the loss).
    recv_act_slot: `[T, P]` slot where the activation arriving after tick t is
      stored (-1: nothing arrives).
    recv_grad_slot: `[T, P]` likewise for arriving gradients.
    num_act_slots: stash slots per device (activations alive at once).
    num_grad_slots: gradient slots per device.
    virtual_stages: v, the chunks each device holds (1 but for interleaving).
    chunk: `[T, P]` the chunk each action runs (0 when idle).
    exchange_every: K, the ticks between two message exchanges (T is a
      multiple of it). Messages sent in ticks k K .. k K + K - 1 arrive after
      the last of them (the receive slots sit in that tick's row); a device
      runs the K ticks in between without waiting for the others.
  """

  name: str
  stages: int
  microbatches: int
  action: np.ndarray
  microbatch: np.ndarray
  act_slot: np.ndarray
  grad_slot: np.ndarray
  recv_act_slot: np.ndarray
  recv_grad_slot: np.ndarray
  num_act_slots: int
  num_grad_slots: int
  virtual_stages: int
  chunk: np.ndarray
  exchange_every: int = 1

  @property
  def num_ticks(self) -> int:
    return self.action.shape[0]

  @property
  def num_exchanges(self) -> int:
    """T / K: how often the devices exchange messages (and wait for each other)."""
    return self.num_ticks // self.exchange_every

  @property
  def model_stages(self) -> int:
    """G = P * v, the pieces the model is cut into."""
    return self.stages * self.virtual_stages

  @property
  def model_stage(self) -> np.ndarray:
    """`[T, P]` the model stage each action runs (-1 when idle)."""
    g = self.chunk * self.stages + np.arange(self.stages)[None, :]
    return np.where(self.action == Action.IDLE, -1, g)

  def bubble_fraction(self) -> float:
    """The measured fraction of (tick, device) slots left idle."""
    return float(np.mean(self.action == Action.IDLE))

  def _is_built(self) -> bool:
    """Whether this is the table `build_schedule` makes for its name and sizes."""
    if self.name not in THEORY:
      return False
    try:
      built = build_schedule(
        self.name,
        self.stages,
        self.microbatches,
        virtual_stages=self.virtual_stages,
        exchange_every=self.exchange_every,
      )
    except ValueError:
      return False
    return all(
      np.array_equal(getattr(built, x), getattr(self, x)) for x in ("action", "microbatch", "chunk")
    )

  def theoretical_bubble(self) -> float | None:
    """The idle share the schedule's paper gives (`THEORY`).

    None for a table whose passes `build_schedule` did not lay out (imported,
    or edited, even under a built-in name; the slots are not compared), and for
    sizes the formula does not cover (ZB-H1's holds for M >= P).
    """
    theory = THEORY.get(self.name)
    if not (self._is_built() and theory.holds(self.stages, self.microbatches)):
      return None
    return theory.bubble(self.stages, self.microbatches, self.virtual_stages)

  def theory_text(self) -> str:
    """E.g. "theory (P-1)/(M+P-1) = 0.273", or why there is none."""
    if not self._is_built():
      return "no theory for an imported or edited schedule"
    theory = THEORY[self.name]
    if not theory.holds(self.stages, self.microbatches):
      return f"theory {theory.formula} holds for M >= P only"
    value = theory.bubble(self.stages, self.microbatches, self.virtual_stages)
    return f"theory {theory.formula} = {value:.3f}"

  def bubble_text(self) -> str:
    """E.g. "bubble 0.273 (theory (P-1)/(M+P-1) = 0.273)".

    With `exchange_every` > 1 the tick table's idle share also counts the ticks a
    device waits for the exchange, so the lock-step bubbles (`lockstep_bubble`,
    recomputing and saving activations) come with it.
    """
    text = f"bubble {self.bubble_fraction():.3f}"
    if self.exchange_every > 1:
      text += (
        f" of the ticks, {self.lockstep_bubble('recompute'):.3f} / "
        f"{self.lockstep_bubble('save'):.3f} lock-step (recomputing / saving)"
      )
    return f"{text} ({self.theory_text()})"

  def max_live_activations(self) -> list[int]:
    """Per device, the most (chunk, microbatch) pairs whose forward ran and whose
    last backward pass (B, or W after I) has not."""
    live = []
    for s in range(self.stages):
      last: dict[tuple[int, int], int] = {}
      for t in range(self.num_ticks):
        if self.action[t, s] in _BACKWARDS:
          last[(int(self.chunk[t, s]), int(self.microbatch[t, s]))] = t
      count = peak = 0
      for t in range(self.num_ticks):
        key = (int(self.chunk[t, s]), int(self.microbatch[t, s]))
        if self.action[t, s] == Action.FORWARD:
          count += 1
        elif self.action[t, s] in _BACKWARDS and last[key] == t:
          count -= 1
        peak = max(peak, count)
      live.append(peak)
    return live

  def lockstep_time(self, cost: dict[Action, float] | str | None = "recompute") -> float:
    """The step's length when the devices wait for each other at every exchange.

    The engine runs in lock-step: each exchange of messages waits for every
    device, so with K = 1 a tick where one device runs a backward and the
    others forwards costs a backward. With `cost` per pass, in forwards of one
    stage (a dict, or "recompute" or "save" for `PASS_COSTS`: the engine
    reruns the forward in every backward pass unless activations="save"), this
    is the sum over exchanges of the largest per-device sum of the passes run
    since the previous exchange. A chunk of an interleaved schedule counts 1/v
    of its cost (it is 1/v of the model).

    Example:
      >>> from parstrat import pipeline
      >>> pipeline.build_schedule("gpipe", 4, 8).lockstep_time("save")  # 11 F + 11 B
      33.0
      >>> pipeline.build_schedule("1f1b", 4, 8).lockstep_time("save")
      40.0
      >>> pipeline.build_schedule("1f1b", 4, 8, exchange_every=2).lockstep_time("save")
      33.0
    """
    cost = pass_costs(cost)
    table = np.vectorize(lambda a: 0.0 if a == Action.IDLE else cost[Action(a)])(self.action)
    if not table.size:
      return 0.0
    per_exchange = table.reshape(self.num_exchanges, self.exchange_every, self.stages).sum(1)
    return float(per_exchange.max(axis=1).sum()) / self.virtual_stages

  def lockstep_bubble(self, cost: dict[Action, float] | str | None = "recompute") -> float:
    """The idle share of `lockstep_time`: 1 - (work per device) / (lock-step time)."""
    cost = pass_costs(cost)
    work = sum(cost[Action(int(a))] for a in self.action.flat if a != Action.IDLE)
    return 1.0 - work / self.stages / self.virtual_stages / self.lockstep_time(cost)

  def messages(self) -> list[frozenset[tuple[int, int, str]]]:
    """Per exchange, each message a device keeps: (sender, receiver, kind).

    kind is "activation" (from device s - 1 to s) or "gradient" (from s + 1 to
    s); the ends wrap when v > 1. At K = 1 a device sends one message per
    tick, and every GPipe or 1F1B exchange moves each device's message to one
    neighbour at most, each device receiving one at most: one permutation of
    the devices (see `engine.exchange_plan`).

    Returns:
      One set per exchange (T / K of them), empty where no device keeps anything.

    Example:
      >>> from parstrat._src.pipeline import schedule
      >>> messages = schedule.build_schedule("1f1b", 2, 2).messages()
      >>> sorted(messages[0])  # after tick 0: device 0's F0 goes on to device 1
      [(0, 1, 'activation')]
      >>> sorted(messages[2])  # after tick 2: device 1's B0 goes back to device 0
      [(1, 0, 'gradient')]
    """
    P, K = self.stages, self.exchange_every
    out = []
    for last in range(K - 1, self.num_ticks, K):
      act = [((s - 1) % P, s, "activation") for s in range(P) if self.recv_act_slot[last, s] >= 0]
      grad = [((s + 1) % P, s, "gradient") for s in range(P) if self.recv_grad_slot[last, s] >= 0]
      out.append(frozenset(act + grad))
    return out

  def residual_slots(self) -> tuple[np.ndarray, int]:
    """Slots for what a forward keeps for its backward passes (activations="save").

    Returns:
      `([T, P] slot each action writes (F) or reads (B, I, W), -1 when idle;
      slots per device)`: (stage, microbatch) holds its slot from its forward to
      its last backward pass.
    """
    return self._slots(self.action != Action.IDLE)

  def handoff_slots(self) -> tuple[np.ndarray, int]:
    """Slots for what an input-gradient pass (I) hands to its weight-gradient pass (W).

    Returns:
      `([T, P] slot each I writes and each W reads, -1 elsewhere; slots per
      device)`: (stage, microbatch) holds its slot from its I to its W pass.
    """
    split = (self.action == Action.BACKWARD_INPUT) | (self.action == Action.BACKWARD_WEIGHT)
    return self._slots(split)

  def _slots(self, used: np.ndarray) -> tuple[np.ndarray, int]:
    """Per device, a slot for each (chunk, microbatch) from its first to its last `used` tick."""
    slot = np.full(self.action.shape, -1, np.int32)
    most = 1
    for s in range(self.stages):
      ticks: dict[tuple[int, int], list[int]] = {}
      for t in np.flatnonzero(used[:, s]):
        ticks.setdefault((int(self.chunk[t, s]), int(self.microbatch[t, s])), []).append(int(t))
      slots, n = _allocate({key: (min(ts), max(ts)) for key, ts in ticks.items()})
      most = max(most, n)
      for key, ts in ticks.items():
        slot[ts, s] = slots[key]
    return slot, most

  def cell(self, t: int, s: int) -> str:
    """One action as text: "F3" (v = 1), or torch's "5F3" (model stage first) when v > 1."""
    a = Action(int(self.action[t, s]))
    if a == Action.IDLE:
      return "."
    m = int(self.microbatch[t, s])
    if self.virtual_stages == 1:
      return f"{a.letter}{m}"
    return f"{int(self.chunk[t, s]) * self.stages + s}{a.letter}{m}"

  def row_label(self, s: int) -> str:
    """Row s's name: "stage s" (v = 1: device s runs stage s), else "device s" (torch's rank)."""
    return f"stage {s}" if self.virtual_stages == 1 else f"device {s}"

  def table(self) -> str:
    """The schedule as text: one row per device, one column per tick."""
    cells = [[self.cell(t, s) for t in range(self.num_ticks)] for s in range(self.stages)]
    width = max(2, *(len(c) for row in cells for c in row))
    return "\n".join(
      f"{self.row_label(s)}: " + " ".join(c.rjust(width) for c in row)
      for s, row in enumerate(cells)
    )

  def __repr__(self) -> str:
    every = f", exchange_every={self.exchange_every}" if self.exchange_every > 1 else ""
    return (
      f"Schedule({self.name!r}, stages={self.stages}, microbatches={self.microbatches}, "
      f"virtual_stages={self.virtual_stages}{every}, ticks={self.num_ticks})"
    )

  def __str__(self) -> str:
    shape = (
      f"{self.stages} devices x {self.virtual_stages} virtual stages"
      if self.virtual_stages > 1
      else f"{self.stages} stages"
    )
    every = (
      f" ({self.num_exchanges} exchanges, one every {self.exchange_every})"
      if self.exchange_every > 1
      else ""
    )
    return (
      f"{self.name} schedule, {shape} x {self.microbatches} microbatches, "
      f"{self.num_ticks} ticks{every}, {self.bubble_text()}\n{self.table()}"
    )


_BACKWARDS = (Action.BACKWARD, Action.BACKWARD_INPUT, Action.BACKWARD_WEIGHT)
# The dependency class of an action: B and I both produce the input gradient.
_KIND = {
  Action.FORWARD: "F",
  Action.BACKWARD: "B",
  Action.BACKWARD_INPUT: "B",
  Action.BACKWARD_WEIGHT: "W",
}


def _deps(kind: str, g: int, m: int, model_stages: int) -> list[tuple[str, int, int]]:
  """What must have run (at an earlier tick) before `kind` of model stage g, microbatch m."""
  if kind == "F":
    return [("F", g - 1, m)] if g > 0 else []
  if kind == "B":
    return [("F", g, m)] + ([("B", g + 1, m)] if g < model_stages - 1 else [])
  return [("B", g, m)]


def sends(kind: Action, g: int, model_stages: int) -> tuple[bool, bool]:
  """Whether a pass of model stage g sends (an activation on, a gradient back)."""
  activation = kind == Action.FORWARD and g < model_stages - 1
  gradient = kind in (Action.BACKWARD, Action.BACKWARD_INPUT) and g > 0
  return activation, gradient


def _simulate(
  stages: int, virtual_stages: int, orders: Sequence[Sequence[Op]], exchange_every: int = 1
) -> list[list[Op | None]]:
  """Runs each device's op list as early as its dependencies allow.

  Between two exchanges (K = `exchange_every` ticks) a device runs its next
  ops in order while each one's inputs are there: what other stages sent
  arrives at an exchange, what the device itself computed is there at once.
  It sends at most one activation and one gradient per exchange (one message
  each way), and stops at the first op that cannot run.
  """
  G, K = stages * virtual_stages, exchange_every
  done: dict[tuple[str, int, int], int] = {}  # (kind, g, m) -> exchange
  pos = [0] * stages
  ticks: list[list[Op | None]] = []
  total = sum(len(o) for o in orders)
  while sum(pos) < total:
    r = len(ticks) // K
    rows: list[list[Op | None]] = [[None] * stages for _ in range(K)]
    for s in range(stages):
      local: set[tuple[str, int, int]] = set()
      sent = [False, False]
      for k in range(K):
        if pos[s] == len(orders[s]):
          break
        kind, m, chunk = orders[s][pos[s]]
        g = chunk * stages + s
        # Another stage's output arrives at an exchange: it is in `done` (earlier
        # exchanges only). Stage g's own passes are usable at once.
        ready = all(d in done or (d[1] == g and d in local) for d in _deps(_KIND[kind], g, m, G))
        out = sends(kind, g, G)
        if not ready or any(a and b for a, b in zip(out, sent, strict=True)):
          break
        sent = [a or b for a, b in zip(out, sent, strict=True)]
        local.add((_KIND[kind], g, m))
        rows[k][s] = orders[s][pos[s]]
        pos[s] += 1
    if all(op is None for row in rows for op in row):
      waiting = ", ".join(
        f"device {s} waits to run {orders[s][pos[s]][2] * stages + s}"
        f"{Action(orders[s][pos[s]][0]).letter}{orders[s][pos[s]][1]}"
        for s in range(stages)
        if pos[s] < len(orders[s])
      )
      raise ValueError(
        f"The schedule deadlocks at tick {len(ticks)}: no stage can proceed ({waiting})."
      )
    for row in rows:
      for s, op in enumerate(row):
        if op is not None:
          done[(_KIND[op[0]], op[2] * stages + s, op[1])] = r
    ticks += rows
  return ticks


def _allocate(intervals: dict[Any, tuple[int, int]]) -> tuple[dict[Any, int], int]:
  """Greedy interval colouring: key -> slot, with inclusive tick intervals."""
  slot_of: dict[Any, int] = {}
  free_at: list[int] = []  # per slot, the first tick it is free again
  for key, (start, end) in sorted(intervals.items(), key=lambda kv: kv[1]):
    for slot, free in enumerate(free_at):
      if free <= start:
        slot_of[key], free_at[slot] = slot, end + 1
        break
    else:
      slot_of[key] = len(free_at)
      free_at.append(end + 1)
  return slot_of, len(free_at)


def _check_positive(what: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{what} must be a positive integer, got {value!r}.")


def resolve_virtual_stages(name: str, virtual_stages: int | None) -> int:
  """Checks a schedule name and its virtual stages; returns v after the default.

  Raises:
    ValueError: for an unknown name, a non-positive v, or v > 1 with a
      schedule that runs one chunk per device.
  """
  if name not in ORDERS:
    raise ValueError(f"Unknown schedule {name!r}; choose one of {sorted(ORDERS)}.")
  v = DEFAULT_VIRTUAL_STAGES.get(name, 1) if virtual_stages is None else virtual_stages
  _check_positive("virtual_stages", v)
  if v > 1 and name != "interleaved_1f1b":
    raise ValueError(
      f"virtual_stages={v} needs schedule 'interleaved_1f1b'; {name!r} runs one chunk per stage."
    )
  return v


def build_schedule(
  name: str,
  stages: int,
  microbatches: int,
  *,
  virtual_stages: int | None = None,
  exchange_every: int = 1,
) -> Schedule:
  """Builds the named schedule's table and its buffer slots.

  Args:
    name: "gpipe", "1f1b", "zb_h1" (zero bubble, backward split into I and W)
      or "interleaved_1f1b" (virtual stages).
    stages: P >= 1, the devices along the pipeline.
    microbatches: M >= 1 (a multiple of P for "interleaved_1f1b").
    virtual_stages: v, the model chunks per device: 2 by default for
      "interleaved_1f1b", and 1 (the only choice) for the others.
    exchange_every: K, the ticks (passes) each device may run between two
      exchanges of messages. With 1 every pass ends with one, and the devices
      wait for the slowest pass of each tick. With 2, 1F1B's steady state runs
      one forward and one backward per exchange: it takes GPipe's lock-step
      time, (M + P - 1) (F + B), for 2 P - 1 activations on the first stage
      instead of P (`Schedule.lockstep_time`). Default 1, the papers' tables;
      `PipelineModelParallel` and `Hybrid` given a schedule's name run
      "interleaved_1f1b" at 2 unless told otherwise, and a `Schedule` passed to
      them at its own K.

  Returns:
    The `Schedule`, checked by `check_schedule`.

  Raises:
    ValueError: for an unknown name, non-positive sizes, or sizes the schedule
      cannot run.

  Example:
    >>> from parstrat import pipeline
    >>> s = pipeline.build_schedule("1f1b", stages=2, microbatches=3)
    >>> print(s.table())
    stage 0: F0 F1  . B0 F2 B1  . B2
    stage 1:  . F0 B0 F1 B1 F2 B2  .
    >>> print(pipeline.build_schedule("zb_h1", stages=2, microbatches=2).table())
    stage 0: F0 F1  . I0 W0 I1 W1
    stage 1:  . F0 I0 F1 I1 W0 W1
    >>> s = pipeline.build_schedule("1f1b", stages=2, microbatches=3, exchange_every=2)
    >>> print(s.table())  # exchanges after ticks 1, 3, 5, 7
    stage 0: F0  . F1  . F2 B0 B1  . B2  .
    stage 1:  .  . F0 B0 F1 B1 F2 B2  .  .
  """
  v = resolve_virtual_stages(name, virtual_stages)
  _check_positive("stages", stages)
  _check_positive("microbatches", microbatches)
  _check_positive("exchange_every", exchange_every)
  orders = [ORDERS[name](stages, microbatches, s, v, exchange_every) for s in range(stages)]
  ticks = _simulate(stages, v, orders, exchange_every)
  return schedule_from_ticks(name, stages, microbatches, v, ticks, exchange_every=exchange_every)


def schedule_from_ticks(
  name: str,
  stages: int,
  microbatches: int,
  virtual_stages: int,
  ticks: Sequence[Sequence[Op | None]],
  *,
  exchange_every: int = 1,
) -> Schedule:
  """The `Schedule` of an explicit tick table, with its buffer slots allocated.

  Args:
    name: the schedule's name.
    stages, microbatches, virtual_stages: P, M and v.
    ticks: per tick, per device, an `Op` or None (idle); padded with idle
      ticks to a multiple of `exchange_every`.
    exchange_every: K, the ticks between two exchanges of messages.

  Returns:
    The checked `Schedule`.

  Raises:
    ValueError: if the table misses an action or breaks a dependency (the
      message names the first one).
  """
  P, M, v, K = stages, microbatches, virtual_stages, exchange_every
  G = P * v
  ticks = [*ticks, *([None] * P for _ in range(-len(ticks) % K))]
  T = len(ticks)
  action = np.zeros((T, P), np.int32)
  microbatch = np.full((T, P), -1, np.int32)
  chunk = np.zeros((T, P), np.int32)
  when: dict[tuple[str, int, int], int] = {}
  uses: dict[tuple[int, int], list[int]] = {}  # (g, m) -> the ticks reading its input
  for t, row in enumerate(ticks):
    if len(row) != P:
      raise ValueError(f"Tick {t} has {len(row)} entries for {P} stages.")
    for s, op in enumerate(row):
      if op is None:
        continue
      kind, m, j = op
      action[t, s], microbatch[t, s], chunk[t, s] = kind, m, j
      g = j * P + s
      when.setdefault((_KIND[Action(kind)], g, m), t)
      uses.setdefault((g, m), []).append(t)
  partial = Schedule(
    name,
    P,
    M,
    action,
    microbatch,
    *(np.full((T, P), -1, np.int32) for _ in range(4)),
    1,
    1,
    v,
    chunk,
    K,
  )
  try:
    _check_actions(partial)
  except AssertionError as e:
    raise ValueError(str(e)) from None

  act_slot, grad_slot, recv_act_slot, recv_grad_slot = (
    np.full((T, P), -1, np.int32) for _ in range(4)
  )
  num_act = num_grad = 1

  def arrival(t: int) -> int:
    """The tick after which a message sent at tick t arrives: its exchange's last."""
    return t - t % K + K - 1

  for s in range(P):
    mine = [(g, m) for g in range(s, G, P) for m in range(M)]
    # Activations arrive from model stage g-1 and live until the last backward pass.
    sent = {(g, m): arrival(when[("F", g - 1, m)]) for g, m in mine if g > 0}
    slots, n = _allocate({key: (t + 1, max(uses[key])) for key, t in sent.items()})
    num_act = max(num_act, n)
    for (g, m), slot in slots.items():
      recv_act_slot[sent[(g, m)], s] = slot
      act_slot[uses[(g, m)], s] = slot
    # Gradients arrive from model stage g+1 and live until the last backward pass.
    sent = {(g, m): arrival(when[("B", g + 1, m)]) for g, m in mine if g < G - 1}
    slots, n = _allocate({key: (t + 1, max(uses[key])) for key, t in sent.items()})
    num_grad = max(num_grad, n)
    for (g, m), slot in slots.items():
      recv_grad_slot[sent[(g, m)], s] = slot
      backward_ticks = [t for t in uses[(g, m)] if action[t, s] != Action.FORWARD]
      grad_slot[backward_ticks, s] = slot
  schedule = dataclasses.replace(
    partial,
    act_slot=act_slot,
    grad_slot=grad_slot,
    recv_act_slot=recv_act_slot,
    recv_grad_slot=recv_grad_slot,
    num_act_slots=num_act,
    num_grad_slots=num_grad,
  )
  try:
    check_schedule(schedule)
  except AssertionError as e:
    raise ValueError(str(e)) from None
  return schedule


def _check_tables(schedule: Schedule) -> None:
  """The sizes, the tables' shapes and dtypes, and every slot within its buffer."""
  for what in (
    "stages",
    "microbatches",
    "virtual_stages",
    "exchange_every",
    *_SLOT_BUFFERS.values(),
  ):
    size = getattr(schedule, what)
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
      raise AssertionError(f"Schedule.{what} must be a positive integer, got {size!r}")
  P, T = schedule.stages, schedule.num_ticks
  for what in ("action", "microbatch", "chunk", *_SLOT_BUFFERS):
    table = getattr(schedule, what)
    shape = np.shape(table)
    if shape != (T, P):
      raise AssertionError(f"Schedule.{what} has shape {shape}, not (ticks, stages) = {(T, P)}")
    if not np.issubdtype(np.asarray(table).dtype, np.integer):
      raise AssertionError(
        f"Schedule.{what} must hold integers, got dtype {np.asarray(table).dtype}"
      )
  for what, buffer in _SLOT_BUFFERS.items():
    slots, size = np.asarray(getattr(schedule, what)), getattr(schedule, buffer)
    bad = np.argwhere((slots < -1) | (slots >= size))
    if len(bad):
      t, s = (int(x) for x in bad[0])
      raise AssertionError(
        f"tick {t}, stage {s}: Schedule.{what} is {int(slots[t, s])}, outside the "
        f"{buffer}={size} slots (-1 for none)"
      )


#: Each slot table and the buffer it indexes.
_SLOT_BUFFERS = {
  "act_slot": "num_act_slots",
  "recv_act_slot": "num_act_slots",
  "grad_slot": "num_grad_slots",
  "recv_grad_slot": "num_grad_slots",
}


def _check_actions(schedule: Schedule) -> dict[tuple[int, int, int], int]:
  """The dependency half of `check_schedule`; returns (action, g, m) -> tick."""
  P, M, G = schedule.stages, schedule.microbatches, schedule.model_stages
  K = schedule.exchange_every
  if not (K >= 1 and schedule.num_ticks % K == 0):
    raise AssertionError(f"{schedule.num_ticks} ticks are not whole exchanges of {K} ticks")

  def where(t: int) -> str:
    return f" (it arrives after tick {t - t % K + K - 1})" if K > 1 else ""

  when: dict[tuple[int, int, int], int] = {}
  for t in range(schedule.num_ticks):
    for s in range(P):
      a, m, j = (int(x[t, s]) for x in (schedule.action, schedule.microbatch, schedule.chunk))
      if a == Action.IDLE:
        continue
      if a not in _KIND:
        raise AssertionError(f"tick {t}, stage {s}: unknown action {a}")
      if not (0 <= m < M):
        raise AssertionError(f"tick {t}, stage {s}: microbatch {m} is outside 0..{M - 1}")
      if not (0 <= j < schedule.virtual_stages):
        raise AssertionError(f"tick {t}, stage {s}: chunk {j} out of range")
      key = (a, j * P + s, m)
      if key in when:
        raise AssertionError(
          f"stage {j * P + s} runs the {_PASS_NAMES[a]} of microbatch {m} twice "
          f"(ticks {when.get(key)} and {t})"
        )
      when[key] = t
  F, B, IN, W = (Action.FORWARD, Action.BACKWARD, Action.BACKWARD_INPUT, Action.BACKWARD_WEIGHT)
  split: dict[tuple[int, int], bool] = {}
  for g in range(G):  # first: every action is there
    for m in range(M):
      if (F, g, m) not in when:
        raise AssertionError(f"stage {g} never runs the forward (F) of microbatch {m}")
      split[(g, m)] = (IN, g, m) in when or (W, g, m) in when
      for a in (IN, W) if split[(g, m)] else (B,):
        if (a, g, m) not in when:
          raise AssertionError(f"stage {g} never runs the {_PASS_NAMES[a]} of microbatch {m}")
      if split[(g, m)] and (B, g, m) in when:
        raise AssertionError(f"stage {g} runs both B and I/W of microbatch {m}")
  for g in range(G):  # then: each after what it needs
    for m in range(M):
      f, b = when[(F, g, m)], when[(IN if split[(g, m)] else B, g, m)]
      if f >= b:
        raise AssertionError(
          f"stage {g} runs the backward of microbatch {m} at tick {b}, not after its forward "
          f"(tick {f})"
        )
      if split[(g, m)]:
        w = when[(W, g, m)]
        if b >= w:
          raise AssertionError(
            f"stage {g} runs the weight backward (W) of microbatch {m} at tick {w}, not after "
            f"its input backward (I, tick {b})"
          )
      # What another stage sent is there after the exchange that follows it.
      if g > 0:
        prev = when[(F, g - 1, m)]
        if prev // K >= f // K:
          raise AssertionError(
            f"stage {g} runs the forward of microbatch {m} at tick {f}, but needs stage "
            f"{g - 1}'s output, computed at tick {prev}" + where(prev) + ": it must come later"
          )
      if g < G - 1:
        nxt = when[(IN if split[(g + 1, m)] else B, g + 1, m)]
        if nxt // K >= b // K:
          raise AssertionError(
            f"stage {g} runs the backward of microbatch {m} at tick {b}, but needs stage "
            f"{g + 1}'s gradient, computed at tick {nxt}" + where(nxt) + ": it must come later"
          )
  return when


def check_schedule(schedule: Schedule) -> None:
  """Asserts the table obeys the pipeline's dependencies and its buffers deliver.

  Checks that every model stage runs the forward and the backward (B, or I
  then W) of every microbatch once, each after what it depends on; then
  replays the messages through the slot tables with (stage, microbatch) ids as
  payloads and checks that every action reads its own input and gradient, and
  that nothing is overwritten while still needed.

  Raises:
    AssertionError: naming the first violated dependency or misdelivered message,
      or a table of the wrong shape or a slot outside the buffers the schedule
      declares.
  """
  _check_tables(schedule)
  _check_actions(schedule)
  P, G, K = schedule.stages, schedule.model_stages, schedule.exchange_every
  stash = np.full((P, schedule.num_act_slots, 2), -1)
  inbox = np.full((P, schedule.num_grad_slots, 2), -1)
  for t in range(schedule.num_ticks):
    if t % K == 0:  # what each device sends until the next exchange: one message each way
      sent_act: list[tuple[int, int] | None] = [None] * P
      sent_grad: list[tuple[int, int] | None] = [None] * P
    for s in range(P):
      a, m, j = (int(x[t, s]) for x in (schedule.action, schedule.microbatch, schedule.chunk))
      if a == Action.IDLE:
        continue
      g = j * P + s
      if g > 0:
        slot = schedule.act_slot[t, s]
        if not (slot >= 0 and tuple(stash[s, slot]) == (g, m)):
          raise AssertionError(f"tick {t}: stage {g} reads the wrong input for microbatch {m}")
      if a != Action.FORWARD and g < G - 1:
        slot = schedule.grad_slot[t, s]
        if not (slot >= 0 and tuple(inbox[s, slot]) == (g, m)):
          raise AssertionError(f"tick {t}: stage {g} reads the wrong gradient for microbatch {m}")
      sends_act, sends_grad = sends(Action(a), g, G)
      for out, sent, what, payload in (
        (sends_act, sent_act, "activations", (g + 1, m)),
        (sends_grad, sent_grad, "gradients", (g - 1, m)),
      ):
        if out:
          if sent[s] is not None:
            raise AssertionError(f"tick {t}: stage {s} sends two {what} in one exchange")
          sent[s] = payload
    if t % K < K - 1:
      # Nothing arrives before the exchange.
      if not (np.all(schedule.recv_act_slot[t] < 0) and np.all(schedule.recv_grad_slot[t] < 0)):
        raise AssertionError(
          f"tick {t}: a message is stored before the exchange after tick {t - t % K + K - 1}"
        )
      continue
    for s in range(P):
      for slots, buffer, sent, what in (
        (schedule.recv_act_slot, stash, sent_act[(s - 1) % P], "activation"),
        (schedule.recv_grad_slot, inbox, sent_grad[(s + 1) % P], "gradient"),
      ):
        slot = slots[t, s]
        if slot >= 0:
          if sent is None:
            raise AssertionError(f"tick {t}: stage {s} stores a {what} nobody sent")
          buffer[s, slot] = sent
        elif sent is not None:
          raise AssertionError(f"tick {t}: stage {s} drops the {what} for (stage, mb) {sent}")
