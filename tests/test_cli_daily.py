"""`parstrat train` as a daily tool: config files, your model and data, TensorBoard, banners."""

import argparse
import json
import pathlib
import re
import shutil
import struct
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow_datasets as tfds

import parstrat
from parstrat._src import cli
from parstrat._src import config
from parstrat._src import optimizers
from parstrat._src import report
from parstrat._src import run_data
from parstrat.checkpoint import Checkpointer

ROOT = pathlib.Path(__file__).resolve().parents[1]

USER_FILE = """
import os
import signal

import haiku as hk
import jax
import numpy as np
import optax


def model():
  net = hk.transform(lambda x: hk.nets.MLP([16, 16, 4])(x))

  def loss_fn(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  return net, loss_fn


def masked_mean_model():  # the mean over the even labels' examples: not a mean over examples
  def loss_fn(logits, labels):
    kept = (labels % 2 == 0).astype(jax.numpy.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return (losses * kept).sum() / jax.numpy.maximum(kept.sum(), 1)

  return model()[0], loss_fn


def with_precision():  # a dict whose keys the command line sets from its flags
  return {"model": model()[0], "precision": "mixed_bfloat16"}


def with_a_typo():
  return {"model": model()[0], "loss_fun": model()[1]}


def float64_model():  # JAX warns at each trace: float64 is not available without x64
  def forward(x):
    return hk.nets.MLP([16, 16, 4])(x) + jax.numpy.zeros(4, jax.numpy.float64)

  return hk.transform(forward), model()[1]


def tanh_model():  # the same shapes as model()'s
  net = hk.transform(lambda x: hk.nets.MLP([16, 16, 4], activation=jax.nn.tanh)(x))
  return net, model()[1]


def dropout_model():
  def forward(x):
    x = hk.dropout(hk.next_rng_key(), 0.5, jax.nn.relu(hk.Linear(16)(x)))
    return hk.Linear(4)(x)

  return hk.transform(forward), model()[1]


def _dropout_net(x, is_training):
  x = jax.nn.relu(hk.Linear(16)(x))
  if is_training:
    x = hk.dropout(hk.next_rng_key(), 0.5, x)
  return hk.Linear(4)(x)


def dropout_with_eval_model():  # the model as trained, and as evaluated: the same params
  return {
    "model": hk.transform(lambda x: _dropout_net(x, True)),
    "loss_fn": model()[1],
    "eval_model": hk.transform(lambda x: _dropout_net(x, False)),
  }


def eval_model_of_other_params():
  return {"model": dropout_model()[0], "eval_model": model()[0]}


def _centred(x):  # dropout_model's net, its hidden features centred: a sum over them
  x = jax.nn.relu(hk.Linear(16)(x))
  return hk.Linear(4)(x - x.mean(-1, keepdims=True))


def eval_model_laid_out_otherwise():  # tensor splits the model's pair, not the eval model's
  return {"model": dropout_model()[0], "eval_model": hk.transform(_centred)}


def _batch_normed(x, is_training):
  x = hk.BatchNorm(True, True, 0.9)(hk.Linear(16)(x), is_training)
  return hk.Linear(4)(jax.nn.relu(x))


def batch_norm_with_eval_model():  # the eval model cannot initialise: BatchNorm in eval mode
  return {
    "model": hk.transform_with_state(lambda x: _batch_normed(x, True)),
    "loss_fn": model()[1],
    "eval_model": hk.transform_with_state(lambda x: _batch_normed(x, False)),
  }


def eval_model_keeping_state():
  return {"model": dropout_model()[0], "eval_model": batch_norm_with_eval_model()["eval_model"]}


def _five_layers(x, centre):
  h = jax.nn.relu(hk.Linear(16, name="l0")(x))
  h = h - h.mean(-1, keepdims=True) if centre else h  # (a sum over l0's features)
  for name in ("l1", "l2"):
    h = jax.nn.relu(hk.Linear(16, name=name)(h))
  return hk.Linear(4, name="l4")(jax.nn.relu(hk.Linear(64, name="l3")(h)))


def eval_model_split_otherwise():  # hybrid splits l0 -> l1 in the model, l1 -> l2 in this one
  return {
    "model": hk.transform(lambda x: _five_layers(x, False)),
    "loss_fn": model()[1],
    "eval_model": hk.transform(lambda x: _five_layers(x, True)),
  }


def eval_model_alike():  # the same layers, its logits halved: hybrid lays it out alike
  halved = hk.transform(lambda x: _five_layers(x, False) / 2)
  return {**eval_model_split_otherwise(), "eval_model": halved}


def eval_model_of_other_outputs():  # [B, 4, 1] where the labels are [B]
  halved = hk.transform(lambda x: _dropout_net(x, False)[..., None])
  return {**dropout_with_eval_model(), "eval_model": halved}


def eval_model_of_fewer_classes():  # the model's first 2 of 4 classes; the default loss
  first_two = hk.transform(lambda x: _dropout_net(x, False)[:, :2])
  return {"model": dropout_with_eval_model()["model"], "eval_model": first_two}


def no_eval_data(batch_size, seed):
  return data(batch_size, seed)[0], None


def checks_its_width():  # the user's own check, in their model function
  raise ValueError("width must be even")


def wrong_call():  # a Haiku module called wrongly in the forward pass
  def forward(x):
    return hk.Linear(4)(x, x)

  return hk.transform(forward), model()[1]


def sequences(batch_size, seed):  # [B, T, 12] inputs and [B, T] labels
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(8 * batch_size, 3, 12)).astype(np.float32)
  y = x[..., :4].argmax(-1).astype(np.int32)
  train = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size)]
  return train, [(x[:20], y[:20])]


def data(batch_size, seed):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(8 * batch_size, 12)).astype(np.float32)
  y = x[:, :4].argmax(-1).astype(np.int32)
  train = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size)]
  return train, [(x[:50], y[:50])]


def sized(batch_size, seed):  # data()'s first ROWS rows, moved by SHIFT (environment variables)
  train, evaluation = data(batch_size, seed)
  rows, shift = int(os.environ.get("ROWS", 8 * batch_size)), float(os.environ.get("SHIFT", 0))
  train = [(x[:rows] + shift, y[:rows])
           for x, y in [tuple(np.concatenate(a) for a in zip(*train))]]
  return [(x[i : i + batch_size], y[i : i + batch_size])
          for x, y in train for i in range(0, len(x), batch_size)], evaluation


def short_last(batch_size, seed):  # 4 batches an epoch, the last one half a batch
  train, evaluation = data(batch_size, seed)
  return train[:3] + [tuple(a[: batch_size // 2] for a in train[3])], evaluation


def two_shapes(batch_size, seed):  # a whole batch, then half a batch
  train, evaluation = short_last(batch_size, seed)
  return train[2:], evaluation


def by_epoch(batch_size, seed):  # a function of the epoch: its length is unknown
  train, evaluation = data(batch_size, seed)
  return (lambda epoch: [train[(i + epoch) % len(train)] for i in range(len(train))]), evaluation


def nan_second(batch_size, seed):  # the second batch's inputs are NaN: its update is skipped
  train, evaluation = data(batch_size, seed)
  train[1] = (np.full_like(train[1][0], np.nan), train[1][1])
  return train, evaluation


def generators(batch_size, seed):  # train and eval as generators: one pass each
  train, evaluation = data(batch_size, seed)
  return (b for b in train), (b for b in evaluation)


def whole_arrays(batch_size, seed):  # the arrays, not batches: iterating gives their names
  train, evaluation = data(batch_size, seed)
  return {"x": train[0][0], "label": train[0][1]}, None


def needs_split(batch_size, seed, split):  # an argument parstrat does not pass
  return data(batch_size, seed)


class _CtrlCAt:  # 8 batches an epoch; Ctrl-C as batch `at` is first read
  def __init__(self, batches, at):
    self.batches, self.at, self.sent = batches, at, False

  def __len__(self):
    return len(self.batches)

  def __iter__(self):
    for i, batch in enumerate(self.batches):
      if i == self.at and not self.sent:
        self.sent = True
        os.kill(os.getpid(), signal.SIGINT)
      yield batch


def ctrl_c_at_epoch_end(batch_size, seed):
  train, evaluation = data(batch_size, seed)
  return _CtrlCAt(train, at=len(train) - 1), evaluation


def ctrl_c_at_the_4th(batch_size, seed):
  train, evaluation = data(batch_size, seed)
  return _CtrlCAt(train, at=3), evaluation


def body_type_error(batch_size, seed):  # the user's own bug, inside the function
  return len(5)


def odd_last(batch_size, seed):  # the third batch has 3 rows: no split over 2 devices
  train, evaluation = data(batch_size, seed)
  return train[:2] + [tuple(a[:3] for a in train[2])], evaluation


def one_eval_pair(batch_size, seed):  # eval as one (x, y) pair, not a list of pairs
  train, evaluation = data(batch_size, seed)
  return train, evaluation[0]


def scalar_label_eval(batch_size, seed):  # one row and its label as a scalar
  train, evaluation = data(batch_size, seed)
  x, y = evaluation[0]
  return train, [(x[:1], y[0])]


def no_eval_batches(batch_size, seed):  # as a dataset function makes none at a large batch
  return data(batch_size, seed)[0], []


def eval_label_12(batch_size, seed):  # one eval label no model here can predict
  train, evaluation = data(batch_size, seed)
  x, y = evaluation[0]
  return train, [(x, np.where(np.arange(len(y)) == 3, 12, y))]


def eval_5_wide(batch_size, seed):  # eval inputs of another width than the training's
  train, evaluation = data(batch_size, seed)
  x, y = evaluation[0]
  return train, [(x[:10, :5], y[:10])]


def eval_int_inputs(batch_size, seed):  # eval inputs of another dtype than the training's
  train, evaluation = data(batch_size, seed)
  x, y = evaluation[0]
  return train, [(x.astype(np.int32), y)]


def interrupted(batch_size, seed):  # Ctrl-C while the data loads
  raise KeyboardInterrupt


def generator_eval(batch_size, seed):  # a list to train on, a generator to evaluate on
  train, evaluation = data(batch_size, seed)
  return train, (b for b in evaluation)
"""


def read_scalars(directory) -> dict[str, list[tuple[int, float]]]:
  """Reads TensorBoard event files (TFRecord framing of `Event` protos) without TensorFlow."""
  from tensorboardX.proto import event_pb2

  scalars = {}
  files = sorted(pathlib.Path(directory).glob("events.out.tfevents.*"))
  assert files, f"no event file in {directory}"
  for path in files:
    raw, i = path.read_bytes(), 0
    while i < len(raw):
      (length,) = struct.unpack("<Q", raw[i : i + 8])
      event = event_pb2.Event.FromString(raw[i + 12 : i + 12 + length])
      i += 12 + length + 4
      for value in event.summary.value:
        scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars


def test_your_model_and_dataset_from_a_config_file_with_tensorboard(tmp_path, monkeypatch, capsys):
  (tmp_path / "mymodel.py").write_text(USER_FILE)
  run = tmp_path / "run"
  (tmp_path / "run.toml").write_text(
    f"""
model-fn = "{tmp_path / "mymodel.py"}:model"
dataset = "mymodel:data"
strategy = "pipeline"
stages = 3
batch_size = 24
epochs = 1
optimizer = "adamw"
weight-decay = 1e-4
lr = 0.01
lr-schedule = "cosine"
warmup-steps = 2
clip-norm = 1.0
log-every = 2
eval-every = 3
no-progress = true
out = "{run}"
"""
  )
  monkeypatch.chdir(tmp_path)  # `mymodel:data` is imported from the current directory
  # The flags win over the file; --steps 15 stops one step before the end of epoch 2.
  assert cli.main(["train", "--config", "run.toml", "--epochs", "2", "--steps", "15"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert "devices: 3 of 8 cpu devices used, 5 idle" in out
  assert "options: schedule=1f1b, microbatches=3 (default: one per stage), non-finite steps " \
    "skipped" in out  # fmt: skip
  assert "warning: 5 of 8 devices idle: the mesh data=1 x stage=3 uses 3" in out
  # The largest stage is linear_1, 16 x 16 + 16 = 272 float32 (1.06 KiB) on every device;
  # AdamW keeps two of those, plus its step counters.
  state = next(x for x in out if x.startswith("state per device: params "))
  assert state.startswith("state per device: params 1.06 KiB + optimizer 2.1")
  throughput = next(x for x in out if x.startswith("throughput:"))
  assert "over the 14 steps after the first" in throughput
  assert throughput.endswith("on 3 of 8 cpu devices")
  assert "mesh: {'data': 1, 'stage': 3}" in out
  assert [x.split(":")[0] for x in out if "eval accuracy" in x and x.startswith("step")] == [
    "step 3",
    "step 6",
    "step 9",
    "step 12",
    "step 15",
  ]  # --eval-every 3, printed with --no-progress

  rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in rows if "loss" in r]
  logged = [2, 4, 6, 8, 10, 12, 14, 15]  # every 2nd step, and the last
  assert [r["step"] for r in steps] == logged
  board = read_scalars(run)
  assert [s for s, _ in board["train/loss"]] == logged
  np.testing.assert_allclose([v for _, v in board["train/loss"]], [r["loss"] for r in steps],
                             rtol=1e-6)  # fmt: skip
  schedule = optimizers.learning_rate_schedule(0.01, schedule="cosine", warmup_steps=2,
                                               total_steps=15)  # fmt: skip
  np.testing.assert_allclose(
    [v for _, v in board["train/learning_rate"]], [float(schedule(s - 1)) for s in logged],
    rtol=1e-5, atol=1e-9,
  )  # fmt: skip
  assert all(v > 0 for _, v in board["train/grad_norm"] + board["train/examples_per_s"])
  assert [v for _, v in board["train/skipped_steps"]] == [0] * 8
  assert [r["examples_per_s"] > 0 for r in steps] == [True] * 8
  assert sorted(s for s, _ in board["eval/accuracy"]) == [3, 6, 8, 9, 12, 15]
  # The epoch loss is the mean over the epoch's steps; a row's loss is the mean of its steps.
  epoch_loss = dict(board["train/epoch_loss"])
  losses = [r["loss"] for r in steps]
  assert epoch_loss[8] == pytest.approx(np.mean(losses[:4]), rel=1e-5)
  assert epoch_loss[15] == pytest.approx((2 * sum(losses[4:7]) + losses[7]) / 7, rel=1e-5)
  assert f"epoch 2: loss {epoch_loss[15]:.4f} (mean of 7 steps)" in " ".join(out)
  assert epoch_loss[15] < epoch_loss[8]  # it learns


def test_a_resume_on_other_data_under_the_same_name_is_refused(tmp_path, capsys):
  # `--dataset` names the data, and `--source auto` may resolve one name to other data
  # (tfds, or the bundled sample offline): a resume checks what it loaded too.
  args = ["train", "--dataset", "fashion_mnist", "--hidden", "16", "--batch-size", "12",
          "--steps", "2", "--no-progress", "--devices", "2", "--out", str(tmp_path / "run"),
          "--checkpoint-dir", str(tmp_path / "ckpt")]  # fmt: skip
  with tfds.testing.mock_data(num_examples=48):
    assert cli.main(args) == 0
  capsys.readouterr()
  with tfds.testing.mock_data(num_examples=36):
    assert cli.main([*args, "--steps", "4", "--resume"]) == 2
  err = " ".join(capsys.readouterr().err.split())
  assert ("data tfds fashion_mnist: 48 train, 48 eval -> tfds fashion_mnist: 36 train, 36 "
          "eval") in err, err  # fmt: skip


def test_a_resume_on_a_dataset_functions_other_data_is_refused_or_named(
  tmp_path, monkeypatch, capsys
):
  # Only the function's name was recorded: 8 batches an epoch resumed on 4 carried on.
  legs = ["--dataset", "mymodel:sized", "--model-fn", "mymodel:model", "--checkpoint-dir", "c"]
  assert _user_run(tmp_path, monkeypatch, *legs, "--steps", "2") == 0
  capsys.readouterr()
  monkeypatch.setenv("ROWS", "32")  # 4 batches of 8
  assert _user_run(tmp_path, monkeypatch, *legs, "--steps", "4", "--resume") == 2
  err = capsys.readouterr().err
  assert "data_batches_per_epoch 8 -> 4" in err and "--allow-config-change" in err
  # 8 batches of other numbers (or drawn without a seed): resumed, and the change printed.
  monkeypatch.setenv("ROWS", "64")
  monkeypatch.setenv("SHIFT", "1")
  assert _user_run(tmp_path, monkeypatch, *legs, "--steps", "4", "--resume") == 0
  assert re.search(r"data_first_example sha256 \w+ -> sha256 \w+", capsys.readouterr().out)


def test_compare_on_a_tfds_dataset_reports_the_devices_each_run_used(tmp_path, capsys):
  args = ["train", "--compare", "data_parallel,tensor", "--data", "2", "--tensor-parallel", "3",
          "--dataset", "fashion_mnist", "--hidden", "16", "--batch-size", "12", "--epochs", "1",
          "--no-progress", "--out", str(tmp_path)]  # fmt: skip
  with tfds.testing.mock_data(num_examples=48):
    assert cli.main(args) == 0
  captured = capsys.readouterr()
  out = captured.out
  warnings = [x for x in captured.err.splitlines() if "deprecated" in x]
  assert warnings == ["parstrat: warning: --data is deprecated and will be removed; use "
                      "--data-parallel"]  # fmt: skip
  assert "data: tfds fashion_mnist: 48 train, 48 eval" in out
  assert "devices: 2 of 8 cpu devices used, 6 idle" in out
  assert "devices: 3 of 8 cpu devices used, 5 idle" in out
  assert "warning: tensor parallelises (almost) nothing here" in out
  assert out.count("warning: data_parallel parallelises") == 0
  summaries = [x for x in out.splitlines() if x.startswith("throughput:")]
  assert len(summaries) == 2 and "nan" not in out
  assert summaries[0].endswith("on 2 of 8 cpu devices")
  assert summaries[1].endswith("on 3 of 8 cpu devices")
  for name in ("data_parallel", "tensor"):
    board = read_scalars(tmp_path / name)
    assert [s for s, _ in board["train/loss"]] == [1, 2, 3, 4]
    assert 0.0 <= board["eval/accuracy"][0][1] <= 1.0


@pytest.fixture()
def parse():
  parser = cli.build_parser()
  return lambda *argv: cli.parse_args(parser, list(argv))


def test_config_keys_are_flags_and_the_command_line_wins(tmp_path, parse):
  path = tmp_path / "run.toml"
  path.write_text(
    'strategy = "hybrid"\ndata-parallel = 2\nhidden = [64, 32]\nbatch_size = 128\n'
    "no-progress = true\nstop-on-nonfinite = false\n"
  )
  args = parse("train", "--config", str(path), "--batch-size", "64")
  assert (args.strategy, args.data, args.hidden, args.batch_size) == ("hybrid", 2, [64, 32], 64)
  assert args.no_progress and not args.stop_on_nonfinite
  path.write_text("[train]\nepochs = 7\n")  # a [train] table works too
  assert parse("train", "--config", str(path)).epochs == 7
  path.write_text("unroll = true\n")  # (a flag the file turns on, the command line off)
  assert parse("train", "--config", str(path)).unroll is True
  assert parse("train", "--config", str(path), "--no-unroll").unroll is False
  # Every flag a file can turn on, the command line can turn off.
  path.write_text(
    "no-progress = true\nresume = true\noverwrite = true\nallow-config-change = true\n"
    "fresh-optimizer = true\nstop-on-nonfinite = true\n"
  )
  on = parse("train", "--config", str(path))
  undo = ("--progress", "--no-resume", "--no-overwrite", "--no-allow-config-change",
          "--no-fresh-optimizer", "--no-stop-on-nonfinite")  # fmt: skip
  off = parse("train", "--config", str(path), *undo)
  names = ("no_progress", "resume", "overwrite", "allow_config_change", "fresh_optimizer",
           "stop_on_nonfinite")  # fmt: skip
  assert [getattr(on, n) for n in names] == [True] * 6
  assert [getattr(off, n) for n in names] == [False] * 6
  parser = cli._train_parser(cli.build_parser())
  for action in parser._actions:  # no flag left that only turns something on
    if action.nargs == 0 and action.option_strings[0] not in ("-h", "--version"):
      assert isinstance(action, argparse.BooleanOptionalAction) or any(
        other.dest == action.dest and other is not action for other in parser._actions
      ), action.option_strings


@pytest.mark.parametrize(
  "text, message",
  [
    ("batchsize = 3", "run.toml: unknown key 'batchsize'; did you mean 'batch-size'?"),
    ("epochs = 0", "run.toml: epochs = 0: expected a positive integer, got 0"),
    ('schedule = "zigzag"', 'run.toml: schedule = "zigzag": choose one of gpipe, 1f1b'),
    ("no-progress = 1", "run.toml: no-progress = 1: expected true or false"),
    # (a value is named as the file writes it: `true`, not Python's True)
    ("batch-size = true", "run.toml: batch-size = true: expected a number or a string"),
    ("epochs = {a = 1}", "run.toml: epochs = {a = 1}: expected a value, got a table"),
    # (`--progress` undoes a file's no-progress; as a key, `false` would do nothing)
    ("progress = false", "run.toml: unknown key 'progress'; did you mean 'no-progress'?"),
    # (nor a `--no-` form: `no-resume = false` would do nothing; the file writes resume = false)
    ("no-resume = true", "run.toml: unknown key 'no-resume'; did you mean 'resume'?"),
    ("epochs = [1, 2]", "run.toml: epochs = [1, 2]: expected one value, got a list"),
    ("hidden = []", "run.toml: hidden = []: expected at least one value"),
    ("epochs = ", "run.toml: not valid TOML"),
    ("seed = -1", "run.toml: seed = -1: expected an integer >= 0, got -1"),
    ("epochs = 2\n[train]\nseed = 1", "run.toml: keys both in a [train] table and outside it"),
    # (names the run's code looks up: checked before any data loads)
    ('strategy = "pipline"', "run.toml: strategy = \"pipline\": Unknown strategy 'pipline'"),
    ('optimizer = "adamm"', "run.toml: optimizer = \"adamm\": Unknown optimizer 'adamm' (choose"),
    ('precision = "mixed_bf16"', 'run.toml: precision = "mixed_bf16": Unknown precision'),
  ],
)
def test_config_errors_are_one_line_naming_the_key(tmp_path, monkeypatch, capsys, text, message):
  monkeypatch.chdir(tmp_path)
  pathlib.Path("run.toml").write_text(text + "\n")
  assert cli.main(["train", "--config", "run.toml"]) == 2
  err = capsys.readouterr().err.strip()
  assert message in err and "\n" not in err


def test_a_bad_name_in_compare_is_not_blamed_on_the_files_strategy(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  pathlib.Path("run.toml").write_text('strategy = "fsdp"\n')
  assert cli.main(["train", "--config", "run.toml", "--compare", "data_parallel,fdsp"]) == 2
  err = capsys.readouterr().err
  assert "Unknown strategy 'fdsp'" in err and "strategy = 'fsdp'" not in err, err


def test_entry_points_load_from_modules_and_files(tmp_path, monkeypatch):
  (tmp_path / "mymodel.py").write_text(USER_FILE)
  monkeypatch.chdir(tmp_path)
  model, options = config.load_model("mymodel:model")
  assert callable(model.init) and list(options) == ["loss_fn"] and callable(options["loss_fn"])
  (tmp_path / "as_dict.py").write_text(
    "from mymodel import model as pair\n"
    "def model(seed):\n"
    "  net, loss = pair()\n"
    "  return {'model': net, 'loss_fn': loss, 'seed_seen': seed}\n"
  )
  model, options = config.load_model("as_dict:model", seed=7)  # gets the seed it names
  assert callable(model.apply) and options["seed_seen"] == 7 and callable(options["loss_fn"])
  fn = config.load_object(str(tmp_path / "mymodel.py") + ":data", "--dataset")
  train, evaluation = fn(batch_size=4, seed=0)
  assert len(train) == 8 and train[0][0].shape == (4, 12)
  with pytest.raises(config.ConfigError, match=r"'mymodel:modle': mymodel has no attribute "
                     r"'modle'; did you mean 'model'\?"):  # fmt: skip
    config.load_object("mymodel:modle", "--model-fn")
  for spec, message in [
    ("mymodel", "expected 'package.module:function' or 'path/to/file.py:function'"),
    ("nosuchmodule:f", "no module named 'nosuchmodule'"),
    ("missing.py:f", "no file missing.py"),
  ]:
    with pytest.raises(config.ConfigError, match=message):
      config.load_object(spec, "--model-fn")
  (tmp_path / "broken.py").write_text("raise RuntimeError('JAX already started')\n")
  with pytest.raises(config.ConfigError, match="importing broken.py failed: RuntimeError: JAX"):
    config.load_object("broken.py:model", "--model-fn")
  (tmp_path / "bad.py").write_text("def model():\n  return 3\n")
  with pytest.raises(config.ConfigError, match="gave int; expected an hk.Transformed"):
    config.load_model("bad:model")
  # --dataset mymodel.py went to tfds: "Parsing builder name string mymodel.py failed".
  from parstrat._src import run_data

  with pytest.raises(config.ConfigError, match=r"^--dataset 'mymodel.py': name the function "
                     r"in the file that gives the data, 'mymodel.py:function'$"):  # fmt: skip
    run_data.load("mymodel.py", batch_size=4, seed=0)


def test_optimizers_by_name_and_schedules():
  import optax

  for name in optimizers.OPTIMIZERS:
    for decay in (0.0, 1e-4):
      tx = optimizers.make_optimizer(name, 1e-3, weight_decay=decay, clip_norm=1.0)
      assert isinstance(tx, optax.GradientTransformation)
  with pytest.raises(
    ValueError, match=r"Unknown optimizer 'adamm' \(choose one of adam, .*\); did you mean 'adam'\?"
  ):
    optimizers.make_optimizer("adamm", 1e-3)
  with pytest.raises(ValueError, match=r"Unknown optimizer 'ADAM' .*; did you mean 'adam'\?"):
    optimizers.make_optimizer("ADAM", 1e-3)
  with pytest.raises(ValueError, match="pass --steps"):
    optimizers.learning_rate_schedule(1.0, schedule="cosine", warmup_steps=0, total_steps=None)
  warm = optimizers.learning_rate_schedule(2.0, schedule="constant", warmup_steps=4,
                                           total_steps=None)  # fmt: skip
  assert [float(warm(i)) for i in (0, 2, 4, 100)] == [0.0, 1.0, 2.0, 2.0]


def test_help_shows_every_default_and_version(capsys):
  parser = cli.build_parser()
  train = cli._train_parser(parser)
  for action in train._actions:
    assert action.help, f"{action.option_strings} has no help"
  text = train.format_help()
  for flag in ("--batch-size", "--optimizer", "--lr-schedule", "--log-every", "--dataset"):
    assert flag in text
  assert "(default: 256)" in text and "(default: adam)" in text and "(default: mnist)" in text
  text = " ".join(text.split())  # (what helper 75 found unsaid or misleading)
  assert "so --optimizer adamw without it is adam, not optax's default 1e-4" in text
  assert "with --no-progress and N > 1 also print a line" in text
  unroll = text.split("--unroll, --no-unroll")[1].split("--no-progress")[0]
  assert "(default: the loop;" in unroll and "(default: none)" not in unroll
  assert "or at the end of --epochs if that comes first" in text
  schedule = next(a for a in parser._actions if a.dest == "command").choices["schedule"]
  assert "(default: 1f1b)" in schedule.format_help()
  with pytest.raises(SystemExit):
    cli.main(["--version"])
  assert capsys.readouterr().out.strip() == "parstrat 0.1.0"


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--strategy", "pipeline", "--stages", "3", "--batch-size", "64"],
     "multiple of 3 (3 microbatches (default: one per stage)), "
     "got 64; the nearest valid sizes are 63 and 66."),
    (["--strategy", "pipeline", "--stages", "4", "--devices", "2"],
     "needs 4 devices, but only 2 are available. Pass --devices 4"),
  ],
)  # fmt: skip
def test_errors_say_what_to_change(argv, message, capsys):
  common = ["train", "--source", "sample", "--hidden", "16", "16", "16", "--steps", "1"]
  assert cli.main([*common, *argv]) == 2
  err = capsys.readouterr().err.strip()
  assert message in err and "\n" not in err


