"""Per-leaf optimizer transforms: exact where the model's leaves are kept, refused on flat ones."""

import dataclasses
import re

import haiku as hk
import jax
import jax.flatten_util
import numpy as np
import optax
import pytest

import parstrat
import parstrat.testing
from parstrat._src import hlo_check
from parstrat._src import testing as parstrat_testing

FEATURES = 12


def _net(x):
  x = jax.nn.relu(hk.Linear(16)(x))
  x = hk.LayerNorm(-1, True, True)(x)
  x = jax.nn.relu(hk.Linear(16)(x))
  return hk.Linear(10)(x)


MODEL = hk.transform(_net)


def _decay_mask(params):
  """Decay weight matrices only: not biases, not LayerNorm's scale and offset."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


def _haiku_name_mask(params):
  """A name-based mask written the Haiku way: needs the model's module names."""
  return hk.data_structures.map(lambda module, name, p: name == "w", params)


MASKED_ADAMW = optax.adamw(1e-2, weight_decay=0.1, mask=_decay_mask)

PER_LEAF = {
  "adamw mask": MASKED_ADAMW,
  "haiku name mask": optax.adamw(1e-2, weight_decay=0.1, mask=_haiku_name_mask),
  "masked": optax.masked(optax.sgd(0.1), _decay_mask),
  "multi_transform": optax.multi_transform(
    {"fast": optax.sgd(0.1), "slow": optax.sgd(0.01)},
    lambda params: jax.tree.map(lambda p: "fast" if p.ndim > 1 else "slow", params),
  ),
  "lamb": optax.lamb(1e-2),
  "lars": optax.lars(1e-2),
  "muon": optax.contrib.muon(1e-2),  # (each matrix orthogonalised, by Newton-Schulz)
  # Per-leaf behaviour that shows only after the first update, or only when
  # the leaves' scales differ (the probe's first versions passed these):
  "multi_transform with warmups from 0": optax.multi_transform(
    {
      "fast": optax.sgd(optax.linear_schedule(0.0, 0.1, 100)),
      "slow": optax.sgd(optax.linear_schedule(0.0, 0.01, 100)),
    },
    lambda params: jax.tree.map(lambda p: "fast" if p.ndim > 1 else "slow", params),
  ),
  # Applies nothing in the probe's first steps: only its state differs.
  "MultiSteps of a decay mask": optax.MultiSteps(MASKED_ADAMW, every_k_schedule=4),
  # A learning rate of 0 for 50 steps: only the masked Adam state differs.
  "masked Adam before a delayed warmup": optax.chain(
    optax.masked(optax.scale_by_adam(), _decay_mask),
    optax.scale_by_learning_rate(optax.linear_schedule(0.0, 1e-3, 100, transition_begin=50)),
  ),
  # MultiSteps wrapped where the probe cannot reach its inner optimizer: nothing moves
  # the params before step 4, past the probe's first 3 (these were let through).
  "MultiSteps of LAMB under apply_if_finite": optax.apply_if_finite(
    optax.MultiSteps(optax.lamb(1e-2), every_k_schedule=4), 3
  ),
  "MultiSteps of LAMB chained after clipping": optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.MultiSteps(optax.lamb(1e-2), every_k_schedule=4).gradient_transformation(),
  ),
  # Clips only leaves whose RMS exceeds 10: none when every value is about 1.
  "block rms clipping": optax.chain(optax.clip_by_block_rms(10.0), optax.sgd(0.1)),
}

ELEMENT_WISE = {
  "sgd": optax.sgd(0.1, momentum=0.9),
  "adam": optax.adam(1e-3),
  "adamw": optax.adamw(1e-3, weight_decay=0.1),
  "clip + sgd": optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)),
  "multisteps": optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2),
  "adamw with a warmup from 0": optax.adamw(optax.linear_schedule(0.0, 1e-3, 100)),
  "lion": optax.lion(1e-3),
  "multisteps under apply_if_finite": optax.apply_if_finite(
    optax.MultiSteps(optax.adam(1e-3), every_k_schedule=5), 3
  ),
  # The probe goes on to its first update: an average of 30 gradients, clipped, where
  # Adam's eps turns rounding into 1e-4 differences (refused, at first).
  "clip + multisteps of adam, k=30": optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.MultiSteps(optax.adam(1e-3), every_k_schedule=30).gradient_transformation(),
  ),
}

