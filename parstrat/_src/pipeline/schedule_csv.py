"""Schedules as CSV in torch.distributed.pipelining's compute-only format.

torch.distributed.pipelining writes a schedule (`_dump_csv`) as one CSV row
per rank and one column per time step; a cell is an action such as `0F0`
(model stage 0, forward, microbatch 0), `1B0` (full backward), `1I0` (input
gradient only), `2W1` (weight gradient only), or empty when the rank idles.
Stage g runs on rank g % P (its "loop" placement, as in interleaved 1F1B).
"""

from __future__ import annotations

import csv
import io
import re

from parstrat._src.pipeline.schedule import Action
from parstrat._src.pipeline.schedule import Op
from parstrat._src.pipeline.schedule import Schedule
from parstrat._src.pipeline.schedule import _simulate
from parstrat._src.pipeline.schedule import schedule_from_ticks

_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")
_LETTERS = {a.letter: a for a in Action if a != Action.IDLE}


def to_csv(schedule: Schedule) -> str:
  """The schedule as torch.distributed.pipelining's compute-only CSV.

  Args:
    schedule: any `Schedule`.

  Returns:
    CSV text: one row per device, one cell per tick ("" when idle).

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


def from_csv(text: str, *, name: str = "imported", retime: bool = False) -> Schedule:
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

  Returns:
    The `Schedule`.

  Raises:
    ValueError: naming the bad cell, a stage in the wrong row, a missing
      action, or the first broken dependency.

  Example:
    >>> from parstrat import pipeline
    >>> s = pipeline.from_csv("0F0,0F1,,0I0,0W0,0I1,0W1\\n,1F0,1I0,1F1,1I1,1W0,1W1\\n")
    >>> s.stages, s.microbatches, round(s.bubble_fraction(), 3)
    (2, 2, 0.143)
  """
  rows = [row for row in csv.reader(io.StringIO(text)) if row]
  if not rows:
    raise ValueError("The CSV schedule has no rows.")
  P = len(rows)
  parsed: list[list[tuple[Action, int, int] | None]] = []
  for s, row in enumerate(rows):
    cells: list[tuple[Action, int, int] | None] = []
    for t, cell in enumerate(row):
      cell = cell.strip()
      if not cell:
        cells.append(None)
        continue
      match = _ACTION.match(cell)
      if match is None:
        raise ValueError(
          f"Row {s}, column {t}: cannot read {cell!r}; expected a compute action like "
          "'0F0', '1B0', '1I0' or '2W1' (stage, F/B/I/W, microbatch) or an empty cell."
        )
      g, letter, m = int(match[1]), match[2], int(match[3])
      if g % P != s:
        raise ValueError(
          f"Row {s}, column {t}: {cell!r} runs stage {g} on device {s}; with {P} devices "
          f"stage {g} must run on device {g % P} (stage g on device g % P)."
        )
      cells.append((_LETTERS[letter], m, g))
    parsed.append(cells)
  found = [op for cells in parsed for op in cells if op is not None]
  if not found:
    raise ValueError("The CSV schedule has no actions.")
  G = max(g for _, _, g in found) + 1
  v = -(-G // P)
  M = max(m for _, m, _ in found) + 1

  def op(cell: tuple[Action, int, int]) -> Op:
    a, m, g = cell
    return (a, m, g // P)

  if retime:
    orders = [[op(c) for c in cells if c is not None] for cells in parsed]
    ticks = _simulate(P, v, orders)
  else:
    T = max(len(cells) for cells in parsed)
    ticks = [
      [op(cells[t]) if t < len(cells) and cells[t] is not None else None for cells in parsed]
      for t in range(T)
    ]
  return schedule_from_ticks(name, P, M, v, ticks)