def test_library_messages_name_options_and_the_device_hint():
  import haiku as hk
  import jax
  import optax

  import parstrat

  model = hk.transform(lambda x: hk.nets.MLP([8, 4])(x))
  trainer = parstrat.DataParallel(data=2)(
    model, optax.sgd(0.1), precision="mixed_bfloat16", accumulate=2
  )
  assert repr(trainer) == (
    "Trainer(DataParallel(data=2), mesh={'data': 2}, precision='mixed_bfloat16', accumulate=2)"
  )
  hint = r"only 1 are available\. On CPU, make 2 virtual .*parstrat\.testing\.use_cpu_devices\(2\)"
  with pytest.raises(ValueError, match=hint):
    parstrat.build_mesh({"data": 2}, jax.devices()[:1])


def test_on_an_accelerator_the_device_hint_points_at_virtual_cpu_devices():
  import types

  from parstrat._src.messages import TooFewDevicesError

  gpus = [types.SimpleNamespace(platform="gpu")]
  error = TooFewDevicesError("stage=2", 2, 1, "gpu")
  assert str(error) == "The mesh stage=2 needs 2 devices, but only 1 are available."
  assert cli._devices_hint(error, gpus) == (
    "The mesh stage=2 needs 2 devices, but only 1 are available. To try it on virtual CPU "
    "devices: JAX_PLATFORMS=cpu parstrat train --devices 2."
  )


def test_a_mesh_axis_that_splits_only_padding_is_named(capsys):
  # 16-wide layers do not split over model=3: Hybrid keeps a 1-element "split" buffer.
  args = ["train", "--strategy", "hybrid", "--data-parallel", "1", "--stages", "2",
          "--tensor-parallel", "3", "--hidden", "16", "16", "16", "--steps", "1", "--epochs", "1",
          "--source", "sample", "--no-progress", "--batch-size", "64"]  # fmt: skip
  assert cli.main(args) == 0
  out = capsys.readouterr().out
  assert "warning: mesh axis 'model' (3 devices) splits (almost) nothing here" in out
  assert "mesh axis 'stage'" not in out and "parallelises" not in out
  assert "throughput: not measured (only the first, compiling, step ran), on 6 of 8" in out


def test_train_runs_the_new_schedules_with_the_same_losses(tmp_path, capsys):
  # Every schedule and activation policy is exact, so the losses agree with 1F1B's.
  base = ["train", "--strategy", "pipeline", "--stages", "2", "--hidden", "16", "16", "16",
          "--steps", "3", "--epochs", "1", "--source", "sample", "--no-progress",
          "--batch-size", "32", "--optimizer", "sgd", "--lr", "0.1"]  # fmt: skip
  runs = {
    "1f1b": ["--schedule", "1f1b"],
    "zb_h1": ["--schedule", "zb_h1", "--activations", "save"],
    "interleaved": ["--schedule", "interleaved_1f1b", "--virtual-stages", "2"],
    "exchange_every": ["--schedule", "1f1b", "--exchange-every", "2", "--activations", "save"],
    "unroll": ["--schedule", "zb_h1", "--unroll"],
  }
  losses, outputs = {}, {}
  for name, extra in runs.items():
    metrics = tmp_path / f"{name}.jsonl"
    assert cli.main([*base, *extra, "--metrics", str(metrics)]) == 0
    outputs[name] = capsys.readouterr().out
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses[name] = [r["loss"] for r in rows if "loss" in r]
  assert len(losses["1f1b"]) == 3
  for name in ("zb_h1", "interleaved", "exchange_every", "unroll"):
    np.testing.assert_allclose(losses[name], losses["1f1b"], rtol=1e-5)
  assert "(an exchange every 2)" in outputs["exchange_every"]
  assert (
    "options: schedule=1f1b, activations=save, exchange_every=2, microbatches=2"
    in (outputs["exchange_every"])
  )
  assert "schedule=interleaved_1f1b, virtual_stages=2," in outputs["interleaved"]
  assert "zb_h1" in outputs["zb_h1"] and "activations: save" in outputs["zb_h1"]
  assert "interleaved_1f1b, 2 virtual stages per device" in outputs["interleaved"]
  assert "(an exchange every 2)" in outputs["interleaved"]  # its default
  assert "options: schedule=zb_h1, unroll=True, microbatches=2" in outputs["unroll"]
  assert "ticks, unrolled" in outputs["unroll"] and "unrolled" not in outputs["zb_h1"]


