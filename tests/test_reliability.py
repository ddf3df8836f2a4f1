"""Runs that lose nothing (issue 13): killed, corrupted and mis-driven on purpose.

Each test is one row of the README's reliability table.
"""

import contextlib
import gc
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import parstrat
from parstrat._src import cli
from parstrat._src import datasets
from parstrat._src import optimizers
from parstrat._src.history import History
from parstrat._src.history import read_history
from parstrat.checkpoint import CheckpointDoesNotFit
from parstrat.checkpoint import Checkpointer
from parstrat.checkpoint import CheckpointError
from parstrat.checkpoint import CheckpointWarning

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = hk.transform(lambda x: hk.nets.MLP([16, 10], activation=jax.nn.swish)(x))
X = np.random.default_rng(0).normal(size=(8, 12)).astype(np.float32)
Y = np.arange(8, dtype=np.int32) % 10
TRAIN = ["train", "--epochs", "1", "--batch-size", "64", "--source", "sample", "--no-progress",
         "--hidden", "16", "--devices", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def trainer():
  trainer = parstrat.DataParallel(data=2)(MODEL, optax.adam(1e-2))
  trainer.initial = trainer.init(jax.random.key(0), X[:1])
  return trainer


def _fresh(trainer):
  """A copy of the initial state (a new `init` would drop the compiled step)."""
  return jax.tree.map(jnp.copy, trainer.initial)


def _steps(path) -> list[int]:
  return [r["step"] for r in read_history(path) if "loss" in r]


def _one_line(text: str) -> str:
  lines = text.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in text, text
  return lines[0]


# ------------------------------------------------------------------ metrics history


def test_history_resumes_at_the_checkpoint_step_without_losing_or_repeating(tmp_path):
  path = tmp_path / "metrics.jsonl"
  with History(path) as history:
    for step in range(1, 14):  # the checkpoint is at 10; the crash came at 13
      history.append({"step": step, "loss": 1.0})
    history.append({"step": 10, "eval_accuracy": 0.5})
  with open(path, "a") as f:
    f.write('{"step": 14, "lo')  # killed in the middle of a line
  before = path.read_text()
  with pytest.raises(FileNotFoundError):
    History(tmp_path / "missing" / "metrics.jsonl", resume_step=10)
  assert path.read_text() == before  # nothing is touched before the history opens
  with History(path, resume_step=10) as history:
    assert [r["step"] for r in history.records if "loss" in r] == list(range(1, 11))
    for step in range(11, 21):
      history.append({"step": step, "loss": 0.5})
  assert _steps(path) == list(range(1, 21))
  assert [r for r in read_history(path) if "eval_accuracy" in r] == [
    {"step": 10, "eval_accuracy": 0.5}
  ]


def test_a_nonfinite_metric_is_strict_json_null_and_still_drawn(tmp_path):
  # json.dumps wrote NaN, which JSON has not: jq and JavaScript refuse the whole file.
  from parstrat._src import report

  def strict(text):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in {text}"))

  path = tmp_path / "metrics.jsonl"
  with History(path) as history:
    history.append({"step": 1, "loss": 2.0, "grad_norm": float("inf")})
    history.append({"step": 2, "loss": float("nan"), "grad_norm": 1.0})
  assert [strict(line)["loss"] for line in path.read_text().splitlines()] == [2.0, None]
  with History(path, resume_step=2) as history:  # rewritten on resume: still strict
    history.append({"step": 3, "loss": 1.0, "grad_norm": 1.0})
  rows = [strict(line) for line in path.read_text().splitlines()]
  assert [(r["loss"], r["grad_norm"]) for r in rows] == [(2.0, None), (None, 1.0), (1.0, 1.0)]
  report.draw_training_report({"run": read_history(path)}, tmp_path / "report.png")
  assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_files_written_whole_have_the_mode_a_plain_write_gives(tmp_path):
  # Through mkstemp, reports and metrics were 0600: unreadable in a group's results folder.
  from parstrat._src import files

  umask = os.umask(0o027)
  try:
    files.write_atomically(tmp_path / "report.png", b"\x89PNG")
  finally:
    os.umask(umask)
  assert (tmp_path / "report.png").stat().st_mode & 0o777 == 0o640
  (tmp_path / "metrics.jsonl").write_text("")
  (tmp_path / "metrics.jsonl").chmod(0o604)
  files.write_atomically(tmp_path / "metrics.jsonl", "{}\n")  # (a file replaced: its mode)
  assert (tmp_path / "metrics.jsonl").stat().st_mode & 0o777 == 0o604


def test_a_report_interrupted_while_drawn_leaves_the_one_before(tmp_path, monkeypatch):
  # matplotlib wrote the picture in place: a run killed while drawing it left half a PNG.
  import matplotlib.figure

  from parstrat._src import report

  def interrupted(figure, target, **kwargs):
    if isinstance(target, (str, os.PathLike)):
      target = open(target, "wb")  # noqa: SIM115 (left open, as a killed process does)
    target.write(b"\x89PNG half")
    raise KeyboardInterrupt

  path = tmp_path / "report.png"
  path.write_bytes(b"the run's report")
  monkeypatch.setattr(matplotlib.figure.Figure, "savefig", interrupted)
  with pytest.raises(KeyboardInterrupt):
    report.draw_training_report({"run": [{"step": 1, "loss": 1.0}]}, path)
  assert path.read_bytes() == b"the run's report" and os.listdir(tmp_path) == ["report.png"]


def test_cli_resume_appends_falls_back_past_a_damaged_checkpoint_and_stops_when_done(
  tmp_path, capsys, monkeypatch
):
  from parstrat._src import report

  drawn = []  # the records each report is drawn from

  def draw(runs, path):
    drawn.append(runs)
    path.touch()  # (a complete run draws its report again only where it is missing)

  monkeypatch.setattr(report, "draw_training_report", draw)
  ckpt = tmp_path / "ck"
  flags = [*TRAIN, "--checkpoint-dir", str(ckpt), "--save-every", "5"]
  assert cli.main([*flags, "--steps", "10"]) == 0
  assert cli.main([*flags, "--steps", "20", "--resume"]) == 0
  metrics = ckpt / "metrics.jsonl"
  assert _steps(metrics) == list(range(1, 21))  # 10 steps + resume to 20: 20 lines
  losses = {r["step"]: r["loss"] for r in read_history(metrics) if "loss" in r}
  assert [r["step"] for r in drawn[-1]["data_parallel"] if "loss" in r] == list(range(1, 21))
  capsys.readouterr()

  # A finished run: one line, exit 0, the metrics file untouched.
  before = metrics.read_bytes()
  assert cli.main([*flags, "--steps", "20", "--resume"]) == 0
  out = capsys.readouterr().out
  assert f"the run in {ckpt} is already complete at step 20: nothing to train" in out
  assert "resumed from" not in out and metrics.read_bytes() == before
  assert cli.main([*flags, "--steps", "15", "--resume"]) == 0  # (it said "already complete")
  assert f"the run in {ckpt} is at step 20, past --steps 15: nothing to train" in (
    capsys.readouterr().out
  )
  assert metrics.read_bytes() == before

  # A line added by hand that is no step's record: one line naming it (a KeyError's
  # traceback before), nothing trained, the file as it was.
  metrics.write_bytes(before.replace(b"\n", b'\n{"note": "hand-added"}\n', 1))
  edited = metrics.read_bytes()
  assert cli.main([*flags, "--steps", "22", "--resume"]) == 2
  assert (
    f'metrics file {metrics}, line 2: not a record of a step (a JSON object with an integer "step")'
    in _one_line(capsys.readouterr().err)
  )
  assert metrics.read_bytes() == edited and not (ckpt / "22").exists()
  metrics.write_bytes(before)

  # Flip 4096 bytes of the newest checkpoint's biggest data file: step 15 is used instead.
  data = max((ckpt / "20" / "state").rglob("d/*"), key=lambda p: p.stat().st_size)
  raw = bytearray(data.read_bytes())
  middle = len(raw) // 2 - 2048
  raw[middle : middle + 4096] = bytes(b ^ 0xFF for b in raw[middle : middle + 4096])
  data.write_bytes(bytes(raw))
  restore = Checkpointer.restore

  def restore_with_warnings(self, *args, **kwargs):
    warnings.warn("a warning silenced by the user", UserWarning, stacklevel=1)
    warnings.warn("a warning silenced but then asked for", UserWarning, stacklevel=1)
    return restore(self, *args, **kwargs)

  monkeypatch.setattr(Checkpointer, "restore", restore_with_warnings)
  with warnings.catch_warnings():  # (as -W or PYTHONWARNINGS give them: they stay so)
    warnings.filterwarnings("ignore", "a warning silenced")
    warnings.filterwarnings("always", "a warning silenced but")  # (in front: it wins)
    assert cli.main([*flags, "--steps", "22", "--resume"]) == 0
  monkeypatch.setattr(Checkpointer, "restore", restore)
  out = capsys.readouterr().out
  warning = [line for line in out.splitlines() if line.startswith("warning:")]
  assert warning[0] == "warning: a warning silenced but then asked for"
  warning = warning[1:]
  assert len(warning) == 1 and "step 20 has state/" in warning[0]
  assert "with a different checksum than was written; restored step 15" in warning[0]
  assert "resumed from" in out and "at step 15" in out
  assert _steps(metrics) == list(range(1, 23))  # 16..20 trained again, once each
  again = {r["step"]: r["loss"] for r in read_history(metrics) if "loss" in r}
  assert [again[s] for s in range(16, 21)] == [losses[s] for s in range(16, 21)]

  # Another learning rate needs --allow-config-change, and is printed.
  assert cli.main([*flags, "--steps", "24", "--resume", "--lr", "0.01"]) == 2
  err = _one_line(capsys.readouterr().err)
  assert "written with another configuration (lr 0.001 -> 0.01)" in err
  assert "--allow-config-change" in err and _steps(metrics) == list(range(1, 23))
  # (this leg also writes its metrics elsewhere, as a leg without the first's --out
  # would: it says where the run's are; a new file started without a word before)
  elsewhere = tmp_path / "elsewhere" / "metrics.jsonl"
  assert cli.main([*flags, "--steps", "24", "--resume", "--lr", "0.01", "--allow-config-change",
                   "--out", str(elsewhere.parent)]) == 0  # fmt: skip
  out = capsys.readouterr().out
  assert "resuming with a changed configuration: lr 0.001 -> 0.01" in out
  assert (
    f"the run's metrics up to step 22 are in {metrics.resolve()}; this leg writes {elsewhere} "
    "(give the first leg's --out or --metrics to continue that file)"
  ) in out.splitlines()
  assert _steps(elsewhere) == [23, 24] and _steps(metrics) == list(range(1, 23))
  with Checkpointer(ckpt) as saved:
    assert saved.all_steps() == [20, 22, 24] and all(saved.verify(s) is None for s in (20, 24))

  # A fresh run into the used directory is refused, or replaces it with --overwrite.
  assert cli.main([*TRAIN, "--checkpoint-dir", str(ckpt), "--steps", "2"]) == 2
  assert "is not empty (another run?)" in _one_line(capsys.readouterr().err)
  assert cli.main([*TRAIN, "--checkpoint-dir", str(ckpt), "--steps", "2", "--overwrite"]) == 0
  assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["2"]
  assert _steps(metrics) == [1, 2]


def test_cli_a_cosine_schedule_resumes_on_its_own_length(tmp_path, capsys):
  # The cosine's length was the invocation's last step, and not in the checkpoint:
  # stopping at step 3 and resuming to 6 silently decayed to 0 at 3, then restarted
  # a 6-step curve. Now the length is recorded (and guarded); --schedule-steps fixes it.
  # A row every 2 steps: the row at step 4 and the epoch's loss span the resume at 3
  # (they were the mean of the steps since the resume). The first leg's end at step 5
  # is lost (its checkpoint deleted, as in a crash before the save), so the run
  # resumes at 3 and drops the rows after it.
  flags = [*TRAIN, "--optimizer", "sgd", "--lr", "0.05", "--lr-schedule", "cosine",
           "--log-every", "2"]  # fmt: skip

  def history(directory):
    rows = [r for r in read_history(directory / "metrics.jsonl") if "loss" in r]
    return [(r["step"], r["loss"], r["learning_rate"]) for r in rows]

  def epoch_line(out):
    return next(line for line in out.splitlines() if line.startswith("epoch 1: loss"))

  capsys.readouterr()
  straight = tmp_path / "straight"
  assert cli.main([*flags, "--checkpoint-dir", str(straight), "--steps", "6"]) == 0
  expected = epoch_line(capsys.readouterr().out)
  assert "(mean of 6 steps)" in expected
  legs = tmp_path / "legs"
  leg = [*flags, "--checkpoint-dir", str(legs), "--save-every", "3", "--schedule-steps", "6"]
  assert cli.main([*leg, "--steps", "5"]) == 0
  shutil.rmtree(legs / "5")
  capsys.readouterr()
  assert cli.main([*leg, "--steps", "6", "--resume"]) == 0
  out = capsys.readouterr().out
  assert "at step 3" in out and epoch_line(out) == expected
  assert [row[0] for row in history(legs)] == [2, 4, 6]
  assert history(legs) == history(straight)
  # A leg that ends at 3 logs step 3 alone; the resumed run's row at 4 is then step 4's
  # loss alone (each step in one row), which the straight run's row averages with 3's.
  ended = tmp_path / "ended"
  leg = [*flags, "--checkpoint-dir", str(ended), "--save-every", "3", "--schedule-steps", "6"]
  assert cli.main([*leg, "--steps", "3"]) == 0
  assert cli.main([*leg, "--steps", "6", "--resume"]) == 0
  rows, expected = {r[0]: r[1] for r in history(ended)}, {r[0]: r[1] for r in history(straight)}
  assert sorted(rows) == [2, 3, 4, 6] and rows[6] == expected[6]
  assert rows[4] == pytest.approx(2 * expected[4] - rows[3], rel=1e-5)
  assert history(straight)[-1][2] > 0 and history(straight)[0][2] > history(straight)[-1][2]

  unplanned = tmp_path / "unplanned"
  leg = [*flags, "--checkpoint-dir", str(unplanned), "--save-every", "3"]
  assert cli.main([*leg, "--steps", "3"]) == 0
  capsys.readouterr()
  assert cli.main([*leg, "--steps", "6", "--resume"]) == 2
  err = _one_line(capsys.readouterr().err)
  assert "written with another configuration (schedule_steps 3 -> 6)" in err
  assert cli.main([*leg, "--steps", "6", "--resume", "--allow-config-change"]) == 0
  assert "changed configuration: schedule_steps 3 -> 6" in capsys.readouterr().out


def test_ctrl_c_or_sigterm_stops_after_the_step_saves_and_resumes(tmp_path):
  # Ctrl-C (or a preemption's SIGTERM) used to end in a traceback, with no checkpoint
  # of the steps since the last one and orbax's temporary folder left behind.
  # Both signals get the one handler while training; Ctrl-C is sent to a real run.
  before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  stop = cli._StopRequests(print).install()  # noqa: SLF001
  try:
    assert signal.getsignal(signal.SIGINT) == signal.getsignal(signal.SIGTERM) == stop._request  # noqa: SLF001
  finally:
    stop.close()
  assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
  signum = signal.SIGINT
  ckpt = tmp_path / "ck"
  flags = [*TRAIN, "--checkpoint-dir", str(ckpt), "--save-every", "1000", "--epochs", "50"]
  env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
  with subprocess.Popen(
    [sys.executable, "-m", "parstrat", *flags], stdout=subprocess.PIPE,
    stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
  ) as process:  # fmt: skip
    metrics = ckpt / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
      assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
      time.sleep(0.05)
    process.send_signal(signum)
    out, err = process.communicate(timeout=240)
  assert process.returncode == 128 + signum, err
  name = signal.Signals(signum).name
  line = _one_line(err)
  step = int(re.search(rf"interrupted: {name} at step (\d+), after the step", line).group(1))
  assert f"checkpoint saved in {ckpt}; continue with --resume" in line
  assert f"{name}: stopping after this step" in out
  saved = [p.name for p in ckpt.iterdir() if not p.name.startswith(("metrics", "events"))]
  assert saved == [str(step)]  # that step, and no orbax temporary folder
  assert _steps(metrics)[-1] == step  # the last steps are logged too
  with Checkpointer(ckpt) as saved:
    assert saved.verify(step) is None
  assert cli.main([*flags, "--steps", str(step + 2), "--resume"]) == 0
  assert _steps(metrics) == list(range(1, step + 3))


def test_a_fresh_run_into_a_used_out_is_refused_and_overwrite_clears_its_curves(tmp_path):
  # A fresh run into the same --out silently replaced metrics.jsonl, and --overwrite
  # left the old run's TensorBoard event files beside the new ones (two runs, one chart).
  out = tmp_path / "run"
  assert cli.main([*TRAIN, "--out", str(out), "--steps", "3"]) == 0
  before = (out / "metrics.jsonl").read_bytes()
  assert cli.main([*TRAIN, "--out", str(out), "--steps", "2"]) == 2
  assert (out / "metrics.jsonl").read_bytes() == before
  assert cli.main([*TRAIN, "--out", str(out), "--steps", "2", "--overwrite"]) == 0
  assert _steps(out / "metrics.jsonl") == [1, 2]
  events = list(out.glob("events.out.tfevents.*"))
  assert len(events) == 1 and events[0].stat().st_size > 0


def test_resume_with_another_model_is_one_line_and_leaves_the_metrics(tmp_path):
  ckpt = tmp_path / "ck"
  assert cli.main([*TRAIN, "--checkpoint-dir", str(ckpt), "--steps", "3"]) == 0
  before = (ckpt / "metrics.jsonl").read_bytes()
  out = subprocess.run(  # a process of its own, to see how it exits
    [sys.executable, "-m", "parstrat", *TRAIN, "--checkpoint-dir", str(ckpt), "--steps", "6",
     "--resume", "--hidden", "8"],
    capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
    timeout=300, check=False,
  )  # fmt: skip
  assert out.returncode == 2
  assert _one_line(out.stderr) == (
    "parstrat train: error: --resume: The checkpoint at step 3 does not fit this model: "
    "params['mlp/~/linear_0']['b']: shape (16,), expected (8,)."
  )  # no orbax traceback, and no "ImportError: sys.meta_path is None" at exit
  assert (ckpt / "metrics.jsonl").read_bytes() == before


def test_resume_with_another_optimizer_is_refused_in_one_line_naming_the_change(tmp_path, capsys):
  # --allow-config-change used to restore first and fail on the optimizer state's tree,
  # blaming "this model"; a change orbax cannot restore into is now named as such.
  ckpt = tmp_path / "ck"
  flags = [*TRAIN, "--checkpoint-dir", str(ckpt), "--optimizer", "sgd", "--lr", "0.1"]
  assert cli.main([*flags, "--steps", "2"]) == 0
  before = (ckpt / "metrics.jsonl").read_bytes()
  capsys.readouterr()
  resume = [*TRAIN, "--checkpoint-dir", str(ckpt), "--steps", "4", "--resume", "--lr", "0.1"]
  assert cli.main([*resume, "--optimizer", "adamw"]) == 2  # refused before any array is read
  err = _one_line(capsys.readouterr().err)
  assert "another configuration (optimizer sgd -> adamw)" in err
  assert cli.main([*resume, "--optimizer", "adamw", "--allow-config-change"]) == 2
  err = _one_line(capsys.readouterr().err)
  assert "fits this model's params but not this trainer's optimizer" in err
  assert "This run changes optimizer sgd -> adamw" in err and "cannot be resumed" in err
  assert "add --fresh-optimizer" in err
  assert (ckpt / "metrics.jsonl").read_bytes() == before
  # A change that keeps the state's layout continues.
  assert cli.main([*resume, "--optimizer", "sgd", "--lr", "0.05", "--allow-config-change"]) == 0
  assert "resuming with a changed configuration: lr 0.1 -> 0.05" in capsys.readouterr().out
  # --fresh-optimizer: the params go on; adamw's state and its warm-up start at step 4,
  # and a later plain resume keeps counting the warm-up from there.
  assert cli.main([*TRAIN, "--fresh-optimizer", "--steps", "6"]) == 2
  assert "--fresh-optimizer restarts the optimizer of a resumed run: add --resume" in (
    _one_line(capsys.readouterr().err)
  )
  cosine = [*TRAIN, "--checkpoint-dir", str(ckpt), "--resume", "--lr-schedule", "cosine"]
  assert cli.main([*cosine, "--fresh-optimizer", "--steps", "6"]) == 2
  assert "pass --schedule-steps N, its length from there" in _one_line(capsys.readouterr().err)
  adamw = [*TRAIN, "--checkpoint-dir", str(ckpt), "--resume", "--optimizer", "adamw",
           "--lr", "0.1", "--warmup-steps", "4"]  # fmt: skip
  assert cli.main([*adamw, "--steps", "6", "--allow-config-change", "--fresh-optimizer"]) == 0
  assert "--fresh-optimizer: the optimizer state starts anew at step 4" in capsys.readouterr().out
  assert cli.main([*adamw, "--steps", "8"]) == 0
  rows = [r for r in read_history(ckpt / "metrics.jsonl") if "loss" in r]
  assert [r["step"] for r in rows] == list(range(1, 9))
  warmup = optimizers.learning_rate_schedule(0.1, schedule="constant", warmup_steps=4,
                                             total_steps=None)  # fmt: skip
  assert [r["learning_rate"] for r in rows[4:]] == pytest.approx(
    [float(warmup(i)) for i in range(4)]
  )


# ------------------------------------------------------------------ checkpoint integrity


def _save(trainer, directory, steps):
  state = _fresh(trainer)
  saved = {}
  with Checkpointer(directory) as ckpt:
    for step in steps:
      state, _ = trainer.step(state, (X, Y))
      ckpt.save(trainer, state, {"at": step}, step=step)
      saved[step] = jax.device_get(trainer.params(state))
  return saved


def _flip(folder):
  data = max(folder.rglob("d/*"), key=lambda p: p.stat().st_size)
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 3 :] = bytes(b ^ 0x5A for b in raw[len(raw) // 3 :])
  data.write_bytes(bytes(raw))


def _flip_every_part(folder):
  # Without a manifest, nothing checks a file the read does not need, and ocdbt can
  # leave such files behind (a superseded b-tree node): flipping only the largest
  # file then damaged nothing once in ~30 saves. Every file covers what is read.
  for path in folder.rglob("d/*"):
    raw = path.read_bytes()
    path.write_bytes(bytes(b ^ 0x5A for b in raw))


def _truncate(folder):
  data = max(folder.rglob("d/*"), key=lambda p: p.stat().st_size)
  data.write_bytes(data.read_bytes()[:100])


def _delete_part(folder):
  for path in folder.rglob("d/*"):  # the data files; the metadata stays
    path.unlink()


def _delete_part_and_manifest(folder):
  _delete_part(folder)
  (folder / "parstrat_manifest.json").unlink()


@contextlib.contextmanager
def _unraisable_to(found):
  previous = sys.unraisablehook
  sys.unraisablehook = found.append
  try:
    yield
  finally:
    sys.unraisablehook = previous


@pytest.mark.parametrize(
  "damage, problem",
  [
    (_flip, "with a different checksum than was written"),
    (_truncate, "bytes, "),
    (_delete_part, "lacks state/"),
    (_delete_part_and_manifest, "cannot be read (ValueError: "),  # orbax itself fails
  ],
  ids=["flipped bytes", "truncated file", "deleted files", "deleted files and manifest"],
)
def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(
  trainer, tmp_path, damage, problem
):
  saved = _save(trainer, tmp_path, [1, 2, 3])
  damage(tmp_path / "3")
  leaked = []  # what reaches sys.unraisablehook: orbax's reads left a dozen tracebacks
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.verify(2) is None and ckpt.verify(3) is not None
    with warnings.catch_warnings(record=True) as caught, _unraisable_to(leaked):
      warnings.simplefilter("always")
      state, meta = ckpt.restore(trainer)
      with pytest.raises(CheckpointError, match="No intact checkpoint .*: step 3 "):
        ckpt.restore(trainer, step=3)
      gc.collect()
  assert not leaked, leaked[0].exc_value
  assert meta == {"at": 2} and int(state.step) == 2
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(trainer.params(state)), saved[2])
  (message,) = [str(w.message) for w in caught if w.category is CheckpointWarning]
  assert message.startswith(f"skipped damaged checkpoint(s) in {tmp_path}: step 3 ")
  assert problem in message and message.endswith("restored step 2, the newest intact one")
  assert "\n" not in message


def test_training_again_after_a_fallback_never_pushes_out_the_intact_checkpoints(trainer, tmp_path):
  # keep=2 and a damaged step 3: without deleting it, saving step 2 again
  # would make orbax keep [3 (damaged), 2] and delete the intact step 1.
  _save(trainer, tmp_path, [1, 2, 3])
  _flip(tmp_path / "3")
  with Checkpointer(tmp_path, keep=2) as ckpt:
    with pytest.warns(CheckpointWarning, match="step 3 "):
      state, _ = ckpt.restore(trainer)
    ckpt.delete(2)  # as if the crash had also lost step 2: restore step 1
    with pytest.warns(CheckpointWarning, match="restored step 1"):
      state, _ = ckpt.restore(trainer)
    state, _ = trainer.step(state, (X, Y))
    assert ckpt.save(trainer, state, {"at": 2}, step=2)
    assert ckpt.all_steps() == [1, 2]
    assert ckpt.verify(1) is None and ckpt.verify(2) is None


def test_without_a_manifest_a_checkpoint_restores_with_a_warning_and_a_damaged_step_is_rewritten(
  trainer, tmp_path
):
  _save(trainer, tmp_path, [1, 2])
  (tmp_path / "2" / "parstrat_manifest.json").unlink()  # killed between orbax and the manifest
  with Checkpointer(tmp_path) as ckpt, pytest.warns(CheckpointWarning, match="restored it unverif"):
    state, _ = ckpt.restore(trainer)
  assert int(state.step) == 2
  _flip_every_part(tmp_path / "2")  # damaged (verified by its data's failure to read)
  with Checkpointer(tmp_path) as ckpt:
    with pytest.warns(CheckpointWarning, match="restored step 1"):
      state, _ = ckpt.restore(trainer)
    with warnings.catch_warnings():  # (the skipped step goes without a word)
      warnings.simplefilter("error")
      assert ckpt.save(trainer, state, {"at": 2}, step=2)  # the damaged step 2 written again
    assert ckpt.verify(2) is None
    for step in (1, 2):
      ckpt.delete(step)
    with pytest.raises(FileNotFoundError):
      ckpt.restore(trainer)


def test_a_save_after_restoring_an_earlier_step_replaces_the_abandoned_run(trainer, tmp_path):
  # The save at an existing step wrote nothing (returned False), and the abandoned
  # run's steps 3 and 4 stayed: `restore()` brought that run back and lost the new one.
  _save(trainer, tmp_path, [1, 2, 3, 4])
  with Checkpointer(tmp_path) as ckpt:
    state, _ = ckpt.restore(trainer, step=2)
    state, _ = trainer.step(state, (X[::-1], Y[::-1]))  # other data from step 2 on
    with pytest.warns(CheckpointWarning, match=r"restoring step 2: deleted .* step\(s\) 3, 4"):
      assert ckpt.save(trainer, state, {"at": "new"})
    assert ckpt.all_steps() == [2, 3]  # (keep=3: step 1 went at step 4)
    assert not ckpt.save(trainer, state, {"at": "new"}, force=True)  # (this state: held)
  with Checkpointer(tmp_path) as ckpt:
    restored, meta = ckpt.restore(trainer)
    assert meta == {"at": "new"}
    chex.assert_trees_all_equal(trainer.params(restored), trainer.params(state))
  # A save of the restored step and meta writes and deletes nothing; with other meta (or
  # after a restore with fresh_optimizer) that step is written again.
  with Checkpointer(tmp_path) as ckpt:
    held, meta = ckpt.restore(trainer, step=2)
    assert not ckpt.save(trainer, held, meta, force=True)
    assert ckpt.all_steps() == [2, 3]
    with pytest.warns(CheckpointWarning, match=r"restoring step 2: deleted .* step\(s\) 3 in"):
      assert ckpt.save(trainer, held, {"at": "again"}, force=True)
    assert ckpt.all_steps() == [2] and ckpt.metadata(2) == {"at": "again"}
    # The same object after its own writes: a restore further back, then the steps it
    # wrote are those of the run abandoned there (it kept its own step 3 before).
    state, _ = trainer.step(held, (X, Y))
    assert ckpt.save(trainer, state, {"at": "first"})
    ckpt.restore(trainer, step=2)
    with pytest.warns(CheckpointWarning, match=r"restoring step 2: deleted .* step\(s\) 3 in"):
      assert ckpt.save(trainer, state, {"at": "second"})
    assert ckpt.metadata(3) == {"at": "second"}
    ckpt.delete(3)
  _save(trainer, tmp_path, [3])
  with Checkpointer(tmp_path) as ckpt:
    restored, meta = ckpt.restore(trainer, step=2)
    assert meta == {"at": "again"}
    # A save before the restored step, over checkpoints of that run: two runs mixed.
    with pytest.raises(CheckpointError, match=r"holds checkpoint\(s\) at step\(s\) 2, 3, not"):
      ckpt.save(trainer, _fresh(trainer), {}, step=1)
    assert ckpt.all_steps() == [2, 3]
    with pytest.raises(TypeError, match="meta must be a dict of JSON-able values, got list"):
      ckpt.save(trainer, state, [1, 2], force=True)


def test_a_checkpoint_restored_into_other_dtypes_says_so(trainer, tmp_path):
  # A float32 checkpoint went into a bfloat16 model rounded, without a word (only
  # shapes were compared; orbax casts).
  _save(trainer, tmp_path, [1])
  bf16 = hk.transform(lambda x: hk.nets.MLP([16, 10])(x.astype(jnp.bfloat16)).astype(jnp.float32))
  other = parstrat.DataParallel(data=2)(bf16, optax.adam(1e-2))
  other.init(jax.random.key(0), X[:1])
  with Checkpointer(tmp_path) as ckpt:
    with pytest.warns(CheckpointWarning, match=re.escape(
      "holds other dtypes than this trainer: restored with a cast, "
      "params['mlp/~/linear_0']['b']: float32 -> bfloat16 and 11 more leaves")):  # fmt: skip
      state, _ = ckpt.restore(other)
  assert other.params(state)["mlp/~/linear_0"]["w"].dtype == jnp.bfloat16


def test_a_checkpoint_of_another_model_is_refused_before_orbax_reads_it(
  trainer, tmp_path, monkeypatch
):
  _save(trainer, tmp_path, [1])
  other = parstrat.DataParallel(data=2)(
    hk.transform(lambda x: hk.nets.MLP([16, 7])(x)), optax.adam(1e-2)
  )
  other.init(jax.random.key(0), X[:1])
  import orbax.checkpoint as ocp

  def never(*args, **kwargs):
    raise AssertionError("orbax was asked to restore")

  monkeypatch.setattr(ocp.CheckpointManager, "restore", never)
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(CheckpointDoesNotFit, match=re.escape(
      "The checkpoint at step 1 does not fit this model: params['mlp/~/linear_1']['b']: "
      "shape (10,), expected (7,).")):  # fmt: skip
      ckpt.restore(other)


def test_the_readme_reads_a_checkpoint_with_plain_orbax_from_a_relative_path(
  trainer, tmp_path, monkeypatch
):
  readme = (ROOT / "README.md").read_text()
  section = readme[readme.index("Without parstrat, plain orbax reads it") :]
  code = section[section.index("```python") + len("```python") : section.index("```\n\n")]
  _save(trainer, tmp_path / "ckpt", [40])
  monkeypatch.chdir(tmp_path)
  scope = {}
  exec(code, scope)  # the README's lines, with the README's relative path "ckpt/40/state"
  assert set(scope["saved"]["params"]) == {"mlp/~/linear_0", "mlp/~/linear_1"}
  assert set(scope["saved"]) == {"step", "params", "opt_state", "rng", "model_state"}


# ------------------------------------------------------------------ non-finite updates


def test_an_infinite_learning_rate_never_writes_a_nonfinite_param(tmp_path, capsys):
  bad = parstrat.DataParallel(data=2)(MODEL, optax.adam(jnp.inf), skip_nonfinite=True)
  state = bad.init(jax.random.key(0), X[:1])
  before = jax.device_get(bad.export_state(state))
  state, metrics = bad.step(state, (X, Y))
  assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
  assert not bool(metrics["finite"])  # the new params are NaN: the update is not applied
  after = jax.device_get(bad.export_state(state))
  jax.tree.map(np.testing.assert_array_equal, after, before)
  for lr in ("inf", "nan", "-1", "0"):
    with pytest.raises(SystemExit) as info:
      cli.main([*TRAIN, "--lr", lr, "--checkpoint-dir", str(tmp_path / "ck")])
    assert info.value.code == 2
    err = _one_line(capsys.readouterr().err)
    assert (
      err == f"parstrat train: error: argument --lr: expected a positive finite number, got {lr!r}"
    )
  assert not (tmp_path / "ck").exists()  # nothing was trained or saved


def _overflowing_state() -> optax.GradientTransformation:
  """Passes the updates on, but its own state overflows to infinity."""

  def init(params):
    return jnp.zeros((), jnp.float32)

  def update(updates, state, params=None):
    del params
    return updates, state + jnp.float32(3e38) * 2

  return optax.GradientTransformation(init, update)


def test_a_nonfinite_optimizer_state_alone_is_skipped():
  # Finite loss, gradients and params: only the optimizer state is infinite.
  optimizer = optax.chain(optax.sgd(0.1), _overflowing_state())
  bad = parstrat.DataParallel(data=2)(MODEL, optimizer, skip_nonfinite=True)
  state = bad.init(jax.random.key(0), X[:1])
  before = jax.device_get(bad.export_state(state))
  state, metrics = bad.step(state, (X, Y))
  assert not bool(metrics["finite"])
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(bad.export_state(state)), before)