FLAT = [parstrat.PipelineModelParallel(stages=2), parstrat.Hybrid(data=2, stages=2, model=2)]

#: The pipelines' layouts, each with a view in the model's layout: one stage per
#: device, two virtual stages per device, data x stage, and data x stage x model
#: (each weight's Megatron slices split over "model", as the step keeps them).
VIEWED = [
  parstrat.PipelineModelParallel(stages=4),  # (the head's 10 biases: whole on every device)
  parstrat.PipelineModelParallel(stages=2, schedule="interleaved_1f1b", virtual_stages=2),
  parstrat.Hybrid(data=2, stages=2, schedule="zb_h1"),
  parstrat.Hybrid(data=2, stages=2, model=2),
]


def _init(strategy, optimizer):
  trainer = strategy(MODEL, optimizer)
  return trainer.init_abstract(jax.random.key(0), np.zeros((1, FEATURES), np.float32))


#: `PER_LEAF`'s optimizers as trained below, where each must act per leaf within the
#: steps trained (so that training on the stage rows would fail the comparison):
#: block RMS clipping at a threshold these gradients exceed, the delayed warmup
#: starting at step 1; the `MultiSteps` ones train 5 steps (an update at the 4th).
TRAINED = {
  **PER_LEAF,
  "block rms clipping": optax.chain(optax.clip_by_block_rms(0.01), optax.sgd(0.1)),
  "masked Adam before a delayed warmup": optax.chain(
    optax.masked(optax.scale_by_adam(), _decay_mask),
    optax.scale_by_learning_rate(optax.linear_schedule(0.0, 1e-2, 4, transition_begin=1)),
  ),
}


@pytest.mark.parametrize("name", sorted(TRAINED))
def test_per_leaf_transforms_train_like_jit_on_the_model_layout(name):
  # Each optimizer once, the four layouts in turn: the optimizer runs on the
  # model's leaves (the plan's view), its state kept there, sharded over "stage".
  strategy = VIEWED[sorted(TRAINED).index(name) % len(VIEWED)]
  steps = 5 if "MultiSteps" in name else 3
  parstrat.testing.check_strategy(
    strategy, MODEL, {name: TRAINED[name]}, steps=steps, batch=8, features=FEATURES, atol=1e-4
  )


@dataclasses.dataclass(frozen=True, kw_only=True)
class _OwnLayout(parstrat.DataParallel):
  """Data parallelism storing the params in a layout of its own: one vector, scaled."""

  scale_back: float = 2.0

  def make_plan(self, model, loss_fn, mesh, sample_params, sample_inputs):
    plan = super().make_plan(model, loss_fn, mesh, sample_params, sample_inputs)
    zeros = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), sample_params)
    unravel = jax.flatten_util.ravel_pytree(zeros)[1]
    return dataclasses.replace(
      plan,
      to_stored=lambda p: 2.0 * jax.flatten_util.ravel_pytree(p)[0],
      to_params=lambda s: unravel(s / self.scale_back),
    )


def test_a_layout_of_ones_own_is_named_as_such_and_must_round_trip():
  # A custom plan's layout got the pipeline's message ("each pipeline stage's ... flat
  # buffer"), and one whose to_params did not undo to_stored a misleading one.
  # (naming the strategy and the difference the probe found)
  with pytest.raises(
    ValueError,
    match=r"^_OwnLayout\(.*\) stores the parameters in a layout of its own \(its plan's "
    r"to_stored\), not the model's, and the optimizer does not act leaf by leaf \(its update "
    r"1 on the flat layout differs from the one on the model's layout\)",
  ):
    _init(_OwnLayout(data=2), PER_LEAF["lamb"])
  with pytest.raises(
    ValueError,
    match=r"to_params\(to_stored\(params\)\) changes params\['layer_norm'\]\['offset'\]; the",
  ):
    _init(_OwnLayout(data=2, scale_back=3.0), optax.sgd(0.1))


