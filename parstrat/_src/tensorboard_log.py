"""TensorBoard event files for `parstrat train --out`, written with tensorboardX (no TensorFlow)."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping

#: How the event files' names start (tensorboardX's and TensorFlow's naming).
PREFIX = "events.out.tfevents."

#: metric key in metrics.jsonl -> TensorBoard tag.
TAGS = {
  "loss": "train/loss",
  "grad_norm": "train/grad_norm",
  "examples_per_s": "train/examples_per_s",
  "learning_rate": "train/learning_rate",
  "skipped_steps": "train/skipped_steps",
  "epoch_loss": "train/epoch_loss",
  "eval_accuracy": "eval/accuracy",
}


class ScalarWriter:
  """Writes scalars to an event file in `logdir`; `tensorboard --logdir` shows them.

  Only the keys of `TAGS` are written (others, like "epoch", are not curves).

  Example:
    >>> import tempfile
    >>> with ScalarWriter(tempfile.mkdtemp()) as w:
    ...   w.write(1, {"loss": 2.3, "epoch": 1})
  """

  def __init__(self, logdir: str | pathlib.Path, purge_step: int | None = None):
    """Opens a new event file in `logdir`; `purge_step` (a resumed run's first step)
    makes TensorBoard drop the points at and after it that an earlier run wrote."""
    from tensorboardX import SummaryWriter

    self._writer = SummaryWriter(str(logdir), flush_secs=10, purge_step=purge_step)

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    for key, value in scalars.items():
      if key in TAGS and value is not None:
        self._writer.add_scalar(TAGS[key], float(value), step)

  def close(self) -> None:
    self._writer.close()

  def __enter__(self) -> ScalarWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
