"""FSDP and TensorParallel: equivalence with jit, and where the parameters live."""

import re

import jax
import numpy as np
import optax
import pytest
from helpers import DEEP_MLP
from helpers import SEED_MLP
from helpers import mlp
from jax.sharding import PartitionSpec as P

import parstrat
import parstrat.testing
from parstrat._src import sharded_params


@pytest.mark.parametrize(
  "strategy, model",
  [
    (parstrat.FSDP(data=8), SEED_MLP),
    (parstrat.TensorParallel(model=8), SEED_MLP),
    (parstrat.TensorParallel(model=4), DEEP_MLP),
  ],
  ids=["fsdp8-seed", "tensor8-seed", "tensor4-deep"],
)
def test_matches_single_device_jit(strategy, model):
  parstrat.testing.check_strategy(strategy, model, steps=20, batch=32)


def _bytes_on_first_device(tree):
  device = jax.devices()[0]
  return sum(
    s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards
    if s.device == device
  )  # fmt: skip


def test_fsdp_holds_about_one_nth_of_params_and_optimizer_state():
  sample = np.zeros((1, 784), np.float32)
  fsdp = parstrat.FSDP(data=8)(SEED_MLP, optax.adam(1e-3))
  data_parallel = parstrat.DataParallel(data=8)(SEED_MLP, optax.adam(1e-3))
  fsdp_state = fsdp.init(jax.random.key(0), sample)
  dp_state = data_parallel.init(jax.random.key(0), sample)
  ideal = _bytes_on_first_device(dp_state) / 8
  assert _bytes_on_first_device(fsdp_state) <= 1.2 * ideal
  w = fsdp_state.params["mlp/~/linear_0"]["w"]
  assert {s.data.shape for s in w.addressable_shards} == {(98, 512)}
  images, labels = parstrat.testing.random_batches(1, 64)
  temp = lambda t, s: t.lower(s, (images[0], labels[0])).compile().memory_analysis()  # noqa: E731
  assert (
    temp(fsdp, fsdp_state).temp_size_in_bytes < temp(data_parallel, dp_state).temp_size_in_bytes
  )


def test_tensor_parallel_splits_pairs_and_replicates_a_lone_last_layer():
  model = mlp([64, 32, 10])
  trainer = parstrat.TensorParallel(model=4)(model, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), np.zeros((1, 784), np.float32))
  shapes = {
    name: {k: {s.data.shape for s in v.addressable_shards} for k, v in leaves.items()}
    for name, leaves in state.params.items()
  }
  assert shapes["mlp/~/linear_0"] == {"w": {(784, 16)}, "b": {(16,)}}  # column-parallel
  assert shapes["mlp/~/linear_1"] == {"w": {(16, 32)}, "b": {(32,)}}  # row-parallel
  assert shapes["mlp/~/linear_2"] == {"w": {(32, 10)}, "b": {(10,)}}  # lone: replicated
  assert "mlp/~/linear_2: replicated (its 10 outputs are not divisible by model=4)" in (
    trainer.plan.description
  )
  parstrat.testing.check_strategy(parstrat.TensorParallel(model=4), model, steps=3, batch=16)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_stages_match_single_device_jit(zero):
  parstrat.testing.check_strategy(parstrat.FSDP(zero=zero), steps=20, batch=32)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_1_and_2_shard_only_the_optimizer_state(zero):
  sample = np.zeros((1, 784), np.float32)
  trainer = parstrat.FSDP(data=8, zero=zero)(SEED_MLP, optax.adam(1e-3))
  state = trainer.init(jax.random.key(0), sample)
  w = state.params["mlp/~/linear_0"]["w"]
  assert {s.data.shape for s in w.addressable_shards} == {(784, 512)}  # params whole
  mu = state.opt_state[0].mu["mlp/~/linear_0"]["w"]
  assert {s.data.shape for s in mu.addressable_shards} == {(98, 512)}  # Adam's moments split
  dp = parstrat.DataParallel(data=8)(SEED_MLP, optax.adam(1e-3))
  dp_state = dp.init(jax.random.key(0), sample)
  # params whole + mu, nu split: a little over a third of data parallelism's state.
  ratio = _bytes_on_first_device(state.opt_state) / _bytes_on_first_device(dp_state.opt_state)
  assert ratio < 1.2 / 8
  assert trainer.plan.description.startswith(f"ZeRO-{zero}")
  # The gradients: laid out whole (ZeRO-1) or split over "data" (ZeRO-2) before the update.
  images, labels = parstrat.testing.random_batches(1, 16)
  text = trainer.lower(state, (images[0], labels[0])).as_text()
  layouts = re.findall(r"sdy.sharding_constraint %\w+ <@mesh, (.*)> : tensor<784x512xf32>", text)
  assert layouts == ['[{"data"}, {}]' if zero == 2 else "[{}, {}]"], layouts