def test_the_haiku_name_mask_failure_is_reported():
  with pytest.raises(ValueError, match="on the flat layout it fails: "):
    _init(_OwnLayout(data=2), PER_LEAF["haiku name mask"])


@pytest.mark.parametrize("strategy", FLAT, ids=repr)
@pytest.mark.parametrize("name", sorted(ELEMENT_WISE))
def test_element_wise_optimizers_pass_the_probe(strategy, name):
  # They run on the stage buffers themselves: no view, no moves.
  trainer = strategy(MODEL, ELEMENT_WISE[name])
  state = trainer.init_abstract(jax.random.key(0), np.zeros((1, FEATURES), np.float32))
  assert trainer.plan.optimizer_view is None
  assert jax.tree.structure(state.opt_state) == jax.tree.structure(
    jax.eval_shape(ELEMENT_WISE[name].init, state.params)
  )


def _per_device_elements(tree):
  """Elements one device holds of `tree`'s arrays (from their shardings)."""
  return sum(
    int(np.prod(x.sharding.shard_shape(x.shape)))
    for x in jax.tree.leaves(tree)
    if hasattr(x, "sharding")
  )


@pytest.mark.parametrize("strategy", VIEWED, ids=repr)
def test_a_per_leaf_optimizer_state_is_in_the_model_layout_sharded_over_stage(strategy):
  trainer = strategy(MODEL, MASKED_ADAMW)
  state = trainer.init(jax.random.key(0), np.zeros((1, FEATURES), np.float32))
  assert trainer.plan.optimizer_view is not None
  params = trainer.params(state)
  adam = state.opt_state[0]
  assert jax.tree.structure(adam.mu) == jax.tree.structure(params)
  stages = trainer.mesh.shape["stage"]
  for (path, mu), param in zip(
    jax.tree_util.tree_leaves_with_path(adam.mu), jax.tree.leaves(params), strict=True
  ):
    assert mu.shape == param.shape, path
    spec = tuple(mu.sharding.spec)
    # Split over "stage" along the largest dimension it divides, or whole where none
    # does; with a "model" axis, of the Megatron slice each device holds.
    local = list(param.shape)
    for d, entry in enumerate(spec):
      if entry == "model" or (isinstance(entry, tuple) and "model" in entry):
        local[d] //= trainer.mesh.shape["model"]
    if any(n % stages == 0 for n in local):
      largest = max((n, -d) for d, n in enumerate(local) if n % stages == 0)
      assert "stage" in jax.tree.leaves(spec[-largest[1]]), (path, spec)
      assert mu.addressable_shards[0].data.size == np.prod(local) // stages, path
    else:
      assert "stage" not in jax.tree.leaves(list(spec)), (path, spec)
  if dict(trainer.mesh.shape).get("model", 1) > 1:  # the Megatron pair's split leaves:
    # linear_1's weight and bias (by output features), linear_2's weight (by input ones)
    specs = [jax.tree.leaves(list(x.sharding.spec)) for x in jax.tree.leaves(adam.mu)]
    assert sum("model" in spec for spec in specs) == 3, specs
  # Each device holds about 1/stages of the moments (whole: 10 biases of the head).
  whole = sum(x.size for x in jax.tree.leaves(params))
  assert _per_device_elements(adam.mu) <= whole // stages + 10


