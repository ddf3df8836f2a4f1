"""The one tensor-parallel analysis: pairs by dataflow, attention by heads, reasons for the rest.

No model that can deadlock runs in this process: every Hybrid(model>1) step
program is first compiled and checked for collectives inside the per-stage
branches (`hlo_check.branch_problems`) before any step runs.
"""

import re

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from split_models import FEATURES
from split_models import RESIDUAL_MLP
from split_models import TRANSFORMER

import parstrat
import parstrat.testing
from parstrat import pipeline
from parstrat._src import hlo_check
from parstrat._src import tensor_split
from parstrat._src.pipeline import engine as pipeline_engine


def _plan(model, parts=2, features=FEATURES, **kwargs):
  x = jax.ShapeDtypeStruct((2, features), jnp.float32)
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  return tensor_split.analyse(lambda p, x: model.apply(p, None, x), params, x, parts, **kwargs)


def _reasons(plan):
  return {leaf.path: leaf.reason for leaf in plan.leaves}


def _dims(plan):
  return {leaf.path: leaf.dim for leaf in plan.leaves}


def test_residual_blocks_pair_their_own_linears_not_the_stream():
  plan = _plan(RESIDUAL_MLP)
  # Haiku names the outer Linear(16) of a block before the inner Linear(32) it calls first.
  assert [(g.columns, g.rows) for g in plan.groups] == [
    (("linear_2",), ("linear_1",)),
    (("linear_4",), ("linear_3",)),
  ]
  dims = _dims(plan)
  assert dims["linear_2/w"] == 1 and dims["linear_2/b"] == 0
  assert dims["linear_1/w"] == 0 and dims["linear_1/b"] is None
  assert "residual connection" in _reasons(plan)["linear/w"]
  assert dims["linear/w"] is None and dims["linear_5/w"] is None


def test_a_residual_add_of_an_unsplit_activation_stops_a_pair():
  def net(x):
    h = jax.nn.relu(hk.Linear(FEATURES)(x)) + x  # x is not split
    return hk.Linear(10)(h)

  plan = _plan(hk.transform(net))
  assert plan.groups == ()
  assert "combines it with an unsplit activation" in _reasons(plan)["linear/w"]
  assert _dims(plan)["linear/w"] is None and _dims(plan)["linear_1/w"] is None


@pytest.mark.parametrize("bad", [0, -2, 2.5, True])
def test_tensor_split_plan_names_a_bad_model_axis_size(bad):
  message = re.escape(f"model_parallel must be an integer >= 1, got {bad!r}.")
  with pytest.raises(ValueError, match=message):
    parstrat.tensor_split_plan(RESIDUAL_MLP, np.zeros((1, FEATURES), np.float32), bad)
  with pytest.raises(TypeError, match="model must be an hk.Transformed"):
    parstrat.tensor_split_plan(lambda x: x, np.zeros((1, FEATURES), np.float32))


def test_attention_is_split_by_heads_and_layer_norms_stop_a_pair():
  plan = _plan(TRANSFORMER)
  attention = "multi_head_attention"
  assert [(set(g.columns), g.rows) for g in plan.groups] == [
    ({f"{attention}/query", f"{attention}/key", f"{attention}/value"}, (f"{attention}/linear",)),
    ({"linear_2"}, ("linear_1",)),
  ]
  dims, reasons = _dims(plan), _reasons(plan)
  for name in ("query", "key", "value"):
    assert dims[f"{attention}/{name}/w"] == 1
  assert dims[f"{attention}/linear/w"] == 0
  # The embedding-like first Linear feeds a LayerNorm: it reduces over the features.
  assert "reduces over the split features (e.g. LayerNorm" in reasons["linear/w"]
  assert reasons["layer_norm/scale"].startswith("replicated")
  text = str(plan)
  assert "tensor-parallel plan over model=2: 2 split group(s)" in text
  assert f"{attention}/linear: row-parallel" in text
  # 3 heads of 4 do not divide over 8: attention stays whole, with the reason.
  assert (
    "heads not divisible by model=8"
    in _reasons(_plan(TRANSFORMER, parts=8))[f"{attention}/query/w"]
  )


def _permuted_by_index(x):
  h = jax.nn.relu(hk.Linear(16)(x))
  return hk.Linear(10)(h[:, np.random.default_rng(0).permutation(16)])


def _permuted_by_reshape(x):
  h = jax.nn.relu(hk.Linear(16)(x))
  return hk.Linear(10)(h.reshape(-1, 4, 4).transpose(0, 2, 1).reshape(-1, 16))


