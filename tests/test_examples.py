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
  assert accuracy > 0.85 and "on 2000 images" in out
  assert "conformance: TwoLevelDataParallel() with sgd" in out
  assert "conformance: TwoLevelDataParallel() with adam" in out


def test_global_normalization_example():
  out = _run_example("global_normalization.py")
  lines = out.splitlines()
  assert [line.split(" sum")[0].strip() for line in lines] == [
    "pmap(vmap)",
    "shard_map on a 4x2 mesh",
    "normalize_on_mesh",
  ]
  for line in lines:
    assert "sum 1.000000" in line
    assert float(line.rsplit(" ", 1)[1]) < 1e-7


def test_vmap_and_pmap_example():
  out = dict(line.split(": ") for line in _run_example("vmap_and_pmap.py").splitlines())
  assert float(out["max |vmap - pmap|"]) == 0.0
  assert float(out["max |vmap - (x - x.mean(0))|"]) == 0.0
  assert out["psum over devices"] == out["x.sum()"] == "496"
  assert out["pmap output devices"] == "8"


def test_data_parallel_mnist_example_matches_pmap_by_hand():
  out = _run_example("data_parallel_mnist.py")
  hand = float(out.split("pmap by hand:")[1].split("accuracy")[1].split()[0])
  library = float(out.split("parstrat data_parallel:")[1].split("accuracy")[1].split()[0])
  assert hand > 0.85
  assert abs(hand - library) <= 0.002  # same params, same batches: same predictions


def test_pipeline_and_hybrid_example_agree_with_data_parallel():
  out = _run_example("pipeline_and_hybrid_mnist.py")
  rows = {
    line.split()[0]: (float(line.split("steps ")[1].split(",")[0]), float(line.split()[-1]))
    for line in out.splitlines()
    if "loss after" in line
  }
  assert set(rows) == {"data_parallel", "pipeline", "hybrid"}
  losses = [loss for loss, _ in rows.values()]
  assert max(losses) - min(losses) < 1e-4
  assert all(accuracy > 0.85 for _, accuracy in rows.values())
