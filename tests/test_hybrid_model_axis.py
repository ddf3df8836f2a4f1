"""Hybrid with a third mesh axis, "model": data x stage x model, Megatron pairs within stages."""

import threading

import jax
import numpy as np
import optax
import pytest
from helpers import mlp

import parstrat
import parstrat.testing
from parstrat._src import hlo_check
from parstrat._src import testing as parstrat_testing

FEATURES = 12
#: Cut before layer 3: stage 0 holds three linear layers (a pair, then a lone one),
#: stage 1 holds two (one pair).
ODD_STAGE = mlp([24, 21, 16, 16, 10])
ODD_CUTS = (3,)


def test_2x2x2_matches_single_device_jit_with_sgd_and_adam():
  # NaN bubbles: an idle pipeline slot's value must never reach a loss or a gradient.
  strategy = parstrat.Hybrid(data=2, stages=2, model=2, cuts=ODD_CUTS, bubble_value=float("nan"))
  reports = parstrat.testing.check_strategy(
    strategy, ODD_STAGE, steps=20, batch=16, features=FEATURES
  )
  assert [r.optimizer for r in reports] == ["sgd", "adam"]


def test_interleaved_with_a_model_axis_matches_single_device_jit():
  # Four model stages (two chunks per device), each split over "model" where it can be,
  # with the forward residuals kept for the backward.
  strategy = parstrat.Hybrid(
    data=1,
    stages=2,
    model=2,
    microbatches=2,
    schedule="interleaved_1f1b",
    activations="save",
    bubble_value=float("nan"),
  )
  parstrat.testing.check_strategy(
    strategy, ODD_STAGE, [optax.sgd(0.1)], steps=3, batch=8, features=FEATURES
  )


# Two passes per exchange, each split over "model", each forward's residuals kept in
# the slot its tick names: the branch check (run before the first step) finds no
# collective leaving "model" inside a stage branch. Unrolled, ZB-H1's ticks run as
# straight-line code (each tick's residual and handoff slots read from its own column)
# and the replicas still average their gradients once, after the last tick.
@pytest.mark.parametrize(
  "schedule, unroll", [("1f1b", False), ("zb_h1", True)], ids=["1f1b", "zb_h1-unrolled"]
)
def test_an_exchange_every_two_ticks_with_a_model_axis_matches_single_device_jit(schedule, unroll):
  strategy = parstrat.Hybrid(
    data=2,
    stages=2,
    model=2,
    microbatches=4,
    cuts=ODD_CUTS,
    schedule=schedule,
    exchange_every=2,
    activations="save",
    unroll=unroll,
    bubble_value=float("nan"),
  )
  parstrat.testing.check_strategy(
    strategy, ODD_STAGE, [optax.sgd(0.1)], steps=3, batch=16, features=FEATURES
  )


def test_gpipe_with_a_model_axis_matches_jit_with_only_stage_local_reductions_in_branches():
  # Autodiff of a forward tick loop (tried for GPipe in an earlier round) made XLA
  # reshard split stage buffers inside the per-stage branches. The tick-table engine
  # does not: only the split groups' all-reduces among one stage's devices sit there.
  strategy = parstrat.Hybrid(
    data=2, stages=2, model=2, cuts=ODD_CUTS, schedule="gpipe", bubble_value=float("nan")
  )
  trainer = strategy(ODD_STAGE, optax.sgd(0.1), precision="mixed_bfloat16")
  images, labels = parstrat.testing.random_batches(1, 16, FEATURES)
  state = trainer.init_abstract(jax.random.key(0), images[0][:1])
  text = trainer.lower(state, (images[0], labels[0])).compile().as_text()
  assert {c.kind for c in hlo_check.branch_collectives(text)} == {"all-reduce"}
  assert hlo_check.branch_problems(text, trainer.mesh) == []
  parstrat.testing.check_strategy(
    strategy,
    ODD_STAGE,
    [optax.sgd(0.1)],
    steps=3,
    batch=16,
    features=FEATURES,
    precision="mixed_bfloat16",
    rtol=1e-3,
    atol=1e-3,  # bfloat16: see tests/test_precision_and_accumulation.py
  )


