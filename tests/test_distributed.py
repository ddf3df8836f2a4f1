"""Training across processes: 2 processes x 4 CPU devices on 127.0.0.1, gloo collectives."""

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import textwrap
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
  # One process: this one (8 devices, the same flags; processes of their own are the
  # point of the run above, not of its reference).
  from parstrat._src import cli

  single = ["--epochs", "1", "--steps", "5", "--devices", "8"]
  assert cli.main([*TRAIN, *single, "--metrics", str(tmp_path / "single.jsonl")]) == 0

  multi_losses, multi_eval = _losses(tmp_path / "metrics_0.jsonl")
  single_losses, single_eval = _losses(tmp_path / "single.jsonl")
  assert len(multi_losses) == 5
  assert multi_losses == pytest.approx(single_losses, rel=1e-6, abs=1e-7)
  assert multi_eval[0]["eval_accuracy"] == pytest.approx(single_eval[0]["eval_accuracy"])
  # Metrics are written once, by process 0 only; process 1 prints nothing of its own.
  assert not (tmp_path / "metrics_1.jsonl").exists()
  assert "eval accuracy" in outputs[0][0] and "eval accuracy" not in outputs[1][0]
  assert "processes: 2, 4 devices each" in outputs[0][0]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_process_stopped_by_a_signal_stops_the_other(tmp_path, signum):
  # (A process killed, SIGKILL, stops the others the same way.)
  # SIGTERM: JAX's preemption service would catch it and let the run go on.
  # SIGINT: the process would wait at JAX's shutdown barrier for the other,
  # which waits for it in a collective (minutes).
  procs = _processes(tmp_path, ["--epochs", "100"], heartbeat=5)
  metrics = tmp_path / "metrics_0.jsonl"
  try:
    deadline = time.monotonic() + 180
    while not (metrics.exists() and metrics.stat().st_size) and time.monotonic() < deadline:
      assert procs[0].poll() is None, procs[0].communicate()[1][-3000:]
      time.sleep(0.2)
    assert metrics.stat().st_size, "training never started"
    procs[1].send_signal(signum)
    start = time.monotonic()
    _, stopped_err = procs[1].communicate(timeout=60)
    _, err = procs[0].communicate(timeout=60)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert time.monotonic() - start < 60
  assert procs[0].returncode != 0
  # (gloo's error in the collective, or the coordinator's when the heartbeat stops)
  assert "gloo" in err.lower() or "another task died" in err, err[-3000:]
  if signum == signal.SIGTERM:
    assert procs[1].returncode == -signal.SIGTERM
  else:
    assert procs[1].returncode == 130, stopped_err[-3000:]
    assert "interrupted: SIGINT in a process of several" in stopped_err


