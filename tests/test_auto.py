"""The "auto" strategy: measured memory, a documented cost model, a clear refusal."""

import dataclasses
import re
import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import parstrat
from parstrat._src import auto as auto_lib
from parstrat._src.sharded_params import global_plan
from parstrat.testing import ADAM_PARAM_ATOL
from parstrat.testing import random_batches
from parstrat.testing import reference_run

FEATURES = 64
BATCH = 256
CANDIDATES = ("data_parallel", "fsdp", "tensor", "pipeline")


def wide_mlp() -> hk.Transformed:
  # Four linear layers: a batch of 256 over a width of 256 makes tensor
  # parallelism's activation all-reduces cost more than the gradients' one.
  return hk.transform(lambda x: hk.nets.MLP([256, 256, 256, 10], activation=jax.nn.swish)(x))


@pytest.fixture(scope="module")
def measured():
  strategy = parstrat.Auto(devices=jax.devices()[:4], candidates=CANDIDATES, verbose=False)
  inputs = np.zeros((BATCH, FEATURES), np.float32)
  return strategy.measure(wide_mlp(), optax.adam(1e-3), inputs)


def by_label(candidates):
  return {c.label: c for c in candidates}


def test_measures_every_candidate_on_every_mesh_shape(measured):
  labels = sorted(c.label for c in measured)
  assert labels == [
    "data_parallel [data=4]",
    "fsdp zero=1 [data=4]",
    "fsdp zero=2 [data=4]",
    "fsdp zero=3 [data=4]",
    "pipeline [stage=4]",
    "pipeline activations=dots_saveable [stage=4]",
    "pipeline activations=save [stage=4]",
    "tensor [model=4]",
  ]
  for c in measured:
    assert c.peak_bytes > c.state_bytes > 0, c
    assert c.time_s == pytest.approx(c.compute_s + c.comm_s + c.latency_s)


def test_memory_comes_from_the_layouts(measured):
  c = by_label(measured)
  dp, zero3 = c["data_parallel [data=4]"], c["fsdp zero=3 [data=4]"]
  zero1 = c["fsdp zero=1 [data=4]"]
  # Adam: params + mu + nu. ZeRO-3 shards all three, ZeRO-1 only mu and nu.
  assert zero3.state_bytes < 0.3 * dp.state_bytes
  assert zero3.state_bytes < zero1.state_bytes < dp.state_bytes
  assert zero3.peak_bytes < dp.peak_bytes


def test_cost_model_terms_follow_the_documented_formulas(measured):
  c = by_label(measured)
  stats_bytes = c["data_parallel [data=4]"].comm_bytes / (2 * 3 / 4)  # all-reduce of grads
  params = sum(
    int(np.prod(x.shape)) * 4
    for x in jax.tree.leaves(
      jax.eval_shape(wide_mlp().init, jax.random.key(0), np.zeros((1, FEATURES), np.float32))
    )
  )
  assert stats_bytes == pytest.approx(params)
  assert c["fsdp zero=3 [data=4]"].comm_bytes == pytest.approx(3 * 3 / 4 * params)
  assert c["fsdp zero=2 [data=4]"].comm_bytes == pytest.approx(2 * 3 / 4 * params)
  # The pipeline pays a bubble of (M + P - 1) / M with M = P = 4, and 1F1B's
  # recomputed forwards, on a quarter of the work.
  dp, pipe = c["data_parallel [data=4]"], c["pipeline [stage=4]"]
  assert pipe.compute_s == pytest.approx(dp.compute_s * 7 / 4 * 4 / 3)
  # "save" reruns no forward, "dots_saveable" its element-wise work (MLP: the biases and
  # the swish between the matmuls).
  assert c["pipeline activations=save [stage=4]"].compute_s == pytest.approx(dp.compute_s * 7 / 4)
  stats = auto_lib.ModelStats.of(
    wide_mlp(),
    jax.eval_shape(wide_mlp().init, jax.random.key(0), np.zeros((1, FEATURES), np.float32)),
    np.zeros((BATCH, FEATURES), np.float32),
  )
  matmuls = 2 * (FEATURES * 256 + 256 * 256 * 2 + 256 * 10)
  assert stats.dot_flops_per_example == matmuls
  # Each of the 3 layer boundaries passes 256 features on; the pipeline sends them on
  # and their gradient back, once per example.
  assert stats.boundary_widths == (256, 256, 256)
  assert pipe.comm_bytes == pytest.approx(2 * BATCH * 256 * 4)
  elementwise = 1 - matmuls / stats.flops_per_example
  dots = c["pipeline activations=dots_saveable [stage=4]"]
  assert dots.compute_s == pytest.approx(dp.compute_s * 7 / 4 * (1 + elementwise / 3))