def _user_run(tmp_path, monkeypatch, *flags) -> int:
  (tmp_path / "mymodel.py").write_text(USER_FILE)
  monkeypatch.chdir(tmp_path)
  # This test's own mymodel.py, not the module of that name an earlier test imported
  # (the same code from another file: checkpoints record which file each run loaded).
  monkeypatch.delitem(sys.modules, "mymodel", raising=False)
  return cli.main(["train", "--epochs", "1", "--steps", "2", "--batch-size", "8",
                   "--no-progress", "--devices", "2", *flags])  # fmt: skip


def test_a_resume_at_the_end_of_an_epoch_of_unknown_length_goes_on(tmp_path, monkeypatch):
  # Data given as a function of the epoch has no length: a checkpoint of an epoch's
  # last batch said (epoch 1, batch 8), and the resume found no batches left and
  # stopped, every time. It now goes on with epoch 2, as the run without a stop did.
  def losses(out):
    rows = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, rows) if "loss" in r and "step" in r}

  flags = ["--dataset", "mymodel:by_epoch", "--model-fn", "mymodel:model", "--epochs", "2",
           "--log-every", "1"]  # fmt: skip
  assert _user_run(tmp_path, monkeypatch, *flags, "--steps", "16", "--out", "straight") == 0
  legs = [*flags, "--out", "legs", "--checkpoint-dir", "ckpt"]
  assert _user_run(tmp_path, monkeypatch, *legs, "--steps", "8") == 0
  assert _user_run(tmp_path, monkeypatch, *legs, "--steps", "16", "--resume") == 0
  straight, resumed = losses("straight"), losses("legs")
  assert sorted(resumed) == list(range(1, 17))
  assert resumed == pytest.approx(straight, rel=1e-6)


STRATEGY_FILE = """
import dataclasses

import parstrat


@parstrat.register("my_data_parallel")
@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class MyDataParallel(parstrat.DataParallel):
  hosts: int = 1
  overlap: bool = False


@parstrat.register("my_fixed_loss")
@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class MyFixedLoss(parstrat.DataParallel):  # takes no loss_fn or model_inputs
  def __call__(self, model, optimizer, *, skip_nonfinite=True, precision=None, accumulate=1):
    return super().__call__(
      model, optimizer, skip_nonfinite=skip_nonfinite, precision=precision, accumulate=accumulate
    )
"""


def test_a_strategy_of_your_own_trains_from_the_command_line(tmp_path, monkeypatch, capsys):
  # --import runs the module that registers it before the strategy is looked up; without
  # it the unknown name says what to pass.
  (tmp_path / "mystrategies.py").write_text(STRATEGY_FILE)
  try:
    assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:model", "--dataset",
                     "mymodel:data", "--strategy", "my_data_parallel") == 2  # fmt: skip
    assert "pass --import MODULE" in capsys.readouterr().err
    assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:model", "--dataset",
                     "mymodel:data", "--strategy", "my_data_parallel",
                     "--import", "mystrategies") == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "mesh: data=2 (MyDataParallel(devices=<2 devices>))" in out.splitlines(), out
    # Its own options, which no flag sets: on the command line, or a config file's table
    # (the command line wins), each read by its field's type ("False" was the text
    # 'False', which is true).
    (tmp_path / "run.toml").write_text(
      "import = ['mystrategies']\n[strategy-option]\nhosts = 2\noverlap = true\n"
    )
    mine = ["--model-fn", "mymodel:model", "--dataset", "mymodel:data", "--strategy",
            "my_data_parallel", "--import", "mystrategies"]  # fmt: skip
    for how, shown in (
      (["--strategy-option", "hosts=2", "overlap=False"], "hosts=2"),
      (["--config", "run.toml"], "hosts=2, overlap=True"),
      (["--config", "run.toml", "--strategy-option", "hosts=3", "overlap=off"], "hosts=3"),
    ):
      assert _user_run(tmp_path, monkeypatch, *mine, *how) == 0
      out = capsys.readouterr().out
      assert f"mesh: data=2 (MyDataParallel(devices=<2 devices>, {shown}))" in out, out
    for how, message in (
      (
        ["--strategy-option", "host=2"],
        "--strategy-option host=2: my_data_parallel has no "
        "option 'host'; did you mean 'hosts'? (it takes --devices, ",
      ),
      (["--strategy-option", "hosts="], "--strategy-option hosts=: give a value after '='"),
      (["--strategy-option", "overlap=maybe"], "overlap is a bool; give true or false"),
      (["--strategy-option", "hosts=two"], "hosts is int; give a number"),
      (  # (each strategy of --compare takes those it has; one that none has is a typo)
        ["--compare", "my_data_parallel,fsdp", "--strategy-option", "hots=2"],
        "--strategy-option hots=2: none of my_data_parallel, fsdp takes it",
      ),
    ):
      assert _user_run(tmp_path, monkeypatch, *mine, *how) == 2
      assert message in capsys.readouterr().err
    # The same mistakes in the config file's table are named as the file writes them (they
    # were named as flags nobody typed); a key the command line gives again is its own.
    for table, how, message in (
      (
        "host = 2",
        [],
        "[strategy-option] host = 2: my_data_parallel has no option 'host'; did you mean 'hosts'?",
      ),  # fmt: skip
      ("overlap = 'maybe'", [], '[strategy-option] overlap = "maybe": overlap is a bool'),
      (
        "hosts = 2\ndevices = [0, 1]",
        [],
        "[strategy-option] devices = [0, 1]: the devices come from --devices",
      ),  # fmt: skip
      (
        "hots = 2",
        ["--compare", "my_data_parallel,fsdp"],
        "[strategy-option] hots = 2: none of my_data_parallel, fsdp takes it",
      ),  # fmt: skip
      ("host = 3", ["--strategy-option", "host=2"], "--strategy-option host=2: my_data_"),
      # (a key with "-", which --strategy-option reads as "_": still the file's spelling)
      (
        "over-lap = true",
        [],
        "[strategy-option] over-lap = true: my_data_parallel has no "
        "option 'over_lap'; did you mean 'overlap'?",
      ),  # fmt: skip
    ):
      (tmp_path / "bad.toml").write_text(f"[strategy-option]\n{table}\n")
      assert _user_run(tmp_path, monkeypatch, *mine, "--config", "bad.toml", *how) == 2
      assert message in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
      _user_run(tmp_path, monkeypatch, "--strategy-option", "hosts")
    assert "expected KEY=VALUE (e.g. hosts=4), got 'hosts'" in capsys.readouterr().err
    # A --model-fn's loss_fn that a later strategy of --compare does not take is refused
    # before the first strategy trains (it was refused after).
    assert _user_run(tmp_path, monkeypatch, *mine[:4], "--import", "mystrategies", "--out",
                     "cmp", "--compare", "data_parallel,my_fixed_loss") == 2  # fmt: skip
    assert "--model-fn returned 'loss_fn' in its dict, which the trainer does not take (it " \
      "takes none)" in capsys.readouterr().err  # fmt: skip
    assert not (tmp_path / "cmp" / "data_parallel" / "metrics.jsonl").exists()
  finally:
    parstrat.unregister("my_data_parallel")
    parstrat.unregister("my_fixed_loss")
    sys.modules.pop("mystrategies", None)


def test_generators_are_evaluated_every_epoch_and_refused_by_compare(tmp_path, monkeypatch, capsys):
  # An eval generator was used up by the first evaluation (later epochs showed no
  # accuracy), and --compare on a train generator trained every strategy after the
  # first on nothing, with exit 0.
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:model", "--dataset",
                   "mymodel:generator_eval", "--out", "run", "--epochs", "2",
                   "--steps", "16") == 0  # fmt: skip
  rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "eval_accuracy" in r] == [8, 16]
  capsys.readouterr()
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:model", "--dataset",
                   "mymodel:generators", "--compare", "data_parallel,fsdp") == 2  # fmt: skip
  assert "--compare: the train data of --dataset mymodel:generators is a one-shot iterator" in (
    capsys.readouterr().err
  )


def test_a_batch_that_does_not_split_names_its_step_batch_and_epoch(tmp_path, monkeypatch, capsys):
  # (the message named neither, after some steps had run)
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:model", "--dataset",
                   "mymodel:odd_last", "--steps", "3") == 2  # fmt: skip
  err = capsys.readouterr().err
  assert "step 3: batch 3 of epoch 1: The batch size of the batch must be a positive " in err


def test_a_type_error_inside_a_dataset_function_keeps_its_traceback(tmp_path, monkeypatch):
  # (it was reported as a call with the wrong arguments, its file and line gone)
  (tmp_path / "mymodel.py").write_text(USER_FILE)
  monkeypatch.chdir(tmp_path)
  with pytest.raises(TypeError, match="object of type 'int' has no len"):
    run_data.from_function("mymodel:body_type_error", batch_size=8, seed=0)


@pytest.mark.parametrize(
  "dataset, message",
  [
    ("whole_arrays", "the first train batch is str 'x': train must yield batches"),
    (
      "needs_split",
      "'mymodel:needs_split': cannot call needs_split: missing a required argument: 'split'",
    ),
  ],
)
def test_a_dataset_function_of_another_shape_is_named_in_one_line(
  tmp_path, monkeypatch, capsys, dataset, message
):
  # (raw tracebacks: an IndexError from the first example, a TypeError from the call)
  assert _user_run(tmp_path, monkeypatch, "--dataset", f"mymodel:{dataset}") == 2
  assert message in capsys.readouterr().err


