"""scripts/setup.sh installs only when pyproject.toml changed, and says nothing otherwise."""

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_setup_installs_once_per_pyproject(tmp_path):
  (tmp_path / "scripts").mkdir()
  shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
  shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
  fake = tmp_path / ".venv" / "bin" / "python"  # records what setup.sh asks of the venv
  fake.parent.mkdir(parents=True)
  fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls"}\n')
  fake.chmod(0o755)
  env = {**os.environ, "PYTHON": sys.executable}

  def setup():
    return subprocess.run(["bash", "scripts/setup.sh"], cwd=tmp_path, env=env, check=True,
                          capture_output=True, text=True)  # fmt: skip

  calls = lambda: (tmp_path / "calls").read_text().splitlines()  # noqa: E731
  first = setup()
  assert [c.split(" install ")[1] for c in calls()] == ["--upgrade pip", "-e .[dev]"]
  second = setup()
  assert second.stdout == second.stderr == "" and len(calls()) == 2  # nothing ran
  with open(tmp_path / "pyproject.toml", "a") as f:
    f.write("# a new dependency\n")
  setup()
  assert len(calls()) == 4  # pyproject.toml changed: installed again
  assert first.stdout == ""
