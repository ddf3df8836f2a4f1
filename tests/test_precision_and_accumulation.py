"""Mixed precision (jmp) and gradient accumulation, on every strategy, against plain jit."""

import re

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import parstrat
from parstrat._src import hlo_check
from parstrat.testing import check_strategy
from parstrat.testing import random_batches

# One strategy of each kind: manual collectives (data_parallel), a pipeline
# inside data-parallel replicas (hybrid), and layouts XLA partitions (fsdp, tensor).
STRATEGIES = {
  "data_parallel": parstrat.DataParallel(),
  "hybrid": parstrat.Hybrid(data=2, stages=2, microbatches=2),
  "fsdp": parstrat.FSDP(),
  "tensor": parstrat.TensorParallel(model=2),
}
# bfloat16 keeps 8 bits of mantissa and each strategy sums per-device
# gradients in its own order, so bf16 runs agree with the bf16 reference to
# ~1e-4 after 3 SGD steps (measured), not to float32's 1e-7.
BF16_TOL = 1e-3


@pytest.mark.parametrize("name", ["data_parallel", "hybrid", "fsdp"])
def test_mixed_bfloat16_matches_jit_with_the_same_policy(name):
  check_strategy(
    STRATEGIES[name],
    optimizers=[optax.sgd(0.1)],
    steps=3,
    batch=32,
    precision="mixed_bfloat16",
    rtol=BF16_TOL,
    atol=BF16_TOL,
  )


def test_mixed_precision_computes_in_bfloat16_and_keeps_float32_state():
  model = parstrat.testing.seed_mlp()
  images, labels = random_batches(1, 32)
  runs = {}
  for precision in (None, "mixed_bfloat16"):
    trainer = parstrat.DataParallel()(model, optax.adam(1e-3), precision=precision)
    state = trainer.init(jax.random.key(0), images[0][:1])
    hlo = trainer.lower(state, (images[0], labels[0])).as_text()
    state, metrics = trainer.step(state, (images[0], labels[0]))
    for leaf in jax.tree.leaves((state.params, state.opt_state)):
      if jnp.issubdtype(leaf.dtype, jnp.floating):
        assert leaf.dtype == jnp.float32
    assert metrics["loss"].dtype == jnp.float32
    assert trainer.apply(state, images[0]).dtype == jnp.float32
    runs[precision] = (hlo, float(metrics["loss"]))
  assert "bf16" not in runs[None][0]
  assert "bf16" in runs["mixed_bfloat16"][0]
  assert runs[None][1] != runs["mixed_bfloat16"][1]


def _matmul_operand_types(hlo: str) -> list[str]:
  """The operand types of every matrix product in lowered StableHLO, e.g. `4x784xbf16`."""
  return re.findall(r"tensor<([^>]*)>", " ".join(re.findall(r"dot_general .*: \((.*)\) ->", hlo)))


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_matrix_product_of_a_mixed_step_takes_bfloat16(name):
  # Params cast to bfloat16 but inputs left in float32 still hold bf16 in the step (the
  # casts), while type promotion silently runs every first-layer product in float32.
  images, labels = random_batches(1, 32)
  for precision, dtype in ((None, "f32"), ("mixed_bfloat16", "bf16")):
    trainer = STRATEGIES[name](parstrat.testing.seed_mlp(), optax.sgd(0.1), precision=precision)
    state = trainer.init(jax.random.key(0), images[0][:1])
    operands = _matmul_operand_types(trainer.lower(state, (images[0], labels[0])).as_text())
    assert len(operands) >= 8, operands  # forward and backward of both layers
    assert all(t.endswith("x" + dtype) for t in operands), (precision, operands)


def test_precision_accepts_jmp_policies():
  policy = jmp.get_policy("params=float32,compute=bfloat16,output=float32")
  trainer = parstrat.DataParallel(data=2)(
    parstrat.testing.seed_mlp(), optax.sgd(0.1), precision=policy
  )
  assert trainer.policy == policy
  full = parstrat.DataParallel(data=2)(
    parstrat.testing.seed_mlp(), optax.sgd(0.1), precision="float32"
  )
  assert full.policy is None


@pytest.mark.parametrize(
  ("precision", "message"),
  [
    ("float16", "needs loss scaling"),
    ("params=float32,compute=float16,output=float32", "float16 compute, which needs loss"),
    # (a float16 loss and its backward need it as much: accepted before)
    ("params=float32,compute=bfloat16,output=float16", "float16 output, which needs loss"),
    ("bogus", "Unknown precision 'bogus'"),
    (3, "precision must be a string or a jmp.Policy, got 3"),
  ],
)
def test_bad_precision_is_refused_by_name(precision, message):
  model = parstrat.testing.seed_mlp()
  with pytest.raises((ValueError, TypeError), match=message):
    parstrat.DataParallel()(model, optax.sgd(0.1), precision=precision)


# Tensor parallelism (global arrays, like FSDP, with an unsplit batch) is checked
# with both options together below.
@pytest.mark.parametrize("name", ["data_parallel", "hybrid", "fsdp"])
def test_accumulation_matches_jit_on_the_whole_batch(name):
  check_strategy(STRATEGIES[name], optimizers=[optax.sgd(0.1)], steps=3, batch=32, accumulate=2)


def test_tensor_parallel_with_mixed_precision_and_accumulation():
  check_strategy(
    STRATEGIES["tensor"],
    optimizers=[optax.sgd(0.1)],
    steps=3,
    batch=32,
    precision="mixed_bfloat16",
    accumulate=2,
    rtol=BF16_TOL,
    atol=BF16_TOL,
  )