def test_ctrl_c_at_an_epochs_last_batch_keeps_its_eval(tmp_path, monkeypatch, capsys):
  # The stop came before the epoch-end eval, and the checkpoint (the next epoch, batch
  # 0) never ran it: that epoch's eval and summary were lost for good.
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:model", "--dataset",
                   "mymodel:ctrl_c_at_epoch_end", "--out", "run", "--epochs", "2",
                   "--steps", "16", "--checkpoint-dir", "ckpt") == 130  # fmt: skip
  rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "eval_accuracy" in r] == [8]
  assert "epoch 1: loss " in capsys.readouterr().out
  assert (tmp_path / "ckpt" / "8").is_dir()  # (saved before the eval)
  # A stop at the run's last step (--steps, mid-epoch) runs its final eval, and ends it.
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:model", "--dataset",
                   "mymodel:ctrl_c_at_the_4th", "--out", "run4", "--steps", "4") == 0  # fmt: skip
  rows = [json.loads(x) for x in (tmp_path / "run4" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "eval_accuracy" in r] == [4]


def test_eval_labels_the_model_cannot_predict_are_named_before_training(
  tmp_path, monkeypatch, capsys
):
  # They counted as wrong answers, without a word. With the default loss (training
  # stops on such labels) the run is refused before it starts; with a loss of one's
  # own (which may skip them, as padding) it is said once.
  assert _user_run(tmp_path, monkeypatch, "--dataset", "mymodel:eval_label_12") == 2
  assert (
    "eval batch 1 has 1 label(s) outside [0, 10), the model's classes (first: 12); "
    "training stops on such labels too"
  ) in capsys.readouterr().err
  assert _user_run(tmp_path, monkeypatch, "--dataset", "mymodel:eval_label_12",
                   "--model-fn", "mymodel:model") == 0  # fmt: skip
  assert (
    "eval batch 1 has 1 label(s) outside [0, 4), the model's classes (first: 12): the "
    "eval accuracy counts them as wrong"
  ) in capsys.readouterr().out.splitlines()
  # Eval inputs the model cannot take: refused before training (after an epoch before,
  # at the first eval, with a traceback naming the 32 rows of the piece, not the batch).
  assert _user_run(tmp_path, monkeypatch, "--dataset", "mymodel:eval_5_wide") == 2
  out, err = capsys.readouterr()
  assert err.strip().endswith(
    "eval batch 1: inputs must have shape [B, 12] like the training inputs, got (10, 5)."
  )
  assert "epoch" not in out and len(err.strip().splitlines()) == 1
  assert _user_run(tmp_path, monkeypatch, "--dataset", "mymodel:eval_int_inputs") == 2
  assert (
    capsys.readouterr()
    .err.strip()
    .endswith(
      "eval batch 1: inputs must have dtype float32 like the training inputs, got dtype int32."
    )
  )


def test_an_error_in_the_users_own_code_is_one_line_naming_where(tmp_path, monkeypatch, capsys):
  # A ValueError or TypeError from a model function or its forward pass was one bare line
  # ("error: width must be even"), without the file or line of the user's code.
  lines = USER_FILE.splitlines()
  for name, message, line, where in [
    ("checks_its_width", "width must be even", 'raise ValueError("width must be even")',
     "checks_its_width"),
    ("wrong_call", "takes 2 positional arguments but 3 were given",
     "return hk.Linear(4)(x, x)", "forward"),
  ]:  # fmt: skip
    number = next(i for i, text in enumerate(lines, 1) if text.strip() == line)
    flags = ["--model-fn", f"mymodel:{name}", "--dataset", "mymodel:data"]
    assert _user_run(tmp_path, monkeypatch, *flags) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert err.endswith(f" (at {tmp_path / 'mymodel.py'}:{number}, in {where})"), err
  # parstrat's own checks need no place: none is named.
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:dropout_model", "--dataset",
                   "mymodel:data", "--strategy", "pipeline", "--stages", "2") == 2  # fmt: skip
  err = capsys.readouterr().err.strip()
  assert "cannot train a model that calls hk.next_rng_key()" in err and "(at " not in err, err


def test_ctrl_c_outside_a_training_step_is_one_line(tmp_path, monkeypatch, capsys):
  # (while the data loads, a step compiles, or between --compare strategies: a raw
  # KeyboardInterrupt traceback before)
  assert _user_run(tmp_path, monkeypatch, "--dataset", "mymodel:interrupted") == 130
  assert capsys.readouterr().err == (
    "parstrat train: interrupted: SIGINT outside a training step; checkpoints already "
    "written are kept\n"
  )


def test_a_model_fns_dict_keys_the_trainer_does_not_take_are_named(tmp_path, monkeypatch, capsys):
  # They gave Python's "got multiple values for keyword argument 'precision'" (without
  # --precision given) or "unexpected keyword argument 'loss_fun'".
  for name, message in [
    ("with_precision", "--model-fn returned 'precision' in its dict: on the command line it "
                       "comes from --precision"),
    ("with_a_typo", "--model-fn returned 'loss_fun' in its dict, which the trainer does not "
                    "take (it takes loss_fn, model_inputs); did you mean 'loss_fn'?"),
  ]:  # fmt: skip
    flags = ["--model-fn", f"mymodel:{name}", "--dataset", "mymodel:data"]
    assert _user_run(tmp_path, monkeypatch, *flags) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err
  for name in parstrat.available():  # every built-in takes a dict's loss_fn and model_inputs
    cli._check_model_options(parstrat.get(name), {"loss_fn": None, "model_inputs": None})


def test_resume_with_another_model_fn_of_the_same_shapes_is_a_guarded_change(
  tmp_path, monkeypatch, capsys
):
  # A relu MLP's checkpoint went on as a tanh MLP without a word (only shapes were
  # compared; the model function was not recorded).
  flags = ["--dataset", "mymodel:data", "--checkpoint-dir", "ckpt", "--save-every", "2"]
  assert _user_run(tmp_path, monkeypatch, *flags, "--model-fn", "mymodel:model") == 0
  capsys.readouterr()
  tanh = [*flags, "--model-fn", "mymodel:tanh_model", "--resume", "--steps", "4"]
  assert _user_run(tmp_path, monkeypatch, *tanh) == 2
  assert "model_fn mymodel:model -> mymodel:tanh_model" in capsys.readouterr().err
  assert _user_run(tmp_path, monkeypatch, *tanh, "--allow-config-change") == 0
  assert (
    "resuming with a changed configuration: model_fn mymodel:model -> mymodel:tanh_model"
    in capsys.readouterr().out.splitlines()
  )
  # The same file written another way (a job script that spells it out) is no change.
  same = ["--dataset", f"{tmp_path}/mymodel.py:data", "--model-fn", "./mymodel.py:tanh_model"]
  assert _user_run(tmp_path, monkeypatch, *flags[2:], *same, "--resume", "--steps", "6") == 0
  out = capsys.readouterr().out
  assert "resumed from" in out and "changed configuration" not in out
  # Another folder's file of the same name is another model: the checkpoint recorded the
  # file the relative path named then, not the one it names from here.
  (other := tmp_path / "other").mkdir()
  (other / "mymodel.py").write_text(f"{USER_FILE}\n\ntanh_model = model  # (a relu one)\n")
  monkeypatch.chdir(other)
  args = ["train", "--epochs", "1", "--batch-size", "8", "--no-progress", "--devices", "2",
          "--checkpoint-dir", "../ckpt", "--dataset", f"{tmp_path}/mymodel.py:data",
          "--model-fn", f"{other}/mymodel.py:tanh_model", "--resume", "--steps", "8"]  # fmt: skip
  assert cli.main(args) == 2
  assert f"model_fn ./mymodel.py:tanh_model -> {other}/mymodel.py:tanh_model" in (
    capsys.readouterr().err
  )


def test_eval_data_that_gives_no_accuracy_is_named_once(tmp_path, monkeypatch, capsys):
  # (one (x, y) pair instead of a list of pairs: no accuracy, and not a word)
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:model", "--dataset",
                   "mymodel:one_eval_pair", "--eval-every", "1", "--source", "sample",
                   "--data-dir", "nowhere") == 0  # fmt: skip
  out = capsys.readouterr().out
  assert out.count("eval: no accuracy: the eval data must be a non-empty iterable of") == 1
  # ... and the reason, the first batch at fault named.
  assert (
    "labels) pairs whose labels match the model's outputs (one class score per label): "
    "eval batch 1 is an array float32[50, 12], not an (inputs, labels) pair"
  ) in out, out
  # (flags a dataset function does not read were passed over without a word)
  assert (
    "--source sample, --data-dir nowhere: not used, the data is --dataset mymodel:one_eval_pair"
  ) in out.splitlines()
  # No eval batches at all (the LM example's at --batch-size 256) is said as such.
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:model", "--dataset",
                   "mymodel:no_eval_batches") == 0  # fmt: skip
  assert (
    "eval: no accuracy: --dataset mymodel:no_eval_batches gave no eval batches (at --batch-size 8)"
  ) in capsys.readouterr().out.splitlines()
  # An eval model whose outputs do not fit the labels is named with both shapes (the
  # data was blamed alone).
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:eval_model_of_other_outputs",
                   "--dataset", "mymodel:data") == 0  # fmt: skip
  out = capsys.readouterr().out
  assert (
    "pairs whose labels match the eval_model's outputs (one class score per label): eval "
    "batch 1's labels int32[50] do not match the eval_model's outputs float32[50, 4, 1] (for "
    "those labels: [50, 'classes'])"
  ) in out
  # (its last axis, 1 wide, was taken for its classes: "33 label(s) outside [0, 1)")
  assert "outside [0, 1)" not in out
  # Labels outside an eval model's fewer classes count as wrong: training (on the
  # model's 4) does not stop on them, as the refusal said it would.
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:eval_model_of_fewer_classes",
                   "--dataset", "mymodel:data") == 0  # fmt: skip
  assert (
    "outside [0, 2), the eval_model's classes (first: 2): the eval accuracy counts them as wrong"
  ) in capsys.readouterr().out
  # A scalar label (one row's) crashed the eval: "len() of unsized object".
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:model",
                   "--dataset", "mymodel:scalar_label_eval") == 0  # fmt: skip
  assert "eval batch 1's label is a scalar, not one per example" in capsys.readouterr().out


