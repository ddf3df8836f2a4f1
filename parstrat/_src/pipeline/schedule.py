"""Pipeline schedules as plain data: who does what at every tick.

A schedule is a table `tick -> stage -> action` (idle, forward of microbatch m,
backward of microbatch m). It is built by small pure functions and can be
printed, checked and drawn without any device. One tick is one stage
computation; a value sent at tick t is usable from tick t+1.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from collections.abc import Sequence

import numpy as np


class Action(enum.IntEnum):
  IDLE = 0
  FORWARD = 1
  BACKWARD = 2


Op = tuple[Action, int]  # (FORWARD or BACKWARD, microbatch)


def num_total_iterations(stages: int, microbatches: int) -> int:
  """Ticks of a forward-only pass: M + P - 1."""
  return microbatches + stages - 1


def theoretical_bubble(stages: int, microbatches: int) -> float:
  """The idle fraction of a flush pipeline: (P - 1) / (M + P - 1)."""
  return (stages - 1) / (microbatches + stages - 1)


def gpipe_order(stages: int, microbatches: int, stage: int) -> list[Op]:
  """GPipe: every forward, then every backward."""
  del stages, stage
  return [(Action.FORWARD, m) for m in range(microbatches)] + [
    (Action.BACKWARD, m) for m in range(microbatches)
  ]


def one_f_one_b_order(stages: int, microbatches: int, stage: int) -> list[Op]:
  """1F1B (PipeDream-flush): P-1-s warm-up forwards, then alternate, then drain."""
  warmup = min(stages - 1 - stage, microbatches)
  ops: list[Op] = [(Action.FORWARD, m) for m in range(warmup)]
  for i in range(microbatches - warmup):
    ops += [(Action.FORWARD, warmup + i), (Action.BACKWARD, i)]
  ops += [(Action.BACKWARD, m) for m in range(microbatches - warmup, microbatches)]
  return ops


ORDERS: dict[str, Callable[[int, int, int], list[Op]]] = {
  "gpipe": gpipe_order,
  "1f1b": one_f_one_b_order,
}


@dataclasses.dataclass(frozen=True)
class Schedule:
  """A pipeline schedule and the buffer slots it needs.

  Attributes:
    name: "gpipe", "1f1b" or "forward".
    stages: P.
    microbatches: M.
    action: `[T, P]` int array of `Action` values.
    microbatch: `[T, P]` microbatch of each action (-1 when idle).
    act_slot: `[T, P]` stash slot holding the input activation the action reads
      (-1 for stage 0, which reads its microbatch from the batch).
    grad_slot: `[T, P]` slot holding the incoming gradient a backward reads
      (-1 for the last stage, whose gradient starts at the loss).
    recv_act_slot: `[T, P]` slot where the activation arriving after tick t is
      stored (-1: nothing arrives).
    recv_grad_slot: `[T, P]` likewise for arriving gradients.
    num_act_slots: stash slots per device (activations alive at once).
    num_grad_slots: gradient slots per device.
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

  @property
  def num_ticks(self) -> int:
    return self.action.shape[0]

  def bubble_fraction(self) -> float:
    """The measured fraction of (tick, stage) slots left idle."""
    return float(np.mean(self.action == Action.IDLE))

  def theoretical_bubble(self) -> float:
    return theoretical_bubble(self.stages, self.microbatches)

  def max_live_activations(self) -> list[int]:
    """Per stage, the most microbatches whose forward ran and backward has not."""
    live = []
    for s in range(self.stages):
      count = peak = 0
      for t in range(self.num_ticks):
        if self.action[t, s] == Action.FORWARD:
          count += 1
        elif self.action[t, s] == Action.BACKWARD:
          count -= 1
        peak = max(peak, count)
      live.append(peak)
    return live

  def table(self) -> str:
    """The schedule as text: one row per stage, one column per tick."""
    width = max(2, len(str(self.microbatches - 1)) + 1)
    rows = []
    for s in range(self.stages):
      cells = []
      for t in range(self.num_ticks):
        a, m = self.action[t, s], self.microbatch[t, s]
        cells.append(("." if a == Action.IDLE else f"{'FB'[a - 1]}{m}").rjust(width))
      rows.append(f"stage {s}: " + " ".join(cells))
    return "\n".join(rows)

  def __str__(self) -> str:
    return (
      f"{self.name} schedule, {self.stages} stages x {self.microbatches} microbatches, "
      f"{self.num_ticks} ticks, bubble {self.bubble_fraction():.3f} "
      f"(theory (P-1)/(M+P-1) = {self.theoretical_bubble():.3f})\n{self.table()}"
    )


def _simulate(stages: int, orders: Sequence[Sequence[Op]]) -> list[list[Op | None]]:
  """Runs each stage's op list as early as its dependencies allow."""
  done: dict[tuple[Action, int, int], int] = {}
  pos = [0] * stages
  ticks: list[list[Op | None]] = []
  total = sum(len(o) for o in orders)
  while sum(pos) < total:
    t = len(ticks)
    row: list[Op | None] = []
    for s in range(stages):
      op = orders[s][pos[s]] if pos[s] < len(orders[s]) else None
      if op is not None:
        kind, m = op
        if kind == Action.FORWARD:
          deps = [] if s == 0 else [(Action.FORWARD, s - 1, m)]
        else:
          deps = [(Action.FORWARD, s, m)]
          if s < stages - 1:
            deps.append((Action.BACKWARD, s + 1, m))
        if all(done.get(d, t) < t for d in deps):
          row.append(op)
          continue
      row.append(None)
    if all(op is None for op in row):
      raise ValueError(f"The schedule deadlocks at tick {t}: no stage can proceed.")
    for s, op in enumerate(row):
      if op is not None:
        done[(op[0], s, op[1])] = t
        pos[s] += 1
    ticks.append(row)
  return ticks


