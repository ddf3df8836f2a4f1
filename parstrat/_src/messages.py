"""Error messages that say what to change: valid batch sizes, how to get more devices."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


def closest(word: str, choices: Iterable[str]) -> str | None:
  """The one of `choices` closest to `word`, for a "did you mean" (None when none is close).

  Compared without case and with "-" and "_" alike, so that a name typed as a
  class is spelled (`"PIPELINE"`, `"Data-Parallel"`), a flag as a key
  (`"--batch_size"`), still finds its match; among choices alike but for case
  (`Net` and `net`), the one closest to `word` as typed. The one implementation
  behind every "did you mean" of the library and the command line.

  Args:
    word: what was typed.
    choices: the valid names.

  Returns:
    The closest choice, or None when none is close enough (difflib's ratio
    below 0.6).

  Example:
    >>> closest("PIPELINE", ["data_parallel", "pipeline"])
    'pipeline'
    >>> closest("batchsize", ["batch-size", "seed"])
    'batch-size'
    >>> closest("modle", ["Model", "model"])
    'model'
    >>> closest("xyz", ["pipeline"]) is None
    True
  """

  def fold(text: str) -> str:
    return text.casefold().replace("-", "_")

  alike: dict[str, list[str]] = {}
  for choice in choices:
    alike.setdefault(fold(choice), []).append(choice)
  match = difflib.get_close_matches(fold(word), list(alike), n=1, cutoff=0.6)
  if not match:
    return None
  return max(alike[match[0]], key=lambda c: difflib.SequenceMatcher(None, word, c).ratio())


def first_line(error: BaseException, limit: int = 160) -> str:
  """The first line of an error's message, cut to `limit` characters, for one-line reports.

  Example:
    >>> first_line(ValueError("Dataset x not found.\\nAvailable datasets:\\n - mnist"))
    'Dataset x not found.'
  """
  return (str(error).strip().splitlines() or [""])[0][:limit]


def _library_dirs() -> tuple[str, ...]:
  """The folders of parstrat, of installed packages and of Python's own library."""
  import os
  import site
  import sysconfig

  paths = sysconfig.get_paths()
  dirs = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # the parstrat package
  dirs += [paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths]
  dirs += [*site.getsitepackages(), site.getusersitepackages()]
  return tuple(os.path.abspath(d) + os.sep for d in dirs)


def _library_file(filename: str) -> bool:
  """Whether `filename` is parstrat's, an installed package's or Python's own."""
  import os

  if filename.startswith("<"):  # (<frozen ...>, <string>)
    return True
  return os.path.abspath(filename).startswith(_library_dirs())


def raised_at(error: BaseException) -> str:
  """Where in the user's own code `error` was raised, as " (at FILE:LINE, in FUNCTION)".

  The innermost frame of its traceback outside parstrat, installed packages and
  Python itself (a model's wrong call into Haiku is named at the call), or else
  of the error it was raised from; "" when every frame is theirs (parstrat's
  own checks need no place).

  Example:
    >>> code = compile("def net():\\n  raise ValueError('bad width')\\n", "mymodel.py", "exec")
    >>> user = {}
    >>> exec(code, user)
    >>> try:
    ...   user["net"]()
    ... except ValueError as e:
    ...   raised_at(e)
    ' (at mymodel.py:2, in net)'
    >>> try:  # a check of one's own, raised `from None` over it: no place of theirs
    ...   try:
    ...     user["net"]()
    ...   except ValueError:
    ...     raise TypeError("checked here") from None
    ... except TypeError as e:
    ...   raised_at(e)
    ''
  """
  import traceback

  seen = set()
  while error is not None and id(error) not in seen:  # (then what it was raised from)
    seen.add(id(error))
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
      if not _library_file(frame.filename):
        return f" (at {frame.filename}:{frame.lineno}, in {frame.name})"
    # (what it was raised from; a context hidden by `raise ... from None` is not)
    error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
  return ""