def test_each_device_holds_its_stage_and_one_tth_of_each_split_weight():
  trainer = parstrat.Hybrid(data=2, stages=2, model=2, cuts=ODD_CUTS)(ODD_STAGE, optax.sgd(0.1))
  images, labels = parstrat.testing.random_batches(1, 16, features=FEATURES)
  state = trainer.init(jax.random.key(0), images[0][:1])
  state, _ = trainer.step(state, (images[0], labels[0]))
  mesh = trainer.mesh
  assert dict(mesh.shape) == {"data": 2, "stage": 2, "model": 2}
  split, replicated = state.params
  params = trainer.params(state)
  l0, l1, l2, l3, l4 = (params[f"mlp/~/linear_{i}"] for i in range(5))

  # What model shard t of each stage must hold: its half of every split leaf.
  def half(x, axis, t):
    n = x.shape[axis] // 2
    return np.moveaxis(np.asarray(x), axis, 0)[t * n : (t + 1) * n].reshape(-1)

  def expected(stage, t):  # leaves in flattened order: b before w
    if stage == 0:  # linear_0 column-parallel (b and w), linear_1 row-parallel (w)
      return np.concatenate([half(l0["b"], 0, t), half(l0["w"], 1, t), half(l1["w"], 0, t)])
    return np.concatenate([half(l3["b"], 0, t), half(l3["w"], 1, t), half(l4["w"], 0, t)])

  split_sizes = [
    (l0["w"].size + l0["b"].size + l1["w"].size) // 2,
    (l3["w"].size + l3["b"].size + l4["w"].size) // 2,
  ]
  assert split.shape == (2, 2, max(split_sizes))
  replicated_sizes = [l1["b"].size + l2["w"].size + l2["b"].size, l4["b"].size]
  assert replicated.shape == (2, max(replicated_sizes))
  for d in range(2):
    for s in range(2):
      for t in range(2):
        device = mesh.devices[d, s, t]
        (shard,) = [x for x in split.addressable_shards if x.device == device]
        assert shard.index[:2] == (slice(s, s + 1), slice(t, t + 1))
        assert shard.data.shape == (1, 1, max(split_sizes))
        data = np.asarray(shard.data)[0, 0]
        np.testing.assert_array_equal(data[: split_sizes[s]], expected(s, t))
        np.testing.assert_array_equal(data[split_sizes[s] :], 0.0)  # padding
        (shard,) = [x for x in replicated.addressable_shards if x.device == device]
        assert shard.index[0] == slice(s, s + 1)
        assert shard.data.shape == (1, max(replicated_sizes))
  parstrat.checks.assert_replicas_equal(state)

  # to_stored and to_params are exact inverses; apply computes the model.
  plan = trainer.plan
  again = plan.to_stored(plan.to_params(state.params))
  for a, b in zip(again, state.params, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  logits = trainer.apply(state, images[0])
  assert {x.data.shape for x in logits.addressable_shards} == {(8, 10)}
  np.testing.assert_allclose(
    np.asarray(logits), ODD_STAGE.apply(params, None, images[0]), rtol=1e-5, atol=1e-6
  )

  text = plan.description
  assert "tensor-parallel plan over model=2: 2 split group(s)" in text
  assert (
    "stage 0: mlp/~/linear_0: column-parallel (split by output features; "
    "consumed by mlp/~/linear_1)" in text
  )
  assert "stage 0: mlp/~/linear_1: row-parallel" in text
  assert (
    "stage 0: mlp/~/linear_2: replicated (not split: its group (mlp/~/linear_2, "
    "mlp/~/linear_3) would straddle stages [0, 1])" in text
  )
  assert (
    "stage 1: mlp/~/linear_3: column-parallel (split by output features; "
    "consumed by mlp/~/linear_4)" in text
  )
  assert "stage 1: mlp/~/linear_4: row-parallel" in text
  assert (
    f"per-device parameter buffers: {max(split_sizes):,} split + "
    f"{max(replicated_sizes):,} replicated elements" in text
  )


def test_a_width_model_does_not_divide_is_replicated_and_still_trains():
  model = mlp([21, 16, 16, 10])  # linear_0's width 21 is odd: no pair starts there
  strategy = parstrat.Hybrid(data=2, stages=2, model=2, cuts=(2,))
  trainer = strategy(model, optax.sgd(0.1))
  images, _ = parstrat.testing.random_batches(1, 16, features=FEATURES)
  trainer.init(jax.random.key(0), images[0][:1])
  text = trainer.plan.description
  assert "stage 0: mlp/~/linear_0: replicated (its 21 outputs are not divisible by model=2)" in text
  assert "stage 0: mlp/~/linear_1: replicated (not split: its group" in text
  assert (
    "stage 1: mlp/~/linear_2: column-parallel (split by output features; "
    "consumed by mlp/~/linear_3)" in text
  )
  parstrat.testing.check_strategy(
    strategy, model, [optax.sgd(0.1)], steps=2, batch=16, features=FEATURES
  )
  # With nothing split (one layer per stage), the plan says 0 split elements (it said
  # 1: the split buffer's least size).
  trainer = strategy.__class__(data=2, stages=2, model=2)(mlp([21, 10]), optax.sgd(0.1))
  trainer.init(jax.random.key(0), images[0][:1])
  text = trainer.plan.description
  assert "0 split group(s)" in text
  assert f"buffers: 0 split + {FEATURES * 21 + 21:,} replicated elements" in text


def test_mesh_shapes_and_bad_model_sizes():
  assert dict(parstrat.Hybrid(model=2).make_mesh().shape) == {"data": 2, "stage": 2, "model": 2}
  assert dict(parstrat.Hybrid(data=4, model=2).make_mesh().shape) == {
    "data": 4,
    "stage": 1,
    "model": 2,
  }
  assert dict(parstrat.Hybrid(stages=2, model=4).make_mesh().shape) == {
    "data": 1,
    "stage": 2,
    "model": 4,
  }
  # model=1 (the default) keeps the two-axis mesh.
  assert dict(parstrat.Hybrid(data=2, stages=4).make_mesh().shape) == {"data": 2, "stage": 4}
  assert "model=2" in repr(parstrat.Hybrid(model=2))
  with pytest.raises(ValueError, match=r"data=2 x stage=2 x model=3 needs 12 devices, but only 8"):
    parstrat.Hybrid(data=2, stages=2, model=3).make_mesh()
  with pytest.raises(ValueError, match=r"model=3 does not divide the 8 available devices"):
    parstrat.Hybrid(model=3).make_mesh()
  with pytest.raises(ValueError, match=r"model=3 x stages=2 does not divide the 8 available"):
    parstrat.Hybrid(stages=2, model=3).make_mesh()
  with pytest.raises(ValueError, match=r"data=3 does not divide the 4 devices left per model=2"):
    parstrat.Hybrid(data=3, model=2).make_mesh()
  for bad in (0, -2, 1.5, True, None):
    with pytest.raises(ValueError, match=rf"model must be a positive integer, got {bad!r}"):
      parstrat.Hybrid(data=2, stages=2, model=bad).make_mesh()


def test_2x2x2_with_mixed_precision_and_accumulation():
  strategy = parstrat.Hybrid(data=2, stages=2, model=2, cuts=ODD_CUTS)
  parstrat.testing.check_strategy(
    strategy,
    ODD_STAGE,
    [optax.sgd(0.1)],
    steps=3,
    batch=32,
    features=FEATURES,
    precision="mixed_bfloat16",
    accumulate=2,
    rtol=1e-3,
    atol=1e-3,  # bfloat16: see tests/test_precision_and_accumulation.py
  )


@pytest.mark.parametrize(
  "name",
  [
    "clip + adam under apply_if_finite",
    "MultiSteps of LAMB under apply_if_finite",
    "apply_if_finite of LAMB under MultiSteps",
  ],
)
def test_an_optimizers_cond_with_collectives_is_not_taken_for_a_stage_branch(name):
  # `optax.apply_if_finite` runs the update in a `lax.cond` on one predicate for all
  # devices; XLA puts the norms' all-reduces (over "stage" and "model") inside it. The
  # branch check took it for a per-stage switch and refused the step as a hang:
  # clipping before Adam since the check came in, LAMB (on the model-layout view) since
  # per-leaf optimizers came to the pipeline. The last one nests a cond in MultiSteps'
  # (`.../uniform_switch/cond/branch_0_fun/cond`: helper 67).
  optimizer = {
    "clip + adam under apply_if_finite": optax.apply_if_finite(
      optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)), 3
    ),
    "MultiSteps of LAMB under apply_if_finite": optax.apply_if_finite(
      optax.MultiSteps(optax.lamb(1e-2), every_k_schedule=2), 3
    ),
    "apply_if_finite of LAMB under MultiSteps": optax.MultiSteps(
      optax.apply_if_finite(optax.lamb(1e-2), 3), every_k_schedule=2
    ),
  }[name]
  parstrat.testing.check_strategy(
    parstrat.Hybrid(data=2, stages=2, model=2),
    mlp([16, 16, 10]),
    {name: optimizer},
    steps=3,
    batch=8,
    features=12,
    atol=1e-4,
  )