def test_a_pipeline_keeps_its_activations_where_memory_allows(measured):
  # Three activation policies are measured: the more a stage keeps of its forward (in
  # the compiled step's memory), the less its backward reruns, so "auto" keeps as much
  # as the budget allows.
  c = by_label(measured)
  policies = [
    c["pipeline [stage=4]"],
    c["pipeline activations=dots_saveable [stage=4]"],
    c["pipeline activations=save [stage=4]"],
  ]
  recompute, dots, save = policies
  assert recompute.peak_bytes < dots.peak_bytes < save.peak_bytes
  assert recompute.time_s > dots.time_s > save.time_s
  for budget, chosen in ((None, "save"), (dots.peak_bytes, "dots_saveable")):
    assert auto_lib.rank(policies, budget).strategy.activations == chosen
  tight = auto_lib.rank(policies, recompute.peak_bytes)
  assert tight.strategy.activations == "recompute"
  assert "pipeline activations=save [stage=4]" in str(tight) and "over budget" in str(tight)


def test_chooses_data_parallel_when_everything_fits(measured):
  choice = auto_lib.rank(measured, None)
  assert type(choice.strategy) is parstrat.DataParallel
  assert choice.strategy.data == 4
  text = str(choice)
  assert "chose data_parallel [data=4]" in text
  for c in measured:
    assert c.label in text


def test_a_shrinking_budget_moves_the_choice_to_sharded_layouts(measured):
  c = by_label(measured)
  dp = c["data_parallel [data=4]"]
  choice = auto_lib.rank(measured, dp.peak_bytes - 1)
  assert type(choice.strategy) in (parstrat.FSDP, parstrat.PipelineModelParallel)
  assert "over budget" in str(choice)
  smallest = min(measured, key=lambda x: x.peak_bytes)
  choice = auto_lib.rank(measured, smallest.peak_bytes)
  assert choice.strategy == smallest.strategy
  assert smallest.label.startswith(("fsdp", "pipeline"))


def test_refuses_clearly_when_nothing_fits(measured):
  smallest = min(measured, key=lambda x: x.peak_bytes)
  with pytest.raises(ValueError, match=r"No strategy fits memory_budget=1000 ") as e:
    auto_lib.rank(measured, 1000)
  assert smallest.label in str(e.value)
  assert "data_parallel [data=4]" in str(e.value)  # the table comes with the refusal


def test_the_choice_is_deterministic(measured):
  shuffled = list(reversed(measured))
  assert str(auto_lib.rank(shuffled, None)) == str(auto_lib.rank(measured, None))
  again = parstrat.Auto(
    devices=jax.devices()[:4], candidates=("data_parallel",), verbose=False
  ).measure(wide_mlp(), optax.adam(1e-3), np.zeros((BATCH, FEATURES), np.float32))
  first = by_label(measured)
  for c in again:
    assert (c.peak_bytes, c.state_bytes, c.time_s) == (
      first[c.label].peak_bytes,
      first[c.label].state_bytes,
      first[c.label].time_s,
    )


