"""Writing files so that a crash leaves either the old or the new content, never half."""

from __future__ import annotations

import os
import pathlib
import tempfile


def write_atomically(path: str | pathlib.Path, text: str | bytes) -> None:
  """Writes `text` (or bytes) to `path` through a temporary file in the same folder and a rename.

  Example:
    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "a.txt"
    >>> write_atomically(path, "hello")
    >>> path.read_text()
    'hello'
  """
  path = pathlib.Path(path)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
  try:
    with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
      # The mode of the file it replaces, or of a new file (mkstemp's is 0600).
      os.fchmod(f.fileno(), path.stat().st_mode & 0o7777 if path.exists() else _new_mode())
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    pathlib.Path(tmp).unlink(missing_ok=True)
    raise


def _new_mode() -> int:
  """The mode `open(path, "w")` gives a new file: 0666 less the process's umask."""
  try:  # (Linux tells it; setting it to read it would change it for other threads meanwhile)
    status = pathlib.Path("/proc/self/status").read_text()
    umask = int(
      next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:")), 8
    )
  except (OSError, StopIteration, ValueError, IndexError):
    umask = os.umask(0o022)
    os.umask(umask)
  return 0o666 & ~umask