def test_resume_if_exists_across_processes_starts_over_process_0s_leg_or_stops_them_all(
  tmp_path,
):
  # Process 1 took process 0's metrics (its --metrics in --checkpoint-dir, left by a leg
  # stopped before its first checkpoint) for another run's and stopped, while process 0
  # went on into a collective and died there with a traceback, at every restart.
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  (ckpt / "metrics_0.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
  (ckpt / "notes.txt").write_text("mine")

  def legs():
    port = _free_port()
    procs = [
      _launch(
        [
          "--steps",
          "1",
          "--checkpoint-dir",
          str(ckpt),
          "--resume-if-exists",
          "--devices",
          "4",
          "--coordinator",
          f"127.0.0.1:{port}",
          "--num-processes",
          "2",
          "--process-id",
          str(i),
          "--join-timeout",
          "60",
        ],
        ckpt / f"metrics_{i}.jsonl",
      )  # fmt: skip
      for i in range(2)
    ]
    return procs, _finish(procs, timeout=240)

  procs, outputs = legs()  # a file no leg leaves: every process stops, in one line
  assert [p.returncode for p in procs] == [2, 2], outputs
  (_, err0), (_, err1) = outputs
  assert "holds no checkpoint but " in err0 and "notes.txt (another run?)" in err0
  assert "another process of the run refused its paths" in err1
  for err in (err0, err1):  # (after the line that says it joins)
    assert "Traceback" not in err and err.count("error:") == 1, err
  (ckpt / "notes.txt").unlink()
  procs, outputs = legs()  # only what process 0's stopped leg left: both start over it
  assert [p.returncode for p in procs] == [0, 0], outputs
  assert [r["step"] for r in map(json.loads, (ckpt / "metrics_0.jsonl").open()) if "loss" in r] == [
    1
  ]
  assert not (ckpt / "metrics_1.jsonl").exists()  # (process 0 alone writes metrics)


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


_DATASET = """
import os
import numpy as np

def data(batch_size):
  rng = np.random.default_rng(int(os.environ["SEED"]))  # what this host's copy holds
  batches = int(os.environ["BATCHES"])
  x = rng.normal(size=(batches * batch_size, 6)).astype(np.float32)
  y = (x[:, 0] > 0).astype(np.int32)
  return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(x), batch_size)], None
"""


def test_processes_given_different_flags_devices_or_data_all_stop_naming_them(tmp_path):
  (dataset := tmp_path / "data.py").write_text(_DATASET)
  (mine := tmp_path / "a.toml").write_text("lr = 0.1\nbatch-size = 64\nepochs = 1\n")
  # (the same keys in another order, a comment: the merged flags are compared, not files)
  (theirs := tmp_path / "b.toml").write_text("# b\nepochs = 1\nbatch-size = 64\nlr = 0.2\n")
  cases = [
    (
      (
        ["--config", str(mine), "--seed", "1"],
        ["--config", str(theirs), "--seed", "2", "--batch-size", "32"],
      ),
      ({}, {}),
      "The processes were given different flags: --batch-size is 64 on process 0, 32 on "
      "process 1; --lr is 0.1 on process 0, 0.2 on process 1; --seed is 1 on process 0, 2 "
      "on process 1. Start every process with the same flags (only --process-id, "
      "--coordinator, --metrics, ",
    ),
    (
      (["--devices", "2"], ["--devices", "4"]),
      ({}, {}),
      "error: The processes have different numbers of devices: 2 on process 0, 4 on "
      "process 1. Give each",
    ),
    (
      (["--dataset", f"{dataset}:data", "--batch-size", "4"],) * 2,
      ({"BATCHES": "3", "SEED": "0"}, {"BATCHES": "5", "SEED": "1"}),
      re.compile(
        r"The processes were given different data: batches per epoch is 3 on process 0, 5 "
        r"on process 1; first example is sha256 \w+ on process 0, sha256 \w+ on process 1. "
        r"Every process must read the same data."
      ),
    ),
  ]
  for flags, env, message in cases:
    port = _free_port()
    common = ["--devices", "4", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
              "--join-timeout", "60"]  # fmt: skip
    procs = [
      subprocess.Popen(
        [
          sys.executable,
          "-m",
          "parstrat",
          *TRAIN,
          *common,
          "--process-id",
          str(i),
          "--metrics",
          str(tmp_path / f"m{i}.jsonl"),
          *flags[i],
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**ENV, **env[i]},
        cwd=ROOT,
      )  # fmt: skip
      for i in range(2)
    ]
    for p, (_, err) in zip(procs, _finish(procs, timeout=120), strict=True):
      assert p.returncode == 2, err[-3000:]
      assert re.search(message, err) if isinstance(message, re.Pattern) else message in err, err[
        -3000:
      ]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a.toml", "b.toml", "data.py"]


_DIFFERENT_BATCHES = textwrap.dedent(
  """
  import sys
  from parstrat._src import distributed
  port, pid = sys.argv[1], int(sys.argv[2])
  distributed.initialize(f"127.0.0.1:{port}", 2, pid, local_cpu_devices=2, timeout_s=60)
  import haiku as hk, jax, numpy as np, optax, parstrat
  for values in ({"--a": "1"} if pid else {"--a": "1", "--c": "2"},
                 {"--a": "1", f"--{pid}": "1"}, {"--a": "1", "--b": "x" * 70 + str(pid)},
                 {"--a": "é" * 40 if pid else "x" * 63}, {"x" * 70 + str(pid): "1"}):
    try:
      distributed.check_same_everywhere("flags", values)
    except ValueError as e:
      print("SAID", e)
  distributed.check_same_everywhere("flags", {"--a": "1", "--b": "x" * 70})
  model = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x)))
  trainer = parstrat.get("data_parallel")(model, optax.sgd(0.1))
  rows = 4 if pid == 0 else 8  # a launcher's bug: process 1 loads twice its rows
  x, y = np.ones((rows, 5), np.float32), np.zeros((rows,), np.int32)
  # (as the CLI does: with a sample_batch, the first step's batch is checked locally
  # against it, which cannot tell the processes apart)
  state = trainer.init(jax.random.key(0), x[:2], sample_batch=(x[:1], y[:1]))
  if pid == 0:
    trainer.lower(state, (x, y))  # one process alone: no collective, no hang
  try:
    trainer.step(state, (x, y))
  except ValueError as e:
    print("SAID", e)
  state, _ = trainer.step(state, (x[:4], y[:4]))  # the state is still usable
  print("SAID trained", float(jax.tree.leaves(state.params)[0].sum()))
  """
)


def test_processes_passing_batches_of_other_shapes_are_told_before_the_step():
  port = _free_port()
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", _DIFFERENT_BATCHES, str(port), str(i)],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env=ENV,
      cwd=ROOT,
    )  # fmt: skip
    for i in range(2)
  ]
  outputs = _finish(procs, timeout=120)
  trained = []
  for p, (out, err) in zip(procs, outputs, strict=True):
    assert p.returncode == 0, err[-3000:]
    lines = [line[5:] for line in out.splitlines() if line.startswith("SAID ")]
    assert lines[:6] == [
      "The processes passed different flags: process 1 has no --c.",
      "The processes passed different flags: process 0 has no --1; process 1 has no --0.",
      "The processes were given different flags: --b is "
      + "x" * 63
      + "... on process 0, "
      + "x" * 63
      + "... on process 1 (they differ further on).",
      "The processes were given different flags: --a is "
      + "x" * 63
      + " on process 0, "
      + "é" * 31
      + "... on process 1.",
      "The processes passed different flags: names that differ after their first 63 bytes.",
      "The processes were given different batches (each process's rows, see "
      "local_batch_rows): batch[0] is (4, 5) float32 on process 0, (8, 5) float32 on process 1;"
      " batch[1] is (4,) int32 on process 0, (8,) int32 on process 1.",
    ]
    assert lines[6].startswith("trained ")
    trained.append(lines[6])
  assert trained[0] == trained[1]


def test_a_coordinator_port_in_use_is_named(tmp_path):
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    alone = _launch(
      ["--devices", "2", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
       "--process-id", "0"],
      tmp_path / "m.jsonl",
    )  # fmt: skip
    ((_, err),) = _finish([alone], timeout=60)
  assert alone.returncode == 2, err[-3000:]  # (JAX's service crashed it at times: SIGSEGV)
  assert (
    f"error: --coordinator: process 0 cannot serve the run at 127.0.0.1:{port}: port {port} "
    "is taken"
  ) in err


def test_processes_compare_strategy_options_in_any_order():
  # (`hosts=4 name=x` on one process and `name=x hosts=4` on another are the same run)
  from parstrat._src import cli

  def flags(*options):
    parser = cli.build_parser()
    return cli._run_flags(cli.parse_args(parser, ["train", "--strategy-option", *options]))

  assert flags("hosts=4", "name=x") == flags("name=x", "hosts=4")
  assert flags("hosts=4") != flags("hosts=2")