def _bias_layer_and_odd_widths(x):
  h = jax.nn.relu(hk.Linear(15)(x))  # 15 outputs: not divisible by 2
  y = jax.nn.relu(hk.Bias()(hk.Linear(16, with_bias=False)(h)))  # hk.Bias: no "w"
  return hk.Linear(10)(y), h  # a tuple of outputs


@pytest.mark.parametrize(
  "net, why",
  [
    (_permuted_by_index, "it reaches `gather`"),
    (_permuted_by_reshape, "`reshape` (2, 4, 4) -> (2, 16) mixes the split features"),
  ],
)
def test_a_permutation_of_the_hidden_features_is_not_paired(net, why):
  plan = _plan(hk.transform(net))
  assert plan.groups == ()
  assert why in _reasons(plan)["linear/w"]


def test_bias_only_layers_odd_widths_and_tuple_outputs():
  model = hk.transform(_bias_layer_and_odd_widths)
  plan = _plan(model)
  dims, reasons = _dims(plan), _reasons(plan)
  assert [(g.columns, g.rows) for g in plan.groups] == [(("linear_1",), ("linear_2",))]
  assert dims["bias/b"] == 0  # the bias-only layer is split with the column it follows
  assert reasons["linear/w"] == "replicated (its 15 outputs are not divisible by model=2)"
  # The tensor strategy takes the model (a tuple of outputs) and lays it out.
  trainer = parstrat.TensorParallel(model=2)(
    model, optax.sgd(0.1), loss_fn=lambda outputs, labels: outputs[0].mean()
  )
  state = trainer.init_abstract(jax.random.key(0), np.zeros((1, FEATURES), np.float32))
  assert state.params["bias"]["b"].sharding.spec == jax.sharding.PartitionSpec("model")
  assert "linear: replicated (its 15 outputs" in trainer.plan.description


def _gain_on_the_split_layer(x):  # a learnable [1] gain (ReZero-like) on the hidden layer
  h = jax.nn.relu(hk.Linear(32, name="up")(x))
  gain = hk.get_parameter("gain", [1], init=hk.initializers.Constant(1.5))
  return hk.Linear(10, name="down")(h * gain)


def test_a_one_element_gain_on_a_split_layer_stays_whole_and_matches_jit():
  # It was taken for the layer's bias and split 2 ways: a raw IndivisibleError at init
  # under tensor, "Parameter leaf 8 ... cannot be split" under hybrid.
  model = hk.transform(_gain_on_the_split_layer)
  plan = _plan(model)
  assert [(g.columns, g.rows) for g in plan.groups] == [(("up",), ("down",))]
  assert _dims(plan)["~/gain"] is None
  parstrat.testing.check_strategy(
    parstrat.TensorParallel(model=2), model, steps=2, batch=8, features=FEATURES
  )


def test_tensor_parallel_transformer_matches_jit_with_one_all_reduce_per_group():
  strategy = parstrat.TensorParallel(model=2)
  parstrat.testing.check_strategy(strategy, TRANSFORMER, steps=3, batch=8, features=FEATURES)
  trainer = strategy(TRANSFORMER, optax.sgd(0.1))
  images, labels = parstrat.testing.random_batches(1, 8, FEATURES)
  state = trainer.init_abstract(jax.random.key(0), images[0][:1])
  text = trainer.lower(state, (images[0], labels[0])).compile().as_text()
  collectives = re.findall(r"= \S+ (all-reduce|all-gather|all-to-all|collective-permute)\(", text)
  forward = [
    line for line in text.splitlines() if " all-reduce(" in line and "transpose(" not in line
  ]
  assert "all-gather" not in collectives and "collective-permute" not in collectives
  # One all-reduce forward per group (attention block, MLP pair); at most one more backward.
  assert len(forward) == 2
  assert collectives.count("all-reduce") <= 4


@pytest.mark.parametrize("model", [RESIDUAL_MLP, TRANSFORMER], ids=["residual_mlp", "transformer"])
def test_hybrid_2x2x2_keeps_collectives_out_of_stage_branches_and_matches_jit(model):
  strategy = parstrat.Hybrid(data=2, stages=2, model=2)
  trainer = strategy(model, optax.sgd(0.1))
  images, labels = parstrat.testing.random_batches(1, 16, FEATURES)
  state = trainer.init_abstract(jax.random.key(0), images[0][:1])
  text = trainer.lower(state, (images[0], labels[0])).compile().as_text()
  inside = hlo_check.branch_collectives(text)
  assert {c.kind for c in inside} == {"all-reduce"}  # the split groups' all-reduces
  assert hlo_check.branch_problems(text, trainer.mesh) == []  # only now is stepping safe
  assert "2 split group(s)" in trainer.plan.description
  parstrat.testing.check_strategy(strategy, model, steps=3, batch=16, features=FEATURES)


