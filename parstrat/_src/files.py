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
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    pathlib.Path(tmp).unlink(missing_ok=True)
    raise
