"""Pipeline stage boundaries carry activations in their own dtype, not the params'."""

import re

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mlp

import parstrat
import parstrat.testing
from parstrat import pipeline
from parstrat._src import precision as precision_lib
from parstrat._src.pipeline import engine

MODEL = mlp([32, 32, 10])
FEATURES = 12


def _mixed_program(schedule: str) -> str:
  """The step's lowered program (as parstrat builds it: XLA's CPU backend later widens
  bf16 collectives to f32 itself; accelerators keep them) under mixed bfloat16."""
  trainer = parstrat.PipelineModelParallel(stages=2, schedule=schedule)(
    MODEL, optax.sgd(0.1), precision="mixed_bfloat16"
  )
  images, labels = parstrat.testing.random_batches(1, 8, FEATURES)
  state = trainer.init_abstract(jax.random.key(0), images[0][:1])
  return trainer.lower(state, (images[0], labels[0])).as_text()


def _permutes(text: str) -> list[str]:
  return re.findall(r"collective_permute.*: \(tensor<([^>]*)>\)", text)


def test_mixed_bfloat16_sends_bfloat16_activations_between_stages():
  text = _mixed_program("1f1b")
  # The forward activation and the backward cotangent (microbatch 4 x width 32).
  assert _permutes(text) == ["4x32xbf16", "4x32xbf16"], _permutes(text)
  # The stash of activations (1F1B: 2 slots and the spare one idle ticks write) and the
  # inbox of gradients (1 slot and the spare) are bfloat16 as well.
  assert "tensor<3x4x32xbf16>" in text and "tensor<2x4x32xbf16>" in text
  assert "x4x32xf32>" not in text


def test_gpipe_sends_bfloat16_both_ways_and_matches_one_device():
  # The activation on to the next stage and the gradient back to the previous one.
  permutes = _permutes(_mixed_program("gpipe"))
  assert permutes == ["4x32xbf16", "4x32xbf16"], permutes
  _matches_one_device_in_mixed_bfloat16(
    parstrat.PipelineModelParallel(stages=2, schedule="gpipe", activations="save")
  )


def _matches_one_device_in_mixed_bfloat16(strategy):
  parstrat.testing.check_strategy(
    strategy,
    MODEL,
    [optax.sgd(0.1)],
    steps=3,
    batch=8,
    features=FEATURES,
    precision="mixed_bfloat16",
    rtol=1e-3,
    atol=1e-3,  # bfloat16: see tests/test_precision_and_accumulation.py
  )


def _slot_buffers(schedule: str, activations: str, slots: int) -> set[str]:
  """The `[slots, n]` buffers of the lowered step at P=2, M=4 under mixed bfloat16."""
  trainer = parstrat.PipelineModelParallel(
    stages=2, microbatches=4, schedule=schedule, activations=activations
  )(MODEL, optax.sgd(0.1), precision="mixed_bfloat16")
  images, labels = parstrat.testing.random_batches(1, 8, FEATURES)
  state = trainer.init_abstract(jax.random.key(0), images[0][:1])
  text = trainer.lower(state, (images[0], labels[0])).as_text()
  return set(re.findall(rf"tensor<({slots}x\d+x(?:bf16|f32))>", text))


def test_zero_bubble_hands_bfloat16_from_i_to_w_and_matches_one_device():
  # Under mixed bfloat16 what ZB-H1's I pass hands its W pass is bfloat16: the buffers
  # ZB-H1's step holds beyond 1F1B's are its handoff slots, and they are bfloat16 (a
  # float32 handoff, cast back in W, matched one device as well).
  slots = pipeline.build_schedule("zb_h1", 2, 4).handoff_slots()[1]
  for activations in ("recompute", "save"):
    handoff = _slot_buffers("zb_h1", activations, slots) - _slot_buffers("1f1b", activations, slots)
    assert handoff and all(t.endswith("xbf16") for t in handoff), (activations, handoff)
    _matches_one_device_in_mixed_bfloat16(
      parstrat.PipelineModelParallel(
        stages=2, microbatches=4, schedule="zb_h1", activations=activations
      )
    )