def test_a_per_leaf_optimizer_state_moves_between_pipelines_and_data_parallel(tmp_path):
  # Saved from data parallelism, restored under each pipeline layout (its state in
  # the model's layout, as exported), trained on: the losses of the uninterrupted
  # run. Then saved from the pipeline and restored under data parallelism.
  from parstrat.checkpoint import Checkpointer  # noqa: PLC0415

  images, labels = parstrat.testing.random_batches(7, 8, features=FEATURES)
  trainer = parstrat.DataParallel(data=2)(MODEL, MASKED_ADAMW)
  state = trainer.init(jax.random.key(0), images[0][:1])
  for i in range(3):
    state, _ = trainer.step(state, (images[i], labels[i]))
  with Checkpointer(tmp_path / "dp") as ckpt:
    assert ckpt.save(trainer, state, {}, force=True)
  expected = []
  for i in range(3, 7):
    state, metrics = trainer.step(state, (images[i], labels[i]))
    expected.append(float(metrics["loss"]))
  for strategy in (VIEWED[0], VIEWED[3]):  # (one stage per device; data x stage x model)
    other = strategy(MODEL, MASKED_ADAMW)
    restored = other.init(jax.random.key(1), images[0][:1])
    with Checkpointer(tmp_path / "dp") as ckpt:
      restored, _ = ckpt.restore(other)
    losses = []
    for i in range(3, 5):
      restored, metrics = other.step(restored, (images[i], labels[i]))
      losses.append(float(metrics["loss"]))
    with Checkpointer(tmp_path / repr(strategy)) as ckpt:
      assert ckpt.save(other, restored, {}, force=True)
    back = trainer.init(jax.random.key(2), images[0][:1])
    with Checkpointer(tmp_path / repr(strategy)) as ckpt:
      back, _ = ckpt.restore(trainer)
    for i in range(5, 7):
      back, metrics = trainer.step(back, (images[i], labels[i]))
      losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, expected, rtol=1e-5, err_msg=repr(strategy))


@pytest.mark.parametrize(
  "strategy",
  [parstrat.DataParallel(data=2), parstrat.FSDP(data=2), parstrat.TensorParallel(model=2)],
  ids=repr,
)
def test_a_decay_mask_sees_the_model_layout_and_matches_jit(strategy):
  # A mask that excludes biases and LayerNorm: these layouts keep the model's
  # leaves, so it acts exactly as on one device.
  parstrat.testing.check_strategy(
    strategy, MODEL, [MASKED_ADAMW], steps=3, batch=8, features=FEATURES, atol=1e-4
  )


# Optimizer states that are not one copy of the params per leaf: multi_transform's
# inner states hold `optax.MaskedNode`s for the leaves of other labels, and
# adafactor's per-leaf moments have other shapes than their leaf (row and column
# factors, or a (1,) placeholder). Each once crashed these layouts at `init`.
OTHER_STATE_SHAPES = {
  "multi_transform sgd / adam": optax.multi_transform(
    {"weights": optax.sgd(0.1), "rest": optax.adam(1e-2)},
    lambda params: jax.tree.map(lambda p: "weights" if p.ndim > 1 else "rest", params),
  ),
  "adafactor, factored from 8": optax.adafactor(1e-2, min_dim_size_to_factor=8),
}


def test_optimizer_state_mirroring_a_param_is_sharded_like_it_whatever_the_label_function():
  # Labels read through Haiku's own mapping failed `init` under every strategy: optax's
  # stand-in for the params, which finds the state leaves that mirror a param, cannot
  # be iterated. They are matched by path (and shape) instead.
  by_name = optax.multi_transform(
    {"w": optax.adam(1e-2), "b": optax.sgd(0.1)},
    lambda params: hk.data_structures.map(lambda m, name, v: "w" if name == "w" else "b", params),
  )
  parstrat.testing.check_strategy(
    parstrat.TensorParallel(model=2), MODEL, [by_name], steps=2, batch=8, features=FEATURES
  )
  trainer = parstrat.FSDP(data=2)(MODEL, by_name)
  state = trainer.init_abstract(jax.random.key(0), np.zeros((1, FEATURES), np.float32))
  adam = state.opt_state.inner_states["w"].inner_state[0]
  weights = {module: leaves["w"] for module, leaves in state.params.items() if "w" in leaves}
  assert len(weights) == 3
  for module, weight in weights.items():
    assert adam.mu[module]["w"].sharding == weight.sharding
    assert weight.sharding.spec != jax.sharding.PartitionSpec()  # (split: a real test)


@pytest.mark.parametrize(
  "strategy",
  [
    parstrat.DataParallel(data=2),
    parstrat.FSDP(data=2),
    parstrat.FSDP(data=4, zero=1),
    parstrat.TensorParallel(model=2),
    VIEWED[0],  # on the pipeline's view
    VIEWED[3],  # with a "model" axis
  ],
  ids=repr,
)
@pytest.mark.parametrize("name", sorted(OTHER_STATE_SHAPES))
def test_optimizer_states_of_other_shapes_train_like_jit(strategy, name):
  parstrat.testing.check_strategy(
    strategy, MODEL, [OTHER_STATE_SHAPES[name]], steps=3, batch=8, features=FEATURES, atol=1e-4
  )