# ------------------------------------------------------------------ labels


def test_labels_outside_the_classes_are_reported_and_raise_in_debug(trainer):
  state = _fresh(trainer)
  for labels, in_range in ((Y, True), (np.where(Y == 3, -1, Y), False), (Y + 3, False)):
    state, metrics = trainer.step(state, (X, labels.astype(np.int32)))
    assert bool(metrics["labels_in_range"]) is in_range
  debug = parstrat.DataParallel(data=2, debug=True)(MODEL, optax.sgd(0.1))
  state = debug.init(jax.random.key(0), X[:1])
  with pytest.raises(ValueError, match=re.escape(
    "labels must be class ids in [0, 10) for the default loss (the model has 10 outputs), "
    "got values from 3 to 10.")):  # fmt: skip
    debug.step(state, (X, Y + 3))
  state, _ = debug.step(state, (X, Y))  # checked before anything ran: the state is intact
  # The default loss passed explicitly (as "auto" passes it to its candidates) is the default.
  explicit = parstrat.DataParallel(data=2)(
    MODEL, optax.sgd(0.1), loss_fn=parstrat.softmax_cross_entropy
  )
  _, metrics = explicit.step(explicit.init(jax.random.key(0), X[:1]), (X, Y + 3))
  assert not bool(metrics["labels_in_range"])
  custom = parstrat.DataParallel(data=2)(MODEL, optax.sgd(0.1), loss_fn=lambda out, y: out.mean())
  _, metrics = custom.step(custom.init(jax.random.key(0), X[:1]), (X, Y))
  assert "labels_in_range" not in metrics  # only the default loss knows what a label is