def test_a_compare_stopped_before_a_strategys_first_checkpoint_resumes(
  tmp_path, monkeypatch, capsys
):
  # Its --resume said "no checkpoint in DIR/fsdp" every time: only --overwrite, which
  # deletes the finished strategy's checkpoints, got past it.
  flags = ["--model-fn", "mymodel:model", "--dataset", "mymodel:data", "--compare",
           "data_parallel,fsdp", "--checkpoint-dir", "ckpt", "--save-every", "1"]  # fmt: skip
  assert _user_run(tmp_path, monkeypatch, *flags) == 0
  for step in (tmp_path / "ckpt" / "fsdp").iterdir():  # as if stopped before fsdp's first
    if step.name.isdigit():  # checkpoint: its metrics and curves stay
      shutil.rmtree(step)
  capsys.readouterr()
  drawn = {}
  monkeypatch.setattr(report, "draw_training_report", lambda runs, path: drawn.update(runs))
  assert _user_run(tmp_path, monkeypatch, *flags, "--resume") == 0
  out = capsys.readouterr().out
  assert "--resume: no checkpoint in ckpt/fsdp yet: fsdp starts" in out
  assert sorted(p.name for p in (tmp_path / "ckpt" / "fsdp").iterdir() if p.name.isdigit())
  # The stopped leg's curves went (TensorBoard showed both); the picture drawn again
  # still has the complete strategy's (it had none of them).
  assert len(list((tmp_path / "ckpt" / "fsdp").glob("events.out.tfevents.*"))) == 1
  assert [r["step"] for r in drawn["data_parallel"] if "loss" in r] == [1, 2]
  # A complete run's damaged metrics leave its curves out, with a word.
  metrics = tmp_path / "ckpt" / "data_parallel" / "metrics.jsonl"
  metrics.write_text("{bad\n" + metrics.read_text())
  capsys.readouterr()
  assert _user_run(tmp_path, monkeypatch, *flags, "--resume") == 0
  assert "not a JSON record" in capsys.readouterr().out
  # Without a checkpoint of any of its strategies there is nothing to resume (another
  # run's checkpoints in the same folder do not count).
  shutil.rmtree(tmp_path / "ckpt")
  (tmp_path / "ckpt" / "another_run" / "2").mkdir(parents=True)
  assert _user_run(tmp_path, monkeypatch, *flags, "--resume") == 2


def test_resume_if_exists_starts_a_job_then_resumes_it_with_the_same_command(
  tmp_path, monkeypatch, capsys
):
  # A job its scheduler restarts runs one command every time: `--resume` refused its
  # first leg ("no checkpoint"), and after a leg killed before its first checkpoint a
  # fresh run was refused too ("not empty": the killed leg's metrics).
  def rows(out):
    lines = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]

  flags = ["--model-fn", "mymodel:model", "--dataset", "mymodel:data", "--log-every", "1"]
  assert _user_run(tmp_path, monkeypatch, *flags, "--steps", "6", "--out", "straight") == 0
  job = [*flags, "--checkpoint-dir", "ckpt", "--resume-if-exists"]
  capsys.readouterr()
  for leg in range(2):  # a first leg; then the same over what it leaves if killed early
    assert _user_run(tmp_path, monkeypatch, *job, "--steps", str(2 + leg)) == 0
    assert "--resume-if-exists: no checkpoint in ckpt: data_parallel starts" in (
      capsys.readouterr().out.splitlines()
    )
    for step in (tmp_path / "ckpt").iterdir():  # as if killed before its first checkpoint
      if step.name.isdigit():
        shutil.rmtree(step)
    (tmp_path / "ckpt" / "report.png").unlink()  # (drawn only by a leg that ends)
    (tmp_path / "ckpt" / "2.orbax-checkpoint-tmp").mkdir(exist_ok=True)  # (in its save)
    (tmp_path / "ckpt" / ".metrics.jsonl-x1y2z3").write_text("")  # (in History's write)
  left = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
  assert left[:2] == [".metrics.jsonl-x1y2z3", "2.orbax-checkpoint-tmp"]
  assert left[2].startswith("events.out.tfevents.") and left[3:] == ["metrics.jsonl"]
  assert _user_run(tmp_path, monkeypatch, *job, "--steps", "3") == 0
  assert rows("ckpt") == rows("straight")[:3]  # (the killed leg's rows replaced)
  unfinished = tmp_path / "ckpt" / "4.orbax-checkpoint-tmp-1765000000"  # (killed in a save)
  unfinished.mkdir()
  assert _user_run(tmp_path, monkeypatch, *job, "--steps", "6") == 0
  assert not unfinished.exists()  # (train deletes what a killed save left)
  with Checkpointer(tmp_path / "ckpt") as ckpt:  # (not shuffled by us)
    assert ckpt.metadata()["config"]["data_order"] == "as the dataset function gives it"
  assert "resumed from" in capsys.readouterr().out
  assert rows("ckpt") == rows("straight")
  # Killed while drawing its report (after its last checkpoint): the next leg, complete,
  # draws it from the whole run's metrics, and leaves a report that is there alone.
  (tmp_path / "ckpt" / "report.png").unlink()
  drawn = []
  monkeypatch.setattr(report, "draw_training_report", lambda runs, path: drawn.append(runs))
  for _ in range(2):
    assert _user_run(tmp_path, monkeypatch, *job, "--steps", "6") == 0
    (tmp_path / "ckpt" / "report.png").touch()
  assert "already complete at step 6" in capsys.readouterr().out
  ((name, records),) = drawn[0].items()  # (drawn once)
  assert len(drawn) == 1 and [(r["step"], r["loss"]) for r in records if "loss" in r] == rows(
    "straight"
  )
  (tmp_path / "ckpt" / "report.png").unlink()  # and its metrics gone: no blank picture
  (tmp_path / "ckpt" / "metrics.jsonl").unlink()
  assert _user_run(tmp_path, monkeypatch, *job, "--steps", "6") == 0
  assert len(drawn) == 1 and (
    "report: ckpt/report.png not drawn: this complete run has no metrics to draw it from"
    in capsys.readouterr().out.splitlines()
  )
  for clash, why in [
    ("--resume", "it resumes where there is a checkpoint: drop --resume"),
    ("--overwrite", "it continues the checkpoints that --overwrite would delete: pick one"),
    ("--fresh-optimizer", "the optimizer would start anew at every leg's resume"),
  ]:
    assert _user_run(tmp_path, monkeypatch, *job, clash) == 2
    assert f"--resume-if-exists with {clash}: {why}" in capsys.readouterr().err
  assert _user_run(tmp_path, monkeypatch, *flags, "--resume-if-exists") == 2
  assert "--resume-if-exists needs --checkpoint-dir" in capsys.readouterr().err
  # A folder that holds what no stopped leg leaves is another run's, or not a run's.
  for foreign in ("notes.txt", "my.orbax-checkpoint-tmp-backup"):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "metrics.jsonl").write_text("")
    if foreign.endswith(".txt"):
      (tmp_path / "other" / foreign).write_text("mine")
    else:
      (tmp_path / "other" / foreign).mkdir()
    assert _user_run(tmp_path, monkeypatch, *flags, "--checkpoint-dir", "other",
                     "--resume-if-exists") == 2  # fmt: skip
    assert (
      f"--resume-if-exists: --checkpoint-dir other holds no checkpoint but other/{foreign} "
      "(another run?)" in capsys.readouterr().err
    )
    shutil.rmtree(tmp_path / "other")
  # ... and so is an --out of another run (a complete one has its report), whether the
  # checkpoint folder exists or not, or of another run stopped early.
  (tmp_path / "new").mkdir()
  for checkpoints in ("new", "none_yet"):
    assert _user_run(tmp_path, monkeypatch, *flags, "--checkpoint-dir", checkpoints, "--out",
                     "straight", "--resume-if-exists") == 2  # fmt: skip
    assert "--resume-if-exists: --out straight holds straight/report.png, which no stopped " \
      "leg of this run leaves (another run?); run once with --overwrite instead of " \
      "--resume-if-exists" in capsys.readouterr().err  # fmt: skip
  (tmp_path / "straight" / "report.png").unlink()
  assert _user_run(tmp_path, monkeypatch, *flags, "--checkpoint-dir", "none_yet", "--out",
                   "straight", "--resume-if-exists") == 2  # fmt: skip
  assert "--resume-if-exists: --out straight holds another run (straight/metrics.jsonl) and " \
    "--checkpoint-dir none_yet none" in capsys.readouterr().err  # fmt: skip
  # A --metrics file of its own in the folder is what a stopped leg leaves, too.
  (tmp_path / "m").mkdir()
  (tmp_path / "m" / "train.jsonl").write_text("")
  assert _user_run(tmp_path, monkeypatch, *flags, "--checkpoint-dir", "m", "--metrics",
                   "m/train.jsonl", "--resume-if-exists") == 0  # fmt: skip
  # A stop tells the job to run its command again (adding --resume is refused with it).
  stopped = [*flags, "--checkpoint-dir", "stopped", "--resume-if-exists", "--steps", "8",
             "--dataset", "mymodel:ctrl_c_at_the_4th"]  # fmt: skip
  assert _user_run(tmp_path, monkeypatch, *stopped) == 130
  assert "after the step: checkpoint saved in" in (err := capsys.readouterr().err)
  assert err.strip().endswith("; run the same command again"), err


def test_what_a_stopped_compare_leg_leaves_is_told_from_another_runs_files(tmp_path):
  args = cli.build_parser().parse_args(["train", "--checkpoint-dir", str(tmp_path / "ckpt"),
                                        "--compare", "data_parallel,fsdp", "--out",
                                        str(tmp_path / "ckpt" / "logs"), "--metrics",
                                        str(tmp_path / "ckpt" / "m" / "run.jsonl")])  # fmt: skip
  folders, files = cli._leg_paths(args)
  for name in ("data_parallel", "logs/fsdp", "m"):  # (the checkpoints', --out's, --metrics')
    (tmp_path / "ckpt" / name).mkdir(parents=True)
  for name in ("data_parallel/events.out.tfevents.1.vm", "m/run.fsdp.jsonl", "m/.run.fsdp.jsonl-x"):
    (tmp_path / "ckpt" / name).write_text("")
  assert cli._first_foreign(tmp_path / "ckpt", folders, files) is None
  (tmp_path / "ckpt" / "compare.png").write_bytes(b"")  # (drawn when all have trained)
  assert cli._first_foreign(tmp_path / "ckpt", folders, files) == str(
    tmp_path / "ckpt" / "compare.png"
  )
  (tmp_path / "ckpt" / "compare.png").unlink()
  (tmp_path / "ckpt" / "logs" / "fsdp" / "mine.txt").write_text("")
  assert cli._first_foreign(tmp_path / "ckpt", folders, files) == str(
    tmp_path / "ckpt" / "logs" / "fsdp" / "mine.txt"
  )


def test_an_older_checkpoints_data_order_is_not_a_change():
  # Checkpoints written before `RunData.order` said "shuffled per epoch by (seed, epoch)"
  # for every dataset, a dataset function's too: resuming one listed it as a change.
  args = cli.build_parser().parse_args(["train", "--dataset", "mymodel:data"])
  data = run_data.RunData(
    description="mymodel:data", train_epoch=lambda epoch: [], steps_per_epoch=8,
    eval_batches=None, example=(np.zeros((1, 12)), np.zeros((1,))),
    order="as the dataset function gives it",
  )  # fmt: skip
  saved = {**cli._run_config(args, data), "data_order": "shuffled per epoch by (seed, epoch)"}
  meta = {"seed": args.seed, "batch_size": args.batch_size, "config": saved}
  assert cli._resumable_changes(args, meta, data) == []
  saved["data_order"] = "something else"
  assert cli._resumable_changes(args, meta, data) == [
    "data_order something else -> as the dataset function gives it"
  ]