def test_a_step_with_collectives_inside_stage_branches_is_refused_before_it_runs():
  # Known case: saved residuals under mixed bfloat16 with a model axis. XLA moves
  # collective-permutes into the per-stage branches; run, the step hangs (the CPU
  # backend aborts after about a minute). If a fix removes them, this test fails:
  # then find another layout that puts collectives in branches, or a unit test.
  strategy = parstrat.Hybrid(data=2, stages=2, model=2, cuts=ODD_CUTS, activations="save")
  trainer = strategy(ODD_STAGE, optax.sgd(0.1), precision="mixed_bfloat16")
  images, labels = parstrat.testing.random_batches(1, 16, FEATURES)
  state = trainer.init(jax.random.key(0), images[0][:1])
  with pytest.raises(
    ValueError,
    match=r"would hang: XLA put collectives inside per-stage branches, which only some of "
    r"their devices run: collective-permute \S+ inside a conditional branch spans devices "
    r"\[[\d, ]+\], which differ along \[",  # (it names the collective)
  ):
    trainer.step(state, (images[0], labels[0]))
  # Nothing ran: the state was not donated.
  assert np.isfinite(jax.tree.leaves(trainer.params(state))[0]).all()


@pytest.fixture
def short_locations():
  """JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS=false for one test: XLA's op_names keep
  only the innermost scope ("cond" for ".../uniform_switch/cond")."""
  before = jax.config.jax_include_full_tracebacks_in_locations
  jax.config.update("jax_include_full_tracebacks_in_locations", False)
  try:
    yield
  finally:
    jax.config.update("jax_include_full_tracebacks_in_locations", before)