def test_the_cli_stops_at_a_batch_with_bad_labels(monkeypatch, capsys):
  data = datasets.load_mnist("sample", log=lambda *a: None)
  second = list(datasets.batch_indices(len(data.train_labels), 64, seed=0, epoch=0))[1]
  labels = data.train_labels.copy()
  labels[second[5]] = 10
  monkeypatch.setattr(
    datasets, "load_mnist", lambda *a, **k: datasets.Dataset(
      data.train_images, labels, data.eval_images, data.eval_labels, "sample with a bad label")
  )  # fmt: skip
  assert cli.main([*TRAIN, "--steps", "4"]) == 1
  assert _one_line(capsys.readouterr().err) == (
    "parstrat train: stopped: step 2: batch 2 of epoch 1 has labels outside [0, 10), the "
    "model's classes; stopping (nothing of this step is saved)"
  )


def test_the_checkpointer_closes_when_the_metrics_file_cannot(tmp_path, monkeypatch):
  closed = []
  real_close = Checkpointer.close

  def failing_close(self):
    raise OSError(28, "No space left on device")

  def recorded_close(self):
    closed.append(True)
    real_close(self)

  monkeypatch.setattr(History, "close", failing_close)
  monkeypatch.setattr(Checkpointer, "close", recorded_close)
  argv = [*TRAIN, "--steps", "2", "--checkpoint-dir", str(tmp_path / "ckpt"),
          "--metrics", str(tmp_path / "metrics.jsonl")]  # fmt: skip
  with pytest.raises(OSError, match="No space left"):
    cli.main(argv)
  assert closed == [True]  # orbax's threads are not left running at exit