def _gathered(x):
  # A later stage that gathers rows of a table by an argmax: its W pass reads the int32
  # indices as well as float32 values.
  x = jnp.tanh(hk.Linear(16)(x))
  x = jnp.tanh(hk.Linear(16)(x))
  table = hk.get_parameter("table", (16, 16), init=hk.initializers.RandomNormal(0.5))
  index = jnp.argmax(hk.Linear(16, name="gate")(x), axis=-1)
  return hk.Linear(10)(x * jnp.take(table, index, axis=0))


def test_zero_bubble_hands_mixed_dtypes_from_i_to_w_and_matches_one_device(monkeypatch):
  # Each dtype has its own part of a handoff slot, as of a residual slot.
  handoffs = []
  split_backward = engine.backward_split_lib.split_backward

  def recording(*args, **kwargs):
    split = split_backward(*args, **kwargs)
    handoffs.append({h.dtype for h in split.handoff})
    return split

  monkeypatch.setattr(engine.backward_split_lib, "split_backward", recording)
  strategy = parstrat.PipelineModelParallel(
    stages=2, microbatches=4, schedule="zb_h1", cuts=(2,), bubble_value=float("nan")
  )
  parstrat.testing.check_strategy(
    strategy, hk.transform(_gathered), [optax.sgd(0.1)], steps=2, batch=16, features=FEATURES
  )
  assert {jnp.dtype("float32"), jnp.dtype("int32")} in handoffs, handoffs


def test_params_in_bfloat16_with_float32_compute_match_one_device():
  policy = "params=bfloat16,compute=float32,output=float32"
  trainer = parstrat.PipelineModelParallel(stages=2)(MODEL, optax.sgd(0.1), precision=policy)
  images, _ = parstrat.testing.random_batches(1, 8, FEATURES)
  state = trainer.init(jax.random.key(0), images[0][:1])
  params = trainer.params(state)
  assert jax.tree.leaves(params)[0].dtype == jax.numpy.bfloat16
  one_device = precision_lib.with_policy(MODEL, precision_lib.resolve_policy(policy))
  expected = jax.jit(one_device.apply)(params, None, images[0])
  np.testing.assert_allclose(trainer.apply(state, images[0]), expected, rtol=1e-6, atol=1e-6)


def test_bfloat16_params_average_their_gradients_in_float32_under_hybrid_model_axis():
  # A bfloat16 pmean over "data" inside the shard_map that leaves "model" to the
  # partitioner aborted the process in XLA's CPU backend ("Invalid binary
  # instruction opcode copy"); `average_gradients` now sums such gradients in float32.
  policy = "params=bfloat16,compute=float32,output=float32"
  strategy = parstrat.Hybrid(data=2, stages=2, model=2)
  trainer = strategy(MODEL, optax.sgd(0.1), precision=policy)
  images, labels = parstrat.testing.random_batches(1, 16, FEATURES)
  state = trainer.init_abstract(jax.random.key(0), images[0][:1])
  lines = trainer.lower(state, (images[0], labels[0])).as_text().splitlines()
  # The element type each all-reduce adds in: the first line of its reduction body.
  summed = [lines[i + 1] for i, line in enumerate(lines) if '"stablehlo.all_reduce"' in line]
  assert summed and not [line for line in summed if "bf16" in line], summed
  parstrat.testing.check_strategy(
    strategy, MODEL, [optax.sgd(0.1)], steps=2, batch=16, features=FEATURES,
    precision=policy, rtol=2e-2, atol=2e-2,
  )  # fmt: skip


def _argmax_then_embed(x):  # the only value crossing the cut is an integer
  ids = jnp.argmax(hk.Linear(16, name="a")(x), -1)
  return hk.Linear(10, name="c")(jax.nn.relu(hk.Embed(16, 16, name="emb")(ids)))


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_an_integer_activation_crossing_a_cut_trains_when_recomputed(schedule):
  # Its gradient is JAX's float0, which the recomputing backward (B, and ZB-H1's I)
  # sent as it was: `lax.switch` refused branches of int32 and float0 buffers.
  strategy = parstrat.PipelineModelParallel(stages=2, microbatches=4, schedule=schedule, cuts=(1,))
  model = hk.transform(_argmax_then_embed)
  parstrat.testing.check_strategy(
    strategy, model, [optax.sgd(0.1)], steps=2, batch=16, features=FEATURES
  )
