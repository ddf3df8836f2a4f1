"""Schedules as CSV in torch.distributed.pipelining's compute-only format.

torch.distributed.pipelining writes a schedule (`_dump_csv`) as one CSV row
per rank and one column per time step; a cell is an action such as `0F0`
(model stage 0, forward, microbatch 0), `1B0` (full backward), `1I0` (input
gradient only), `2W1` (weight gradient only), or empty when the rank idles.
Stage g runs on rank g % P (its "loop" placement, as in interleaved 1F1B).
torch before 2.6 wrote the input gradient as `B` (next to a `W`) and a full
backward as `BW`; those read as `I` and `B`.

The format holds ticks only: a schedule that exchanges messages every K > 1
ticks (`exchange_every`) is read back as one by passing the same K.
"""

from __future__ import annotations

import csv
import io
import re

from parstrat._src.pipeline.schedule import Action
from parstrat._src.pipeline.schedule import Op
from parstrat._src.pipeline.schedule import Schedule
from parstrat._src.pipeline.schedule import _check_positive
from parstrat._src.pipeline.schedule import _simulate
from parstrat._src.pipeline.schedule import schedule_from_ticks

_ACTION = re.compile(r"^(\d+)(BW|[FBIW])(\d+)$")
_LETTERS = {a.letter: a for a in Action if a != Action.IDLE} | {"BW": Action.BACKWARD}
# torch's communication and sharding actions (its compute + comms format).
_COMMS = re.compile(
  r"^(\d+)(UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B|OVERLAP_F_B"
  r"|SEND_F_RECV_B|SEND_B_RECV_F)(\d*)$"
  r"|^\(.*\)OVERLAP_F_B$"  # (how torch writes an overlapped pair: "(1F1;1B0)OVERLAP_F_B")
)
_LARGEST_INDEX = 2**31 - 1  # (tables are int32)


def to_csv(schedule: Schedule) -> str:
  """The schedule as torch.distributed.pipelining's compute-only CSV.

  Args:
    schedule: any `Schedule`.

  Returns:
    CSV text: one row per device, one cell per tick ("" when idle), no header;
    lines end with "\n" (torch's `csv.writer` writes "\r\n"; each reads both).

  Example:
    >>> from parstrat import pipeline
    >>> print(pipeline.to_csv(pipeline.build_schedule("1f1b", 2, 2)), end="")
    0F0,0F1,,0B0,,0B1
    ,1F0,1B0,1F1,1B1,
  """
  out = io.StringIO()
  writer = csv.writer(out, lineterminator="\n")
  P = schedule.stages
  for s in range(P):
    row = []
    for t in range(schedule.num_ticks):
      a = Action(int(schedule.action[t, s]))
      if a == Action.IDLE:
        row.append("")
      else:
        g = int(schedule.chunk[t, s]) * P + s
        row.append(f"{g}{a.letter}{int(schedule.microbatch[t, s])}")
    writer.writerow(row)
  return out.getvalue()