def test_zero_stage_must_be_1_2_or_3():
  with pytest.raises(ValueError, match="zero must be the ZeRO stage 1, 2 or 3, got 4"):
    parstrat.FSDP(zero=4)


def _all_gathered_shapes(trainer, state, batch) -> list[str]:
  text = trainer.lower(state, batch).compile().as_text()
  return re.findall(r"= (\S+) all-gather(?:-start)?\(", text)


def test_replicate_below_keeps_whole_the_leaves_of_fewer_elements_than_it():
  assert sharded_params.fsdp_spec((512,), "data", 8, replicate_below=513) == P()
  assert sharded_params.fsdp_spec((512,), "data", 8, replicate_below=512) == P("data")
  assert sharded_params.fsdp_spec((64, 8), "data", 8, replicate_below=0) == P("data", None)


def test_fsdp_replicate_below_keeps_small_leaves_whole_and_stops_gathering_them():
  sample = np.zeros((1, 784), np.float32)
  images, labels = parstrat.testing.random_batches(1, 1024)
  gathered = {}
  for below in (0, 4096):
    trainer = parstrat.FSDP(data=8, replicate_below=below)(SEED_MLP, optax.adam(1e-3))
    state = trainer.init(jax.random.key(0), sample)
    shapes = {
      f"{layer}/{name}": {s.data.shape for s in leaf.addressable_shards}
      for layer, leaves in state.params.items() for name, leaf in leaves.items()
    }  # fmt: skip
    mu = state.opt_state[0].mu["mlp/~/linear_0"]["b"]
    if below:
      # 512-wide bias (512 elements) replicated, with its Adam moment; weights still split.
      assert shapes["mlp/~/linear_0/b"] == {(512,)}
      assert {s.data.shape for s in mu.addressable_shards} == {(512,)}
      assert shapes["mlp/~/linear_1/w"] == {(64, 10)}  # 5,120 elements
      assert "(under 4096 elements: replicated)" in trainer.plan.description
    else:
      assert shapes["mlp/~/linear_0/b"] == {(64,)}
      assert {s.data.shape for s in mu.addressable_shards} == {(64,)}
    assert shapes["mlp/~/linear_0/w"] == {(98, 512)}
    gathered[below] = _all_gathered_shapes(trainer, state, (images[0], labels[0]))
  # The partitioner gathers the sharded 512-wide bias; replicated, it has nothing to gather.
  assert "f32[512]{0}" in gathered[0]
  assert "f32[512]{0}" not in gathered[4096]
  assert len(gathered[4096]) < len(gathered[0])


@pytest.mark.parametrize("zero", [3, 2])
def test_fsdp_replicate_below_matches_single_device_jit(zero):
  strategy = parstrat.FSDP(data=8, zero=zero, replicate_below=4096)
  parstrat.testing.check_strategy(strategy, SEED_MLP, steps=5, batch=32)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4096"])
def test_fsdp_replicate_below_must_be_a_non_negative_int(bad):
  with pytest.raises(ValueError, match=f"replicate_below must be .* got {re.escape(repr(bad))}"):
    parstrat.FSDP(replicate_below=bad)