def test_hybrid_groups_never_straddle_a_stage_cut():
  stage_of = {"linear": 0, "linear_2": 0, "linear_1": 1, "linear_4": 1, "linear_3": 1}
  stage_of["linear_5"] = 1
  plan = _plan(RESIDUAL_MLP, stage_of=stage_of)
  assert [(g.columns, g.rows) for g in plan.groups] == [(("linear_4",), ("linear_3",))]
  assert "would straddle stages [0, 1]" in _reasons(plan)["linear_2/w"]


def test_branch_problems_reads_collective_permutes_and_replica_groups():
  mesh = jax.make_mesh((2, 2, 2), ("data", "stage", "model"))
  text = """HloModule m

%branch (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %ok = f32[4]{0} all-reduce(%p), channel_id=1, replica_groups=[4,2]<=[8], to_apply=%add
  %bad = f32[4]{0} collective-permute(%ok), channel_id=2, source_target_pairs={{0,1},{2,3}}
  ROOT %across = f32[4]{0} all-reduce(%bad), channel_id=3, replica_groups={{0,4},{1,5}}
}

ENTRY %main (i: s32[], x: f32[4]) -> f32[4] {
  %i = s32[] parameter(0)
  %x = f32[4]{0} parameter(1)
  %outside = f32[4]{0} all-reduce(%x), channel_id=4, replica_groups={{0,2}}, to_apply=%add
  ROOT %c = f32[4]{0} conditional(%i, %outside), branch_computations={%branch}
}
"""
  found = hlo_check.branch_collectives(text)
  assert [(c.kind, c.name) for c in found] == [
    ("all-reduce", "ok"),
    ("collective-permute", "bad"),
    ("all-reduce", "across"),
  ]
  assert found[1].groups == ((0, 1, 2, 3),)  # one rendezvous of every device in its pairs
  problems = hlo_check.branch_problems(text, mesh)
  assert len(problems) == 2
  # Named by the axes its devices differ along (devices 0-3 share "data"; 0 and 4 "stage").
  assert problems[0].startswith("collective-permute bad") and "along ['stage']" in problems[0]
  assert problems[1].startswith("all-reduce across") and "along ['data']" in problems[1]


def test_branch_problems_leaves_out_switches_every_device_takes_alike():
  # The pipeline's exchange picks its collective by the tick (`hlo_check.UNIFORM_SCOPE`):
  # every device takes the same branch. A per-stage switch gets no such pass.
  mesh = jax.make_mesh((2, 2, 2), ("data", "stage", "model"))
  text = """HloModule m

%branch (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %move = f32[4]{0} collective-permute(%p), channel_id=1, source_target_pairs={{0,2},{2,4}}
}

ENTRY %main (i: s32[], x: f32[4]) -> f32[4] {
  %i = s32[] parameter(0)
  %x = f32[4]{0} parameter(1)
  ROOT %c = f32[4]{0} conditional(%i, %x), branch_computations={%branch}, metadata={op_name="jit(step)/shard_map/while/body/SCOPE/cond"}
}
"""  # noqa: E501
  uniform = text.replace("SCOPE", hlo_check.UNIFORM_SCOPE)
  assert hlo_check.branch_collectives(uniform) == []
  assert hlo_check.branch_problems(uniform, mesh) == []
  per_stage = text.replace("SCOPE", "stage")
  assert [c.name for c in hlo_check.branch_collectives(per_stage)] == ["move"]
  assert len(hlo_check.branch_problems(per_stage, mesh)) == 1
  # The benchmark's measured bubble tells the exchange from the pass switch by name.
  assert hlo_check.uniform_switches(uniform) == {"c"}
  assert hlo_check.uniform_switches(per_stage) == set()
  # A cond nested under the scope (the optimizer's, e.g. MultiSteps inside
  # apply_if_finite) is one every device takes alike too.
  nested = text.replace("SCOPE/cond", f"{hlo_check.UNIFORM_SCOPE}/cond/branch_1_fun/cond")
  assert hlo_check.branch_collectives(nested) == []
  # But a shard_map inside the scope runs per device again: a line search's `value_fn`
  # runs the pipeline's stage switches inside the optimizer's update (helper 70). Its
  # own exchange, marked inside the map, is uniform again.
  scope = hlo_check.UNIFORM_SCOPE
  in_map = text.replace("SCOPE/cond", f"{scope}/while/body/jvp()/shard_map/while/body/cond")
  assert [c.name for c in hlo_check.branch_collectives(in_map)] == ["move"]
  assert hlo_check.uniform_switches(in_map) == set()
  marked_again = text.replace("SCOPE/cond", f"{scope}/while/shard_map/scan/{scope}/cond")
  assert hlo_check.branch_collectives(marked_again) == []


