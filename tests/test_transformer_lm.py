"""examples/transformer_lm.py: its LM trains under five strategies exactly like plain jit.

The example's own `train` (its model, corpus and batches) runs with tiny
sizes under data_parallel, pipeline, hybrid (data x stage x model), fsdp and
tensor with SGD, and under the pipeline with Adam too; the per-step losses and
final params must match single-device `jax.jit` on the same batches from the
same params. (The model matrix runs the same LM with Adam-like optimizers
under data_parallel, fsdp, tensor, hybrid 2x2x2 and auto.) The
tied-head variant (and the untied one with dict batches) is in the model
matrix, tests/test_model_matrix.py, as "lm": it matches under data_parallel,
fsdp, tensor and auto, and the pipeline and hybrid refuse it naming 'embed'.
"""

from __future__ import annotations

import functools
import hashlib

import jax
import models
import numpy as np
import optax
import pytest

import parstrat
import parstrat.testing

lm = models.transformer_lm_example

TINY = dict(width=16, heads=2, blocks=2)
BATCH, SEQ, STEPS = 8, 8, 3
TOL = 1e-5

STRATEGIES = {
  "data_parallel": lambda: parstrat.DataParallel(data=4),
  "pipeline": lambda: parstrat.PipelineModelParallel(stages=2, microbatches=2),
  "hybrid": lambda: parstrat.Hybrid(data=2, stages=2, model=2),
  "fsdp": lambda: parstrat.FSDP(data=4),
  "tensor": lambda: parstrat.TensorParallel(model=2),
}
OPTIMIZERS = {"sgd": (lambda: optax.sgd(0.1), TOL)}


@functools.cache
def _reference(optimizer: str):
  net, loss = lm.model(**TINY)
  batches = lm.dataset(BATCH, SEQ, seed=0)[0][:STEPS]
  params = jax.jit(net.init)(jax.random.key(0), batches[0][0][:1])
  tokens, targets = zip(*batches, strict=True)
  return parstrat.testing.reference_run(
    net, OPTIMIZERS[optimizer][0](), tokens, targets, params, loss
  )


def _train(strategy: str, optimizer: str) -> lm.Result:
  return lm.train(
    STRATEGIES[strategy](),
    STEPS,
    optimizer=OPTIMIZERS[optimizer][0](),
    batch_size=BATCH,
    seq_len=SEQ,
    eval_batches=2,
    **TINY,
  )


def _assert_matches(result: lm.Result, optimizer: str) -> None:
  ref_losses, ref_params = _reference(optimizer)
  np.testing.assert_allclose(result.losses, ref_losses, rtol=TOL, atol=TOL)
  param_tol = OPTIMIZERS[optimizer][1]
  for (path, got), want in zip(
    jax.tree_util.tree_leaves_with_path(result.params), jax.tree.leaves(ref_params), strict=True
  ):
    np.testing.assert_allclose(
      got, want, rtol=TOL, atol=param_tol, err_msg=jax.tree_util.keystr(path)
    )
  assert np.isfinite(result.eval_loss)


# SGD, where a wrong gradient scale shows (the model matrix runs this LM with Adam and
# AdamW under every strategy).
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_untied_lm_matches_jit(strategy):
  _assert_matches(_train(strategy, "sgd"), "sgd")


def test_a_causal_mask_built_in_apply_lets_every_block_boundary_be_cut():
  # The example builds its mask with `jnp.tril` inside `apply`; read by every attention
  # layer, it was a second value live across each cut between blocks. It is a constant.
  net, loss = lm.model(**TINY)
  tokens = lm.dataset(BATCH, SEQ, seed=0)[0][0][0]
  params = jax.eval_shape(net.init, jax.random.key(0), tokens[:1])
  plan = parstrat.pipeline.plan_stages(
    lambda p, x: net.apply(p, None, x), params, jax.ShapeDtypeStruct((1, SEQ), np.int32), 4
  )
  firsts = [plan.layers[group[0]].name for group in plan.stage_layers]
  assert "block1_ln_attn" in firsts, plan  # (the cut between the two blocks)
  strategy = parstrat.PipelineModelParallel(stages=4, microbatches=2, schedule="zb_h1")
  result = lm.train(
    strategy, STEPS, optimizer=optax.sgd(0.1), batch_size=BATCH, seq_len=SEQ, eval_batches=2, **TINY
  )
  _assert_matches(result, "sgd")


def test_corpus_and_batches():
  text = lm.load_text()
  assert hashlib.md5(text.encode()).hexdigest() == "2d8e3f823b9eac410eb65632ae6b91c9"  # data/README
  assert set(text) <= set(lm.ALPHABET)
  assert lm.decode(lm.encode(text[:500])) == text[:500]
  train, held_out = lm.dataset(batch_size=4, seq_len=8, seed=1)
  assert len(train) > 5 * len(held_out) > 0  # a 90 / 10 split
  tokens, targets = train[0]
  assert tokens.shape == targets.shape == (4, 8) and tokens.dtype == np.int32
  np.testing.assert_array_equal(tokens[:, 1:], targets[:, :-1])  # targets: the next character
  assert lm.decode(tokens[0]) in text
  again, _ = lm.dataset(batch_size=4, seq_len=8, seed=1)
  np.testing.assert_array_equal(again[5][0], train[5][0])  # deterministic per seed


def test_a_tied_head_is_refused_naming_the_embedding_first_and_once():
  tokens, _ = models.token_batches(1, BATCH)[0]
  trainer = parstrat.PipelineModelParallel(stages=2)(
    models.LM.model, optax.sgd(0.1), loss_fn=models.token_loss
  )
  with pytest.raises(ValueError, match="cannot be cut into 2 stages") as info:
    trainer.init(jax.random.key(0), tokens[:1])
  message = str(info.value)
  # One sentence for every boundary the tied weight blocks, before any other reason.
  assert message.split("cuttable (", 1)[1].startswith(
    "the parameters of 'embed' are used both before and after each of the 18 layers "
    "'~' .. 'ln_final' (a weight shared or tied"
  ), message
  # (the boundary just after the embedding, before the position embedding '~', was
  # "used interleaved", said after it)
  assert "interleaved" not in message, message
  assert message.count("tied across the cut") == 1, message
