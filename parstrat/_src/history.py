"""A run's metrics history (metrics.jsonl) that survives stops and resumes."""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
from typing import Any

from parstrat._src import files


def read_history(path: str | pathlib.Path) -> list[dict[str, Any]]:
  """The records of a metrics file, one JSON object per line.

  A last line cut short (a process killed while writing it) is dropped.

  Raises:
    ValueError: naming the line of a record that is not JSON (other than the
      last), or not a JSON object with an integer "step" (a line added by hand).
  """
  lines = pathlib.Path(path).read_text().splitlines()
  records = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      if number == len(lines):
        break
      raise ValueError(f"{path}, line {number}: not a JSON record: {line[:60]!r}") from None
    step = record.get("step") if isinstance(record, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
      raise ValueError(
        f'{path}, line {number}: not a record of a step (a JSON object with an integer "step"): '
        f"{line[:60]!r}"
      )
    records.append(record)
  return records


def json_line(record: dict[str, Any]) -> str:
  """`record` as one line of strict JSON: a non-finite number (a NaN loss) becomes null.

  Python's `json` writes NaN and Infinity, which JSON has not, and which `jq`,
  JavaScript and most JSON readers refuse.

  Example:
    >>> json_line({"step": 3, "loss": float("nan")})
    '{"step": 3, "loss": null}'
  """
  finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in record.items()}  # fmt: skip
  return json.dumps(finite, allow_nan=False)


def records_up_to(records: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
  """The records of steps `<= step`: the history a checkpoint of `step` continues.

  Example:
    >>> records_up_to([{"step": 1}, {"step": 2}, {"step": 3}], 2)
    [{'step': 1}, {'step': 2}]
  """
  return [r for r in records if r["step"] <= step]  # (read_history: each has one)


class MetricsWriteError(OSError):
  """The metrics file could not be written (a full disk, its file system gone); names it."""


class History:
  """The records of one run, appended to a JSONL file as they come.

  A fresh run starts an empty file. A resumed run (`resume_step` given) keeps
  the file's records up to that step, drops any later ones (steps a crashed
  run wrote after its last checkpoint, which the resumed run trains again),
  and appends: the file never loses or repeats a step, and `records` holds the
  whole history. Nothing is written until the history is opened, so a resume
  that fails before leaves the file as it was.

  Args:
    path: the JSONL file, or None to keep the records in memory only.
    resume_step: the step a resumed run continues from; None for a fresh run.

  Example:
    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
    >>> with History(path) as history:
    ...   for step in (1, 2, 3):
    ...     history.append({"step": step, "loss": 1.0 / step})
    >>> with History(path, resume_step=2) as history:  # step 3 is trained again
    ...   history.append({"step": 3, "loss": 0.3})
    >>> [r["step"] for r in read_history(path)]
    [1, 2, 3]
  """

  def __init__(self, path: str | pathlib.Path | None, *, resume_step: int | None = None):
    self.path = None if path is None else pathlib.Path(path)
    self.records: list[dict[str, Any]] = []
    self._file = None
    if self.path is None:
      return
    if resume_step is not None and self.path.exists():
      self.records = records_up_to(read_history(self.path), resume_step)
    files.write_atomically(self.path, "".join(json_line(r) + "\n" for r in self.records))
    self._file = open(self.path, "a")  # noqa: SIM115 - closed by close()

  def append(self, record: dict[str, Any]) -> None:
    """Adds one record (and writes it through to the file).

    Raises:
      MetricsWriteError: when the file cannot be written, naming it and the cause;
        the file is then closed (what it holds stays: a line cut short at its end
        is dropped when it is read back).
    """
    self.records.append(record)
    if self._file is not None:
      try:
        self._file.write(json_line(record) + "\n")
        self._file.flush()
      except OSError as e:
        file, self._file = self._file, None
        with contextlib.suppress(OSError):  # (the same error again, flushing what failed)
          file.close()
        raise self._error(e) from e

  def close(self) -> None:
    """Closes the file.

    Raises:
      MetricsWriteError: when what was left to write cannot be written.
    """
    if self._file is not None:
      file, self._file = self._file, None
      try:
        file.close()
      except OSError as e:
        raise self._error(e) from e

  def _error(self, e: OSError) -> MetricsWriteError:
    error = MetricsWriteError(f"cannot write the metrics file {self.path} ({e.strerror or e})")
    error.errno = e.errno
    return error

  def __enter__(self) -> History:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()