def test_a_model_fn_is_compared_by_the_file_only_where_its_spelling_changed(tmp_path, monkeypatch):
  # The files a checkpoint's run loaded forgive another spelling of them; they never
  # make a change of their own (a moved or copied project is the same run), and an
  # older checkpoint's relative path is not resolved from the resume's folder.
  for folder in ("a", "b"):
    (tmp_path / folder).mkdir()
    (tmp_path / folder / "mymodel.py").write_text(USER_FILE)
  monkeypatch.chdir(tmp_path / "b")
  monkeypatch.delitem(sys.modules, "mymodel", raising=False)

  def changes(saved_model_fn, saved_source, model_fn):
    args = cli.build_parser().parse_args(["train", "--model-fn", model_fn])
    data = run_data.RunData(
      description="sample", train_epoch=lambda epoch: [], steps_per_epoch=8,
      eval_batches=None, example=(np.zeros((1, 12)), np.zeros((1,))), order="shuffled",
    )  # fmt: skip
    saved = {**cli._run_config(args, data), "model_fn": saved_model_fn}
    saved["model_fn_source"] = saved_source
    if saved_source is None:  # (an older checkpoint: no sources)
      del saved["model_fn_source"], saved["dataset_source"]
    meta = {"seed": args.seed, "batch_size": args.batch_size, "config": saved}
    try:
      return cli._resumable_changes(args, meta, data)
    except cli.UsageError as e:
      return str(e)

  a, b = (f"{tmp_path / folder}/mymodel.py:model" for folder in ("a", "b"))
  assert changes("mymodel:model", a, "mymodel:model") == []  # (the project moved from a)
  assert changes("mymodel:model", b, "./mymodel.py:model") == []  # (spelled another way)
  assert "model_fn mymodel:model -> ./mymodel.py:model" in changes(
    "mymodel:model", a, "./mymodel.py:model"
  )  # (a's file then, b's now)
  assert changes(a.replace("/a/", "/b/../b/"), None, b) == []  # (older: absolute resolved)
  assert "model_fn ./mymodel.py:model -> " in changes("./mymodel.py:model", None, b)


def test_a_dropout_model_is_evaluated_with_a_key(tmp_path, monkeypatch, capsys):
  # The evaluation called trainer.apply without rng: a dropout model crashed at epoch end.
  keys = []

  def recording(*args, rng=None, **kwargs):
    keys.append(rng)
    return eval_accuracy(*args, rng=rng, **kwargs)

  eval_accuracy = run_data.eval_accuracy
  monkeypatch.setattr(run_data, "eval_accuracy", recording)
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:dropout_model", "--seed", "3",
                   "--dataset", "mymodel:data", "--out", "run", "--hidden", "8") == 0  # fmt: skip
  # One eval, at step 2: its key is folded from --seed and the step (not a training key).
  (key,) = keys
  want = jax.random.fold_in(jax.random.key(3 + 1), 2)
  np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(want))
  # (--hidden shapes only the built-in MLP: the run says it left it out)
  assert "--hidden 8: not used, the model is --model-fn mymodel:dropout_model" in (
    capsys.readouterr().out.splitlines()
  )
  rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert 0.0 <= [r for r in rows if "eval_accuracy" in r][0]["eval_accuracy"] <= 1.0


def test_an_eval_model_evaluates_the_trained_params(tmp_path, monkeypatch, capsys):
  # A dropout model could only be evaluated as it trains, dropout on. --model-fn's dict
  # may now give the model as evaluated, which runs on the trained params.
  evaluated = []

  def recording(trainer, *args, **kwargs):
    evaluated.append(trainer.model)
    return eval_accuracy(trainer, *args, **kwargs)

  eval_accuracy = run_data.eval_accuracy
  monkeypatch.setattr(run_data, "eval_accuracy", recording)
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:dropout_with_eval_model",
                   "--dataset", "mymodel:data", "--seed", "0", "--checkpoint-dir", "ckpt",
                   "--out", "run") == 0  # fmt: skip
  user = sys.modules["mymodel"]

  def accuracies(run, ckpt, model_fn, step=2):  # the run's, and the eval model's own
    rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    (accuracy,) = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    checkpointer = ocp.StandardCheckpointer()
    path = (tmp_path / ckpt / str(step) / "state").resolve()
    saved = checkpointer.metadata(path).item_metadata.tree
    zeros = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), saved)
    restored = checkpointer.restore(path, zeros)
    params, model_state = restored["params"], restored.get("model_state")
    ((x, y),) = user.data(8, 0)[1]
    eval_model = getattr(user, model_fn)()["eval_model"]
    if model_state:  # (the trained BatchNorm statistics)
      logits, _ = eval_model.apply(params, model_state, None, x)
    else:
      logits = eval_model.apply(params, None, x)
    return accuracy, int((np.argmax(logits, -1) == y).sum()) / len(y), params, x

  accuracy, own, params, x = accuracies("run", "ckpt", "dropout_with_eval_model")
  assert accuracy == own
  # (the eval model's: the training model, with its dropout, needs a key to apply at all)
  (model,) = set(evaluated)
  np.testing.assert_array_equal(
    model.apply(params, None, x),
    user.dropout_with_eval_model()["eval_model"].apply(params, None, x),
  )
  # An eval model `tensor` lays out otherwise (it splits the model's pair, not the eval
  # model's, which sums over the hidden features) runs on the trained params all the same.
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:eval_model_laid_out_otherwise",
                   "--dataset", "mymodel:data", "--seed", "0", "--strategy", "tensor",
                   "--checkpoint-dir", "ckpt_tensor", "--out", "tensor") == 0  # fmt: skip
  accuracy, own, _, _ = accuracies("tensor", "ckpt_tensor", "eval_model_laid_out_otherwise")
  assert accuracy == own
  assert "moves the state" not in capsys.readouterr().out  # (the params are the model's own)
  # Under hybrid the params are stage buffers laid out from each model's own plan: one
  # that splits other pairs read the wrong elements (0.297 where its own was 0.406, in a
  # reviewer's run), or failed after training. The state is moved to its layout.
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:eval_model_split_otherwise",
                   "--dataset", "mymodel:data", "--seed", "0", "--strategy", "hybrid",
                   "--strategy-option", "data=1", "--strategy-option", "stages=2",
                   "--strategy-option", "model=2", "--devices", "4", "--steps", "8",
                   "--checkpoint-dir", "ckpt_hybrid", "--out", "hybrid") == 0  # fmt: skip
  assert "each eval moves the state to its layout" in capsys.readouterr().out
  accuracy, own, _, _ = accuracies("hybrid", "ckpt_hybrid", "eval_model_split_otherwise", step=8)
  assert accuracy == own
  # One whose buffers are provably the model's (equal layouts) reads the state as it is.
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:eval_model_alike",
                   "--dataset", "mymodel:data", "--seed", "0", "--strategy", "hybrid",
                   "--strategy-option", "data=1", "--strategy-option", "stages=2",
                   "--strategy-option", "model=2", "--devices", "4", "--steps", "8",
                   "--checkpoint-dir", "ckpt_alike", "--out", "alike") == 0  # fmt: skip
  assert "moves the state" not in capsys.readouterr().out
  accuracy, own, _, _ = accuracies("alike", "ckpt_alike", "eval_model_alike", step=8)
  assert accuracy == own
  # A BatchNorm model's eval model (is_training=False), which cannot initialise itself,
  # runs on the trained params and statistics.
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:batch_norm_with_eval_model",
                   "--dataset", "mymodel:data", "--seed", "0", "--checkpoint-dir", "ckpt_bn",
                   "--out", "bn") == 0  # fmt: skip
  accuracy, own, _, _ = accuracies("bn", "ckpt_bn", "batch_norm_with_eval_model")
  assert accuracy == own
  # An eval model with other params is refused before training, naming the first leaf.
  capsys.readouterr()
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:eval_model_of_other_params",
                   "--dataset", "mymodel:data", "--out", "other") == 2  # fmt: skip
  err = capsys.readouterr().err
  assert (
    "--model-fn mymodel:eval_model_of_other_params: its eval_model cannot run on the model's "
    "params and state: Unable to retrieve parameter 'w' for module 'mlp/~/linear_0'"
  ) in err, err
  assert not (tmp_path / "other" / "metrics.jsonl").exists()  # (refused before training)
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:eval_model_keeping_state",
                   "--dataset", "mymodel:data") == 2  # fmt: skip
  assert (
    "--model-fn mymodel:eval_model_keeping_state: its eval_model keeps state and its model "
    "keeps none: give both the same kind"
  ) in capsys.readouterr().err
  # With no eval data, it is said to be unused.
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:dropout_with_eval_model",
                   "--dataset", "mymodel:no_eval_data") == 0  # fmt: skip
  assert (
    "--model-fn mymodel:dropout_with_eval_model: its eval_model not used, --dataset "
    "mymodel:no_eval_data gives no eval data"
  ) in capsys.readouterr().out.splitlines()


def test_auto_on_the_command_line_measures_the_datasets_own_labels(tmp_path, monkeypatch):
  # --strategy auto lowered its candidates on guessed [B] labels: a loss over [B, T]
  # labels failed; the CLI now gives init the dataset's first example as sample_batch.
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:model", "--devices", "1",
                   "--dataset", "mymodel:sequences", "--strategy", "auto") == 0  # fmt: skip