def test_a_failed_save_names_its_cause_and_the_newest_kept_and_loses_nothing(
  trainer, tmp_path, monkeypatch, capsys
):
  # A save that failed mid-run (a full disk, a directory gone) was orbax's traceback.
  directory = tmp_path / "gone"
  with Checkpointer(directory) as ckpt:
    ckpt.save(trainer, _fresh(trainer), {}, step=1, force=True)
    shutil.rmtree(directory)
    directory.write_text("not a directory any more")  # (a real failure: no mock)
    with pytest.raises(CheckpointError) as raised:
      ckpt.save(trainer, _fresh(trainer), {}, step=2, force=True)
  assert str(raised.value).startswith(f"saving checkpoint step 2 in {directory} failed (")
  assert str(raised.value).endswith("); no checkpoint is kept")  # (step 1 went with it)
  assert isinstance(raised.value.__cause__, OSError)
  # The disk filled after orbax's save, before the manifest: that step is complete, and said
  # to be unverified (it said "the newest kept is step 2" of the step that "failed").
  from parstrat._src import checkpoint

  def no_space(folder):
    raise OSError(28, "No space left on device")

  with Checkpointer(tmp_path / "half") as ckpt, monkeypatch.context() as patch:
    patch.setattr(checkpoint, "_write_manifest", no_space)
    with pytest.raises(CheckpointError, match=re.escape(
        "(OSError: [Errno 28] No space left on device); the newest kept is step 2 (written, "
        "but not its manifest: it restores unverified)")):  # fmt: skip
      ckpt.save(trainer, _fresh(trainer), {}, step=2, force=True)

  # The command line: one line naming the step, the cause and the newest kept; a resume
  # goes on from there, and the metrics hold every step once.
  import orbax.checkpoint as ocp

  from parstrat._src import tensorboard_log

  real_save = ocp.CheckpointManager.save

  def full_disk_at_6(self, step, *args, **kwargs):
    if step == 6:
      raise OSError(28, "No space left on device")
    return real_save(self, step, *args, **kwargs)

  ckpt = tmp_path / "ck"
  flags = [*TRAIN, "--checkpoint-dir", str(ckpt), "--save-every", "3", "--steps", "9"]

  def events_cannot_close(self):  # (a full disk: the TensorBoard events file, in --checkpoint-dir
    raise OSError(28, "No space left on device")  # without --out, cannot flush either)

  with monkeypatch.context() as patch:
    patch.setattr(ocp.CheckpointManager, "save", full_disk_at_6)
    patch.setattr(tensorboard_log.ScalarWriter, "close", events_cannot_close)
    assert cli.main(flags) == 1
  assert _one_line(capsys.readouterr().err) == (
    f"parstrat train: stopped: saving checkpoint step 6 in {ckpt} failed (OSError: [Errno 28] "
    "No space left on device); the newest kept is step 3: once the cause is fixed, --resume "
    "goes on from there"
  )
  assert cli.main([*flags, "--resume"]) == 0
  assert f"resumed from {ckpt} at step 3 " in capsys.readouterr().out
  assert _steps(ckpt / "metrics.jsonl") == list(range(1, 10))