def test_the_probe_compiles_the_same_few_programs_however_many_leaves():
  # Each function of the probe is compiled once per layout. Run eagerly, the
  # updates' application and the re-layouts compiled each operation apart, per
  # leaf shape: 60 to 140 small programs per pipeline `init` of an 8-layer MLP.
  # (`init_abstract` compiles nothing but the probe, and the first time the few
  # operations on the key and the sample every init runs: the uncounted first model.)
  counts = []
  x = np.zeros((1, FEATURES), np.float32)
  for widths in ([12, 10], [30, 28, 26, 24, 22, 20, 18, 10], [16, 10]):
    model = hk.transform(lambda x, widths=widths: hk.nets.MLP(widths)(x))
    trainer = parstrat.PipelineModelParallel(stages=2)(model, optax.adam(1e-3))
    with parstrat_testing._count_compiles() as compiles:
      trainer.init_abstract(jax.random.key(0), x)
    counts.append(len(compiles))
  assert counts[1] == counts[2] <= 10, counts


def test_the_probe_runs_once_per_optimizer_and_layout(monkeypatch):
  # Trainers of one layout given the same optimizer object ("auto"'s candidates, a
  # trainer built again) reuse the answer: about 0.5-1 s of each pipeline `init`.
  from parstrat._src import optimizer_probe  # noqa: PLC0415

  probed = []
  real = optimizer_probe._probe
  monkeypatch.setattr(optimizer_probe, "_probe", lambda *a: probed.append(a[1]) or real(*a))
  optimizer = optax.adamw(1e-2, weight_decay=0.1, mask=_decay_mask)
  for strategy in [parstrat.PipelineModelParallel(stages=2)] * 2 + [
    parstrat.PipelineModelParallel(stages=4)
  ] * 2:
    trainer = strategy(MODEL, optimizer)
    trainer.init_abstract(jax.random.key(0), np.zeros((1, FEATURES), np.float32))
    assert trainer.plan.optimizer_view is not None  # (the answer, probed or remembered)
  assert len(probed) == 2
  other = optax.adamw(1e-2, weight_decay=0.1, mask=_decay_mask)  # another object: probed
  parstrat.PipelineModelParallel(stages=2)(MODEL, other).init_abstract(
    jax.random.key(0), np.zeros((1, FEATURES), np.float32)
  )
  assert len(probed) == 3


#: Reads the loss (`update(..., value=loss)`): halves the scale whenever a step's loss
#: does not improve on the best so far (patience 0).
ON_PLATEAU = optax.chain(
  optax.sgd(0.5),
  optax.contrib.reduce_on_plateau(patience=0, factor=0.5, cooldown=0, accumulation_size=1),
)


@pytest.mark.parametrize(
  "strategy",
  [parstrat.DataParallel(data=2), parstrat.FSDP(data=2), parstrat.PipelineModelParallel(stages=2)],
  ids=repr,
)
def test_an_optimizer_that_reads_the_loss_gets_it_and_trains_like_jit(strategy):
  # reduce_on_plateau failed under every strategy: "missing ... argument: 'value'".
  parstrat.testing.check_strategy(
    strategy, MODEL, {"reduce_on_plateau": ON_PLATEAU}, steps=6, batch=8, features=FEATURES
  )
  images, labels = parstrat.testing.random_batches(6, 8, features=FEATURES)
  trainer = strategy(MODEL, ON_PLATEAU)
  state = trainer.init(jax.random.key(0), images[0][:1])
  for x, y in zip(images, labels, strict=True):
    state, _ = trainer.step(state, (x, y))
  assert float(state.opt_state[1].scale) < 1.0  # (it acted: the comparison means something)


def _loss_scaled_sgd(learning_rate):
  """A transform of one's own that takes `value` and no other extra argument."""

  def update(updates, state, params=None, *, value):
    return jax.tree.map(lambda g: -learning_rate * value * g, updates), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