def _allocate(intervals: dict[int, tuple[int, int]]) -> tuple[dict[int, int], int]:
  """Greedy interval colouring: microbatch -> slot, with inclusive tick intervals."""
  slot_of: dict[int, int] = {}
  free_at: list[int] = []  # per slot, the first tick it is free again
  for m, (start, end) in sorted(intervals.items(), key=lambda kv: kv[1]):
    for slot, free in enumerate(free_at):
      if free <= start:
        slot_of[m], free_at[slot] = slot, end + 1
        break
    else:
      slot_of[m] = len(free_at)
      free_at.append(end + 1)
  return slot_of, len(free_at)


def build_schedule(name: str, stages: int, microbatches: int) -> Schedule:
  """Builds the named schedule's table and its buffer slots.

  Args:
    name: "gpipe" or "1f1b".
    stages: P >= 1.
    microbatches: M >= 1.

  Returns:
    The `Schedule`.

  Raises:
    ValueError: for an unknown name or non-positive sizes.

  Example:
    >>> from parstrat import pipeline
    >>> s = pipeline.build_schedule("1f1b", stages=2, microbatches=3)
    >>> print(s.table())
    stage 0: F0 F1  . B0 F2 B1  . B2
    stage 1:  . F0 B0 F1 B1 F2 B2  .
  """
  if name not in ORDERS:
    raise ValueError(f"Unknown schedule {name!r}; choose one of {sorted(ORDERS)}.")
  for what, value in (("stages", stages), ("microbatches", microbatches)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{what} must be a positive integer, got {value!r}.")
  orders = [ORDERS[name](stages, microbatches, s) for s in range(stages)]
  ticks = _simulate(stages, orders)
  T = len(ticks)
  action = np.zeros((T, stages), np.int32)
  microbatch = np.full((T, stages), -1, np.int32)
  when: dict[tuple[Action, int, int], int] = {}
  for t, row in enumerate(ticks):
    for s, op in enumerate(row):
      if op is not None:
        action[t, s], microbatch[t, s] = op[0], op[1]
        when[(op[0], s, op[1])] = t

  act_slot = np.full((T, stages), -1, np.int32)
  grad_slot = np.full((T, stages), -1, np.int32)
  recv_act_slot = np.full((T, stages), -1, np.int32)
  recv_grad_slot = np.full((T, stages), -1, np.int32)
  num_act = num_grad = 1
  M = microbatches
  for s in range(stages):
    if s > 0:  # activations arrive from stage s-1 and live until our backward.
      life = {
        m: (when[(Action.FORWARD, s - 1, m)] + 1, when[(Action.BACKWARD, s, m)]) for m in range(M)
      }
      slots, n = _allocate(life)
      num_act = max(num_act, n)
      for m in range(M):
        recv_act_slot[when[(Action.FORWARD, s - 1, m)], s] = slots[m]
        act_slot[when[(Action.FORWARD, s, m)], s] = slots[m]
        act_slot[when[(Action.BACKWARD, s, m)], s] = slots[m]
    if s < stages - 1:  # gradients arrive from stage s+1.
      life = {
        m: (when[(Action.BACKWARD, s + 1, m)] + 1, when[(Action.BACKWARD, s, m)]) for m in range(M)
      }
      slots, n = _allocate(life)
      num_grad = max(num_grad, n)
      for m in range(M):
        recv_grad_slot[when[(Action.BACKWARD, s + 1, m)], s] = slots[m]
        grad_slot[when[(Action.BACKWARD, s, m)], s] = slots[m]
  return Schedule(
    name=name,
    stages=stages,
    microbatches=microbatches,
    action=action,
    microbatch=microbatch,
    act_slot=act_slot,
    grad_slot=grad_slot,
    recv_act_slot=recv_act_slot,
    recv_grad_slot=recv_grad_slot,
    num_act_slots=num_act,
    num_grad_slots=num_grad,
  )


def check_schedule(schedule: Schedule) -> None:
  """Asserts the table obeys the pipeline's dependencies and runs every op once.

  Raises:
    AssertionError: naming the first violated dependency.
  """
  P, M = schedule.stages, schedule.microbatches
  when: dict[tuple[int, int, int], int] = {}
  for t in range(schedule.num_ticks):
    for s in range(P):
      a, m = int(schedule.action[t, s]), int(schedule.microbatch[t, s])
      if a == Action.IDLE:
        continue
      key = (a, s, m)
      assert key not in when, f"stage {s} runs {Action(a).name} of microbatch {m} twice"
      when[key] = t
  for s in range(P):
    for m in range(M):
      for a in (Action.FORWARD, Action.BACKWARD):
        assert (a, s, m) in when, f"stage {s} never runs {a.name} of microbatch {m}"
      f, b = when[(Action.FORWARD, s, m)], when[(Action.BACKWARD, s, m)]
      assert f < b, f"stage {s}: backward of microbatch {m} (tick {b}) before its forward ({f})"
      if s > 0:
        prev = when[(Action.FORWARD, s - 1, m)]
        assert prev < f, f"stage {s} runs forward {m} at tick {f}, stage {s - 1} only at {prev}"
      if s < P - 1:
        nxt = when[(Action.BACKWARD, s + 1, m)]
        assert nxt < b, f"stage {s} runs backward {m} at tick {b}, stage {s + 1} only at {nxt}"
