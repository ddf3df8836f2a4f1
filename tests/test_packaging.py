"""The wheel's metadata: every bundled data file is packaged and its licence ships with it."""

import fnmatch
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_bundled_data_file_is_packaged_with_its_licence():
  project = PYPROJECT["project"]
  assert project["license"] == "Apache-2.0"
  licence_files = project["license-files"]
  for name in licence_files:
    assert (ROOT / name).is_file(), name
  patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["parstrat"]
  data = sorted(
    p.relative_to(ROOT / "parstrat").as_posix() for p in (ROOT / "parstrat/data").iterdir()
  )
  assert data
  for name in data:
    assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), name
  # MNIST's CC BY-SA note (data/README.md) and the Python docs' PSF licence.
  assert "parstrat/data/README.md" in licence_files
  assert "parstrat/data/LICENSE-python-docs.txt" in licence_files
  assert "Attribution-Share Alike 3.0" in (ROOT / "parstrat/data/README.md").read_text()