def from_csv(
  text: str, *, name: str = "imported", retime: bool = False, exchange_every: int = 1
) -> Schedule:
  """Reads a compute-only CSV schedule (torch.distributed.pipelining's format).

  The number of rows is P, the largest stage index + 1 is P * v (stage g must
  sit in row g % P), the largest microbatch + 1 is M. The table is checked
  (`check_schedule`) and its buffer slots allocated, so it runs on the engine
  like a built-in schedule (`PipelineModelParallel(schedule=...)`).

  Args:
    text: the CSV text.
    name: the schedule's name.
    retime: keep each row's order of actions but rerun them as early as their
      dependencies allow (for tables whose time steps are not lock-step ticks);
      by default the columns are the ticks.
    exchange_every: K, the ticks between two exchanges of messages (the CSV
      does not hold it: pass the K of the schedule that was written).

  Returns:
    The `Schedule`.

  Raises:
    ValueError: naming the bad cell, a stage in the wrong row, a missing
      action, or the first broken dependency; or an `exchange_every` that is
      not a positive integer.

  Example:
    >>> from parstrat import pipeline
    >>> s = pipeline.from_csv("0F0,0F1,,0I0,0W0,0I1,0W1\\n,1F0,1I0,1F1,1I1,1W0,1W1\\n")
    >>> s.stages, s.microbatches, round(s.bubble_fraction(), 3)
    (2, 2, 0.143)
  """
  _check_positive("exchange_every", exchange_every)
  text = text.removeprefix("\ufeff")  # (the byte-order mark spreadsheets write first)
  rows = [[cell.strip() for cell in row] for row in csv.reader(io.StringIO(text))]
  while rows and rows[-1] in ([], [""]):  # (trailing blank lines: a row of commas is a row)
    rows.pop()
  if not rows:
    raise ValueError("The CSV schedule has no rows.")
  P = len(rows)
  parsed: list[list[tuple[Action, int, int] | None]] = []
  plain_b: set[tuple[int, int]] = set()  # (row, column) of each cell written `B`
  where: dict[tuple[str, int], str] = {}  # the first cell naming each stage and microbatch
  for s, row in enumerate(rows):  # (the first problem in reading order is named)
    if not any(row):
      raise ValueError(
        f"Row {s} of {P} is empty: each row is one device's actions, with no blank rows "
        "between them."
      )
    cells: list[tuple[Action, int, int] | None] = []
    for t, cell in enumerate(row):
      if not cell:
        cells.append(None)
        continue
      match = _ACTION.match(cell)
      if match is None and _COMMS.match(cell):
        raise ValueError(
          f"Row {s}, column {t}: {cell!r} is one of torch's communication actions (its "
          "compute + comms format); give the compute-only table (F, B, I, W): parstrat "
          "plans the messages itself."
        )
      if match is None:
        raise ValueError(
          f"Row {s}, column {t}: cannot read {cell!r}; expected a compute action like "
          "'0F0', '1B0', '1I0' or '2W1' (stage, F/B/I/W, microbatch) or an empty cell."
        )
      g, letter, m = int(match[1]), match[2], int(match[3])
      if max(g, m) > _LARGEST_INDEX:
        raise ValueError(
          f"Row {s}, column {t}: {cell!r}: a stage or microbatch index above {_LARGEST_INDEX}."
        )
      if g % P != s:
        raise ValueError(
          f"Row {s}, column {t}: {cell!r} runs stage {g} on device {s}; with {P} devices "
          f"stage {g} must run on device {g % P} (stage g on device g % P)."
        )
      cells.append((_LETTERS[letter], m, g))
      where.setdefault(("stage", g), f"row {s}, column {t}: {cell!r}")
      where.setdefault(("microbatch", m), f"row {s}, column {t}: {cell!r}")
      if letter == "B":
        plain_b.add((s, t))
    parsed.append(cells)
  found = [op for cells in parsed for op in cells if op is not None]
  # torch before 2.6: `B` then `W` of one stage and microbatch were its I and W.
  split = {(g, m) for a, m, g in found if a != Action.BACKWARD and a.letter in "IW"}
  inputs = {(g, m) for a, m, g in found if a == Action.BACKWARD_INPUT}
  parsed = [
    [
      (Action.BACKWARD_INPUT, c[1], c[2])
      if (s, t) in plain_b and (c[2], c[1]) in split - inputs
      else c
      for t, c in enumerate(cells)
    ]
    for s, cells in enumerate(parsed)
  ]
  found = [op for cells in parsed for op in cells if op is not None]
  G = max(g for _, _, g in found) + 1
  if G % P:
    raise ValueError(
      f"The table names stages 0..{G - 1} on {P} devices (rows): each device holds the "
      f"same number of stages, so their count must be a multiple of {P} (stage {G - 1} "
      f"first at {where['stage', G - 1]})."
    )
  v = G // P
  M = max(m for _, m, _ in found) + 1
  forwards = {(g, m) for a, m, g in found if a == Action.FORWARD}
  if G * M > len(forwards):  # (named here: the checks below walk every stage and microbatch)
    g, m = next((g, m) for g in range(G) for m in range(M) if (g, m) not in forwards)
    raise ValueError(
      f"stage {g} never runs the forward (F) of microbatch {m}: with stages 0..{G - 1} and "
      f"microbatches 0..{M - 1} named, the table needs {G * M} forwards and has "
      f"{len(forwards)} (the last stage first at {where['stage', G - 1]}; the last "
      f"microbatch first at {where['microbatch', M - 1]})."
    )

  def op(cell: tuple[Action, int, int]) -> Op:
    a, m, g = cell
    return (a, m, g // P)

  if retime:
    orders = [[op(c) for c in cells if c is not None] for cells in parsed]
    ticks = _simulate(P, v, orders, exchange_every)
  else:
    T = max(len(cells) for cells in parsed)
    ticks = [
      [op(cells[t]) if t < len(cells) and cells[t] is not None else None for cells in parsed]
      for t in range(T)
    ]
  return schedule_from_ticks(name, P, M, v, ticks, exchange_every=exchange_every)
