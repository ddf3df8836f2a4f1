"""Training across processes: 2 processes x 4 CPU devices on 127.0.0.1, gloo collectives."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
TRAIN = [
    "train", "--strategy", "hybrid", "--data-parallel", "2", "--stages", "4", "--hidden", "64",
    "64", "64", "--batch-size", "64", "--source", "sample", "--no-progress",
]  # fmt: skip


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(args, metrics):
  return subprocess.Popen(
    [sys.executable, "-m", "parstrat", *TRAIN, *args, "--metrics", str(metrics)],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env=ENV,
    cwd=ROOT,
  )


def _processes(tmp_path, extra, heartbeat=30):
  port = _free_port()
  return [
      _launch(
          [
              *extra, "--devices", "4", "--coordinator", f"127.0.0.1:{port}",
              "--num-processes", "2", "--process-id", str(i), "--join-timeout", "60",
              "--heartbeat-timeout", str(heartbeat),
          ],
          tmp_path / f"metrics_{i}.jsonl",
      )
      for i in range(2)
  ]  # fmt: skip


def _finish(procs, timeout):
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=timeout))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return outputs


def _losses(path):
  rows = [json.loads(line) for line in path.read_text().splitlines()]
  return [r["loss"] for r in rows if "loss" in r], [r for r in rows if "eval_accuracy" in r]


def test_hybrid_across_two_processes_matches_one_process(tmp_path):
  procs = _processes(tmp_path, ["--epochs", "1", "--steps", "5"])
  outputs = _finish(procs, timeout=240)
  for p, (_, err) in zip(procs, outputs, strict=True):
    assert p.returncode == 0, err[-3000:]
  single = _launch(["--epochs", "1", "--steps", "5", "--devices", "8"], tmp_path / "single.jsonl")
  ((_, err),) = _finish([single], timeout=240)
  assert single.returncode == 0, err[-3000:]

  multi_losses, multi_eval = _losses(tmp_path / "metrics_0.jsonl")
  single_losses, single_eval = _losses(tmp_path / "single.jsonl")
  assert len(multi_losses) == 5
  assert multi_losses == pytest.approx(single_losses, rel=1e-6, abs=1e-7)
  assert multi_eval[0]["eval_accuracy"] == pytest.approx(single_eval[0]["eval_accuracy"])
  # Metrics are written once, by process 0 only; process 1 prints nothing of its own.
  assert not (tmp_path / "metrics_1.jsonl").exists()
  assert "eval accuracy" in outputs[0][0] and "eval accuracy" not in outputs[1][0]
  assert "processes: 2, 4 devices each" in outputs[0][0]


def test_a_lost_process_stops_the_other(tmp_path):
  procs = _processes(tmp_path, ["--epochs", "100"], heartbeat=5)
  metrics = tmp_path / "metrics_0.jsonl"
  try:
    deadline = time.monotonic() + 180
    while not (metrics.exists() and metrics.stat().st_size) and time.monotonic() < deadline:
      assert procs[0].poll() is None, procs[0].communicate()[1][-3000:]
      time.sleep(0.2)
    assert metrics.stat().st_size, "training never started"
    procs[1].kill()
    start = time.monotonic()
    _, err = procs[0].communicate(timeout=120)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert procs[0].returncode != 0
  assert time.monotonic() - start < 120
  assert "another task died" in err or "heartbeat" in err


def test_a_missing_process_times_out_clearly(tmp_path):
  port = _free_port()
  alone = _launch(
      [
          "--epochs", "1", "--devices", "4", "--coordinator", f"127.0.0.1:{port}",
          "--num-processes", "2", "--process-id", "0", "--join-timeout", "5",
      ],
      tmp_path / "alone.jsonl",
  )  # fmt: skip
  ((_, err),) = _finish([alone], timeout=120)
  assert alone.returncode != 0
  assert alone.returncode != 0
  assert "joining 2 processes at 127.0.0.1" in err and "(giving up after 5 s)" in err
  assert "Timeout (0:00:05)!" in err