def test_a_metrics_file_that_cannot_be_written_stops_the_run_in_one_line(
  tmp_path, monkeypatch, capsys
):
  # A full disk under the metrics file was a traceback from the training loop. /dev/full
  # fails every write with ENOSPC, as a full disk does.
  from parstrat._src import history

  real_open = open
  monkeypatch.setattr(history, "open", lambda _, mode: real_open("/dev/full", mode), raising=False)
  ckpt = tmp_path / "ck"
  argv = [*TRAIN, "--steps", "4", "--checkpoint-dir", str(ckpt), "--save-every", "2",
          "--log-every", "3"]  # fmt: skip
  assert cli.main(argv) == 1
  assert _one_line(capsys.readouterr().err) == (
    f"parstrat train: stopped: cannot write the metrics file {ckpt / 'metrics.jsonl'} (No space "
    "left on device); the newest checkpoint is step 2: once the cause is fixed, --resume goes "
    "on from there"
  )


# ------------------------------------------------------------------ donated and foreign states


def test_a_donated_or_foreign_state_is_refused_before_jax_sees_it(trainer):
  state = _fresh(trainer)
  new_state, _ = trainer.step(state, (X, Y))  # `state` is donated now
  calls = {
    "step": lambda s: trainer.step(s, (X, Y)),
    "apply": lambda s: trainer.apply(s, X),
    "params": trainer.params,
    "export_state": trainer.export_state,
  }
  for name, call in calls.items():
    with pytest.raises(ValueError, match=re.escape(
      f"{name}: this state was donated to an earlier trainer.step (its leaf step is deleted); "
      "pass the state that step returned.")):  # fmt: skip
      call(state)
  other = parstrat.DataParallel(data=2)(hk.transform(lambda x: hk.nets.MLP([8, 10])(x)),
                                        optax.adam(1e-2))  # fmt: skip
  foreign = other.init(jax.random.key(0), X[:1])
  with pytest.raises(ValueError, match=re.escape(
    "apply: the state does not belong to this trainer: params['mlp/~/linear_0']['b']: shape "
    "(8,), expected (16,).")):  # fmt: skip
    trainer.apply(foreign, X)
  with pytest.raises(ValueError, match="step: the state does not belong to this trainer: got a "
                     "dict, expected the TrainState its init or step returned"):  # fmt: skip
    trainer.step(trainer.export_state(new_state), (X, Y))
  # The same model's state on other devices (a wider mesh): JAX's "incompatible devices"
  # before, now named here.
  wider = parstrat.DataParallel(data=4)(MODEL, optax.adam(1e-2))
  elsewhere = wider.init(jax.random.key(0), X[:1])
  for name, call in calls.items():
    with pytest.raises(ValueError, match=re.escape(
      f"{name}: the state does not belong to this trainer: its arrays are on devices "
      "[0, 1, 2, 3], this trainer's mesh on [0, 1] (another trainer's state moves with "
      "trainer.import_state(other.export_state(state))).")):  # fmt: skip
      call(elsewhere)
  moved = trainer.import_state(wider.export_state(elsewhere))
  jax.tree.map(np.testing.assert_array_equal, trainer.params(moved), wider.params(elsewhere))
  trainer.step(new_state, (X, Y))  # the live state still works