def test_accumulation_with_adam_and_mixed_precision_together():
  # Adam's update is about lr * sign(g) for tiny gradients, so bf16 rounding
  # can flip a step: params are compared to a few learning rates.
  check_strategy(
    "fsdp",
    optimizers=[optax.adam(1e-3)],
    steps=3,
    batch=64,
    accumulate=4,
    precision="mixed_bfloat16",
    rtol=BF16_TOL,
    atol=5e-3,
  )


def all_reduce_shapes(hlo: str) -> list[str]:
  """The operand shapes of each all-reduce in `hlo`, layouts dropped, in order."""
  shapes = []
  for line in hlo.splitlines():
    if " all-reduce(" in line:
      shape = line.split(" = ", 1)[1].split(" all-reduce(")[0]
      shapes.append(re.sub(r"\{[^}]*\}|/\*[^*]*\*/|^\(|\)$", "", shape).strip())
  return shapes


def test_data_parallel_accumulation_reduces_once_and_holds_less():
  # A big batch on narrow layers, so activations outweigh params and gradients.
  model = hk.transform(lambda x: hk.nets.MLP([256, 256, 10])(x))
  images, labels = random_batches(1, 4096)
  compiled = {}
  for k in (1, 4):
    trainer = parstrat.DataParallel(data=2)(model, optax.sgd(0.1), accumulate=k)
    state = trainer.init(jax.random.key(0), images[0][:1])
    compiled[k] = trainer.lower(state, (images[0], labels[0])).compile()
  reductions = {k: all_reduce_shapes(c.as_text()) for k, c in compiled.items()}
  # The k microsteps sum local gradients; the one gradient pmean runs after the
  # loop. The scalars (the loss, the label check, each device's part of the
  # gradient norm) share a second, scalar all-reduce; a jnp.all over the labels
  # was a third.
  gradients = "f32[256], f32[784,256], f32[256], f32[256,256], f32[10], f32[256,10]"
  assert reductions[4] == reductions[1] == [gradients, "f32[], f32[], f32[]"]
  temp = {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
  assert temp[4] < 0.75 * temp[1]  # measured: 5.3 MB vs 8.7 MB


@pytest.mark.parametrize(
  "strategy",
  [parstrat.DataParallel(data=2), parstrat.Hybrid(data=2, stages=2, microbatches=2)],
  ids=["data_parallel", "hybrid"],
)
def test_accumulation_reduces_the_gradients_after_its_loop_not_in_every_microstep(strategy):
  # Their plans return local gradients and reduce them in `Plan.reduce`: once a step.
  # (Moving Hybrid's "data" mean into each microstep passed every other test.)
  model = hk.transform(lambda x: hk.nets.MLP([32, 32, 10])(x))
  images, labels = random_batches(1, 64)
  trainer = strategy(model, optax.sgd(0.1), accumulate=4)
  state = trainer.init(jax.random.key(0), images[0][:1])
  hlo = trainer.lower(state, (images[0], labels[0])).compile().as_text()
  in_loops = [line for op, _, line in hlo_check.loop_instructions(hlo) if op == "all-reduce"]
  looped = all_reduce_shapes("\n".join(in_loops))
  # In a loop: scalars only (the pipeline's loss, summed over its stages, each tick).
  assert all(re.fullmatch(r"f32\[\](, f32\[\])*", shape) for shape in looped), looped
  # After it: one all-reduce of every gradient.
  gradients = [x for x in all_reduce_shapes(hlo) if x not in looped and re.search(r"\[\d", x)]
  assert len(gradients) == 1, all_reduce_shapes(hlo)


def test_accumulation_needs_a_batch_that_splits_into_microsteps():
  model = parstrat.testing.seed_mlp()
  trainer = parstrat.DataParallel(data=4)(model, optax.sgd(0.1), accumulate=3)
  images, labels = random_batches(1, 16)
  state = trainer.init(jax.random.key(0), images[0][:1])
  with pytest.raises(ValueError, match=r"multiple of 12 .*accumulate=3\), got 16"):
    trainer.step(state, (images[0], labels[0]))
  # The data-axis size x microbatches x k, all three (12 is a multiple of data x
  # microbatches and of data x k, not of data x microbatches x k).
  pipe = parstrat.Hybrid(data=2, stages=2, microbatches=2)(model, optax.sgd(0.1), accumulate=2)
  images, labels = random_batches(1, 12)
  state = pipe.init(jax.random.key(0), images[0][:1])
  with pytest.raises(
    ValueError,
    match=r"multiple of 8 \(2 devices along .* x 2 microbatches x accumulate=2\), got 12",
  ):
    pipe.step(state, (images[0], labels[0]))
  for bad in (0, -1):
    with pytest.raises(ValueError, match=f"accumulate must be a positive integer, got {bad}"):
      parstrat.DataParallel()(model, optax.sgd(0.1), accumulate=bad)
  with pytest.raises(TypeError, match="accumulate must be a positive integer, got 2.0"):
    parstrat.DataParallel()(model, optax.sgd(0.1), accumulate=2.0)


def test_accumulate_gradients_is_the_mean_over_microsteps():
  def loss_and_grad(w, x, y):
    return jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)

  w = jnp.ones((3,))
  x = jnp.arange(24.0).reshape(8, 3) / 10
  y = jnp.arange(8.0)
  loss, grad = parstrat.accumulate_gradients(loss_and_grad, w, x.reshape(4, 2, 3), y.reshape(4, 2))
  want_loss, want_grad = loss_and_grad(w, x, y)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-6)
