"""Ordinary models x optimizers x every strategy: matches single-device jit, or refuses clearly.

Each case trains a model of the zoo (tests/models.py) for 3 steps under one
strategy and mesh, and the plain `jax.jit` reference for the same steps from
the same params. `EXPECTED` says for every case whether it must match (per-step
losses and `grad_norm`, and final params, within the suite's tolerances: 1e-5,
Adam-like params lr / 10) or be refused with an error containing a given text.
A case that silently changes either way fails.

The full cross product (8 models x 5 optimizers x 14 strategy meshes) would
take far too long, so the table is a covering design: under every strategy,
every model and every optimizer appears at least once and both mesh shapes
are used; each (model, optimizer) pair appears under several strategies and
its jit reference is computed once (`_reference`).
`test_the_table_covers_every_strategy_model_optimizer_and_mesh` checks those
properties.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import models
import numpy as np
import optax
import pytest

import parstrat
import parstrat.testing
from parstrat import checks

STEPS = 3
BATCH = 16
SEED = 0
#: Tolerances of the conformance kit (parstrat.testing.check_strategy).
TOL = 1e-5
ADAM_PARAM_TOL = parstrat.testing.ADAM_PARAM_ATOL  # lr / 10 for lr = 1e-3

#: Two mesh shapes for every registered strategy, by short id.
STRATEGIES = {
  "data_parallel:8": lambda: parstrat.DataParallel(data=8),
  "data_parallel:2": lambda: parstrat.DataParallel(data=2),
  "fsdp:8": lambda: parstrat.FSDP(data=8),
  "fsdp:2,zero2": lambda: parstrat.FSDP(data=2, zero=2),
  # Leaves under 64 elements (biases, LayerNorm scales) replicated, the 16x16 weights split.
  "fsdp:4,replicate<64": lambda: parstrat.FSDP(data=4, replicate_below=64),
  "tensor:2": lambda: parstrat.TensorParallel(model=2),
  "tensor:4": lambda: parstrat.TensorParallel(model=4),
  "pipeline:2": lambda: parstrat.PipelineModelParallel(stages=2, microbatches=2),
  "pipeline:4,gpipe": lambda: parstrat.PipelineModelParallel(
    stages=4, microbatches=4, schedule="gpipe"
  ),
  # Two passes per message exchange (#15), with each forward's residuals kept.
  "pipeline:2,exchange2": lambda: parstrat.PipelineModelParallel(
    stages=2, microbatches=4, exchange_every=2, activations="save"
  ),
  # ZB-H1: its I and W passes are cut out of each stage's backward (backward_split);
  # at M = 2P some gradients wait on their sender for a later exchange (exchange_plan).
  "pipeline:4,zb_h1": lambda: parstrat.PipelineModelParallel(
    stages=4, microbatches=8, schedule="zb_h1"
  ),
  "pipeline:2,zb_h1,dots": lambda: parstrat.PipelineModelParallel(
    stages=2, microbatches=4, schedule="zb_h1", activations="dots_saveable"
  ),
  "hybrid:2x2x2": lambda: parstrat.Hybrid(data=2, stages=2, model=2),
  "hybrid:2x2x2,zb_h1": lambda: parstrat.Hybrid(
    data=2, stages=2, model=2, microbatches=4, schedule="zb_h1"
  ),
  "hybrid:4x2": lambda: parstrat.Hybrid(data=4, stages=2),
  "auto:8": lambda: parstrat.Auto(
    candidates=("data_parallel", "tensor"), verbose=False, batch_size=BATCH
  ),
  "auto:4": lambda: parstrat.Auto(
    candidates=("data_parallel", "tensor"),
    verbose=False,
    batch_size=BATCH,
    devices=jax.devices()[:4],
  ),
}

MATCH = "match"
#: The pipeline passes no PRNG key to the model.
NO_RNG = "cannot train a model that calls hk.next_rng_key()"
#: A tied LM head reuses the embedding across any cut.
TIED_REFUSAL = "the parameters of 'embed' are used both before and after"

#: case (strategy id, model, optimizer) -> MATCH or a substring of the refusal.
EXPECTED = {
  # data_parallel
  ("data_parallel:8", "mlp", "sgd_momentum"): MATCH,
  ("data_parallel:2", "mlp_layernorm", "adamw_mask"): MATCH,
  ("data_parallel:8", "residual_mlp", "clip_sgd"): MATCH,
  ("data_parallel:2", "cnn", "multisteps"): MATCH,
  ("data_parallel:8", "lm", "adamw_mask"): MATCH,
  ("data_parallel:2", "lm_untied", "adam"): MATCH,
  ("data_parallel:8", "shared", "adam"): MATCH,
  ("data_parallel:2", "dropout", "sgd_momentum"): MATCH,
  # fsdp
  ("fsdp:2,zero2", "mlp", "multisteps"): MATCH,
  ("fsdp:8", "mlp_layernorm", "clip_sgd"): MATCH,
  ("fsdp:2,zero2", "residual_mlp", "adam"): MATCH,
  ("fsdp:8", "cnn", "sgd_momentum"): MATCH,
  ("fsdp:2,zero2", "lm", "adam"): MATCH,
  ("fsdp:2,zero2", "shared", "clip_sgd"): MATCH,
  ("fsdp:8", "dropout", "adamw_mask"): MATCH,
  ("fsdp:4,replicate<64", "mlp_layernorm", "adamw_mask"): MATCH,
  ("fsdp:4,replicate<64", "lm", "adamw_mask"): MATCH,
  # tensor
  ("tensor:2", "mlp", "sgd_momentum"): MATCH,
  ("tensor:4", "mlp_layernorm", "adamw_mask"): MATCH,
  ("tensor:2", "residual_mlp", "clip_sgd"): MATCH,
  ("tensor:4", "cnn", "multisteps"): MATCH,
  ("tensor:2", "lm", "adamw_mask"): MATCH,
  ("tensor:2", "shared", "adam"): MATCH,
  ("tensor:4", "dropout", "sgd_momentum"): MATCH,
  # pipeline
  ("pipeline:4,gpipe", "mlp", "multisteps"): MATCH,
  ("pipeline:2", "mlp_layernorm", "adamw_mask"): MATCH,
  ("pipeline:4,gpipe", "residual_mlp", "adam"): MATCH,
  ("pipeline:2", "cnn", "sgd_momentum"): MATCH,
  ("pipeline:4,gpipe", "lm", "clip_sgd"): TIED_REFUSAL,
  ("pipeline:2", "lm_untied", "sgd_momentum"): MATCH,
  ("pipeline:4,gpipe", "shared", "adam"): (
    "the parameters of 'shared' are used both before and after layer 'middle'"
  ),
  ("pipeline:2", "shared", "clip_sgd"): MATCH,
  ("pipeline:2,exchange2", "lm_untied", "adam"): MATCH,
  ("pipeline:2,exchange2", "residual_mlp", "sgd_momentum"): MATCH,
  ("pipeline:4,gpipe", "dropout", "sgd_momentum"): NO_RNG,
  ("pipeline:4,zb_h1", "residual_mlp", "clip_sgd"): MATCH,
  ("pipeline:4,zb_h1", "mlp", "adam"): MATCH,
  ("pipeline:4,zb_h1", "lm_untied", "adamw_mask"): MATCH,
  ("pipeline:2,zb_h1,dots", "lm_untied", "sgd_momentum"): MATCH,
  ("pipeline:2,zb_h1,dots", "cnn", "multisteps"): MATCH,
  # hybrid
  ("hybrid:2x2x2", "mlp", "sgd_momentum"): MATCH,
  ("hybrid:4x2", "mlp_layernorm", "adamw_mask"): MATCH,
  ("hybrid:2x2x2", "lm_untied", "adamw_mask"): MATCH,
  ("hybrid:2x2x2", "residual_mlp", "clip_sgd"): MATCH,
  ("hybrid:4x2", "cnn", "multisteps"): MATCH,
  ("hybrid:4x2", "lm", "sgd_momentum"): TIED_REFUSAL,
  ("hybrid:2x2x2", "lm_untied", "adam"): MATCH,
  ("hybrid:2x2x2", "shared", "adam"): MATCH,
  ("hybrid:4x2", "dropout", "clip_sgd"): NO_RNG,
  ("hybrid:2x2x2,zb_h1", "lm_untied", "sgd_momentum"): MATCH,
  ("hybrid:2x2x2,zb_h1", "residual_mlp", "adam"): MATCH,
  # auto
  ("auto:8", "mlp", "multisteps"): MATCH,
  ("auto:4", "mlp_layernorm", "adamw_mask"): MATCH,
  ("auto:8", "residual_mlp", "adam"): MATCH,
  ("auto:4", "cnn", "sgd_momentum"): MATCH,
  ("auto:8", "lm", "adam"): MATCH,
  ("auto:8", "shared", "clip_sgd"): MATCH,
  ("auto:4", "dropout", "sgd_momentum"): MATCH,
}


#: The untied LM (dict batches) runs where the tied one is refused, and once beside it;
#: tests/test_trainer_contract.py feeds dict batches of tokens to the other strategies.
UNTIED_LM_UNDER = ("data_parallel", "pipeline", "hybrid")


def _strategy_name(strategy_id: str) -> str:
  return strategy_id.split(":", maxsplit=1)[0]


@functools.cache
def _reference(model_name: str, optimizer_name: str):
  """Plain single-device jit's losses and final params, once per (model, optimizer) pair."""
  spec = models.ZOO[model_name]
  return models.jit_run(spec, models.optimizers()[optimizer_name], STEPS, BATCH, SEED)