# ------------------------------------------------------------------ the command line


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--save-every", "5"], "--save-every needs --checkpoint-dir"),
    (["--keep", "2"], "--keep needs --checkpoint-dir"),
    (["--checkpoint-dir", "{tmp}/file"], "--checkpoint-dir {tmp}/file is a file, not a directory"),
    (["--checkpoint-dir", "{tmp}/file/sub"], "{tmp}/file is a file, not a directory"),
    (["--checkpoint-dir", "/proc/parstrat/ck"], "--checkpoint-dir /proc/parstrat/ck: cannot "
     "write in /proc"),  # a file system that takes no new files, even from root
    (["--checkpoint-dir", "{tmp}/used"], "--checkpoint-dir {tmp}/used is not empty (another "
     "run?): pass --resume to continue it or --overwrite to start afresh"),
    (["--checkpoint-dir", "{tmp}/used", "--resume", "--overwrite"], "pick one"),
    (["--out", "{tmp}/file"], "--out {tmp}/file is a file, not a directory"),
    (["--out", "{tmp}/ran"], "--out {tmp}/ran holds another run ({tmp}/ran/metrics.jsonl): "
     "pass --overwrite to replace it"),
    (["--metrics", "{tmp}/missing/m.jsonl"], "the directory {tmp}/missing does not exist"),
    (["--metrics", "{tmp}"], "--metrics {tmp} is a directory"),
  ],
)  # fmt: skip
def test_file_system_problems_are_one_line_before_anything_runs(tmp_path, flags, message, capsys):
  (tmp_path / "file").write_text("x")
  (tmp_path / "used").mkdir()
  (tmp_path / "used" / "10").mkdir()
  (tmp_path / "ran").mkdir()
  (tmp_path / "ran" / "metrics.jsonl").write_text("")
  flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
  assert cli.main([*TRAIN, *flags]) == 2
  captured = capsys.readouterr()
  assert message.replace("{tmp}", str(tmp_path)) in _one_line(captured.err)
  assert captured.out == ""  # no data loaded, nothing trained


