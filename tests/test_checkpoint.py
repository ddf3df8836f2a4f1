"""Checkpoints: exact resume, moves between strategies, atomic writes."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import types
import warnings

import haiku as hk
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import parstrat
import parstrat.testing
from parstrat.checkpoint import Checkpointer
from parstrat.checkpoint import CheckpointWarning
from parstrat.checkpoint import OptimizerDoesNotFit

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
TRAIN = ["train", "--epochs", "3", "--batch-size", "400", "--source", "sample", "--no-progress",
         "--hidden", "64"]  # fmt: skip


def _cli(*args, timeout=300):
  return subprocess.run(
    [sys.executable, "-m", "parstrat", *TRAIN, *args],
    capture_output=True,
    text=True,
    timeout=timeout,
    env=ENV,
    cwd=ROOT,
    check=False,
  )


def _read_without_parstrat(path):
  """How a user reads a checkpoint with plain orbax, on any number of devices."""
  checkpointer = ocp.StandardCheckpointer()
  metadata = checkpointer.metadata(path).item_metadata.tree
  target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), metadata)
  return checkpointer.restore(path, target)


def _losses(path):
  rows = [json.loads(line) for line in path.read_text().splitlines()]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_stop_and_resume_is_bit_identical(tmp_path, capsys):
  from parstrat._src import cli

  def train(*args):
    assert cli.main([*TRAIN, *args]) == 0
    return capsys.readouterr().out

  def epoch_2(out):
    return next(line for line in out.splitlines() if line.startswith("epoch 2:"))

  straight = train("--steps", "40", "--checkpoint-dir", str(tmp_path / "a"), "--save-every",
                   "20", "--metrics", str(tmp_path / "a.jsonl"))  # fmt: skip
  train("--steps", "30", "--checkpoint-dir", str(tmp_path / "b"), "--save-every", "10",
        "--metrics", str(tmp_path / "b1.jsonl"))  # fmt: skip
  resumed = train("--steps", "40", "--checkpoint-dir", str(tmp_path / "b"), "--resume",
                  "--metrics", str(tmp_path / "b2.jsonl"))  # fmt: skip
  assert "resumed from" in resumed and "at step 30 (epoch 2, batch 10)" in resumed
  # The epoch's loss (the mean of its 20 steps) and eval accuracy, to the last digit.
  assert epoch_2(resumed) == epoch_2(straight) and "(mean of 20 steps)" in epoch_2(straight)
  a, b2 = _losses(tmp_path / "a.jsonl"), _losses(tmp_path / "b2.jsonl")
  assert sorted(b2) == list(range(31, 41))
  assert [b2[s] for s in range(31, 41)] == [a[s] for s in range(31, 41)]  # exactly equal
  saved_a = _read_without_parstrat(tmp_path / "a" / "40" / "state")
  saved_b = _read_without_parstrat(tmp_path / "b" / "40" / "state")
  assert set(saved_a["params"]) == {"mlp/~/linear_0", "mlp/~/linear_1"}  # Haiku layout
  for x, y in zip(jax.tree.leaves(saved_a), jax.tree.leaves(saved_b), strict=True):
    np.testing.assert_array_equal(x, y)
  assert sorted(int(p.name) for p in (tmp_path / "b").iterdir() if p.name.isdigit()) == [20, 30, 40]


def test_resume_errors_are_one_line(tmp_path, capsys):
  from parstrat._src import cli

  flags = [*TRAIN, "--checkpoint-dir"]
  assert cli.main([*flags, str(tmp_path / "none"), "--resume"]) == 2
  assert (
    capsys.readouterr()
    .err.strip()
    .endswith(
      "--resume: no checkpoint in " + str(tmp_path / "none") + " (--resume-if-exists starts "
      "there when there is none, as a job restarted with the same command needs)"
    )
  )
  assert cli.main([*flags, str(tmp_path / "c"), "--steps", "2"]) == 0
  capsys.readouterr()
  # A refused --resume creates nothing: a folder "31" in a run's checkpoints would pass
  # for a checkpoint, and --compare's per-strategy folders for started runs.
  for where in (["none"], ["c/31"], ["c", "--compare", "data_parallel,fsdp"]):
    assert cli.main([*flags, str(tmp_path / where[0]), *where[1:], "--resume"]) == 2
    assert "--resume: no checkpoint in" in capsys.readouterr().err
  assert not (tmp_path / "none").exists() and not (tmp_path / "c" / "31").exists()
  assert not (tmp_path / "c" / "data_parallel").exists()
  resume = [*flags, str(tmp_path / "c"), "--steps", "4", "--resume"]
  for change, named in (  # the data order would differ; only what changed is named
    (["--seed", "7"], "written with --seed 0 (now 7), which"),
    (["--batch-size", "200"], "written with --batch-size 400 (now 200), which"),
    (["--seed", "7", "--batch-size", "200"], "--seed 0 (now 7) and --batch-size 400 (now 200)"),
  ):
    assert cli.main([*resume, *change]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and "(no flag allows another)" in err and "\n" not in err
  # Each guarded change is named and needs --allow-config-change.
  for change, named in [
    (["--precision", "mixed_bfloat16"], "precision float32 -> mixed_bfloat16"),
    (["--lr", "0.5"], "lr 0.001 -> 0.5"),
    (["--lr-schedule", "cosine"], "lr_schedule constant -> cosine, schedule_steps None -> 4"),
    (["--warmup-steps", "1"], "warmup_steps 0 -> 1"),
    (["--weight-decay", "0.1"], "weight_decay 0.0 -> 0.1"),
    (["--clip-norm", "1"], "clip_norm None -> 1.0"),
    (["--optimizer", "sgd"], "optimizer adam -> sgd"),
  ]:
    assert cli.main([*resume, *change]) == 2, change
    err = capsys.readouterr().err.strip()
    assert f"another configuration ({named});" in err and "--allow-config-change" in err, err


MODEL = hk.transform(lambda x: hk.nets.MLP([32, 24, 16, 10], activation=jax.nn.swish)(x))


def _adam_run_saved(directory, steps, batches):
  """`MODEL` trained `steps` steps with Adam on 8 devices and saved: (trainer, state, data)."""
  images, labels = parstrat.testing.random_batches(batches, 32, features=20)
  trainer = parstrat.DataParallel(data=8)(MODEL, optax.adam(1e-2))
  state = trainer.init(jax.random.key(0), images[0][:1])
  for i in range(steps):
    state, _ = trainer.step(state, (images[i], labels[i]))
  with Checkpointer(directory) as ckpt:
    assert ckpt.save(trainer, state, {"epoch": 0}, force=True)
  return trainer, state, (images, labels)


def test_a_checkpoint_moves_between_strategies_and_device_counts(tmp_path):
  trainer, state, (images, labels) = _adam_run_saved(tmp_path, steps=5, batches=10)
  expected = []
  for i in range(5, 10):
    state, metrics = trainer.step(state, (images[i], labels[i]))
    expected.append(float(metrics["loss"]))
  for strategy in (
    parstrat.PipelineModelParallel(stages=4, microbatches=2),
    parstrat.Hybrid(data=2, stages=4, microbatches=2),
    parstrat.DataParallel(data=1),
    # Weights split over 8 devices, biases and the 160-element head whole.
    parstrat.FSDP(data=8, replicate_below=200),
  ):
    other = strategy(MODEL, optax.adam(1e-2))
    restored = other.init(jax.random.key(1), images[0][:1])  # different init: overwritten
    with Checkpointer(tmp_path) as ckpt:
      restored, meta = ckpt.restore(other)
    assert meta == {"epoch": 0} and int(restored.step) == 5
    losses = []
    for i in range(5, 10):
      restored, metrics = other.step(restored, (images[i], labels[i]))
      losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, expected, rtol=1e-5, err_msg=repr(strategy))


def test_meta_that_json_cannot_hold_is_refused_before_anything_is_written(tmp_path):
  # A NumPy int in meta failed inside orbax, after it had started writing: the
  # temporary folder it left made the next save fail.
  images, labels = parstrat.testing.random_batches(1, 16, features=20)
  trainer = parstrat.DataParallel(data=2)(MODEL, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), images[0][:1])
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    with pytest.raises(TypeError, match=r"meta\['data'\]\['epoch'\] is a numpy.int64 \(np"):
      ckpt.save(trainer, state, {"data": {"epoch": np.int64(0)}}, force=True)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == []
    assert ckpt.save(trainer, state, {"data": {"epoch": 0}}, force=True)
    assert ckpt.restore(trainer)[1] == {"data": {"epoch": 0}}
  (tmp_path / "file").write_text("")
  with pytest.raises(ValueError, match=r"Checkpointer: .*file is a file, not a directory"):
    Checkpointer(tmp_path / "file")
  # A file named like a step was replaced by that step's checkpoint, without a word.
  (tmp_path / "ckpt" / "3").write_text("my notes")
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    with pytest.raises(parstrat.checkpoint.CheckpointError, match=r"ckpt/3 is a file, not a c"):
      ckpt.save(trainer, state, {}, step=3, force=True)
    (tmp_path / "ckpt" / "5").symlink_to(tmp_path / "elsewhere")  # (dangling: helper 71)
    with pytest.raises(parstrat.checkpoint.CheckpointError, match=r"ckpt/5 is a file, not a c"):
      ckpt.save(trainer, state, {}, step=5, force=True)
    assert ckpt.all_steps() == [0]
  assert (tmp_path / "ckpt" / "3").read_text() == "my notes"
  assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["0", "3", "5"]


def test_keeps_the_last_n(tmp_path):
  images, _ = parstrat.testing.random_batches(1, 8, features=20)
  trainer = parstrat.DataParallel(data=2)(MODEL, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), images[0][:1])
  with Checkpointer(tmp_path, save_every=2, keep=2) as ckpt:
    for step in range(1, 8):
      ckpt.save(trainer, state, {}, step=step)
    assert ckpt.all_steps() == [4, 6]
  with pytest.raises(ValueError, match="save_every and keep must be >= 1, got 0 and 3"):
    Checkpointer(tmp_path, save_every=0)


def test_the_writer_deletes_the_folders_of_saves_that_never_finished(tmp_path):
  images, _ = parstrat.testing.random_batches(1, 8, features=20)
  trainer = parstrat.DataParallel(data=2)(MODEL, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), images[0][:1])
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(trainer, state, {}, step=1)
  unfinished = tmp_path / "2.orbax-checkpoint-tmp-1765000000"  # (a save killed midway)
  (unfinished / "state").mkdir(parents=True)
  (unfinished / "state" / "part").write_bytes(b"x" * 1000)
  with Checkpointer(tmp_path) as reader:  # (a reader leaves a running save's folder)
    reader.restore(trainer)
  assert unfinished.is_dir()
  with Checkpointer(tmp_path, clean_unfinished=True) as writer:
    writer.save(trainer, state, {}, step=3)
    assert writer.all_steps() == [1, 3]
  assert not unfinished.exists()


def _newest(directory) -> int:
  steps = [int(p.name) for p in directory.glob("*") if p.name.isdigit()]
  return max(steps, default=0)


def test_killing_a_save_leaves_the_previous_checkpoint_readable(tmp_path):
  directory = tmp_path / "ckpt"
  for attempt in range(2):
    proc = subprocess.Popen(
      [sys.executable, "-m", "parstrat", "train", "--epochs", "50", "--batch-size", "400",
       "--source", "sample", "--no-progress", "--hidden", "512", "512", "--devices", "2",
       "--checkpoint-dir", str(directory), "--save-every", "1", "--keep", "2",
       *(["--resume"] if attempt else [])],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT,
    )  # fmt: skip
    before = _newest(directory)
    try:
      deadline = time.monotonic() + 120
      while _newest(directory) < before + 2 and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        time.sleep(0.05)
      time.sleep(0.13 * (attempt + 1))  # land somewhere inside a later save
      proc.send_signal(signal.SIGKILL)
      proc.wait(timeout=30)
    finally:
      if proc.poll() is None:
        proc.kill()
    trainer = parstrat.DataParallel(data=2)(
      hk.transform(lambda x: hk.nets.MLP([512, 512, 10], activation=jax.nn.swish)(x)),
      optax.adam(1e-3),
    )
    trainer.init(jax.random.key(0), np.zeros((1, 784), np.float32))
    with warnings.catch_warnings(record=True) as caught, Checkpointer(directory) as ckpt:
      warnings.simplefilter("always", CheckpointWarning)
      latest = ckpt.latest_step()
      assert latest is not None
      state, meta = ckpt.restore(trainer)
      # A kill after orbax finished a step but before its manifest was written
      # leaves a whole checkpoint, restored with a warning that it is unverified.
      for w in caught:
        if issubclass(w.category, CheckpointWarning):
          assert f"checkpoint step {latest} in" in str(w.message), w
          assert "has no manifest" in str(w.message), w
          assert ckpt.verify(latest) == "has no manifest"
    assert meta["batches_seen"] == latest
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state.params)))


def test_fresh_optimizer_restores_everything_but_the_optimizer_state(tmp_path):
  trainer, state, (images, labels) = _adam_run_saved(tmp_path, steps=2, batches=3)
  saved = jax.device_get(trainer.export_state(state))
  # Clipping + momentum has other leaves than Adam; adamw has Adam's leaves in another
  # tree (an extra EmptyState), which orbax alone finds.
  results = []
  for strategy, optimizer in (
    (
      parstrat.DataParallel(data=1),
      optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, 0.9)),
    ),
    (parstrat.DataParallel(data=1), optax.adamw(1e-2)),
    (parstrat.PipelineModelParallel(stages=4, microbatches=2), optax.adamw(1e-2)),
  ):
    other = strategy(MODEL, optimizer)
    other.init(jax.random.key(1), images[0][:1])
    with Checkpointer(tmp_path) as ckpt:
      with pytest.raises(OptimizerDoesNotFit, match="fits this model's params but not this"):
        ckpt.restore(other)
      restored, meta = ckpt.restore(other, fresh_optimizer=True)
    assert meta == {"epoch": 0}
    moved = jax.device_get(other.export_state(restored))
    for key in ("step", "params", "rng", "model_state"):
      jax.tree.map(np.testing.assert_array_equal, moved[key], saved[key])
    fresh = jax.device_get(optimizer.init(saved["params"]))
    assert jax.tree.structure(moved["opt_state"]) == jax.tree.structure(fresh)
    jax.tree.map(np.testing.assert_array_equal, moved["opt_state"], fresh)
    restored, metrics = other.step(restored, (images[2], labels[2]))
    results.append((float(metrics["loss"]), jax.device_get(other.params(restored))))
  # The pipeline's flat per-stage layout starts adamw as the model's layout does.
  assert results[2][0] == pytest.approx(results[1][0], rel=1e-6)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), results[2][1], results[1][1]
  )


def test_export_and_import_move_a_state_to_another_device_set():
  images, labels = parstrat.testing.random_batches(2, 32, features=20)
  source = parstrat.FSDP(data=8, zero=1)(MODEL, optax.adam(1e-2))
  state = source.init(jax.random.key(0), images[0][:1])
  state, _ = source.step(state, (images[0], labels[0]))
  exported = source.export_state(state)
  target = parstrat.PipelineModelParallel(stages=4, devices=jax.devices()[4:])(
    MODEL, optax.adam(1e-2)
  )
  target.init(jax.random.key(1), images[0][:1])
  moved = target.import_state(exported)
  jax.tree.map(np.testing.assert_array_equal, target.params(moved), source.params(state))
  _, a = source.step(state, (images[1], labels[1]))
  moved, b = target.step(moved, (images[1], labels[1]))
  np.testing.assert_allclose(float(a["loss"]), float(b["loss"]), rtol=1e-5)
  # And back, from 4 of the devices to all 8 (a subset of the other mesh's devices).
  back = source.import_state(target.export_state(moved))
  jax.tree.map(np.testing.assert_array_equal, source.params(back), target.params(moved))


def test_a_model_with_a_zero_size_parameter_saves_and_resumes_exactly(tmp_path):
  # orbax refuses arrays of size 0 ("Cannot save arrays with zero size"): such a model
  # could not be checkpointed at all. Its empty leaves (the param and Adam's moments)
  # are saved as None and made again, from the restoring trainer's shapes.
  def forward(x):
    empty = hk.get_parameter("empty", [0, 4], init=hk.initializers.Constant(0.0))
    return hk.Linear(10)(x) + empty.sum()

  model = hk.transform(forward)
  x = np.random.default_rng(0).normal(size=(8, 6)).astype(np.float32)
  y = np.arange(8, dtype=np.int32) % 10
  trainer = parstrat.DataParallel(data=2)(model, optax.adam(1e-2))
  state = trainer.init(jax.random.key(0), x)
  with Checkpointer(tmp_path / "c") as ckpt:
    state, _ = trainer.step(state, (x, y))
    assert ckpt.save(trainer, state, {}, force=True)
    saved_w = np.asarray(trainer.params(state)["linear"]["w"])
    target = jax.eval_shape(trainer.export_state, state)  # (before the step donates it)
    straight = [float(trainer.step(state, (x, y))[1]["loss"])]
    plain = _read_without_parstrat(tmp_path / "c" / "1" / "state")  # README's way
    assert plain["params"]["~"] == {"empty": None}
    with pytest.raises(ValueError, match=re.escape("params['~']['empty'] is missing")):
      trainer.import_state(plain)  # (as README says: Checkpointer.restore refills it)
    with pytest.raises(ValueError, match="empty"):  # nor with the trainer's tree as target
      ocp.StandardCheckpointer().restore(tmp_path / "c" / "1" / "state", target)
    for fresh_optimizer in (False, True):
      other = parstrat.FSDP(data=2)(model, optax.adam(1e-2))
      other.init(jax.random.key(1), x)
      restored, _ = ckpt.restore(other, fresh_optimizer=fresh_optimizer)
      params = other.params(restored)
      assert params["~"]["empty"].shape == (0, 4) and params["~"]["empty"].dtype == np.float32
      np.testing.assert_array_equal(params["linear"]["w"], saved_w)
      if not fresh_optimizer:  # the same update from the same Adam state: the same loss
        assert [float(other.step(restored, (x, y))[1]["loss"])] == straight


def _init_blocks(rng, inputs, blocks=2):
  keys = jax.random.split(rng, blocks)
  width = inputs.shape[-1]
  return {
    "blocks": {
      i: {"w": jax.random.normal(key, (width, width)) / width, "b": np.zeros(width, np.float32)}
      for i, key in enumerate(keys)
    }
  }


def _apply_blocks(params, rng, x):
  del rng
  for block in params["blocks"].values():
    x = jax.numpy.tanh(x @ block["w"] + block["b"])
  return x


def _block_0_frozen():
  def labels(params):
    return {
      "blocks": {
        i: jax.tree.map(lambda _, i=i: "frozen" if i == 0 else "train", block)
        for i, block in params["blocks"].items()
      }
    }

  return optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels)


@pytest.mark.parametrize(
  "make_optimizer",
  [lambda: optax.adam(1e-2), _block_0_frozen],
  ids=["adam", "multi_transform with block 0 frozen"],
)
def test_a_model_with_layers_under_integer_keys_resumes_exactly(tmp_path, make_optimizer):
  # An nnx.List of layers gives params {"blocks": {0: ..., 1: ...}}. Orbax writes the
  # keys as text ('0', '1'), and restore refused the checkpoint, wrongly: "params['blocks']
  # [0]['b'] is missing (expected shape (6,))". With block 0 frozen, Adam's moments hold
  # only optax.MaskedNode()s (no leaves) under key 0, which must be taken back too.
  model = types.SimpleNamespace(init=_init_blocks, apply=_apply_blocks)
  x = np.random.default_rng(0).normal(size=(8, 6)).astype(np.float32)
  y = np.arange(8, dtype=np.int32) % 6
  trainer = parstrat.DataParallel(data=2)(model, make_optimizer())
  state = trainer.init(jax.random.key(0), x)
  with Checkpointer(tmp_path / "c") as ckpt:
    state, _ = trainer.step(state, (x, y))
    assert ckpt.save(trainer, state, {}, force=True)
    saved = jax.tree.map(np.asarray, trainer.params(state))
    target = jax.eval_shape(trainer.export_state, state)  # (before the step donates it)
    straight = float(trainer.step(state, (x, y))[1]["loss"])
    for fresh_optimizer in (False, True):
      other = parstrat.FSDP(data=2)(model, make_optimizer())
      other.init(jax.random.key(1), x)
      restored, _ = ckpt.restore(other, fresh_optimizer=fresh_optimizer)
      params = other.params(restored)
      assert list(params["blocks"]) == [0, 1]  # the model's own keys, not orbax's text
      jax.tree.map(np.testing.assert_array_equal, params, saved)
      if not fresh_optimizer:  # the same Adam state: the same next step
        assert float(other.step(restored, (x, y))[1]["loss"]) == straight
    # A model that truly differs is still refused, named by its own key.
    narrower = types.SimpleNamespace(
      init=lambda rng, inputs: _init_blocks(rng, inputs[:, :5]), apply=_apply_blocks
    )
    other = parstrat.FSDP(data=2)(narrower, make_optimizer())
    other.init(jax.random.key(1), x[:, :5])
    with pytest.raises(
      parstrat.checkpoint.CheckpointDoesNotFit,
      match=re.escape("params['blocks'][0]['b']: shape (6,), expected (5,)"),
    ):
      ckpt.restore(other)
    # So is one with fewer layers, naming the saved layer it lacks (its key, read as an
    # integer like the others: a dict of mixed keys, which JAX cannot sort, made restore
    # call the checkpoint unreadable).
    shallower = types.SimpleNamespace(
      init=lambda rng, inputs: _init_blocks(rng, inputs, blocks=1), apply=_apply_blocks
    )
    other = parstrat.FSDP(data=2)(shallower, make_optimizer())
    other.init(jax.random.key(1), x)
    with pytest.raises(
      parstrat.checkpoint.CheckpointDoesNotFit,
      match=re.escape("params['blocks'][1]['b'] (shape (6,)) is not expected"),
    ):
      ckpt.restore(other)
  # Plain orbax given the trainer's tree as its target reads the integer keys too (README).
  plain = ocp.StandardCheckpointer().restore((tmp_path / "c" / "1" / "state").resolve(), target)
  assert list(plain["params"]["blocks"]) == [0, 1]
  jax.tree.map(np.testing.assert_array_equal, plain["params"], saved)


def test_a_fault_in_the_comparison_is_not_taken_for_a_damaged_checkpoint(tmp_path, monkeypatch):
  # Both faults of the integer-key fix (a dict of mixed keys, which JAX cannot sort) came
  # out as "No intact checkpoint ... step 1 cannot be read": every checkpoint was skipped
  # as damaged, and the CLI's --resume refused the run.
  from parstrat._src import trees

  model = types.SimpleNamespace(init=_init_blocks, apply=_apply_blocks)
  x = np.zeros((8, 6), np.float32)
  trainer = parstrat.DataParallel(data=2)(model, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), x)
  with Checkpointer(tmp_path / "c") as ckpt:
    assert ckpt.save(trainer, state, {}, force=True)

    def faulty(got, want):
      raise TypeError("'<' not supported between instances of 'str' and 'int'")

    with monkeypatch.context() as patch:
      patch.setattr(trees, "first_mismatch", faulty)
      with pytest.raises(RuntimeError, match="a fault in parstrat and not in the checkpoint"):
        ckpt.restore(trainer)
    restored, _ = ckpt.restore(trainer)  # (left as it is)
    jax.tree.map(np.testing.assert_array_equal, trainer.params(restored), trainer.params(state))