def test_branch_problems_reads_mesh_replica_groups_with_and_without_device_ids():
  # XLA leaves device_ids out when the devices are 0, 1, ... in order: such a line was
  # "unreadable", and Hybrid(data=1, stage=1, model=2) refused every step as a hang.
  line = "  %{name} = f32[16,32]{{1,0}} all-reduce(%p), channel_id={id}, replica_groups=mesh[{mesh}]{ids} {{{over}}}, use_global_device_ids=true, to_apply=%add"  # noqa: E501
  body = [
    line.format(name="plain", id=1, mesh="'axis_0'=1,'axis_1'=2", ids="", over="'axis_1'"),
    line.format(name="listed", id=2, mesh="'a'=2,'b'=2", ids=", device_ids=(3,2,1,0)", over="'a'"),
    line.format(name="iota", id=3, mesh="'a'=2,'b'=2", over="'b'",
                ids=", device_ids=([4]<=[2,2]T(1,0))"),
    # An iota without its flat shape, as XLA printed it for an optimizer's norm (helper 66).
    line.format(name="shaped", id=4, mesh="'a'=2,'b'=4", over="'a'",
                ids=", device_ids=([2,2,2]T(1,0,2))"),
  ]  # fmt: skip
  text = (
    "HloModule m\n\n%branch (p: f32[16,32]) -> f32[16,32] {\n  %p = f32[16,32]{1,0} parameter(0)\n"
  )
  text += "\n".join(body) + "\n}\n\nENTRY %main (i: s32[], x: f32[16,32]) -> f32[16,32] {\n"
  text += "  ROOT %c = f32[16,32]{1,0} conditional(%i, %x), branch_computations={%branch}\n}\n"
  found = {c.name: c.groups for c in hlo_check.branch_collectives(text)}
  assert found == {
    "plain": ((0, 1),),
    "listed": ((3, 1), (2, 0)),
    "iota": ((0, 2), (1, 3)),
    "shaped": ((0, 2), (1, 3), (4, 6), (5, 7)),
  }
  two = jax.make_mesh((1, 1, 2), ("data", "stage", "model"), devices=jax.devices()[:2])
  only_plain = text.replace(body[1], "").replace(body[2], "").replace(body[3], "")
  assert hlo_check.branch_problems(only_plain, two) == []


def test_a_marker_followed_by_a_parameter_free_op_cuts_before_the_next_layer():
  def net(x):
    x = jax.nn.swish(hk.Linear(16)(x))
    x = jax.nn.swish(hk.Linear(16)(x))
    x = pipeline.stage_boundary(x)
    return hk.Linear(10)(jax.nn.relu(x))

  model = hk.transform(net)
  x = jax.ShapeDtypeStruct((1, FEATURES), jnp.float32)
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  plan = pipeline.plan_stages(lambda p, x: model.apply(p, None, x), params, x, 2)
  assert plan.stage_layers == ((0, 1), (2,))


def test_weights_tied_across_stages_are_refused_naming_the_parameter():
  def lm(tokens):
    embed = hk.Embed(20, 8)
    h = embed(tokens.astype(jnp.int32))
    h = jax.nn.relu(hk.Linear(8)(h))
    h = jax.nn.relu(hk.Linear(8)(h))
    return h @ embed.embeddings.T  # the head reuses the embedding matrix

  trainer = parstrat.PipelineModelParallel(stages=2, cuts=(2,))(
    hk.transform(lm), optax.sgd(0.1), loss_fn=lambda logits, labels: logits.mean()
  )
  with pytest.raises(ValueError, match=r"Cannot cut before layer 2: the parameters of 'embed' "):
    trainer.init_abstract(jax.random.key(0), np.zeros((1, 4), np.float32))
  # Where a cut exists, the layout names the tied parameter and the stages that use it.
  tied = {"embed": {"embeddings": jnp.zeros((3,))}}
  with pytest.raises(
    ValueError, match=r"Parameter \['embed'\]\['embeddings'\] is used by stages 0 and 1"
  ):
    pipeline_engine.FlatLayout.build(tied, ((0,), (0,)))