@pytest.mark.parametrize(
  "argv, expected",
  [
    (["train", "--chekpoint-dir", "x"], "parstrat: error: unrecognized arguments: --chekpoint-dir "
     "x (did you mean --checkpoint-dir?)"),
    (["trian"], "parstrat: error: argument command: invalid choice: 'trian' (choose from "
     "'train', 'schedule', 'list') (did you mean train?)"),
    (["train", "--epochs"], "parstrat train: error: argument --epochs: expected one argument"),
    (["schedule", "--stagse", "3", "--microbatches", "4"], "parstrat schedule: error: the "
     "following arguments are required: --stages; unrecognized arguments: --stagse (did you "
     "mean --stages?)"),
    (["train", "--source", "sampel"], "parstrat train: error: argument --source: invalid choice: "
     "'sampel' (choose from 'auto', 'tfds', 'sample') (did you mean sample?)"),
  ],
)  # fmt: skip
def test_argument_errors_are_one_line_with_a_suggestion(argv, expected, capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(argv)
  assert info.value.code == 2
  assert _one_line(capsys.readouterr().err) == expected


def test_import_state_names_the_first_leaf_that_does_not_fit(trainer):
  exported = {"step": 0, "params": {"mlp/~/linear_0": {"w": np.zeros((12, 16))}}}
  with pytest.raises(ValueError, match=re.escape(
    "The saved params do not fit this model: params['mlp/~/linear_0']['b'] is missing "
    "(expected shape (16,)).")):  # fmt: skip
    trainer.import_state(exported)


@pytest.mark.parametrize(
  "optimizer, problem",
  [  # other leaves; Adam's leaves in another tree (adamw's extra EmptyState)
    (optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, 0.9)), "opt_state[1][0]['trace']"),
    (
      optax.adamw(1e-2),
      "its leaves fit but its tree does not: (ScaleByAdamState, "
      "EmptyState), expected (ScaleByAdamState, EmptyState, EmptyState)",
    ),
  ],
)
def test_import_state_names_another_optimizers_state(trainer, optimizer, problem):
  other = parstrat.DataParallel(data=2)(MODEL, optimizer)
  other.init(jax.random.key(0), X[:1])
  exported = trainer.export_state(trainer.initial)
  with pytest.raises(ValueError, match=re.escape(
    "The saved optimizer state does not fit this trainer's optimizer (another optimizer, "
    f"clipping or weight decay?): {problem}")) as info:  # fmt: skip
    other.import_state(exported)
  assert 'without its "opt_state"' in str(info.value)
  fresh = other.import_state({**exported, "opt_state": None})  # what the message offers
  assert int(fresh.step) == 0