def stacklevel_outside() -> int:
  """The `stacklevel` for `warnings.warn` that names the caller's first frame outside parstrat.

  Called in the function that warns: a warning raised deep in parstrat (`Auto.resolve`
  under `trainer.init`) then points at the user's line that called into parstrat, not
  at parstrat's own code.

  Example:
    >>> stacklevel_outside()  # (called outside parstrat: the caller's own line)
    1
  """
  import os
  import sys

  package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
  frame, level = sys._getframe(1), 1  # (the function that warns: level 1)
  while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
    frame, level = frame.f_back, level + 1
  return level


def nearest_multiples(value: int, multiple: int) -> tuple[int | None, int]:
  """The multiples of `multiple` just below (None if there is none) and just above `value`.

  Example:
    >>> nearest_multiples(256, 3)
    (255, 258)
    >>> nearest_multiples(2, 3)
    (None, 3)
  """
  below = value // multiple * multiple
  return (below or None), below + multiple


class BatchSizeError(ValueError):
  """A batch the strategy's layout cannot split (`batch_size_message` says how it could)."""


def batch_size_message(
  what: str, batch: int, split: str, ways: int, microbatches: int, default_note: str,
  accumulate: int,
) -> str:  # fmt: skip
  """The batch-size error: what the size must divide by, why, and the nearest valid sizes.

  Args:
    what: the batch's name ("the global batch", "images").
    batch: its size.
    split: the devices it is split over, in words.
    ways: how many ways it is split.
    microbatches: the plan's microbatches (1 for none).
    default_note: `microbatches_default(strategy)`, where M came from.
    accumulate: gradient-accumulation microsteps.

  Example:
    >>> msg = batch_size_message(
    ...     "the global batch", 256, "P('data',)", 1, 3, " (default: one per stage)", 1)
    >>> msg.startswith("The batch size of the global batch must be a positive multiple of 3 "
    ...                "(3 microbatches (default: one per stage)), got 256")
    True
    >>> msg.endswith("got 256; the nearest valid sizes are 255 and 258.")
    True
  """
  multiple = ways * microbatches * accumulate
  parts = [f"{ways} devices along {split}"] if ways > 1 else []  # (none: not split over any)
  if microbatches > 1:
    parts.append(f"{microbatches} microbatches{default_note}")
  if accumulate > 1:
    parts.append(f"accumulate={accumulate}")
  detail = " x ".join(parts)
  below, above = nearest_multiples(batch, multiple)
  nearest = f"{below} and {above}" if below else f"{above}"
  plural = "s are" if below else " is"
  return (
    f"The batch size of {what} must be a positive multiple of {multiple}"
    + (f" ({detail})" if detail else "")
    + f", got {batch}; the nearest valid size{plural} {nearest}."
  )


def microbatches_default(strategy: Any) -> str:
  """Where a strategy's M came from when `microbatches` was left to its default, or "".

  Example:
    >>> import parstrat
    >>> microbatches_default(parstrat.PipelineModelParallel(stages=2))
    ' (default: one per stage)'
  """
  if getattr(strategy, "microbatches", 0) is not None:
    return ""
  if hasattr(getattr(strategy, "schedule", None), "microbatches"):  # a `Schedule` given
    return " (default: the given schedule's)"
  return " (default: one per stage)"


class TooFewDevicesError(ValueError):
  """A mesh needs more devices than there are; says how to make virtual CPU devices.

  Attributes:
    needed: devices the mesh needs.
    available: devices there are.
  """

  def __init__(self, mesh: str, needed: int, available: int, platform: str):
    self.needed, self.available = needed, available
    self.base = f"The mesh {mesh} needs {needed} devices, but only {available} are available."
    hint = ""
    if platform == "cpu":
      hint = (
        f" On CPU, make {needed} virtual devices before JAX starts: "
        f"parstrat.testing.use_cpu_devices({needed}) (or `parstrat train --devices {needed}`)."
      )
    super().__init__(self.base + hint)