def test_trainer_runs_the_choice_and_matches_single_device_jit(measured, capsys):
  model = wide_mlp()
  images, labels = random_batches(20, BATCH, FEATURES)
  budget = by_label(measured)["data_parallel [data=4]"].peak_bytes - 1
  strategy = parstrat.get(
    "auto", memory_budget=budget, devices=jax.devices()[:4], candidates=("data_parallel", "fsdp")
  )
  trainer = strategy(model, optax.adam(1e-3))  # the optimizer `measured` was taken with
  assert trainer.mesh is None and "chosen at init" in repr(trainer)
  state = trainer.init(jax.random.key(0), images[0])
  printed = capsys.readouterr().out
  assert "chose fsdp" in printed and "data_parallel [data=4]" in printed
  assert type(trainer.strategy) is parstrat.FSDP
  assert dict(trainer.mesh.shape) == {"data": 4}
  assert trainer.choice.strategy is trainer.strategy
  losses = []
  for x, y in zip(images, labels, strict=True):
    state, metrics = trainer.step(state, (x, y))
    losses.append(float(metrics["loss"]))
  params0 = jax.jit(model.init)(jax.random.key(0), images[0][:1])
  ref_losses, ref_params = reference_run(model, optax.adam(1e-3), images, labels, params0)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=ADAM_PARAM_ATOL),
    trainer.params(state),
    ref_params,
  )


def test_a_custom_strategy_takes_part_by_declaring_its_axes(measured):
  @parstrat.register("test_auto_custom_dp")
  @dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
  class CustomDataParallel(parstrat.DataParallel):
    """DataParallel under another name; its `data` field takes the axis size."""

  try:
    choice = parstrat.Auto(
      devices=jax.devices()[:2], candidates=("test_auto_custom_dp",), verbose=False
    ).choose(wide_mlp(), optax.sgd(0.1), np.zeros((32, FEATURES), np.float32))
  finally:
    parstrat.unregister("test_auto_custom_dp")
  assert type(choice.strategy) is CustomDataParallel
  assert choice.strategy.data == 2


def test_candidates_that_cannot_run_are_listed_with_the_reason(measured):
  shallow = hk.transform(lambda x: hk.nets.MLP([16, 10])(x))
  measured_shallow = parstrat.Auto(
    devices=jax.devices()[:4], candidates=("pipeline",), verbose=False
  ).measure(shallow, optax.sgd(0.1), np.zeros((8, 4), np.float32))
  assert len(measured_shallow) == 3  # under each of the three activation policies
  for only in measured_shallow:
    assert only.peak_bytes is None
    assert "stages=4 exceeds the model's 2 layers" in only.problem
  # The table says the refusal once, in full; the rows after it point at it, also
  # where the refusal names each candidate's strategy (its activation policy).
  rows = auto_lib.format_table(measured_shallow, None, "").splitlines()[2:5]
  assert "stages=4 exceeds the model's 2 layers" in rows[0]
  assert [row.split()[-3:] for row in rows[1:]] == [["same", "as", "#1"]] * 2
  dropout = hk.transform(lambda x: hk.Linear(10)(hk.dropout(hk.next_rng_key(), 0.5, x)))
  refused = parstrat.Auto(
    devices=jax.devices()[:4], candidates=("pipeline", "hybrid"), verbose=False
  ).measure(dropout, optax.sgd(0.1), np.zeros((8, 4), np.float32))
  rows = auto_lib.format_table(refused, None, "").splitlines()[2:-1]
  assert [row.split()[1] for row in rows[:4]] == ["pipeline"] * 3 + ["hybrid"]
  assert "cannot train a model that calls hk.next_rng_key()" in rows[0]
  assert [row.split()[-3:] for row in rows[1:3]] == [["same", "as", "#1"]] * 2
  assert "Hybrid(" in rows[3] and "cannot train a model that calls" in rows[3]  # (its own)
  assert {tuple(row.split()[-3:]) for row in rows[4:]} == {("same", "as", "#4")}
  with pytest.raises(ValueError, match="^No candidate strategy can run this model: no candidate "
                     "could be built .*stages=4 exceeds"):  # fmt: skip
    auto_lib.rank(measured_shallow, None)


@pytest.mark.parametrize(
  ("text", "expected"),
  [("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1.5 GiB", int(1.5 * 2**30)), (4096, 4096),
   (1e6, 10**6), (np.float32(1e6), 10**6)],
)  # fmt: skip
def test_parses_memory_budgets(text, expected):
  assert auto_lib.parse_bytes(text) == expected


