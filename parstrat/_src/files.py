"""Writing files so that a crash leaves either the old or the new content, never half."""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets


def write_atomically(path: str | pathlib.Path, text: str | bytes) -> None:
  """Writes `text` (or bytes) to `path` through a temporary file in the same folder and a rename.

  The new file gets the mode a plain write gives (the umask, a folder's default
  ACL), or keeps the one of the file it replaces where the file system allows.

  Example:
    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "a.txt"
    >>> write_atomically(path, "hello")
    >>> path.read_text()
    'hello'
  """
  path = pathlib.Path(path)
  fd, tmp = _create_beside(path)
  try:
    with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
      if path.exists():
        with contextlib.suppress(OSError):  # (a file system that refuses chmod)
          os.fchmod(f.fileno(), path.stat().st_mode & 0o7777)
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise


def _create_beside(path: pathlib.Path) -> tuple[int, pathlib.Path]:
  """A new file `.NAME-XXXXXXXX` in `path`'s folder, opened for writing, as `open` makes it.

  (Not `tempfile.mkstemp`, whose files are 0600 whatever the umask.)
  """
  for _ in range(100):
    tmp = path.with_name(f".{path.name}-{secrets.token_hex(4)}")
    try:
      return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
    except FileExistsError:
      continue
  raise FileExistsError(f"no free temporary name beside {path}")