def test_compare_with_a_metrics_file_writes_one_file_per_strategy(tmp_path, monkeypatch):
  # Each strategy of --compare used to overwrite the one --metrics file.
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:model",
                   "--dataset", "mymodel:data", "--compare", "data_parallel,fsdp",
                   "--metrics", "m.jsonl") == 0  # fmt: skip
  for name in ("data_parallel", "fsdp"):
    rows = [json.loads(x) for x in (tmp_path / f"m.{name}.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
  assert not (tmp_path / "m.jsonl").exists()


def test_a_config_files_strategy_options_give_way_to_another_strategy(
  tmp_path, monkeypatch, capsys
):
  # The README's run.toml (hybrid, stages = 2) with `--strategy fsdp` failed: "Strategy
  # 'fsdp' has no option 'stages'". The file's options that fsdp lacks are now named and
  # left out; the same option given on the command line is still refused by name.
  (tmp_path / "run.toml").write_text(
    'strategy = "hybrid"\ndata-parallel = 2\nstages = 2\nmemory-budget = 1000000\n'
  )
  run = ["--config", "run.toml", "--model-fn", "mymodel:model", "--dataset", "mymodel:data"]
  assert _user_run(tmp_path, monkeypatch, *run, "--strategy", "fsdp", "--devices", "4") == 0
  out = capsys.readouterr().out
  # (each as the file writes it: the budget is a number there, text to argparse)
  assert (
    "run.toml: not used by fsdp (it takes no such option): stages = 2, memory-budget = 1000000"
    in out
  )
  assert "mesh: {'data': 2}" in out  # data-parallel = 2 from the file: fsdp takes it
  assert _user_run(tmp_path, monkeypatch, *run, "--strategy", "fsdp", "--stages", "2") == 2
  assert "--stages 2: fsdp has no option 'stages' (it takes --devices, " in (
    capsys.readouterr().err
  )


def test_throughput_counts_a_short_batchs_rows_and_leaves_out_every_compiling_step(
  tmp_path, monkeypatch, capsys
):
  # A short last batch was counted as a whole --batch-size, and its step, which
  # compiles for the new shape, was timed.
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:model", "--dataset",
                   "mymodel:short_last", "--epochs", "2", "--steps", "8") == 0  # fmt: skip
  out = capsys.readouterr().out
  # Timed: epoch 1's steps 2 and 3 (8 rows each) and all of epoch 2 (8 + 8 + 8 + 4).
  assert "over the 6 steps (44 examples) that reused a compiled step; not timed: the 2 " in out
  assert "steps that compiled for a new batch shape, on 2 of 2 cpu devices" in out
  # Two steps, each compiling: nothing to time (it said "only the first step ran").
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:model", "--dataset",
                   "mymodel:two_shapes") == 0  # fmt: skip
  out = capsys.readouterr().out
  assert "throughput: not measured (each of the 2 steps compiled for a new batch shape)" in out


def test_skipped_updates_are_counted_across_a_resume(tmp_path, monkeypatch, capsys):
  # Step 2 is skipped; a row every 3 steps. The first leg's end at step 3 is lost (its
  # checkpoint deleted, as in a crash before the save), so the run resumes at 2, in
  # the middle of the row for steps 1..3, which must still be marked as skipping one.
  run = ["--model-fn", "mymodel:model", "--dataset", "mymodel:nan_second", "--out", "run",
         "--checkpoint-dir", "ck", "--save-every", "2", "--log-every", "3"]  # fmt: skip
  assert _user_run(tmp_path, monkeypatch, *run, "--steps", "3") == 0
  assert "skipped 1 update(s) with non-finite loss or gradients: steps [2]" in (
    capsys.readouterr().out
  )
  shutil.rmtree(tmp_path / "ck" / "3")
  assert _user_run(tmp_path, monkeypatch, *run, "--steps", "6", "--resume") == 0
  out = capsys.readouterr().out
  assert "at step 2" in out
  assert "skipped 1 update(s) with non-finite loss or gradients, all before the resume" in out
  rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  rows = [r for r in rows if "loss" in r]
  assert [(r["step"], r["skipped_steps"], r.get("skipped")) for r in rows] == [
    (3, 1, True),
    (6, 1, None),
  ]


def test_the_logged_learning_rate_is_the_one_each_update_used(tmp_path, monkeypatch):
  # Step 2's update is skipped and leaves the optimizer's count, and so its warm-up,
  # where it was: step 3 uses the rate step 2 would have. The log ran one step ahead.
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:model", "--dataset",
                   "mymodel:nan_second", "--out", "run", "--steps", "4", "--lr", "1.0",
                   "--warmup-steps", "4", "--log-every", "1") == 0  # fmt: skip
  rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  warmup = optimizers.learning_rate_schedule(1.0, schedule="constant", warmup_steps=4,
                                             total_steps=None)  # fmt: skip
  assert [r["learning_rate"] for r in rows if "loss" in r] == pytest.approx(
    [float(warmup(c)) for c in (0, 1, 1, 2)]
  )


def test_eval_accuracy_gives_each_piece_of_a_dropout_model_its_own_key():
  class RecordsKeys:  # a "trainer" of a model that draws randomness
    uses_rng = True

    def __init__(self):
      self.keys = []

    def apply(self, state, x, rng):
      self.keys.append(np.asarray(jax.random.key_data(rng)))
      return np.zeros((len(x), 3), np.float32)

  trainer, rng = RecordsKeys(), jax.random.key(7)
  labels = np.zeros(5, np.int32)
  batches = [(labels, labels)] * 2
  assert run_data.eval_accuracy(trainer, None, batches, 2, slice(None), rng=rng) == 1
  want = [jax.random.key_data(jax.random.fold_in(rng, i)) for i in range(6)]
  np.testing.assert_array_equal(trainer.keys, want)  # 3 pieces of 2 a batch, each its own key
  with pytest.raises(ValueError, match="the model draws randomness; pass rng="):
    run_data.eval_accuracy(trainer, None, [(labels, labels)], 2, slice(None))


def test_eval_accuracy_counts_every_label_of_a_sequence_once():
  class OneHotOfInputs:  # a "trainer" whose outputs predict each input token itself
    def __init__(self):
      self.pieces = []

    def apply(self, state, tokens):
      self.pieces.append(np.asarray(tokens))
      return np.eye(5, dtype=np.float32)[np.asarray(tokens)]

  tokens = np.array([[1, 2, 3], [0, 0, 0], [4, 4, 4]], np.int32)
  labels = tokens.copy()
  labels[0, 0] = 2  # 8 of 9 tokens right; pieces of 2 rows, the last one short
  trainer = OneHotOfInputs()
  accuracy = run_data.eval_accuracy(trainer, None, [(tokens, labels)], 2, slice(None))
  assert accuracy == pytest.approx(8 / 9)
  # The short piece is filled with the row before it, not zeros: a model whose outputs
  # depend on the piece (BatchNorm in training mode) sees only real rows.
  np.testing.assert_array_equal(np.concatenate(trainer.pieces), tokens[[0, 1, 1, 2]])
  # [B] labels: the share of examples (a one-token "sequence" per example).
  accuracy = run_data.eval_accuracy(
    OneHotOfInputs(), None, [(tokens[:, 0], np.array([1, 1, 4]))], 2, slice(None)
  )
  assert accuracy == pytest.approx(2 / 3)
  # A batch smaller than a piece is filled with its own rows again.
  trainer = OneHotOfInputs()
  accuracy = run_data.eval_accuracy(trainer, None, [(tokens[:2], labels[:2])], 4, slice(None))
  assert accuracy == pytest.approx(5 / 6)
  np.testing.assert_array_equal(trainer.pieces[0], tokens[[0, 1, 0, 1]])


def test_the_lm_example_trains_from_the_command_line(tmp_path, capsys):
  # examples/transformer_lm.py's entry points: its model and loss, its corpus' batches.
  example = str(ROOT / "examples" / "transformer_lm.py")
  args = ["train", "--model-fn", f"{example}:model", "--dataset", f"{example}:dataset",
          "--strategy", "pipeline", "--stages", "2", "--batch-size", "8", "--steps", "2",
          "--epochs", "1", "--no-progress", "--metrics", str(tmp_path / "m.jsonl")]  # fmt: skip
  assert cli.main(args) == 0
  rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in rows if "loss" in r]
  assert len(losses) == 2 and all(np.isfinite(losses))
  # Token accuracy of 96 characters after 2 steps: a share, not a count per sequence.
  accuracy = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r][-1]
  assert 0.0 <= accuracy <= 1.0
  assert "stage=2" in capsys.readouterr().out


OPTIONS_FILE = """
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

import parstrat

if TYPE_CHECKING:
  from somewhere_not_importable import Thing


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class Typed(parstrat.DataParallel):
  flag: bool = False
  name: str = "x"
  mode: Literal["1", "2"] = "1"
  every: int | None = 4
  thing: Thing | None = None  # (only this one cannot be evaluated)


class OwnInit(parstrat.DataParallel):
  def __init__(self, *, flag: bool = False, **kwargs):
    super().__init__(**kwargs)
"""


def test_strategy_options_are_read_by_each_fields_own_type(tmp_path, monkeypatch, capsys):
  # One annotation that could not be evaluated made every field of the class read as
  # TOML: flag=no was the text 'no' (true), name=1 the int 1.
  (tmp_path / "typed_options.py").write_text(OPTIONS_FILE)
  monkeypatch.syspath_prepend(tmp_path)
  import typed_options  # noqa: PLC0415

  read = cli._option_value
  assert read(typed_options.Typed, "flag", "no") is False
  assert read(typed_options.Typed, "name", "1") == "1"
  assert read(typed_options.Typed, "mode", "2") == "2"
  assert read(typed_options.Typed, "every", "none") is None  # (an optional field)
  assert read(typed_options.Typed, "every", "None") is None
  assert read(typed_options.Typed, "every", "3") == 3
  assert read(typed_options.Typed, "thing", "3") == 3  # (not evaluable: TOML)
  assert read(typed_options.OwnInit, "flag", "on") is True  # (an __init__ parameter)
  with pytest.raises(cli.UsageError, match=r"mode=3: mode is one of 1, 2"):
    read(typed_options.Typed, "mode", "3")
  # The devices come from --devices (they gave "got multiple values for 'devices'").
  assert cli.main(["train", "--strategy", "pipeline", "--strategy-option", "devices=[0,1]"]) == 2
  assert "--strategy-option devices=[0,1]: the devices come from --devices; give that instead" in (
    capsys.readouterr().err
  )


def test_a_loss_that_is_not_a_mean_over_examples_is_said_as_a_line(tmp_path, monkeypatch, capsys):
  # Under data_parallel a masked mean over its own count trains otherwise than on one
  # device, without a word: the first step now warns, and the command line says it as
  # one line of the run's output (not a traceback-like warning on stderr).
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:masked_mean_model",
                   "--dataset", "mymodel:data") == 0  # fmt: skip
  captured = capsys.readouterr()
  lines = [x for x in captured.out.splitlines() if x.startswith("warning: loss_fn is not a mean")]
  assert len(lines) == 1, captured.out
  assert "DataParallel(devices=<2 devices>) averages the losses of 2 parts" in lines[0]
  assert "LossNotAMeanWarning" not in captured.err
  # (a mean over examples: no word)
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:model",
                   "--dataset", "mymodel:data") == 0  # fmt: skip
  assert "not a mean" not in capsys.readouterr().out


def test_a_warning_of_each_trace_in_the_first_step_is_said_once(tmp_path, monkeypatch, capsys):
  # The first step traces the model twice (the loss check's shapes, the step): a warning
  # the model gives at each trace was said as two identical lines.
  assert _user_run(tmp_path, monkeypatch, "--model-fn", "mymodel:float64_model",
                   "--dataset", "mymodel:data") == 0  # fmt: skip
  lines = capsys.readouterr().out.splitlines()
  said = [x for x in lines if x.startswith("warning: Explicitly requested dtype float64")]
  assert len(said) == 1, lines
