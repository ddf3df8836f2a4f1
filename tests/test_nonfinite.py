"""A NaN batch must not poison the params."""

import jax
import numpy as np
import optax
import pytest
from helpers import DEEP_MLP

import parstrat
import parstrat.testing


@pytest.mark.parametrize(
  "strategy",
  [parstrat.DataParallel(data=4), parstrat.PipelineModelParallel(stages=4, microbatches=2)],
)
def test_a_nan_batch_is_skipped_and_counted(strategy):
  trainer = strategy(DEEP_MLP, optax.adam(1e-3), skip_nonfinite=True)
  images, labels = parstrat.testing.random_batches(3, 16)
  state = trainer.init(jax.random.key(0), images[0][:1])
  state, metrics = trainer.step(state, (images[0], labels[0]))
  assert bool(metrics["finite"])
  before = jax.device_get(trainer.params(state))
  poisoned = images[1].copy()
  poisoned[5, 3] = np.nan  # one example of one microbatch
  state, metrics = trainer.step(state, (poisoned, labels[1]))
  assert not bool(metrics["finite"])
  assert int(state.step) == 1  # the update was not applied
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(trainer.params(state)), before)
  state, metrics = trainer.step(state, (images[2], labels[2]))
  assert bool(metrics["finite"]) and int(state.step) == 2
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(trainer.params(state))))


def test_without_the_guard_a_nan_batch_poisons_everything():
  trainer = parstrat.DataParallel(data=4)(DEEP_MLP, optax.sgd(0.1))
  images, labels = parstrat.testing.random_batches(1, 16)
  state = trainer.init(jax.random.key(0), images[0][:1])
  poisoned = images[0].copy()
  poisoned[0, 0] = np.nan
  state, metrics = trainer.step(state, (poisoned, labels[0]))
  assert not bool(metrics["finite"])
  assert np.isnan(jax.device_get(trainer.params(state))["mlp/~/linear_0"]["w"]).any()
