"""Every example runs, and prints what it claims."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run_example(name, timeout=600):
  env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
  out = subprocess.run(
    [sys.executable, str(ROOT / "examples" / name)],
    capture_output=True,
    check=False,
    text=True,
    timeout=timeout,
    env=env,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def test_custom_strategy_example_trains_and_passes_the_kit():
  out = _run_example("custom_strategy.py")
  assert "mesh: {'host': 2, 'local': 4}" in out
  accuracy = float(out.split("eval accuracy: ")[1].split()[0])
  assert accuracy > 0.85
  assert "conformance: TwoLevelDataParallel() with sgd" in out
  assert "conformance: TwoLevelDataParallel() with adam" in out


def test_global_normalization_example():
  out = _run_example("global_normalization.py")
  lines = out.splitlines()
  assert len(lines) == 2
  for line in lines:
    assert "sum 1.000000" in line
    assert float(line.rsplit(" ", 1)[1]) < 1e-7