@pytest.mark.parametrize(
  "bad", ["lots", "12 parsecs", -5, 0, "0MiB", 0.5, float("inf"), float("nan")]
)
def test_rejects_bad_budgets_naming_them(bad):
  # (0.5 became 0 bytes, read as "no limit"; inf and NaN failed converting to int)
  with pytest.raises(ValueError, match=re.escape(f"got {bad!r}")):
    parstrat.get("auto", memory_budget=bad)


def test_auto_has_no_mesh_of_its_own():
  with pytest.raises(ValueError, match="chooses its mesh when the trainer is initialised"):
    parstrat.Auto().make_mesh()
  with pytest.raises(ValueError, match="'auto' cannot be its own candidate"):
    parstrat.Auto(candidates=("auto",))
  with pytest.raises(KeyError, match="Unknown strategy 'fdsp'"):
    parstrat.Auto(candidates=("fdsp",))
  # A NumPy integer batch size is an integer (it was refused as "not a positive integer").
  assert parstrat.get("auto", batch_size=np.int64(32)).batch_size == 32
  with pytest.raises(ValueError, match=r"batch_size must be a positive integer, got 2\.0"):
    parstrat.get("auto", batch_size=2.0)


def test_only_paired_layers_divide_over_model_and_reductions_scale_the_data_traffic():
  cost = parstrat.CostModel()
  unpaired = auto_lib.ModelStats(
    param_bytes=4000, flops_per_example=1000, boundary_widths=(), tensor_pairs=()
  )
  tensor = cost.estimate(parstrat.TensorParallel(model=8), {"model": 8}, unpaired, batch=64)
  # Nothing to split: every device computes the whole batch, with nothing to all-reduce.
  assert tensor["compute_s"] == pytest.approx(3 * 1000 * 64 / cost.flops_per_second)
  assert tensor["comm_bytes"] == 0
  paired = dataclasses.replace(unpaired, tensor_pairs=((0, 10),), tensor_split_flops=800)
  tensor = cost.estimate(parstrat.TensorParallel(model=8), {"model": 8}, paired, batch=64)
  assert tensor["compute_s"] == pytest.approx(3 * (200 + 800 / 8) * 64 / cost.flops_per_second)
  dp = parstrat.DataParallel(data=8)
  once = cost.estimate(dp, {"data": 8}, unpaired, batch=64)
  four = cost.estimate(dp, {"data": 8}, unpaired, batch=64, reductions=4)
  assert once["comm_bytes"] > 0
  assert four["comm_bytes"] == pytest.approx(4 * once["comm_bytes"])


def test_a_per_leaf_optimizer_costs_a_pipeline_three_all_to_alls_of_its_params():
  cost = parstrat.CostModel()
  stats = auto_lib.ModelStats(
    param_bytes=4000, flops_per_example=1000, boundary_widths=(8,), tensor_pairs=()
  )
  pipeline = parstrat.PipelineModelParallel(stages=4)
  rows = cost.estimate(pipeline, {"stage": 4}, stats, batch=64)
  view = cost.estimate(pipeline, {"stage": 4}, stats, batch=64, optimizer_view=True)
  assert view["comm_bytes"] - rows["comm_bytes"] == pytest.approx(3 * 3 / 4 * 4000 / 4)
  assert view["latency_s"] - rows["latency_s"] == pytest.approx(3 * cost.collective_latency)
  # What "auto" passes: whether the trainer runs the optimizer on the view.
  model = hk.transform(lambda x: hk.nets.MLP([16, 16, 10])(x))
  mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # noqa: E731

  def comm_bytes(optimizer):
    auto = parstrat.Auto(devices=jax.devices()[:2], candidates=("pipeline",), verbose=False)
    measured = auto.measure(model, optimizer, np.zeros((8, 4), np.float32))
    return {repr(c.strategy): c.comm_bytes for c in measured if not c.problem}

  masked, plain = comm_bytes(optax.adamw(1e-3, mask=mask)), comm_bytes(optax.adamw(1e-3))
  assert masked.keys() == plain.keys() and masked
  assert all(masked[name] > plain[name] for name in masked), (masked, plain)