def run_case(strategy_id: str, model_name: str, optimizer_name: str) -> dict:
  """Trains one case: {"losses", "grad_norms", "params", "chosen"} or {"refused": message}."""
  spec = models.ZOO[model_name]
  trainer = STRATEGIES[strategy_id]()(
    spec.model, models.optimizers()[optimizer_name], **spec.trainer_options()
  )
  try:
    # The sample batch tells "auto" the labels' layout to measure its candidates with.
    sample_batch = spec.batches(1, 1, SEED)[0]
    state = trainer.init(jax.random.key(SEED), spec.sample(), sample_batch=sample_batch)
    losses, norms = [], []
    for batch in spec.batches(STEPS, BATCH, SEED):
      state, metrics = trainer.step(state, batch)
      losses.append(float(metrics["loss"]))
      norms.append(float(metrics["grad_norm"]))
  except (ValueError, TypeError, NotImplementedError) as e:
    return {"refused": f"{type(e).__name__}: {e}"}
  checks.assert_replicas_equal(state)
  params = jax.tree.map(np.asarray, trainer.params(state))
  return {"losses": losses, "grad_norms": norms, "params": params, "chosen": repr(trainer.strategy)}


@pytest.mark.parametrize(
  ("strategy_id", "model_name", "optimizer_name"),
  [pytest.param(*case, id="-".join(case)) for case in EXPECTED],
)
def test_case(strategy_id, model_name, optimizer_name):
  case = (strategy_id, model_name, optimizer_name)
  expected = EXPECTED[case]
  out = run_case(*case)
  if expected != MATCH:
    assert "refused" in out, f"{case} trained, but should be refused with {expected!r}"
    assert expected in out["refused"], f"{case} was refused for another reason: {out['refused']}"
    return
  assert "refused" not in out, f"{case} was refused: {out.get('refused')}"
  ref = _reference(model_name, optimizer_name)
  np.testing.assert_allclose(out["losses"], ref.losses, rtol=TOL, atol=TOL, err_msg=str(case))
  np.testing.assert_allclose(
    out["grad_norms"], ref.grad_norms, rtol=TOL, atol=TOL, err_msg=f"{case}: grad_norm"
  )
  param_tol = ADAM_PARAM_TOL if optimizer_name in models.ADAM_LIKE else TOL
  close = jax.tree.map(
    lambda a, b: bool(np.allclose(a, b, rtol=TOL, atol=param_tol)), out["params"], ref.params
  )
  bad = [jax.tree_util.keystr(p) for p, ok in jax.tree_util.tree_leaves_with_path(close) if not ok]
  assert not bad, f"{case} ({out['chosen']}): params differ from jit at {bad}"


