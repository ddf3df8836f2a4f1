"""Training reports: loss and accuracy curves as a picture."""

from __future__ import annotations

import io
import math
import pathlib

from parstrat._src import files


def draw_training_report(runs: dict[str, list[dict]], path: str | pathlib.Path) -> None:
  """Draws loss per step and eval accuracy per epoch, one line per run.

  Args:
    runs: run name -> the records `parstrat train` writes to metrics.jsonl
      (`{"step", "loss", ...}` per step and `{"step", "eval_accuracy"}` per epoch).
    path: the PNG to write (its suffix names the format): written whole or not at
      all, so a run killed while drawing it leaves no half picture.
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
  styles = ["-", "--", ":", "-."]
  for i, (name, records) in enumerate(runs.items()):
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    style = styles[i % len(styles)]
    losses = [math.nan if r["loss"] is None else r["loss"] for r in steps]  # null: not finite
    loss_ax.plot([r["step"] for r in steps], losses, style, label=name)
    acc_ax.plot(
      [r["step"] for r in evals],
      [r["eval_accuracy"] for r in evals],
      style,
      marker="o",
      label=name,
    )
  loss_ax.set_xlabel("step")
  loss_ax.set_ylabel("training loss")
  loss_ax.set_yscale("log")
  loss_ax.set_title("loss")
  acc_ax.set_xlabel("step")
  acc_ax.set_ylabel("eval accuracy")
  acc_ax.set_title("accuracy (end of each epoch)")
  for ax in (loss_ax, acc_ax):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  picture = io.BytesIO()
  try:
    fig.savefig(picture, format=pathlib.Path(path).suffix.lstrip(".") or "png")
  finally:
    plt.close(fig)
  files.write_atomically(path, picture.getvalue())
