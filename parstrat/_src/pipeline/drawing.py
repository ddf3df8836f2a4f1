"""Drawing a pipeline schedule as a timeline picture (matplotlib)."""

from __future__ import annotations

from parstrat._src.pipeline.schedule import Action
from parstrat._src.pipeline.schedule import Schedule

FORWARD_COLOUR = "#4C72B0"
BACKWARD_COLOUR = "#DD8452"
IDLE_COLOUR = "#EEEEEE"


def draw_schedule(schedule: Schedule, path: str) -> None:
  """Writes the schedule as a PNG: stages as rows, ticks as columns.

  Forward cells are blue, backward cells orange, bubbles light grey; each cell
  is labelled with its microbatch, and the title gives the measured bubble
  fraction next to the theory (P-1)/(M+P-1).

  Args:
    schedule: the schedule to draw.
    path: the output file (PNG).
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.patches import Patch
  from matplotlib.patches import Rectangle

  T, P = schedule.num_ticks, schedule.stages
  fig, ax = plt.subplots(figsize=(max(6.0, 0.38 * T + 1.5), 0.55 * P + 1.6), dpi=120)
  for t in range(T):
    for s in range(P):
      action, m = int(schedule.action[t, s]), int(schedule.microbatch[t, s])
      colour = {Action.FORWARD: FORWARD_COLOUR, Action.BACKWARD: BACKWARD_COLOUR}.get(
        action, IDLE_COLOUR
      )
      ax.add_patch(Rectangle((t, s), 1, 1, facecolor=colour, edgecolor="white", linewidth=1))
      if action != Action.IDLE:
        ax.text(t + 0.5, s + 0.5, str(m), ha="center", va="center", fontsize=7, color="white")
  ax.set_xlim(0, T)
  ax.set_ylim(P, 0)
  ax.set_yticks([s + 0.5 for s in range(P)], [f"stage {s}" for s in range(P)])
  ax.set_xticks(range(0, T + 1, max(1, T // 20)))
  ax.set_xlabel("tick")
  ax.set_title(
    f"{schedule.name}: P={P}, M={schedule.microbatches}, bubble "
    f"{schedule.bubble_fraction():.3f} (theory {schedule.theoretical_bubble():.3f})",
    fontsize=10,
  )
  ax.legend(
    handles=[
      Patch(color=FORWARD_COLOUR, label="forward"),
      Patch(color=BACKWARD_COLOUR, label="backward"),
      Patch(color=IDLE_COLOUR, label="bubble"),
    ],
    loc="upper center",
    bbox_to_anchor=(0.5, -0.3),
    ncol=3,
    fontsize=8,
    frameon=False,
  )
  fig.tight_layout()
  fig.savefig(path, bbox_inches="tight")
  plt.close(fig)
