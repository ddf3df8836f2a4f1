"""Every public entry point, fed bad input, says what is wrong and builds nothing half-way."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import DEEP_MLP
from helpers import SEED_MLP

import parstrat
from parstrat import pipeline
from parstrat._src import cli
from parstrat._src import datasets

X = np.zeros((16, 784), np.float32)
Y = np.zeros((16,), np.int32)
KEY = jax.random.key(0)


def _trainer(strategy=None, model=SEED_MLP):
  trainer = (strategy or parstrat.DataParallel(data=8))(model, optax.sgd(0.1))
  return trainer, trainer.init(KEY, X[:1])


CASES = [
  # registry
  ("unknown strategy", lambda: parstrat.get("fsdpp"), KeyError, "Unknown strategy 'fsdpp'"),
  ("unknown option", lambda: parstrat.get("fsdp", stages=2), TypeError, "no option 'stages'"),
  ("empty name", lambda: parstrat.register("")(parstrat.DataParallel), ValueError, "non-empty"),
  # constructors and meshes
  ("zero data", lambda: parstrat.DataParallel(data=0).make_mesh(), ValueError, "got 0"),
  ("negative stages", lambda: parstrat.PipelineModelParallel(stages=-1).make_mesh(), ValueError,
   "stages must be a positive integer, got -1"),
  ("float microbatches", lambda: parstrat.Hybrid(stages=2, microbatches=1.5).make_mesh(),
   ValueError, "microbatches must be a positive integer, got 1.5"),
  ("impossible mesh", lambda: parstrat.Hybrid(data=3, stages=3).make_mesh(), ValueError,
   "needs 9 devices, but only 8"),
  ("no devices", lambda: parstrat.DataParallel(devices=[]).make_mesh(), ValueError,
   r"No devices to build the mesh \{'data': None\} from \(devices=\[\]\)"),
  ("unknown schedule", lambda: parstrat.Hybrid(stages=2, schedule="zb").make_mesh(), ValueError,
   "Unknown schedule 'zb'"),
  ("unknown balance", lambda: _trainer(parstrat.PipelineModelParallel(stages=2, balance="mem")),
   ValueError, "balance must be 'params' or 'flops', got 'mem'"),
  ("bad cuts", lambda: _trainer(parstrat.PipelineModelParallel(stages=2, cuts=(9,)), DEEP_MLP),
   ValueError, r"cuts must be 1 increasing layer indices in 1..7 .*got \(9,\)"),
  ("too many stages", lambda: _trainer(parstrat.PipelineModelParallel(stages=4)), ValueError,
   "stages=4 exceeds the model's 2 layers"),
  # wrap
  ("bad model", lambda: parstrat.DataParallel()(object(), optax.sgd(0.1)), TypeError,
   "must be an hk.Transformed"),
  ("bad optimizer", lambda: parstrat.DataParallel()(SEED_MLP, optax.sgd), TypeError,
   "optax.GradientTransformation"),
  ("bad loss_fn", lambda: parstrat.DataParallel()(SEED_MLP, optax.sgd(0.1), loss_fn=3),
   TypeError, "loss_fn must be callable"),
  # init
  ("int seed as rng", lambda: parstrat.DataParallel()(SEED_MLP, optax.sgd(0.1)).init(0, X[:1]),
   TypeError, "rng must be a JAX PRNG key"),
  ("string inputs", lambda: parstrat.DataParallel()(SEED_MLP, optax.sgd(0.1)).init(KEY, "x"),
   TypeError, "sample_inputs must be a jax or numpy array, got str"),
  ("empty sample", lambda: parstrat.DataParallel()(SEED_MLP, optax.sgd(0.1)).init(KEY, X[:0]),
   ValueError, r"size >= 1, got shape \(0, 784\)"),
]  # fmt: skip


@pytest.mark.parametrize("name, call, error, message", CASES, ids=[c[0] for c in CASES])
def test_entry_points_reject_bad_input(name, call, error, message):
  with pytest.raises(error, match=message):
    call()


@pytest.fixture(scope="module")
def trained():
  return _trainer(parstrat.PipelineModelParallel(stages=2, microbatches=2))


STEP_CASES = [
  ("empty batch", (X[:0], Y[:0]), ValueError, "positive multiple of 2 .*got 0"),
  ("odd batch", (X[:3], Y[:3]), ValueError, r"positive multiple of 2 \(2 microbatches\), "
   r"got 3"),
  ("wrong features", (X[:, :10], Y), ValueError, r"shape \[B, 784\] .*got \(16, 10\)"),
  ("int images", (X.astype(np.int32), Y), TypeError, r"batch\[0\] \(the model inputs\) must "
   "have dtype float32 like the sample_inputs given to init, got dtype int32"),
  ("float labels", (X, Y.astype(np.float32)), TypeError, "integer class ids, got dtype float32"),
  ("labels 2-D", (X, Y[:, None]), ValueError, r"labels must have shape \[16\], got \(16, 1\)"),
  ("labels short", (X, Y[:4]), ValueError, r"The leaves of batch must share their leading "
   r"\(batch\) axis, got batch\[0\]: 16, batch\[1\]: 4"),
  ("triple", (X, Y, Y), TypeError, r"pair \(inputs, labels\), got tuple of 3; .*model_inputs="),
  ("dict", {"x": X}, TypeError, r"pair \(inputs, labels\), got dict"),
  ("scalar labels", (X, np.int32(3)), ValueError, r"batch\[1\] needs a leading batch axis"),
]  # fmt: skip


@pytest.mark.parametrize("name, batch, error, message", STEP_CASES, ids=[c[0] for c in STEP_CASES])
def test_step_rejects_bad_batches_and_keeps_the_state_usable(trained, name, batch, error, message):
  trainer, state = trained
  with pytest.raises(error, match=message):
    trainer.step(state, batch)
  with pytest.raises((ValueError, TypeError)):
    trainer.apply(state, batch[0][:, :5] if isinstance(batch, tuple) else X[:, :5])
  # Nothing ran: the state is intact, not donated.
  assert all(not leaf.is_deleted() for leaf in jax.tree.leaves(state))


@pytest.mark.parametrize(
  "name, options", [("data_parallel", {"data": 8}), ("pipeline", {"stages": 2}), ("fsdp", {})]
)
def test_a_loss_fn_without_its_mean_is_named_before_the_step(name, options):
  # A [B] loss failed deep in jax.grad ("Gradient only defined for scalar-output
  # functions"; the pipeline: "unexpected JAX type ... for argument to VJP function").
  per_example = optax.softmax_cross_entropy_with_integer_labels  # no .mean()
  trainer = parstrat.get(name, **options)(SEED_MLP, optax.sgd(0.1), loss_fn=per_example)
  state = trainer.init(KEY, X[:1])
  with pytest.raises(ValueError, match=r"loss_fn must return a scalar .*got shape \(16,\); "):
    trainer.step(state, (X, Y))
  assert all(not leaf.is_deleted() for leaf in jax.tree.leaves(state))  # nothing ran


def test_a_failed_init_leaves_nothing_half_built():
  trainer = parstrat.PipelineModelParallel(stages=2, microbatches=2)(SEED_MLP, optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"sample_inputs must share .*\['a'\]: 1, .*\['b'\]: 2"):
    trainer.init(KEY, {"a": X[:1], "b": X[:2]})
  with pytest.raises(RuntimeError, match="Call trainer.init"):
    trainer.apply(None, X)
  state = trainer.init(KEY, X[:1])  # and a good init afterwards works
  state, metrics = trainer.step(state, (X, Y))
  assert np.isfinite(float(metrics["loss"]))


def test_loader_and_schedule_reject_bad_input():
  with pytest.raises(ValueError, match="Unknown MNIST source 'kaggle'"):
    datasets.load_mnist("kaggle")
  with pytest.raises(ValueError, match="batch_size must be a positive integer, got -1"):
    next(datasets.batch_indices(10, -1, seed=0, epoch=0))
  with pytest.raises(ValueError, match="microbatches must be a positive integer, got 0"):
    pipeline.build_schedule("gpipe", 2, 0)


@pytest.mark.parametrize(
  "argv, message",
  [
    (["train", "--strategy", "fsdpp"], "Unknown strategy 'fsdpp'"),
    (["train", "--strategy", "hybrid", "--data-parallel", "3", "--stages", "3"], "needs 9 devices"),
    (["train", "--strategy", "pipeline", "--stages", "3"], "stages=3 exceeds the model's 2"),
    (["train", "--batch-size", "20000", "--source", "sample"], "exceeds the 8000 training"),
    (["train", "--batch-size", "12", "--source", "sample", "--steps", "1"], "multiple of 8"),
    (["schedule", "--stages", "2", "--microbatches", "2", "--schedule", "1f1b", "--out",
      "/nonexistent/dir/x.png"], "cannot write /nonexistent/dir/x.png: No such file"),
  ],
)  # fmt: skip
def test_cli_turns_errors_into_one_line_with_exit_2(argv, message, capsys):
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert message in err and "\n" not in err and "Traceback" not in err


def test_legacy_prng_keys_work():
  trainer = parstrat.DataParallel(data=2)(SEED_MLP, optax.sgd(0.1))
  state = trainer.init(jax.random.PRNGKey(0), jnp.zeros((1, 784)))
  assert int(state.step) == 0
  assert hk.data_structures.tree_size(trainer.params(state)) == 784 * 512 + 512 + 5130