def _remat_block(x):
  h = hk.Linear(32, name="inp")(x)
  h = h + hk.remat(lambda y: hk.Linear(32, name="down")(jax.nn.gelu(hk.Linear(64, name="up")(y))))(
    h
  )
  return hk.Linear(10, name="head")(h)


def test_a_pair_inside_hk_remat_is_split_and_matches_jit():
  # JAX 0.10 names jax.checkpoint's primitive "remat2": the analysis did not look
  # inside it, and the whole model stayed replicated. One list of call primitives
  # (`jaxpr_calls`) now serves this analysis and the pipeline's cut.
  model = hk.transform(_remat_block)
  plan = _plan(model)
  assert len(plan.groups) == 1, str(plan)
  assert _dims(plan)["up/w"] == 1 and _dims(plan)["down/w"] == 0
  parstrat.testing.check_strategy(
    parstrat.TensorParallel(model=2), model, [optax.sgd(0.1)], steps=2, batch=8,
    features=FEATURES,
  )  # fmt: skip


def test_tensor_split_plan_reads_models_with_randomness_or_state():
  # As the trainer does: a key for a model that draws one, the state of a stateful one.
  def dropout(x):
    h = jax.nn.relu(hk.Linear(16, name="up")(x))
    return hk.Linear(10, name="down")(hk.dropout(hk.next_rng_key(), 0.5, h))

  def running_mean(x):
    mean = hk.get_state("mean", [x.shape[-1]], init=jnp.zeros)
    hk.set_state("mean", 0.9 * mean + 0.1 * x.mean(0))
    return hk.Linear(10, name="down")(jax.nn.relu(hk.Linear(16, name="up")(x - mean)))

  x = np.zeros((2, FEATURES), np.float32)
  for model in (hk.transform(dropout), hk.transform_with_state(running_mean)):
    plan = parstrat.tensor_split_plan(model, x, 2)
    assert len(plan.groups) == 1 and _dims(plan)["up/w"] == 1, str(plan)


def _padded_attention(tokens):
  length, width = tokens.shape[1], 32
  x = hk.Embed(16, width)(tokens)
  causal = jnp.tril(jnp.ones((length, length), bool))[None, None]
  mask = causal & (tokens != 0)[:, None, None, :]  # [B, 1, T, T]: broadcast over the heads
  attention = hk.MultiHeadAttention(4, 8, w_init=hk.initializers.VarianceScaling(1.0))
  h = attention(x, x, x, mask=mask)
  return hk.Linear(10, name="head")(h.mean(axis=1))


def test_attention_under_a_padding_mask_is_split_by_heads_and_matches_jit():
  # The mask, broadcast to [B, H, T, T] before `select_n` masks the split scores,
  # looked like an unsplit activation: the block stayed replicated.
  model = hk.transform(_padded_attention)
  plan = parstrat.tensor_split_plan(model, jnp.zeros((2, 6), jnp.int32), 2)
  assert len(plan.groups) == 1 and _dims(plan)["multi_head_attention/query/w"] == 1, str(plan)
  rng = np.random.default_rng(0)
  batches = [
    (rng.integers(0, 16, (8, 6)).astype(np.int32), rng.integers(0, 10, 8).astype(np.int32))
    for _ in range(2)
  ]
  batches[0][0][:, :2] = 0  # padding
  parstrat.testing.check_strategy(
    parstrat.TensorParallel(model=2), model, [optax.sgd(0.1)], batches=batches
  )


def _weight_normed_and_tied(x):
  w = hk.get_parameter("w", [FEATURES, 32], init=hk.initializers.RandomNormal())
  h = jax.nn.relu(x @ (w / jnp.linalg.norm(w)))  # a weight norm reads w besides its product
  shared = hk.Linear(32, name="shared")
  h = shared(jax.nn.relu(shared(h)))  # one weight in two products
  return hk.Linear(10, name="head")(h)


def test_a_weight_read_besides_its_product_is_not_called_tied():
  # A normalised weight (`w / norm(w)`) is read three times, once in its product: it
  # was "used 3 times: a shared or tied weight".
  reasons = _reasons(_plan(hk.transform(_weight_normed_and_tied)))
  assert re.fullmatch(
    r"replicated \(used \d times: read by `[a-z_]+`(, `[a-z_]+`)* besides its product, "
    r"as a weight norm is\)",
    reasons["~/w"],
  ), reasons["~/w"]
  assert reasons["shared/w"] == "replicated (used 2 times: a shared or tied weight)"