def test_custom_labels_and_models_the_pipeline_cannot_analyse():
  def net(x):
    hk.get_parameter("unused", (3,), init=jnp.zeros)  # the pipeline's analysis refuses this
    return hk.Linear(10)(x)

  def mse(outputs, targets):
    return jnp.mean((outputs - targets) ** 2)

  strategy = parstrat.Auto(
    devices=jax.devices()[:2],
    candidates=("data_parallel",),
    label_shape=(10,),
    label_dtype="float32",
    verbose=False,
  )
  choice = strategy.choose(hk.transform(net), optax.sgd(0.1), np.zeros((8, 4)), loss_fn=mse)
  assert type(choice.strategy) is parstrat.DataParallel


def _layer_norm_between_linears(x):
  x = jax.nn.relu(hk.LayerNorm(-1, True, True)(hk.Linear(32)(x)))
  x = hk.LayerNorm(-1, True, True)(hk.Linear(32)(x))
  return hk.Linear(10)(x)


def _conv_net(x):
  x = x.reshape(-1, 8, 8, 1)
  x = jax.nn.relu(hk.Conv2D(4, 3)(x))
  return hk.Linear(10)(x.reshape(x.shape[0], -1))


@pytest.mark.parametrize("net", [_layer_norm_between_linears, _conv_net], ids=["layernorm", "conv"])
def test_tensor_that_splits_nothing_pays_full_compute_and_is_never_chosen(net):
  strategy = parstrat.Auto(
    devices=jax.devices()[:4], candidates=("data_parallel", "tensor"), verbose=False
  )
  measured = strategy.measure(hk.transform(net), optax.sgd(0.1), np.zeros((32, 64), np.float32))
  c = by_label(measured)
  tensor, dp = c["tensor [model=4]"], c["data_parallel [data=4]"]
  # Every device redoes the whole step: 4x data parallelism's compute, and listed as redundant.
  assert tensor.compute_s == pytest.approx(4 * dp.compute_s)
  assert tensor.problem == "redundant: 'model' splits no work, so 4 devices redo the same step"
  choice = auto_lib.rank(measured, None)
  assert type(choice.strategy) is parstrat.DataParallel
  assert "redundant" in str(choice)


def test_a_custom_strategy_auto_cannot_configure_is_listed_with_the_reason():
  # It vanished from the table (or left "no candidate could be built" alone).
  @parstrat.register("test_auto_no_field")
  @dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
  class NoFieldForItsAxis(parstrat.Strategy):
    axis_names = ("local",)

    def make_mesh(self):
      return parstrat.build_mesh({"local": len(self.devices or jax.devices())}, self.devices)

    def make_plan(self, model, loss_fn, mesh, sample_params, sample_inputs):
      return global_plan(model, loss_fn, P(), P("local"), "params replicated, batch split")

  try:
    auto = parstrat.Auto(
      devices=jax.devices()[:2], candidates=("data_parallel", "test_auto_no_field"), verbose=False
    )
    measured = auto.measure(wide_mlp(), optax.sgd(0.1), np.zeros((BATCH, FEATURES), np.float32))
  finally:
    parstrat.unregister("test_auto_no_field")
  listed = by_label(measured)["test_auto_no_field []"]
  assert listed.problem == (
    "no configuration: no dataclass field 'local' or 'locals' takes the size of its axis "
    "'local': add one, or override candidates_for"
  )
  assert "test_auto_no_field []" in str(auto_lib.rank(measured, None))


