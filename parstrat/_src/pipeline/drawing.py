"""Drawing a pipeline schedule as a timeline picture (matplotlib)."""

from __future__ import annotations

import pathlib

from parstrat._src.pipeline.schedule import Action
from parstrat._src.pipeline.schedule import Schedule

FORWARD_COLOUR = "#4C72B0"
BACKWARD_COLOUR = "#DD8452"
INPUT_GRAD_COLOUR = "#C44E52"
WEIGHT_GRAD_COLOUR = "#55A868"
IDLE_COLOUR = "#EEEEEE"

#: The colour and legend label of each kind of work.
STYLE = {
  Action.FORWARD: (FORWARD_COLOUR, "F forward"),
  Action.BACKWARD: (BACKWARD_COLOUR, "B backward"),
  Action.BACKWARD_INPUT: (INPUT_GRAD_COLOUR, "I input gradient"),
  Action.BACKWARD_WEIGHT: (WEIGHT_GRAD_COLOUR, "W weight gradient"),
}


def draw_schedule(schedule: Schedule, path: str) -> str:
  """Draws the schedule into an image file: stages as rows, ticks as columns.

  Forward cells are blue, full backward cells orange, input-gradient cells (I)
  red and weight-gradient cells (W) green, bubbles light grey; each cell is
  labelled with its microbatch (and, with virtual stages, its model stage, as
  in "5:3"; later chunks are drawn lighter), and the title gives the measured
  bubble fraction next to the schedule's theory.

  Args:
    schedule: the schedule to draw.
    path: the output file; its extension picks the format (`.png`, `.svg`,
      `.pdf`, or any other matplotlib writes); without one, `.png` is added.

  Returns:
    The path written.

  Raises:
    ValueError: for an extension matplotlib cannot write, naming it (before
      anything is drawn or written).
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.backend_bases import FigureCanvasBase
  from matplotlib.patches import Patch
  from matplotlib.patches import Rectangle

  suffix = pathlib.Path(path).suffix
  if not suffix:
    path = f"{path}.png"
  elif suffix[1:].lower() not in FigureCanvasBase.get_supported_filetypes():
    raise ValueError(
      f"cannot draw into {path}: matplotlib does not write {suffix!r} files; use .png, .svg, "
      f"or .pdf (or one of {', '.join(sorted(FigureCanvasBase.get_supported_filetypes()))})."
    )

  T, P, v = schedule.num_ticks, schedule.stages, schedule.virtual_stages
  width = 0.38 if v == 1 else 0.55
  fig, ax = plt.subplots(figsize=(max(6.0, width * T + 1.5), 0.55 * P + 1.6), dpi=120)
  kinds = set()
  for t in range(T):
    for s in range(P):
      action, m = Action(int(schedule.action[t, s])), int(schedule.microbatch[t, s])
      chunk = int(schedule.chunk[t, s])
      colour, _ = STYLE.get(action, (IDLE_COLOUR, ""))
      alpha = 1.0 - 0.45 * chunk / max(1, v - 1)
      ax.add_patch(
        Rectangle((t, s), 1, 1, facecolor=colour, alpha=alpha, edgecolor="white", linewidth=1)
      )
      if action != Action.IDLE:
        kinds.add(action)
        label = str(m) if v == 1 else f"{chunk * P + s}:{m}"
        ax.text(t + 0.5, s + 0.5, label, ha="center", va="center", fontsize=6, color="white")
  K = schedule.exchange_every
  for t in range(K, T, K) if K > 1 else ():  # the message exchanges, between ticks
    ax.axvline(t, color="black", linewidth=0.8)
  ax.set_xlim(0, T)
  ax.set_ylim(P, 0)
  ax.set_yticks([s + 0.5 for s in range(P)], [schedule.row_label(s) for s in range(P)])
  ax.set_xticks(range(0, T + 1, max(1, T // 20)))
  ax.set_xlabel("tick" if v == 1 else "tick (cells: model stage:microbatch)")
  chunks = f", v={v}" if v > 1 else ""
  chunks += f", an exchange every {K} ticks (lines)" if K > 1 else ""
  ax.set_title(
    f"{schedule.name}: P={P}, M={schedule.microbatches}{chunks}, bubble "
    f"{schedule.bubble_fraction():.3f} ({schedule.theory_text()})",
    fontsize=10,
  )
  handles = [Patch(color=STYLE[a][0], label=STYLE[a][1]) for a in sorted(kinds)]
  ax.legend(
    handles=[*handles, Patch(color=IDLE_COLOUR, label="bubble")],
    loc="upper center",
    bbox_to_anchor=(0.5, -0.3),
    ncol=len(handles) + 1,
    fontsize=8,
    frameon=False,
  )
  fig.tight_layout()
  try:
    fig.savefig(path, bbox_inches="tight")
  finally:
    plt.close(fig)
  return path