@pytest.mark.parametrize(
  "name",
  ["sam after clipping", "MultiSteps of reduce_on_plateau", "value alone, after clipping"],
)
def test_optimizers_with_extra_arguments_get_the_loss_only_where_they_take_it(name):
  # SAM's update takes no `value` (a chain passes extra arguments to it anyway): it
  # trains as it did before optimizers got the loss. MultiSteps forwards `value` to
  # its inner optimizer, which reads it (helper 68). A transform taking `value` but
  # not `grad` and `value_fn` still gets `value` (helper 70).
  optimizer = {
    "sam after clipping": optax.chain(
      optax.clip(1.0), optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.05))
    ),
    "MultiSteps of reduce_on_plateau": optax.MultiSteps(ON_PLATEAU, every_k_schedule=2),
    "value alone, after clipping": optax.chain(
      optax.clip_by_global_norm(1.0), _loss_scaled_sgd(0.1)
    ),
  }[name]
  parstrat.testing.check_strategy(
    parstrat.DataParallel(data=2), MODEL, {name: optimizer}, steps=6, batch=8, features=FEATURES
  )


def test_an_update_that_fails_with_and_without_the_loss_shows_both_errors():
  # A chain whose SAM refuses the extra arguments and whose reduce_on_plateau needs
  # `value`: the retries without them fail too, and the error names the first refusal
  # as its cause (helper 69). A refusal from inside an update that names `value`
  # itself is that update's own error: raised, not retried (helper 71).
  from parstrat._src import optimizers  # noqa: PLC0415

  params = {"w": np.ones(2, np.float32)}
  sam = optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.05))
  both = optax.chain(sam, optax.contrib.reduce_on_plateau())
  with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'value'") as e:
    optimizers.update(both, params, both.init(params), params, 1.0)
  assert "unexpected keyword argument 'value'" in str(e.value.__cause__)

  inner = optax.chain(optax.clip(1.0), sam)

  def update(updates, state, params=None, *, value):
    return inner.update(updates, state, params, value=value)

  named = optax.GradientTransformationExtraArgs(inner.init, update)
  with pytest.raises(TypeError, match="unexpected keyword argument 'value'") as e:
    optimizers.update(named, params, named.init(params), params, 1.0)
  assert e.value.__cause__ is None


#: Line searches: they evaluate the loss (and its gradient) at trial params, through
#: `value_fn`. Backtracking from a learning rate these gradients overshoot must
#: shrink it; the masked decay before it makes the pipelines run it on their view.
_BACKTRACKING = optax.scale_by_backtracking_linesearch(max_backtracking_steps=30)
LINE_SEARCHES = {
  "lbfgs": optax.lbfgs(),
  "backtracking sgd": optax.chain(optax.sgd(1e3), _BACKTRACKING),
  "masked decay, then backtracking sgd": optax.chain(
    optax.add_decayed_weights(1e-2, mask=_decay_mask), optax.sgd(1e3), _BACKTRACKING
  ),
}


@pytest.mark.parametrize(
  ("strategy", "name"),
  [
    (parstrat.DataParallel(data=2), "lbfgs"),
    (parstrat.FSDP(data=2), "backtracking sgd"),
    (parstrat.PipelineModelParallel(stages=2, schedule="zb_h1"), "lbfgs"),
    (parstrat.Hybrid(data=2, stages=2, model=2), "backtracking sgd"),
    (parstrat.PipelineModelParallel(stages=2), "masked decay, then backtracking sgd"),
  ],
  ids=repr,
)
def test_line_searches_get_the_strategys_loss_function_and_train_like_jit(strategy, name):
  # optax.lbfgs failed under every strategy: its line search needs `grad` and
  # `value_fn`, and optax's `tree_map_params` cannot run its `init` (IndexError).
  optimizer = LINE_SEARCHES[name]
  parstrat.testing.check_strategy(
    strategy, MODEL, {name: optimizer}, steps=3, batch=8, features=FEATURES
  )
  images, labels = parstrat.testing.random_batches(1, 8, features=FEATURES)
  trainer = strategy(MODEL, optimizer)
  state = trainer.init(jax.random.key(0), images[0][:1])
  state, _ = trainer.step(state, (images[0], labels[0]))
  search = state.opt_state[-1]  # (it searched: the comparison means something)
  if name != "lbfgs":
    assert float(search.learning_rate) < 1e-2
  else:  # the zoom search keeps the loss and gradient it found at the new params:
    # the batch's, as the next step computes them (the gradient through `value_fn`)
    _, metrics = trainer.step(state, (images[0], labels[0]))
    np.testing.assert_allclose(search.value, metrics["loss"], rtol=1e-5)
    np.testing.assert_allclose(optax.tree.norm(search.grad), metrics["grad_norm"], rtol=1e-4)
  assert (trainer.plan.optimizer_view is not None) == name.startswith("masked decay")
  if isinstance(strategy, parstrat.Hybrid):  # the stage switches the search runs are
    # checked for collectives, not taken for uniform ones (helper 71)
    text = trainer.lower(state, (images[0], labels[0])).compile().as_text()
    assert _stage_switches_in_the_optimizer(text)
    assert _stage_switches_in_the_optimizer(text).isdisjoint(hlo_check.uniform_switches(text))