def test_the_readme_gives_the_number_of_cases():
  readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
  assert f"names the outcome of each of its {len(EXPECTED)} cases" in readme


def test_the_table_covers_every_strategy_model_optimizer_and_mesh():
  by_strategy: dict[str, set] = {}
  for strategy_id, model_name, optimizer_name in EXPECTED:
    seen = by_strategy.setdefault(_strategy_name(strategy_id), set())
    seen.update({("mesh", strategy_id), ("model", model_name), ("optimizer", optimizer_name)})
  assert set(by_strategy) == set(parstrat.available()), "a registered strategy is not in the table"
  meshes = {("mesh", s) for s in STRATEGIES}
  for name, seen in by_strategy.items():
    zoo = set(models.ZOO) if name in UNTIED_LM_UNDER else set(models.ZOO) - {"lm_untied"}
    want = {("model", m) for m in zoo} | {("optimizer", o) for o in models.optimizers()}
    want |= {m for m in meshes if _strategy_name(m[1]) == name}
    assert want <= seen, f"{name} misses {sorted(want - seen)}"
  three_axes = STRATEGIES["hybrid:2x2x2"]()
  assert min(three_axes.data, three_axes.stages, three_axes.model) > 1  # data x stage x model


def test_the_adamw_mask_is_visible_at_these_tolerances():
  """Were the mask ignored (biases and LayerNorm decayed), the params would differ."""
  masked = _reference("mlp_layernorm", "adamw_mask").params
  unmasked = optax.adamw(models.ADAMW_LR, weight_decay=models.ADAMW_DECAY)
  decayed = models.jit_run(models.MLP_LAYERNORM, unmasked, STEPS, BATCH, SEED).params
  for layer, leaf in (("linear", "b"), ("layer_norm", "scale")):
    diff = np.max(np.abs(masked[layer][leaf] - decayed[layer][leaf]))
    assert diff > 5 * ADAM_PARAM_TOL, (layer, leaf, diff)
