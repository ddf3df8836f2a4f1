import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import SEED_MLP

import parstrat
import parstrat.testing


# data=4 trains dict batches and an LSTM in tests/test_trainer_contract.py.
@pytest.mark.parametrize("data", [1, 2, 8])
def test_matches_single_device_jit_with_sgd_and_adam(data):
  reports = parstrat.testing.check_strategy(
    parstrat.DataParallel(data=data), SEED_MLP, steps=5, batch=64
  )
  assert [r.optimizer for r in reports] == ["sgd", "adam"]
  for report in reports:
    assert report.max_loss_diff < 1e-5 and report.compiles_after_first_step == 0


def _trained(data=8, steps=2, optimizer=None):
  trainer = parstrat.DataParallel(data=data)(SEED_MLP, optimizer or optax.adam(1e-3))
  images, labels = parstrat.testing.random_batches(steps, 32)
  state = trainer.init(jax.random.key(0), images[0][:1])
  for x, y in zip(images, labels, strict=True):
    state, _ = trainer.step(state, (x, y))
  return trainer, state, images


def test_state_is_replicated_and_batch_split_over_data():
  trainer, state, images = _trained()
  mesh = trainer.mesh
  assert dict(mesh.shape) == {"data": 8}
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  for leaf in jax.tree.leaves(state):
    assert leaf.sharding.is_equivalent_to(replicated, leaf.ndim)
    assert len(leaf.addressable_shards) == 8
  logits = trainer.apply(state, images[0])
  assert logits.shape == (32, 10)
  assert [s.data.shape for s in logits.addressable_shards] == [(4, 10)] * 8
  parstrat.checks.assert_replicas_equal(state)


def test_apply_and_params_match_the_plain_model():
  trainer, state, images = _trained()
  params = trainer.params(state)
  assert jax.tree.structure(params) == jax.tree.structure(
    SEED_MLP.init(jax.random.key(0), images[0][:1])
  )
  np.testing.assert_allclose(
    trainer.apply(state, images[0]), SEED_MLP.apply(params, None, images[0]), atol=1e-5
  )


def _one_copy_moved(x, by, index=-1):
  """`x`, a replicated array, with its copy on device `index` moved by `by`."""
  copies = [shard.data for shard in x.addressable_shards]
  copies[index] = copies[index] + by
  return jax.make_array_from_single_device_arrays(x.shape, x.sharding, copies)


def _with_layer_0(params, **leaves):
  """`params` with leaves of layer "mlp/~/linear_0" replaced."""
  return {**params, "mlp/~/linear_0": {**params["mlp/~/linear_0"], **leaves}}


def test_corrupted_replica_is_caught():
  _, state, _ = _trained()
  bad = _one_copy_moved(state.params["mlp/~/linear_0"]["w"], 1e-3, index=3)
  corrupted = state._replace(params=_with_layer_0(state.params, w=bad))
  with pytest.raises(
    AssertionError,
    match=r"Replicas of .*linear_0.*\['w'\] differ.*TFRT_CPU_3|Replicas of .*linear_0.*w.* differ",
  ):
    parstrat.checks.assert_replicas_equal(corrupted)
  parstrat.checks.assert_replicas_equal(corrupted, atol=2e-3)


class _GradientsNotAveraged(parstrat.DataParallel):
  """Each device applies its own gradients: the replicas drift apart."""

  def make_plan(self, *args, **kwargs):
    return dataclasses.replace(super().make_plan(*args, **kwargs), reduce=lambda pair: pair)


def test_debug_option_checks_replicas_every_step():
  images, labels = parstrat.testing.random_batches(2, 16)
  trainer = parstrat.DataParallel(data=4, debug=True)(SEED_MLP, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), images[0][:1])
  for x, y in zip(images, labels, strict=True):
    state, metrics = trainer.step(state, (x, y))
  assert np.isfinite(float(metrics["loss"]))
  # Replicas made to differ after a few steps: the next step, not only the first, checks.
  b = _one_copy_moved(state.params["mlp/~/linear_0"]["b"], 1)
  state = state._replace(params=_with_layer_0(state.params, b=b))
  with pytest.raises(
    AssertionError, match=r"Replicas of \.params\['mlp/~/linear_0'\]\['b'\] differ"
  ):
    trainer.step(state, (images[0], labels[0]))
  # A plan that forgets its gradient mean passes without debug and fails the check with it.
  for debug in (False, True):
    trainer = _GradientsNotAveraged(data=4, debug=debug)(SEED_MLP, optax.sgd(0.1))
    state = trainer.init(jax.random.key(0), images[0][:1])
    if debug:
      with pytest.raises(
        AssertionError, match=r"Replicas of \.params\['mlp/~/linear_0'\]\['b'\] differ: block"
      ):
        trainer.step(state, (images[0], labels[0]))
    else:
      trainer.step(state, (images[0], labels[0]))


def test_second_step_does_not_retrace():
  trainer = parstrat.DataParallel(data=8)(SEED_MLP, optax.adam(1e-3))
  images, labels = parstrat.testing.random_batches(3, 16)
  state = trainer.init(jax.random.key(0), images[0][:1])
  for x, y in zip(images, labels, strict=True):
    state, _ = trainer.step(state, (x, y))
  assert trainer._compiled_step._cache_size() == 1