def _a_uniform_switch():
  """The compiled HLO of a `lax.cond` traced under `UNIFORM_SCOPE`, a program no cache
  holds: JAX's persistent cache keys programs without their debug information, so one
  compiled before with other `op_name`s would be read instead."""
  scale = float(np.random.default_rng().integers(2, 2**24))  # (a constant of its own)

  def f(x):
    with jax.named_scope(hlo_check.UNIFORM_SCOPE):
      return jax.lax.cond(x.sum() > 0, lambda x: x * scale, lambda x: x + 1, x)

  return jax.jit(f).lower(np.ones(3, np.float32)).compile().as_text()


def test_the_full_locations_hold_per_thread_and_over_a_thread_local_setting(short_locations):
  # Thread B enters while the main thread holds the setting on, and lowers after the
  # main thread has left: a process-wide switch would have been turned off under it.
  entered, left, found = threading.Event(), threading.Event(), []

  def thread_b():
    try:
      with hlo_check.scopes_in_op_names():
        entered.set()
        assert left.wait(timeout=60)
        found.append(hlo_check.uniform_switches(_a_uniform_switch()))
    except BaseException as e:  # noqa: BLE001 - raised again in the test's thread
      found.append(e)

  with hlo_check.scopes_in_op_names():
    b = threading.Thread(target=thread_b)
    b.start()
    assert entered.wait(timeout=60)
  left.set()
  b.join(timeout=120)
  assert not b.is_alive()
  if found and isinstance(found[0], BaseException):
    raise found[0]
  assert [len(x) for x in found] == [1]
  # A caller's own thread-local False (JAX's context manager for the setting) is
  # overridden inside, and is what it was after.
  from jax._src import config as jax_config  # noqa: PLC0415 - the thread-local form

  with jax_config.include_full_tracebacks_in_locations(False):
    with hlo_check.scopes_in_op_names():
      assert len(hlo_check.uniform_switches(_a_uniform_switch())) == 1
    assert not jax.config.jax_include_full_tracebacks_in_locations
  assert not jax.config.jax_include_full_tracebacks_in_locations  # (the fixture's global)


def test_a_model_axis_trains_where_jax_keeps_short_locations(short_locations):
  # The setting does hide the scope (two programs: one lowered without the context,
  # one inside it; both new to the compilation caches)...
  assert hlo_check.uniform_switches(_a_uniform_switch()) == set()
  with hlo_check.scopes_in_op_names():
    assert len(hlo_check.uniform_switches(_a_uniform_switch())) == 1
  assert not jax.config.jax_include_full_tracebacks_in_locations  # set back
  # ...yet the step's branch check still tells the exchange's switch from a stage's
  # branch: before, these steps were refused as ones "that would hang". Layer widths
  # of this test's own, so that no other test's compiled step is in the session's
  # compilation cache (conftest.py starts an empty one); the kit's run with no lowering
  # before its first step, then a step lowered first with `trainer.lower`, as "auto"
  # does, whose lowering the step then reuses.
  strategy = parstrat.Hybrid(data=2, stages=2, model=2)
  parstrat.testing.check_strategy(
    strategy, mlp([13, 11, 9, 10]), [optax.sgd(0.1)], steps=2, batch=8, features=5
  )
  trainer = strategy(mlp([15, 11, 9, 10]), optax.sgd(0.1))
  x, y = np.ones((8, 5), np.float32), np.zeros(8, np.int32)
  state = trainer.init(jax.random.key(0), x)
  trainer.lower(state, (x, y)).compile()
  with parstrat_testing._count_compiles() as compiles:
    _, metrics = trainer.step(state, (x, y))
  assert np.isfinite(float(metrics["loss"]))
  assert compiles == []  # the step ran the program trainer.lower compiled