def test_a_custom_strategy_on_its_own_axis_pays_its_gradient_traffic():
  @parstrat.register("test_auto_replica_axis")
  @dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
  class ReplicaParallel(parstrat.Strategy):
    """Data parallelism over an axis named "replica", written as a global plan."""

    replica: int | None = None
    axis_names = ("replica",)
    gradient_traffic = (1.0, 1)  # half data_parallel's (2.0, 1): its traffic is read

    def make_mesh(self):
      return parstrat.build_mesh({"replica": self.replica}, self.devices)

    def make_plan(self, model, loss_fn, mesh, sample_params, sample_inputs):
      return global_plan(model, loss_fn, P(), P("replica"), "params replicated, batch split")

  try:
    measured = parstrat.Auto(
      devices=jax.devices()[:4],
      candidates=("data_parallel", "test_auto_replica_axis"),
      verbose=False,
    ).measure(wide_mlp(), optax.sgd(0.1), np.zeros((BATCH, FEATURES), np.float32))
  finally:
    parstrat.unregister("test_auto_replica_axis")
  c = by_label(measured)
  custom, dp = c["test_auto_replica_axis [replica=4]"], c["data_parallel [data=4]"]
  # Its batch axis splits the compute and its gradients cross that axis: not free.
  assert custom.comm_bytes == pytest.approx(dp.comm_bytes / 2) and custom.comm_bytes > 0
  assert custom.latency_s == pytest.approx(dp.latency_s) and custom.latency_s > 0
  assert custom.compute_s == pytest.approx(dp.compute_s)
  assert custom.problem == ""


def test_the_batch_is_the_larger_of_the_samples_given_to_init():
  # A one-row sample of the inputs beside a whole sample batch measured every candidate
  # at batch 1, where no data-parallel layout splits it.
  model = hk.transform(lambda tokens: hk.Linear(7)(hk.Embed(7, 8)(tokens)))
  tokens = np.zeros((8, 5), np.int32)
  auto = parstrat.Auto(devices=jax.devices()[:2], candidates=("data_parallel",), verbose=False)
  options = dict(loss_fn=lambda logits, labels: logits.mean(), sample_batch=(tokens, tokens))
  (candidate,) = auto.measure(model, optax.sgd(0.1), tokens[:1], **options)
  assert candidate.problem == "" and candidate.mesh == {"data": 2}


def test_candidates_refused_only_by_a_one_row_sample_are_said_with_what_to_pass():
  # `init(key, images[:1])`, as for every other strategy, measured at batch 1: every
  # candidate that splits the batch "cannot run", and "auto" chose tensor without a word.
  model = hk.transform(lambda x: hk.nets.MLP([16, 10])(x))
  auto = parstrat.Auto(devices=jax.devices()[:2], candidates=("data_parallel", "tensor"),
                       verbose=False)  # fmt: skip
  hint = (
    r"1 candidate\(s\) could not split the 1 row\(s\) of the samples given to init, which are "
    r"the batch measured: pass Auto\(batch_size=...\) or init\(..., sample_batch=<a whole batch>\)"
  )
  with pytest.warns(UserWarning, match=r"chose tensor \[model=2\].*; " + hint) as warned:
    choice = auto.choose(model, optax.sgd(0.1), np.zeros((1, 12), np.float32))
  assert re.search(hint, choice.reason)
  with pytest.warns(UserWarning, match=hint) as warned:  # (through init: deeper in parstrat)
    auto(model, optax.sgd(0.1)).init(jax.random.key(0), np.zeros((1, 12), np.float32))
  assert [w.filename for w in warned] == [__file__]  # (the user's line, not parstrat's)
  only = dataclasses.replace(auto, candidates=("data_parallel",))
  with pytest.raises(ValueError, match=r"^No candidate strategy can run this model: no "
                     r"candidate could be built \(the first, data_parallel \[data=2\]: cannot run: "
                     r"BatchSizeError: The batch size of .*; " + hint + r"\.\n"):  # fmt: skip
    only.choose(model, optax.sgd(0.1), np.zeros((1, 12), np.float32))
  with warnings.catch_warnings():  # measured at a batch given as such: nothing to say
    warnings.simplefilter("error")
    choice = dataclasses.replace(auto, batch_size=8).choose(
      model, optax.sgd(0.1), np.zeros((1, 12), np.float32)
    )
    assert "could not split" not in choice.reason
    batch = (np.zeros((3, 12), np.float32), np.zeros(3, np.int32))  # (3 rows, 2 devices)
    choice = auto.choose(model, optax.sgd(0.1), batch[0][:1], sample_batch=batch)
    assert "could not split" not in choice.reason