@pytest.fixture(scope="module")
def setup():
  trainer = parstrat.DataParallel(data=8)(SEED_MLP, optax.sgd(0.1))
  images, labels = parstrat.testing.random_batches(1, 16)
  state = trainer.init(jax.random.key(0), images[0][:1])
  return trainer, state, images[0], labels[0]


class TestBadInput:
  def test_batch_not_divisible_by_data_axis(self, setup):
    trainer, state, x, y = setup
    with pytest.raises(ValueError, match=r"positive multiple of 8 .*got 12"):
      trainer.step(state, (x[:12], y[:12]))

  def test_more_devices_than_exist(self):
    with pytest.raises(ValueError, match="data=16 needs 16 devices, but only 8 are available"):
      parstrat.DataParallel(data=16)(SEED_MLP, optax.sgd(0.1))

  @pytest.mark.parametrize("data", [0, -2, 2.5, "4"])
  def test_bad_axis_sizes(self, data):
    with pytest.raises(ValueError, match=f"'data' needs a positive integer size, got {data!r}"):
      parstrat.DataParallel(data=data)(SEED_MLP, optax.sgd(0.1))

  def test_labels_of_wrong_shape(self, setup):
    trainer, state, x, y = setup
    with pytest.raises(ValueError, match=r"labels must have shape \[16\], got \(16, 1\)"):
      trainer.step(state, (x, y[:, None]))
    with pytest.raises(ValueError, match=r"share their leading .*batch\[0\]: 16, batch\[1\]: 8"):
      trainer.step(state, (x, y[:8]))

  def test_labels_of_wrong_dtype(self, setup):
    trainer, state, x, y = setup
    with pytest.raises(TypeError, match="labels must be integer class ids, got dtype float32"):
      trainer.step(state, (x, y.astype(np.float32)))

  def test_inputs_with_wrong_feature_size(self, setup):
    trainer, state, x, y = setup
    with pytest.raises(ValueError, match=r"shape \[B, 784\] .*got \(16, 783\)"):
      trainer.step(state, (x[:, :783], y))
    with pytest.raises(ValueError, match=r"shape \[B, 784\] .*got \(16, 28, 28\)"):
      trainer.apply(state, x.reshape(16, 28, 28))

  def test_integer_images(self, setup):
    trainer, state, x, y = setup
    with pytest.raises(TypeError, match=r"batch\[0\] .*must have dtype float32 .*got dtype int32"):
      trainer.step(state, (x.astype(np.int32), y))

  def test_not_a_pair(self, setup):
    trainer, state, x, _ = setup
    with pytest.raises(TypeError, match=r"pair \(inputs, labels\)"):
      trainer.step(state, x)

  def test_state_survives_a_rejected_step(self, setup):
    trainer, state, x, y = setup
    with pytest.raises(ValueError):
      trainer.step(state, (x[:12], y[:12]))
    new_state, metrics = trainer.step(state, (x, y))
    assert int(new_state.step) == 1 and np.isfinite(float(metrics["loss"]))

  def test_wrong_model_and_optimizer(self):
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
      parstrat.DataParallel()(SEED_MLP, "adam")
    with pytest.raises(TypeError, match="hk.Transformed"):
      parstrat.DataParallel()(lambda x: x, optax.sgd(0.1))

  def test_sample_inputs(self):
    trainer = parstrat.DataParallel(data=2)(SEED_MLP, optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"sample_inputs\['x'\] must be a jax or numpy array"):
      trainer.init(jax.random.key(0), {"x": "images"})
    with pytest.raises(ValueError, match=r"leading batch axis of size >= 1, got shape \(0, 784\)"):
      trainer.init(jax.random.key(0), jnp.zeros((0, 784)))
    with pytest.raises(RuntimeError, match="Call trainer.init"):
      trainer.apply(None, np.zeros((2, 784), np.float32))


def test_each_replica_squares_only_its_share_of_the_gradients_for_the_norm():
  # The gradients are the same on every replica after their pmean, so each of
  # the 4 devices sums the squares of a quarter of every leaf, and a scalar psum
  # adds the parts: metrics["grad_norm"] reads each gradient once across the mesh.
  trainer = parstrat.DataParallel(data=4)(SEED_MLP, optax.sgd(0.1))
  images, labels = parstrat.testing.random_batches(1, 16)
  state = trainer.init(jax.random.key(0), images[0][:1])
  hlo = trainer.lower(state, (images[0], labels[0])).compile().as_text()
  squared = sorted(
    int(np.prod([int(d) for d in dims.split(",") if d]))
    for dims in re.findall(r"%square[\w.]* = f32\[([\d,]*)\]", hlo)
  )
  sizes = [leaf.size for leaf in jax.tree.leaves(state.params)]
  # A leaf 4 does not divide (the 10-wide bias) is summed whole, counted 1/4 each.
  shares = sorted(size // 4 if size % 4 == 0 else size for size in sizes)
  assert squared == shares  # 784 x 512 / 4, 512 / 4, 512 x 10 / 4 and 10
  state, metrics = trainer.step(state, (images[0], labels[0]))
  shards = metrics["grad_norm"].addressable_shards
  assert len({float(shard.data) for shard in shards}) == 1  # the same norm on every device