def test_import_state_names_a_state_read_without_its_tree_and_moves_an_optimizer_key(
  trainer, tmp_path
):
  def plain(tree):  # what orbax gives without a target tree: dicts and lists
    if hasattr(tree, "_fields"):
      return {field: plain(getattr(tree, field)) for field in tree._fields} or None
    if isinstance(tree, (list, tuple)):
      return [plain(part) for part in tree]
    return {k: plain(v) for k, v in tree.items()} if isinstance(tree, dict) else tree

  exported = trainer.export_state(trainer.initial)
  with pytest.raises(ValueError, match=re.escape(
    "The saved optimizer state has this trainer's leaves in plain dicts and lists ([dict, "
    "NoneType], expected (ScaleByAdamState, EmptyState)), as orbax reads a checkpoint without "
    "a target tree")):  # fmt: skip
    trainer.import_state({**exported, "opt_state": plain(exported["opt_state"])})
  # What the message offers works: orbax given the target jax.eval_shape(trainer.export_state,
  # state) reads the trainer's own tree (eval_shape of export_state failed on its tracers).
  import orbax.checkpoint as ocp  # noqa: PLC0415

  with ocp.StandardCheckpointer() as orbax:
    orbax.save(tmp_path / "state", exported)
    orbax.wait_until_finished()
    read = orbax.restore(tmp_path / "state", jax.eval_shape(trainer.export_state, trainer.initial))
  assert jax.tree.structure(read) == jax.tree.structure(exported)
  chex.assert_trees_all_equal(trainer.export_state(trainer.import_state(read)), exported)
  # (an optimizer whose own state is plain: a list for its tuple is just another tree)
  kept = optax.GradientTransformation(lambda p: (p,), lambda g, s, p=None: (g, s))
  own = parstrat.DataParallel(data=2)(MODEL, kept)
  own.init(jax.random.key(0), X[:1])
  tupled = own.export_state(own.init(jax.random.key(0), X[:1]))
  with pytest.raises(
    ValueError, match=re.escape("its leaves fit but its tree does not: [dict], expected (dict)")
  ):
    own.import_state({**tupled, "opt_state": list(tupled["opt_state"])})
  # A typed PRNG key in the optimizer state (a noise transform's) moves to other devices.
  noisy = optax.chain(optax.add_noise(0.01, 0.55, 0), optax.sgd(0.1))
  wide = parstrat.DataParallel(data=8)(MODEL, noisy)
  state = wide.init(jax.random.key(0), X[:1])
  narrow = parstrat.DataParallel(data=2)(MODEL, noisy)
  narrow.init(jax.random.key(0), X[:1])
  moved = narrow.import_state(wide.export_state(state))
  np.testing.assert_array_equal(
    jax.random.key_data(moved.opt_state[0].rng_key), jax.random.key_data(state.opt_state[0].rng_key)
  )
