import jax
import numpy as np
import optax
import pytest
from helpers import DEEP_MLP

import parstrat
import parstrat.testing
from parstrat._src import hlo_check


# (8, 1) and (1, 8) are data parallelism and the pipeline: see
# test_data_and_pipeline_are_special_cases and tests/test_pipeline.py; (4, 2) runs in
# the conformance kit (tests/test_testing_kit.py).
@pytest.mark.parametrize("data, stages", [(2, 4)])
def test_matches_single_device_jit(data, stages):
  strategy = parstrat.Hybrid(data=data, stages=stages, microbatches=2)
  reports = parstrat.testing.check_strategy(strategy, DEEP_MLP, steps=20, batch=32)
  assert [r.optimizer for r in reports] == ["sgd", "adam"]


@pytest.mark.parametrize(
  "schedule, stages, microbatches", [("gpipe", 2, 2), ("zb_h1", 4, 8), ("interleaved_1f1b", 2, 2)]
)
def test_zero_bubble_and_interleaved_match_single_device_jit(schedule, stages, microbatches):
  # 2 replicas x 2 devices; interleaved: 4 model stages, 2 per device, an exchange
  # after every tick (its default, every 2, runs in tests/test_hybrid_model_axis.py).
  # ZB-H1: 2 replicas x 4 devices at M = 2P, where some gradients wait on their sender
  # for a later exchange (`engine.exchange_plan`).
  # SGD only (Adam runs on all three schedules in tests/test_pipeline.py).
  strategy = parstrat.Hybrid(
    data=2,
    stages=stages,
    microbatches=microbatches,
    schedule=schedule,
    exchange_every=1,
    bubble_value=float("nan"),
  )
  parstrat.testing.check_strategy(strategy, DEEP_MLP, [optax.sgd(0.1)], steps=3, batch=16)


def test_an_exchange_every_two_ticks_matches_single_device_jit():
  strategy = parstrat.Hybrid(
    data=2, stages=2, microbatches=4, exchange_every=2, bubble_value=float("nan")
  )
  parstrat.testing.check_strategy(strategy, DEEP_MLP, [optax.sgd(0.1)], steps=3, batch=16)


def test_one_data_replica_runs_no_all_reduce_of_the_gradients():
  # The mean over "data" is the identity with one replica, but XLA would still run it
  # over singleton groups (about 8% of a 1F1B step in the benchmark).
  images, labels = parstrat.testing.random_batches(1, 16)
  reductions = {}
  for data in (1, 2):
    trainer = parstrat.Hybrid(data=data, stages=2, microbatches=2)(DEEP_MLP, optax.sgd(0.1))
    state = trainer.init(jax.random.key(0), images[0][:1])
    text = trainer.lower(state, (images[0], labels[0])).compile().as_text()
    buffer = f"[1,{state.params.shape[1]}]"
    reductions[data] = [
      line for line in text.splitlines() if "all-reduce(" in line and buffer in line
    ]
  assert not reductions[1], reductions[1]
  assert reductions[2]


def test_replicas_average_their_gradients_once_per_step_not_in_every_tick():
  # A hand-written data x GPipe under `shard_map` with check_vma gets its params'
  # gradient psum over "data" at their use inside the loop, so autodiff puts it in every
  # tick of the backward loop (the benchmark's reference was caught doing so). The
  # replicas' one all-reduce over "data" belongs after the loop.
  images, labels = parstrat.testing.random_batches(1, 16)
  trainer = parstrat.Hybrid(data=2, stages=2, microbatches=4)(DEEP_MLP, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), images[0][:1])
  text = trainer.lower(state, (images[0], labels[0])).compile().as_text()
  in_loop = hlo_check.loop_instructions(text)
  assert {kind for kind, _, _ in in_loop} >= {"collective-permute", "conditional"}
  assert [line for kind, _, line in in_loop if kind == "all-reduce"] == []
  buffer = f"[1,{state.params.shape[1]}]"
  assert [line for line in text.splitlines() if "all-reduce(" in line and buffer in line]


def test_stage_replicas_are_identical_and_each_device_holds_one_stage():
  trainer = parstrat.Hybrid(data=2, stages=4, microbatches=2)(DEEP_MLP, optax.sgd(0.1))
  images, labels = parstrat.testing.random_batches(3, 16)
  state = trainer.init(jax.random.key(0), images[0][:1])
  for x, y in zip(images, labels, strict=True):
    state, _ = trainer.step(state, (x, y))
  parstrat.checks.assert_replicas_equal(state)
  mesh = trainer.mesh
  assert dict(mesh.shape) == {"data": 2, "stage": 4}
  for d_index, row in enumerate(mesh.devices):
    for s_index, device in enumerate(row):
      (shard,) = [s for s in state.params.addressable_shards if s.device == device]
      assert shard.index[0] == slice(s_index, s_index + 1), (d_index, s_index)
  logits = trainer.apply(state, images[0])
  # The batch is split over "data" only: each replica's block is 8 examples.
  assert {s.data.shape for s in logits.addressable_shards} == {(8, 10)}


def test_data_and_pipeline_are_special_cases():
  """Hybrid(data=D, stages=1) trains like DataParallel, Hybrid(data=1) like the pipeline."""
  images, labels = parstrat.testing.random_batches(3, 16)

  def losses(strategy):
    trainer = strategy(DEEP_MLP, optax.sgd(0.1))
    state = trainer.init(jax.random.key(0), images[0][:1])
    out = []
    for x, y in zip(images, labels, strict=True):
      state, metrics = trainer.step(state, (x, y))
      out.append(float(metrics["loss"]))
    return out

  np.testing.assert_allclose(
    losses(parstrat.Hybrid(data=4, stages=1)), losses(parstrat.DataParallel(data=4)), rtol=1e-6
  )
  np.testing.assert_allclose(
    losses(parstrat.Hybrid(data=1, stages=4, microbatches=2)),
    losses(parstrat.PipelineModelParallel(stages=4, microbatches=2)),
    rtol=1e-6,
  )


def test_default_split_uses_every_device():
  strategy = parstrat.Hybrid()
  assert dict(strategy.make_mesh().shape) == {"data": 4, "stage": 2}
  assert dict(parstrat.Hybrid(data=2).make_mesh().shape) == {"data": 2, "stage": 4}
  assert dict(parstrat.Hybrid(stages=8).make_mesh().shape) == {"data": 1, "stage": 8}
  with pytest.raises(ValueError, match="data=3 does not divide the 8 available devices"):
    parstrat.Hybrid(data=3).make_mesh()
  with pytest.raises(ValueError, match="data=4 x stage=4 needs 16 devices, but only 8"):
    parstrat.Hybrid(data=4, stages=4).make_mesh()