def test_a_loss_over_other_labels_is_named_once_with_what_to_pass():
  model = hk.transform(lambda tokens: hk.Linear(7)(hk.Embed(7, 8)(tokens)))

  def per_position(logits, labels):  # labels [B, T]: one class per token
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  tokens = np.zeros((8, 5), np.int32)
  auto = parstrat.Auto(devices=jax.devices()[:2], batch_size=8, verbose=False)
  with pytest.raises(ValueError, match=r"labels shaped \[B\] int32 .*Pass sample_batch="):
    auto(model, optax.sgd(0.1), loss_fn=per_position).init(jax.random.key(0), tokens[:1])
  # With the batch's layout, or the labels' shape, the candidates measure and one is chosen.
  trainer = auto(model, optax.sgd(0.1), loss_fn=per_position)
  trainer.init(jax.random.key(0), tokens[:1], sample_batch=(tokens, tokens))
  assert trainer.choice.strategy is not None
  shaped = dataclasses.replace(auto, label_shape=(5,), candidates=("data_parallel",))
  choice = shaped.choose(model, optax.sgd(0.1), tokens, loss_fn=per_position)
  assert type(choice.strategy) is parstrat.DataParallel


def test_a_stateful_model_is_measured_without_a_sample_batch():
  # The label check traced the model with its abstract state closed over, which
  # BatchNorm cannot do arithmetic on: every stateful model failed at init,
  # blamed on the labels.
  def net(x):
    h = hk.BatchNorm(True, True, 0.9)(hk.Linear(16)(x), is_training=True)
    return hk.Linear(10)(jax.nn.relu(h))

  model = hk.transform_with_state(net)
  images, labels = random_batches(3, 16, 12)
  devices = jax.devices()[:2]
  auto = parstrat.Auto(
    devices=devices, candidates=("fsdp", "pipeline"), batch_size=16, verbose=False
  )
  trainer = auto(model, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), images[0][:1])
  assert type(trainer.strategy) is parstrat.FSDP  # the pipeline refuses state
  problems = [c.problem for c in trainer.choice.ranked if c.name == "pipeline"]
  assert problems and all("cannot train a model with state" in p for p in problems), problems
  fsdp = parstrat.FSDP(devices=devices)(model, optax.sgd(0.1))
  fsdp_state = fsdp.init(jax.random.key(0), images[0][:1])
  for x, y in zip(images, labels, strict=True):
    state, metrics = trainer.step(state, (x, y))
    fsdp_state, fsdp_metrics = fsdp.step(fsdp_state, (x, y))
    assert float(metrics["loss"]) == float(fsdp_metrics["loss"])
  jax.tree.map(np.testing.assert_array_equal, state.model_state, fsdp_state.model_state)
  assert "each device's" not in trainer.choice.reason  # (fsdp: the whole batch's)
  # Where data parallelism wins, its choice says that BatchNorm's statistics become each
  # device's (it chose it without a word; fsdp, which keeps them whole, was 2x slower).
  choice = dataclasses.replace(auto, candidates=("data_parallel", "fsdp")).choose(
    model, optax.sgd(0.1), images[0][:1]
  )
  assert choice.reason.startswith("chose data_parallel [data=2]"), choice.reason
  assert choice.reason.endswith(
    "; the model's state (BatchNorm's statistics) is then each device's, averaged, not the "
    "whole batch's (fsdp zero=2 [data=2] computes it on the whole batch)"
  ), choice.reason


def test_a_tie_goes_to_the_built_in_strategy_not_a_users_copy(measured):
  # A user's strategy registered (for a negative test, say) under a name sorting first
  # tied with data_parallel on every figure and was chosen by its name.
  @dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
  class ACopy(parstrat.DataParallel):
    pass

  dp = by_label(measured)["data_parallel [data=4]"]
  copy = dataclasses.replace(dp, name="a_copy", strategy=ACopy(data=4))
  for order in ([copy, *measured], [*measured, copy]):
    assert type(auto_lib.rank(order, None).strategy) is parstrat.DataParallel