def _stage_switches_in_the_optimizer(text):
  """Conditionals in a `shard_map` under the optimizer's uniform scope, with no mark of
  their own inside it: a line search's runs of the pipeline's stage switch."""
  names = set()
  for line in text.splitlines():
    op_name = re.search(r'op_name="([^"]*)"', line)
    if " conditional(" not in line or not op_name or "uniform_switch/" not in op_name[1]:
      continue
    if "shard_map/" in op_name[1].split("uniform_switch/")[-1]:
      names.add(re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)[1])
  return names


@pytest.mark.parametrize("linesearch", [True, False])
def test_a_line_search_state_is_sharded_like_the_params(linesearch):
  # lbfgs keeps its last updates stacked, [memory, *param.shape]: split like the param,
  # also without a line search, whose state optax's `tree_map_params` reads (helper 70).
  optimizer = optax.lbfgs(memory_size=3, **({} if linesearch else {"linesearch": None}))
  trainer = parstrat.FSDP(data=2, replicate_below=0)(MODEL, optimizer)
  state = trainer.init(jax.random.key(0), np.zeros((1, FEATURES), np.float32))
  params = trainer.params(state)
  memory = state.opt_state[0].diff_params_memory
  for (path, param), kept in zip(
    jax.tree_util.tree_leaves_with_path(state.params), jax.tree.leaves(memory), strict=True
  ):
    assert kept.shape == (3, *param.shape), path
    assert kept.sharding.spec == jax.sharding.PartitionSpec(None, *param.sharding.spec), path
  assert jax.tree.structure(params) == jax.tree.structure(memory)


def test_a_line_search_state_moves_between_a_pipeline_and_data_parallel():
  # lbfgs's stacked memory is exported in the model's layout (one param-like tree
  # per remembered step) and imported into the pipeline's rows: the losses of the
  # uninterrupted run. (Without a line search: the memory is what moves.)
  images, labels = parstrat.testing.random_batches(6, 8, features=FEATURES)
  optimizer = optax.lbfgs(0.1, memory_size=3, linesearch=None)  # (its memory is the point)
  trainer = parstrat.DataParallel(data=2)(MODEL, optimizer)
  state = trainer.init(jax.random.key(0), images[0][:1])
  losses = []
  for i in range(6):
    if i == 2:
      exported = trainer.export_state(state)
    state, metrics = trainer.step(state, (images[i], labels[i]))
    losses.append(float(metrics["loss"]))
  pipeline = parstrat.PipelineModelParallel(stages=2)(MODEL, optimizer)
  pipeline.init(jax.random.key(1), images[0][:1])
  moved = pipeline.import_state(exported)
  assert pipeline.plan.optimizer_view is None  # (its sums need no view: on the rows)
  rows = moved.params.shape
  assert moved.opt_state[0].diff_params_memory.shape == (3, *rows)
  got = []
  for i in range(2, 4):
    moved, metrics = pipeline.step(moved, (images[i], labels[i]))
    got.append(float(metrics["loss"]))
  back = trainer.import_state(pipeline.export_state(moved))
  for i in range(4, 6):
    back, metrics = trainer.step(back, (images[i], labels[i]))
    got.append(float(metrics["loss"]))
  np.testing.assert_allclose(got, losses[2:], rtol=1e-5)
