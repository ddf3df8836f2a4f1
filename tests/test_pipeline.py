import dataclasses
import functools

import haiku as hk
import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest
from helpers import DEEP_MLP
from helpers import SEED_MLP
from helpers import mlp
from jax import lax
from jax.extend import core as jex

import parstrat
import parstrat.testing
from parstrat import pipeline
from parstrat._src import hlo_check
from parstrat._src import precision
from parstrat._src.pipeline import backward_split
from parstrat._src.pipeline import engine
from parstrat._src.pipeline import partition


def _abstract(model, features=784):
  x = jax.ShapeDtypeStruct((1, features), jnp.float32)
  return jax.eval_shape(model.init, jax.random.key(0), x), x


def _apply(model):
  return lambda params, x: model.apply(params, None, x)


# ------------------------------------------------------------------ partition
def test_seed_mlp_on_two_stages():
  params, x = _abstract(SEED_MLP)
  plan = pipeline.plan_stages(_apply(SEED_MLP), params, x, 2)
  assert [[plan.layers[i].name for i in g] for g in plan.stage_layers] == [
    ["mlp/~/linear_0"],
    ["mlp/~/linear_1"],
  ]
  assert plan.stage_params() == [784 * 512 + 512, 512 * 10 + 10]
  assert plan.stage_flops()[0] > plan.stage_flops()[1]
  text = str(plan)
  assert "2 stages, cut by balanced params" in text and "401,920" in text


def test_parameter_math_done_up_front_moves_to_its_layer():
  # Like a precision policy, transform every weight before any layer runs, here
  # through a long chain: left at the top, the results would cross every cut.
  def apply(params, x):
    def chain(w):
      for _ in range(1500):
        w = w * 1.0
      return w.astype(jnp.bfloat16)

    return SEED_MLP.apply(jax.tree.map(chain, params), None, x.astype(jnp.bfloat16))

  params, x = _abstract(SEED_MLP)
  plan = pipeline.plan_stages(apply, params, x, 2)
  assert plan.stage_params() == [784 * 512 + 512, 512 * 10 + 10]


# One layer a stage (8, 7) and layers split unevenly (4, 6).
@pytest.mark.parametrize("stages, k", [(8, 7), (4, 6)])
def test_uniform_hidden_layers_balance_and_padding_is_bounded(stages, k):
  model = mlp([512] * k + [10])
  params, x = _abstract(model)
  plan = pipeline.plan_stages(_apply(model), params, x, stages)
  assert plan.num_stages == stages
  assert all(plan.stage_layers)
  trainer = parstrat.PipelineModelParallel(stages=stages)(model, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), np.zeros((1, 784), np.float32))
  per_device = state.params.addressable_shards[0].data.size
  assert per_device == max(plan.stage_params())
  assert per_device <= 1.25 * max(plan.stage_params())


def test_balance_by_flops_and_manual_cuts():
  params, x = _abstract(DEEP_MLP)
  by_flops = pipeline.plan_stages(_apply(DEEP_MLP), params, x, 4, balance="flops")
  assert by_flops.balance == "balanced flops"
  # The first layer (784 x 96) dominates, so the best split gives it a stage alone.
  assert by_flops.stage_layers[0] == (0,)
  assert max(by_flops.stage_flops()) == by_flops.layers[0].flops
  manual = pipeline.plan_stages(_apply(DEEP_MLP), params, x, 3, cuts=(1, 7))
  assert manual.stage_layers == ((0,), tuple(range(1, 7)), (7,))
  # The strategy takes cuts as any sequence of integers (a range, a NumPy array).
  for cuts in (range(1, 8, 6), np.array([1, 7])):
    trainer = parstrat.PipelineModelParallel(stages=3, cuts=cuts)(DEEP_MLP, optax.sgd(0.1))
    trainer.init(jax.random.key(0), np.zeros((1, 784), np.float32))
    rows = trainer.plan.description.splitlines()
    assert rows[0] == "pipeline plan: 3 stages, cut by manual cut points"
    assert [row.split()[-1] for row in rows[2:5]] == [
      "mlp/~/linear_0", "mlp/~/linear_6", "mlp/~/linear_7"
    ]  # fmt: skip


def test_convolutions_count_their_multiply_adds():
  # A convolution counted 1 FLOP per output element: a conv net's flops balance cut its
  # stages as if its convolutions cost nothing, and "auto" priced its compute at ~0.
  def conv(dimension_numbers, padding="VALID", groups=1):
    return lambda x, w: lax.conv_general_dilated(
      x, w, (1, 1), padding, dimension_numbers=dimension_numbers, feature_group_count=groups
    )

  x, w = jnp.ones((2, 9, 9, 16)), jnp.ones((3, 3, 16, 32))
  for f, args in [
    (conv(("NHWC", "HWIO", "NHWC")), (x, w)),
    (conv(("NCHW", "OIHW", "NCHW")), (x.transpose(0, 3, 1, 2), w.transpose(3, 2, 0, 1))),
    (conv(("NHWC", "HWIO", "NHWC"), groups=4), (x, w[:, :, :4])),
  ]:
    (eqn,) = jax.make_jaxpr(f)(*args).jaxpr.eqns
    cost = jax.jit(f).lower(*args).compile().cost_analysis()
    xla = (cost[0] if isinstance(cost, list) else cost)["flops"]
    assert partition._eqn_flops(eqn) == partition._eqn_flops(eqn, only_dots=True) == xla > 0
  # A transposed convolution (input dilated by the stride) counts its taps on real rows.
  transposed = lambda x, w: lax.conv_transpose(  # noqa: E731
    x, w, (2, 2), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  (eqn,) = jax.make_jaxpr(transposed)(x, w).jaxpr.eqns
  assert partition._eqn_flops(eqn) == 2 * (2 * 19 * 19 * 32) * (3 * 3 * 16) // 4
  # With padding, XLA leaves out the taps on the padding; the count is the upper bound.
  (eqn,) = jax.make_jaxpr(conv(("NHWC", "HWIO", "NHWC"), "SAME"))(x, w).jaxpr.eqns
  assert partition._eqn_flops(eqn) == 2 * (2 * 9 * 9 * 32) * (3 * 3 * 16)


def test_time_major_activations_are_not_cut():
  # Layers a and b run time-major ([T, B, C], as `hk.static_unroll` wants) before a mean
  # over time: the boundary between them carries no batch-leading value, so the cut
  # goes after b, and cutting between them is refused, naming the shape.
  def net(x):  # x: [B, T=4, 64]
    x = jnp.swapaxes(x, 0, 1)
    x = jax.nn.relu(hk.Linear(16, name="a")(x))
    x = jax.nn.relu(hk.Linear(16, name="b")(x)).mean(0)
    x = jax.nn.relu(hk.Linear(16, name="c")(x))
    return hk.Linear(10, name="d")(x)

  model = hk.transform(net)
  x = jax.ShapeDtypeStruct((1, 4, 64), jnp.float32)
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  plan = pipeline.plan_stages(_apply(model), params, x, 2)
  assert plan.stage_layers == ((0, 1), (2, 3))
  with pytest.raises(ValueError, match=r"'a' and 'b' the one activation .* shape \(4, 1, 16\), "):
    pipeline.plan_stages(_apply(model), params, x, 2, cuts=(1,))
  with pytest.raises(ValueError, match=r"only 2 of its 3 layer boundaries are cuttable"):
    pipeline.plan_stages(_apply(model), params, x, 4)


def test_a_weight_read_after_the_next_layer_is_named_tied_and_alternating_layers_interleaved():
  # An LM head reusing the embedding just before the only cut: the embedding's params are
  # read after the next layer is done, which is a tied weight (it was called "used
  # interleaved"). Two layers run in turn (a, b, a, b) are interleaved.
  def tied(tokens):
    embed = hk.Embed(16, 8, name="embed")
    x = jax.nn.relu(hk.Linear(8, name="mlp")(embed(tokens)))
    return x @ embed.embeddings.T

  def alternating(x):
    a, b = hk.Linear(8, name="a"), hk.Linear(8, name="b")
    for _ in range(2):
      x = jax.nn.relu(b(jax.nn.relu(a(x))))
    return hk.Linear(4, name="head")(x)

  for net, x, why in [
    (tied, jax.ShapeDtypeStruct((2, 3), jnp.int32),
     r"the parameters of 'embed' are used both before and after layer 'mlp' \(a weight "
     "shared or tied"),
    (alternating, jax.ShapeDtypeStruct((2, 8), jnp.float32),
     r"layers 'a' and 'b' are used interleaved"),
  ]:  # fmt: skip
    model = hk.transform(net)
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"Cannot cut before layer 1: " + why):
      pipeline.plan_stages(_apply(model), params, x, 2, cuts=(1,))


def test_a_cond_given_the_parameters_is_named_as_the_reason_no_cut_exists():
  # hk.cond passes every parameter into its `cond`: each layer then looked read on both
  # sides of every cut, and the refusal blamed weights "shared or tied across the cut".
  def net(x):
    x = jax.nn.relu(hk.Linear(16, name="l0")(x))
    block = hk.Linear(16, name="a")
    if hk.running_init():
      block(x)
    x = hk.cond(x.mean() > 0, lambda v: jax.nn.relu(block(v)), lambda v: v, x)
    x = jax.nn.relu(hk.Linear(16, name="l1")(x))
    return hk.Linear(10, name="head")(x)

  x = jax.ShapeDtypeStruct((1, 12), jnp.float32)
  # (under a precision policy the cond takes the cast parameters: the same reason)
  for policy in (None, "mixed_bfloat16"):
    model = precision.with_policy(hk.transform(net), precision.resolve_policy(policy))
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    with pytest.raises(ValueError) as e:
      pipeline.plan_stages(_apply(model), params, x, 2)
    message = str(e.value)
    assert "only 0 of its 3 layer boundaries are cuttable (one `cond` equation (hk.cond" in message
    assert "keep such a branch within one layer's module" in message
    assert "pick with jnp.where" in message
    assert "tied" not in message and message.count("`cond`") == 1


def test_stage_boundary_markers():
  def net(x):
    x = jax.nn.swish(hk.Linear(64)(x))
    x = jax.nn.swish(hk.Linear(32)(x))
    x = pipeline.stage_boundary(x)
    return hk.Linear(10)(x)

  model = hk.transform(net)
  params, x = _abstract(model)
  plan = pipeline.plan_stages(_apply(model), params, x, 2)
  assert plan.balance == "markers" and plan.stage_layers == ((0, 1), (2,))
  with pytest.raises(ValueError, match="1 stage_boundary marker.*2 stages, but stages=3"):
    pipeline.plan_stages(_apply(model), params, x, 3)
  parstrat.testing.check_strategy(
    parstrat.PipelineModelParallel(stages=2, microbatches=2), model, steps=3, batch=16
  )


def test_unread_params_mixed_dtypes_and_virtual_stages_are_named():
  def ghost(x):
    hk.get_parameter("ghost", (3,), init=jnp.zeros)
    hk.get_parameter("ghost2", (2,), init=jnp.zeros)  # (each unread leaf is named)
    return hk.Linear(10, name="out")(jax.nn.swish(hk.Linear(16, name="inp")(x)))

  def mixed(x):
    w = hk.get_parameter("w", (16, 16), jnp.bfloat16, init=jnp.ones)
    x = hk.Linear(16, name="a")(x).astype(jnp.bfloat16) @ w
    return hk.Linear(10, name="out")(x.astype(jnp.float32))

  def half_read(x):  # (an unread leaf in a layer whose other leaf is read: a raw zip error)
    scale = hk.get_parameter("scale", (16,), init=jnp.ones)
    hk.get_parameter("unused", (7,), init=jnp.zeros)
    return hk.Linear(10, name="out")(jax.nn.swish(hk.Linear(16, name="inp")(x)) * scale)

  x = np.zeros((8, 16), np.float32)
  for net, strategy, message in (
    (
      ghost,
      parstrat.PipelineModelParallel(stages=2),
      r"Parameters \['~'\]\['ghost'\], \['~'\]\['ghost2'\] \(layer",
    ),
    (
      half_read,
      parstrat.Hybrid(data=2, stages=2),
      r"Parameters \['~'\]\['unused'\] \(layer\(s\) '~'\) are never used",
    ),
    (
      mixed,
      parstrat.PipelineModelParallel(stages=2),
      r"share one dtype .*got float32 \(e.g. \['a'\]\['b'\]\), bfloat16 \(e.g. \['~'\]\['w'\]\)",
    ),
    (
      lambda x: hk.Linear(10, name="out")(jax.nn.swish(hk.Linear(16, name="inp")(x))),
      parstrat.PipelineModelParallel(stages=4, schedule="interleaved_1f1b", virtual_stages=3),
      r"stages=12 exceeds .* cut into stages x virtual_stages = 4 x 3 = 12 model stages",
    ),
  ):
    trainer = strategy(hk.transform(net), optax.sgd(0.1))
    with pytest.raises(ValueError, match=message):
      trainer.init(jax.random.key(0), x[:1])


def test_a_boundary_no_single_value_crosses_is_named_with_the_values_that_do():
  def skips(x):  # (two streams: both cross each boundary between the blocks)
    a = b = hk.Linear(8, name="inp")(x)
    for i in range(3):
      a = jnp.tanh(hk.Linear(8, name=f"l{i}")(a))
      b = b + a
    return hk.Linear(4, name="out")(b)

  trainer = parstrat.PipelineModelParallel(stages=4)(hk.transform(skips), optax.sgd(0.1))
  with pytest.raises(
    ValueError,
    match=r"between layers 'l0' and 'l1' .*\(2 or more values are live, e.g. a skip "
    r"connection: float32\[1,8\], float32\[1,8\]\)",
  ):
    trainer.init(jax.random.key(0), np.zeros((1, 8), np.float32))


def _masked_encoder(inputs):
  # Token ids and a float padding weight; the attention mask is computed from the ids,
  # and every block reads both: values from the model inputs alone, live across each
  # cut between blocks, which each stage that reads them recomputes from the inputs.
  tokens, weight = inputs
  mask = (tokens != 0)[:, None, None, :]
  x = hk.Embed(11, 16, name="embed")(tokens)
  for i in range(3):
    h = hk.LayerNorm(-1, True, True, name=f"b{i}_ln")(x)
    attention = hk.MultiHeadAttention(2, 8, w_init=hk.initializers.VarianceScaling(), name=f"b{i}")
    x = (x + attention(h, h, h, mask=mask)) * weight[:, :, None]
  return hk.Linear(11, name="head")(x.mean(1))


def _masked_batches():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 11, (2, 16, 6)).astype(np.int32)
  tokens[:, :, 0] = 1  # (no row fully masked)
  weight = (rng.random((2, 16, 6)) > 0.2).astype(np.float32)
  labels = rng.integers(0, 11, (2, 16)).astype(np.int32)
  return [((tokens[i], weight[i]), labels[i]) for i in range(2)]


@pytest.mark.parametrize(
  "strategy, firsts",
  [
    (
      parstrat.PipelineModelParallel(
        stages=4, microbatches=8, schedule="zb_h1", activations="save"
      ),
      ["embed,", "b1_ln,", "b2_ln,", "head"],
    ),
    (parstrat.Hybrid(data=2, stages=2, model=2, microbatches=2), ["embed,", "b2_ln,"]),
  ],
  ids=["pipeline-zb_h1-save", "hybrid-2x2x2"],
)
def test_values_from_the_model_inputs_are_recomputed_by_the_stages_that_read_them(strategy, firsts):
  model, batches = hk.transform(_masked_encoder), _masked_batches()
  trainer = strategy(model, optax.sgd(0.1))
  trainer.init(jax.random.key(0), jax.tree.map(lambda a: a[:1], batches[0][0]))
  # Cut between blocks (each such boundary was refused: only the head could be cut off).
  rows = trainer.plan.description.splitlines()[2 : 2 + strategy.stages]
  assert [row.split()[3] for row in rows] == firsts, rows
  parstrat.testing.check_strategy(strategy, model, [optax.sgd(0.1)], batches=batches)


def _class_token_net(x):  # [B, T, F] -> [B, 10], a ViT-style class token
  h = hk.Linear(16, name="patch")(x)
  with hk.name_scope("cls"):
    token = hk.get_parameter("token", [1, 1, 16], init=jnp.ones)
  h = jnp.concatenate([jnp.broadcast_to(token, (h.shape[0], 1, 16)), h], axis=1)
  for i in range(2):
    h = h + hk.Linear(16, name=f"fc{i}b")(jax.nn.relu(hk.Linear(32, name=f"fc{i}a")(h)))
  return hk.Linear(10, name="head")(h[:, 0])


@pytest.mark.parametrize(
  "strategy",
  [
    parstrat.PipelineModelParallel(stages=2, microbatches=4),
    parstrat.PipelineModelParallel(stages=4, microbatches=4, schedule="zb_h1"),
    parstrat.Hybrid(data=2, stages=2, model=2, microbatches=2),
  ],
  ids=["pipeline-2-1f1b", "pipeline-4-zb_h1", "hybrid-2x2x2"],
)
def test_a_model_traced_otherwise_at_one_row_is_cut_between_the_same_layers(strategy):
  # `jnp.broadcast_to` to the shape a value already has emits no equation, so the
  # class token's broadcast is there at a microbatch's 4 rows and not at the sample's
  # one: the cuts, equation indices of the 1-row trace, fell one equation early in the
  # microbatch's, and the first step failed with "KeyError: Var(id=...):float32[4,5,16]".
  model = hk.transform(_class_token_net)
  apply = lambda params, x: model.apply(params, None, x)
  x = np.random.default_rng(0).normal(size=(16, 4, 6)).astype(np.float32)
  params = model.init(jax.random.key(0), x[:1])
  one_row, four_rows = (len(jax.make_jaxpr(apply)(params, x[:n]).eqns) for n in (1, 4))
  assert one_row != four_rows
  batches = [(x, np.arange(16, dtype=np.int32) % 10)] * 2
  # (the kit inits with the first batch's first row)
  parstrat.testing.check_strategy(
    strategy, model, [optax.sgd(0.1), optax.adam(1e-2)], batches=batches
  )


def _position_table_and_temperature_net(tokens):  # both at the top level: Haiku's "~"
  x = hk.Embed(16, 16, name="embed")(tokens)
  x = x + hk.get_parameter("pos", [8, 16], init=jnp.zeros)[None]
  x = x + hk.Linear(16, name="fc2")(jax.nn.gelu(hk.Linear(32, name="fc1")(x)))
  x = hk.LayerNorm(-1, True, True, name="ln0")(x)
  return hk.Linear(16, name="head")(x) / jnp.exp(hk.get_parameter("log_temp", [], init=jnp.zeros))


def test_a_module_holding_parameters_read_at_both_ends_is_not_called_a_tied_weight():
  # "~" holds a position table read first and a temperature read last: no weight is
  # shared, yet the refusal said "(a weight shared or tied across the cut, e.g. an output
  # head that reuses the embedding)", naming neither parameter nor the fix.
  model = hk.transform(_position_table_and_temperature_net)
  tokens = np.zeros((1, 8), np.int32)
  params = model.init(jax.random.key(0), tokens)
  with pytest.raises(ValueError) as refused:
    pipeline.plan_stages(_apply(model), params, tokens, 4)
  message = str(refused.value)
  assert "shared or tied" not in message, message
  assert "'~' holds ['~']['pos'] (read before) and ['~']['log_temp'] (read after)" in message
  assert "hk.name_scope" in message

  # A weight read on both sides is still called tied.
  def tied_head(t):
    embed = hk.Embed(16, 16, name="embed")
    x = hk.Linear(16, name="middle")(embed(t))
    return hk.Linear(16, name="last")(jax.nn.relu(x)) @ embed.embeddings.T

  tied = hk.transform(tied_head)
  with pytest.raises(ValueError, match="a weight shared or tied across the cut"):
    pipeline.plan_stages(_apply(tied), tied.init(jax.random.key(0), tokens), tokens, 2)


def test_errors_name_the_problem():
  params, x = _abstract(SEED_MLP)
  with pytest.raises(
    ValueError, match=r"stages=3 exceeds the model's 2 layers \(mlp/~/linear_0, mlp/~/linear_1\)"
  ):
    pipeline.plan_stages(_apply(SEED_MLP), params, x, 3)
  with pytest.raises(
    ValueError, match=r"cuts must be 1 increasing layer indices in 1..1 .*got \(2,\)"
  ):
    pipeline.plan_stages(_apply(SEED_MLP), params, x, 2, cuts=(2,))

  def residual(x):
    h = jax.nn.swish(hk.Linear(64, name="inp")(x))
    y = jax.nn.swish(hk.Linear(64, name="mid1")(h))
    y = jax.nn.swish(hk.Linear(64, name="mid2")(y))
    return hk.Linear(10, name="out")(y + h)

  model = hk.transform(residual)
  params, x = _abstract(model)
  with pytest.raises(
    ValueError,
    match=r"cannot be cut into 4 stages: only 2 of its 3 layer boundaries.*"
    r"between layers 'mid1' and 'mid2' .*2 or more values are live",
  ):
    pipeline.plan_stages(_apply(model), params, x, 4)
  with pytest.raises(
    ValueError, match=r"Cannot cut before layer 2: between layers 'mid1' and 'mid2'"
  ):
    pipeline.plan_stages(_apply(model), params, x, 2, cuts=(2,))
  # The skip spans mid1 and mid2 only, so three stages cut around them.
  plan = pipeline.plan_stages(_apply(model), params, x, 3)
  assert plan.stage_layers == ((0,), (1, 2), (3,))
  parstrat.testing.check_strategy(
    parstrat.PipelineModelParallel(stages=3, microbatches=2),
    model,
    [optax.sgd(0.1)],
    steps=3,
    batch=8,
  )


def test_microbatches_must_divide_the_batch():
  trainer = parstrat.PipelineModelParallel(stages=2, microbatches=4)(SEED_MLP, optax.sgd(0.1))
  images, labels = parstrat.testing.random_batches(1, 16)
  state = trainer.init(jax.random.key(0), images[0][:1])
  with pytest.raises(ValueError, match=r"positive multiple of 4 \(4 microbatches\), got 6"):
    trainer.step(state, (images[0][:6], labels[0][:6]))
  # M left to its default comes from a given schedule (it said "one per stage": 2)
  given = pipeline.build_schedule("1f1b", 2, 4)
  trainer = parstrat.PipelineModelParallel(stages=2, schedule=given)(SEED_MLP, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), images[0][:1])
  with pytest.raises(ValueError, match=r"\(4 microbatches \(default: the given schedule's\)\)"):
    trainer.step(state, (images[0][:6], labels[0][:6]))


def _edited_gpipe(one_slot):
  """GPipe at P=2, M=4 with its stash cut to one slot: its tables moved there, or not."""
  schedule = pipeline.build_schedule("gpipe", 2, 4)
  tables = {}
  if one_slot:
    tables = {k: np.minimum(getattr(schedule, k), 0) for k in ("act_slot", "recv_act_slot")}
  return dataclasses.replace(schedule, num_act_slots=1, **tables)


@pytest.mark.parametrize(
  "kwargs, error, message",
  [
    (dict(stages=0), ValueError, "stages must be a positive integer, got 0"),
    (dict(stages=16), ValueError, "needs 16 devices, but only 8 are available"),
    (dict(stages=2, microbatches=0), ValueError, "microbatches must be a positive integer, got 0"),
    (dict(stages=2, schedule="interleaved"), ValueError, "Unknown schedule 'interleaved'"),
    (dict(stages=2, activations="keep"), ValueError, "Unknown activations 'keep'; choose one"),
    (
      dict(stages=2, schedule="gpipe", virtual_stages=2),
      ValueError,
      "virtual_stages=2 needs schedule 'interleaved_1f1b'",
    ),
    (
      dict(stages=4, schedule=pipeline.build_schedule("1f1b", 2, 2)),
      ValueError,
      "The '1f1b' schedule runs stages=2, not 4",
    ),
    (dict(stages=2, exchange_every=0), ValueError, "exchange_every must be a positive integer"),
    (dict(stages=2, unroll="yes"), ValueError, "unroll must be True or False, got 'yes'"),
    # (`--strategy-option cuts=3` gave "'int' object is not iterable")
    (dict(stages=2, cuts=3), ValueError, r"cuts must be a tuple of layer indices, got 3\."),
    (
      dict(stages=2, schedule=pipeline.build_schedule("1f1b", 2, 2), exchange_every=2),
      ValueError,
      "The '1f1b' schedule runs exchange_every=1, not 2",
    ),
    (  # A `Schedule` edited by hand is checked before it runs: every stashed input in
      # one slot, where later forwards overwrite inputs still needed, trained wrong.
      dict(stages=2, microbatches=4, schedule=_edited_gpipe(one_slot=True)),
      ValueError,
      "The 'gpipe' schedule does not check: tick 5: stage 1 reads the wrong input for microbatch 0",
    ),
    (
      dict(stages=2, microbatches=4, schedule=_edited_gpipe(one_slot=False)),
      ValueError,
      r"does not check: tick 2, stage 1: Schedule.act_slot is 1, outside the "
      r"num_act_slots=1 slots \(-1 for none\)",
    ),
  ],
)
def test_bad_configs(kwargs, error, message):
  with pytest.raises(error, match=message):
    parstrat.PipelineModelParallel(**kwargs)(SEED_MLP, optax.sgd(0.1))


# ---------------------------------------------------------------- equivalence
@pytest.mark.parametrize("microbatches, schedule", [(2, "gpipe"), (4, "1f1b")])
def test_seed_mlp_matches_jit(schedule, microbatches):
  strategy = parstrat.PipelineModelParallel(stages=2, microbatches=microbatches, schedule=schedule)
  parstrat.testing.check_strategy(strategy, SEED_MLP, steps=20, batch=32)


# Stages x microbatches (1, P and 2P) with the schedules alternating, to keep the
# suite's time: every (P, M, schedule) table is checked exhaustively and cheaply in
# test_schedule.py, and both schedules run at P = 8. P = 2 at M = 4 under 1F1B is
# test_seed_mlp_matches_jit[4-1f1b]; P = 4 runs GPipe in tests/test_model_matrix.py
# (pipeline:4,gpipe) and test_nan_bubbles_never_leak, 1F1B at M = 2P below at P = 8.
DEEP_CASES = [
  (2, 1, "gpipe"),
  (8, 1, "1f1b"),
  (8, 8, "gpipe"),
  (8, 16, "1f1b"),
]


@pytest.mark.parametrize("stages, microbatches, schedule", DEEP_CASES)
def test_deep_unequal_mlp_matches_jit(stages, microbatches, schedule):
  # SGD on every case (a wrong gradient scale shows); Adam too on the largest cases
  # (the seed-MLP matrix above runs Adam on every case).
  optimizers = [optax.sgd(0.1)]
  if stages == 8 and microbatches == 16:
    optimizers.append(optax.adam(1e-3))
  strategy = parstrat.PipelineModelParallel(
    stages=stages, microbatches=microbatches, schedule=schedule
  )
  parstrat.testing.check_strategy(strategy, DEEP_MLP, optimizers, steps=6, batch=32)


# Zero bubble (backward split into I and W) and interleaved virtual stages (8 model
# stages on 4 devices: DEEP_MLP's 8 layers, chunk c on device c % 4, wrapping from
# device 3 to device 0), NaN in every bubble.
# ZB-H1 at M = 2P, where some gradients wait on their sender for a later exchange
# (`engine.exchange_plan`; at M = P nothing waits).
# Interleaved at `exchange_every=1` (its default, 2, runs in the tests below).
@pytest.mark.parametrize(
  "stages, microbatches, schedule, virtual_stages",
  [(4, 8, "zb_h1", None), (4, 4, "interleaved_1f1b", 2)],
)
def test_zero_bubble_and_interleaved_match_jit(stages, microbatches, schedule, virtual_stages):
  strategy = parstrat.PipelineModelParallel(
    stages=stages,
    microbatches=microbatches,
    schedule=schedule,
    virtual_stages=virtual_stages,
    exchange_every=1,
    bubble_value=float("nan"),
  )
  parstrat.testing.check_strategy(
    strategy, DEEP_MLP, [optax.sgd(0.1), optax.adam(1e-3)], steps=3, batch=16
  )


def test_interleaved_exchanges_every_two_ticks_unless_told_otherwise():
  for schedule, given, runs in [
    ("interleaved_1f1b", None, 2),
    ("interleaved_1f1b", 1, 1),
    ("1f1b", None, 1),
    ("zb_h1", None, 1),
  ]:
    strategy = parstrat.PipelineModelParallel(
      stages=2, microbatches=4, schedule=schedule, exchange_every=given
    )
    trainer = strategy(DEEP_MLP, optax.sgd(0.1))
    trainer.init(jax.random.key(0), jnp.zeros((1, 16)))
    description = trainer.plan.description
    assert ("(an exchange every 2)" in description) == (runs == 2), (schedule, given)


def test_exchanges_take_two_ppermutes_only_where_two_messages_cannot_wait():
  # Every GPipe and 1F1B exchange is one permutation at K = 1 as the table has it;
  # ZB-H1's become one where a gradient waits on its sender through a W pass
  # (`tests/test_schedule.py::test_the_exchange_plan_delivers_what_the_table_does`);
  # interleaved's devices send every tick of its steady state, so at P=4, M=8 nothing
  # waits and 2 of its exchanges still take two.
  for name, v, two_way, waits in (
    ("1f1b", 1, 0, False),
    ("zb_h1", 1, 0, True),
    ("interleaved_1f1b", 2, 2, False),
  ):
    plan = engine.exchange_plan(pipeline.build_schedule(name, 4, 8, virtual_stages=v))
    assert sum(plan.ways[i] == engine.BOTH_WAYS for i in plan.way_index) == two_way, name
    assert plan.waits == waits, name
  plan = engine.exchange_plan(pipeline.build_schedule("1f1b", 4, 8, exchange_every=2))
  assert plan.ways == (engine.BOTH_WAYS,) and not plan.waits


def _step_jaxpr(**options):
  """The traced step of a P = 4, M = 8 pipeline on DEEP_MLP."""
  strategy = parstrat.PipelineModelParallel(stages=4, microbatches=8, **options)
  trainer = strategy(DEEP_MLP, optax.sgd(0.1))
  state = trainer.init_abstract(jax.random.key(0), np.zeros((1, 16), np.float32))
  sharding = trainer._batch_sharding()
  batch = (
    jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=sharding),
    jax.ShapeDtypeStruct((32,), jnp.int32, sharding=sharding),
  )
  return trainer._compiled_step.trace(state, batch).jaxpr.jaxpr


def _ppermutes_per_exchange(schedule, **options):
  """(the most ppermutes one exchange branch runs, ppermutes outside a switch) in a step."""
  step = _step_jaxpr(schedule=schedule, **options)
  (loop,) = [  # the tick loop (a `scan`: `fori_loop` with a fixed trip count)
    j
    for e in _eqns(step)
    if e.primitive.name in ("scan", "while")
    for j in _subjaxprs(e)
    if _count(j, "ppermute")
  ]
  switches = [e for e in _eqns(loop) if e.primitive.name == "cond" and _count_in(e, "ppermute")]
  most = max(
    (_count(b.jaxpr, "ppermute") for e in switches for b in e.params["branches"]), default=0
  )
  return most, _count(loop, "ppermute") - sum(_count_in(e, "ppermute") for e in switches)


def test_a_step_at_k1_runs_one_ppermute_per_exchange():
  assert _ppermutes_per_exchange("1f1b") == (1, 0)
  assert _ppermutes_per_exchange("gpipe", activations="save") == (1, 0)
  assert _ppermutes_per_exchange("zb_h1") == (1, 0)  # (some gradients wait for it)
  assert _ppermutes_per_exchange("zb_h1", activations="save") == (1, 0)
  assert _ppermutes_per_exchange("interleaved_1f1b", virtual_stages=2, exchange_every=1) == (
    2,
    0,
  )  # (in its 2 exchanges where two messages reach one device and neither can wait)
  assert _ppermutes_per_exchange("1f1b", exchange_every=2) == (0, 2)


def test_one_device_interleaved_passes_chunk_to_chunk_without_a_collective():
  strategy = parstrat.PipelineModelParallel(
    stages=1, microbatches=4, schedule="interleaved_1f1b", virtual_stages=2, exchange_every=1
  )
  trainer = strategy(DEEP_MLP, optax.sgd(0.1))
  images, labels = parstrat.testing.random_batches(1, 16)
  state = trainer.init(jax.random.key(0), images[0][:1])
  step = trainer._compiled_step.trace(state, (images[0], labels[0])).jaxpr.jaxpr
  assert _count(step, "ppermute") == 0  # (a one-device ppermute is a rendezvous for nothing)
  parstrat.testing.check_strategy(strategy, DEEP_MLP, [optax.sgd(0.1)], steps=2, batch=16)


def test_a_schedule_read_from_csv_runs():
  # Designed by hand: stage 1 runs full backwards, stage 0 splits its second one into
  # an input-gradient and a weight-gradient pass.
  schedule = pipeline.from_csv("0F0,0F1,,0B0,,0I1,0W1\n,1F0,1B0,1F1,1B1,,\n", name="mine")
  strategy = parstrat.PipelineModelParallel(stages=2, schedule=schedule)
  reports = parstrat.testing.check_strategy(strategy, DEEP_MLP, [optax.sgd(0.1)], steps=3, batch=8)
  assert len(reports[0].losses) == 3


def test_interleaved_apply_matches_the_model_and_each_device_holds_its_chunks():
  strategy = parstrat.PipelineModelParallel(
    stages=4, microbatches=4, schedule="interleaved_1f1b", virtual_stages=2
  )
  trainer = strategy(DEEP_MLP, optax.sgd(0.1))
  images, _ = parstrat.testing.random_batches(1, 16)
  state = trainer.init(jax.random.key(0), images[0][:1])
  params = trainer.params(state)
  np.testing.assert_allclose(
    trainer.apply(state, images[0]), DEEP_MLP.apply(params, None, images[0]), atol=1e-6
  )
  # Device s holds rows for model stages s and s + 4: layers s and s + 4 of the 8.
  rows = {shard.device: np.asarray(shard.data) for shard in state.params.addressable_shards}
  for s, device in enumerate(trainer.mesh.devices.flat):
    assert rows[device].shape[0] == 2
    for chunk in range(2):
      layer = params[f"mlp/~/linear_{chunk * 4 + s}"]
      own = np.concatenate([np.asarray(layer[k]).reshape(-1) for k in ("b", "w")])
      np.testing.assert_array_equal(rows[device][chunk, : own.size], own)


# ------------------------------------------------------------ activation memory
WIDE = mlp([64, 64, 64, 10])  # four layers, every boundary 64 wide


@functools.cache
def _compiled_cost(microbatches, schedule="1f1b", activations="recompute"):
  """(temporaries in microbatch activation slots, XLA's FLOP count) of the step at P=4.

  Microbatches of 8 examples, lowered abstractly (nothing is allocated).
  """
  strategy = parstrat.PipelineModelParallel(
    stages=4, microbatches=microbatches, schedule=schedule, activations=activations
  )
  trainer = strategy(WIDE, optax.sgd(0.1))
  state = trainer.init_abstract(jax.random.key(0), np.zeros((1, 16), np.float32))
  batch = (
    jax.ShapeDtypeStruct((8 * microbatches, 16), jnp.float32),
    jax.ShapeDtypeStruct((8 * microbatches,), jnp.int32),
  )
  compiled = trainer.lower(state, batch).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  slot_bytes = 8 * 64 * 4
  return compiled.memory_analysis().temp_size_in_bytes / slot_bytes, cost["flops"]


def test_1f1b_holds_p_activation_slots_not_m():
  # Doubling M (same microbatch size) adds M stash slots to GPipe and none to 1F1B,
  # in the compiled program's memory, not only in the table.
  M = 8
  gpipe = _compiled_cost(2 * M, "gpipe")[0] - _compiled_cost(M, "gpipe")[0]
  one_f = _compiled_cost(2 * M)[0] - _compiled_cost(M)[0]
  assert gpipe >= M, gpipe
  assert one_f < 1, one_f
  # ZB-H1 too, with the values each I pass hands its W pass in slots of their own.
  zero_bubble = _compiled_cost(2 * M, "zb_h1")[0] - _compiled_cost(M, "zb_h1")[0]
  assert zero_bubble < 1, zero_bubble


def test_activation_policies_trade_memory_for_compute():
  recompute, save, dots = (_compiled_cost(8, activations=a) for a in ACTIVATIONS)
  # Keeping residuals costs memory and saves the forward rerun in every backward.
  assert recompute[0] < dots[0] < save[0], (recompute, dots, save)
  assert save[1] < dots[1] < recompute[1], (recompute, dots, save)
  # The residual slots follow the schedule, not M: 1F1B still holds P of them.
  assert _compiled_cost(16, activations="save")[0] - save[0] < 1


ACTIVATIONS = ("recompute", "save", "dots_saveable")


def _forwards_per_step(schedule, activations):
  """How often a step runs each layer's forward, per microbatch, counted on the devices."""
  calls = []

  def model(x):
    for _ in range(8):
      x = jax.nn.swish(hk.Linear(16)(x))
      jax.debug.callback(lambda: calls.append(1))
    return x

  strategy = parstrat.PipelineModelParallel(
    stages=4, microbatches=4, schedule=schedule, activations=activations
  )
  trainer = strategy(hk.transform(model), optax.sgd(0.1))
  x, y = np.ones((16, 16), np.float32), np.zeros((16,), np.int32)
  state = trainer.init(jax.random.key(0), x[:1])
  jax.effects_barrier()
  calls.clear()
  jax.block_until_ready(trainer.step(state, (x, y)))
  jax.effects_barrier()
  return len(calls) / (8 * 4)


def test_backward_passes_rerun_the_forward_only_under_recompute():
  # 1F1B's B reruns the forward once. So does ZB-H1's I pass, and its W pass reruns
  # nothing: I hands W what it needs (it was 2.75 when I and W reran it each). "save"
  # runs each forward once.
  assert _forwards_per_step("1f1b", "recompute") == 2
  assert _forwards_per_step("zb_h1", "recompute") == 2
  assert _forwards_per_step("zb_h1", "save") == 1


def _dots(fn, *args) -> int:
  return sum(e.primitive.name == "dot_general" for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns)


def _subjaxprs(eqn):
  for value in eqn.params.values():
    for j in value if isinstance(value, (list, tuple)) else [value]:
      if isinstance(j, (jex.ClosedJaxpr, jex.Jaxpr)):
        yield getattr(j, "jaxpr", j)


def _count(jaxpr, primitive: str) -> int:
  """The equations of one primitive in a jaxpr, its sub-jaxprs included."""
  return sum(
    1 if e.primitive.name == primitive else sum(_count(j, primitive) for j in _subjaxprs(e))
    for e in jaxpr.eqns
  )


def _count_in(eqn, primitive: str) -> int:
  """The equations of one primitive inside one equation's sub-jaxprs (once per branch)."""
  return sum(_count(j, primitive) for j in _subjaxprs(eqn))


def _eqns(jaxpr):
  """Every equation of a jaxpr and of its sub-jaxprs."""
  for e in jaxpr.eqns:
    yield e
    for j in _subjaxprs(e):
      yield from _eqns(j)


def _switches(jaxpr):
  """The branches of every per-tick `lax.switch` over passes (a cond of more than 2
  branches, none of which runs a collective: not the exchange's switch)."""
  for e in jaxpr.eqns:
    branches = e.params.get("branches", ()) if e.primitive.name == "cond" else ()
    if len(branches) > 2 and not any(_count(b.jaxpr, "ppermute") for b in branches):
      yield branches
    for j in _subjaxprs(e):
      yield from _switches(j)


def _products_per_pass(schedule, activations):
  """The matrix products in each branch of the step's per-tick `lax.switch`.

  On 8 layers of 16 x 16 over 4 stages (2 layers a stage), traced, not run.
  """

  def model(x):
    for _ in range(8):
      x = jax.nn.swish(hk.Linear(16)(x))
    return x

  strategy = parstrat.PipelineModelParallel(
    stages=4, microbatches=4, schedule=schedule, activations=activations
  )
  trainer = strategy(hk.transform(model), optax.sgd(0.1))
  state = trainer.init_abstract(jax.random.key(0), np.zeros((1, 16), np.float32))
  sharding = trainer._batch_sharding()
  batch = (
    jax.ShapeDtypeStruct((16, 16), jnp.float32, sharding=sharding),
    jax.ShapeDtypeStruct((16,), jnp.int32, sharding=sharding),
  )

  (branches,) = _switches(trainer._compiled_step.trace(state, batch).jaxpr.jaxpr)
  return [_count(b.jaxpr, "dot_general") for b in branches]


def test_every_zero_bubble_pass_runs_at_most_one_product_per_layer_and_a_rerun():
  # 2 layers a stage. 1F1B's B: 2 forward reruns, 2 dX and 2 dW products ("save": 4).
  # ZB-H1's I: 2 reruns and 2 dX products (the first stage: 1, the batch has no
  # gradient), W: the 2 dW products; "save": one product per layer in every pass. The
  # first stage's W ran its whole weight backward (5 and 4) before I computed its
  # gradient chain.
  assert max(_products_per_pass("1f1b", "recompute")) == 6
  assert max(_products_per_pass("1f1b", "save")) == 4
  assert max(_products_per_pass("zb_h1", "recompute")) == 4
  assert max(_products_per_pass("zb_h1", "save")) == 2


def test_a_weight_pass_runs_only_the_weight_gradient_products():
  # A stage of three linear layers with a LayerNorm and a skip connection: its traced
  # backward reruns 3 forward products and runs 3 input-gradient and 3 weight-gradient
  # ones. Split, the W pass runs only the 3 weight-gradient products, the I pass the
  # 3 input-gradient ones and the 2 forward ones whose outputs a gradient reads
  # (nothing twice), and what I hands W is activation-sized, never a weight.
  def stage(w, x):
    h = jax.nn.swish(x @ w[0])
    h = h + jax.nn.swish(h @ w[1])  # skip connection
    h = (h - h.mean(-1, keepdims=True)) * lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
    return h @ w[2]

  def backward(w, x, dy):
    d_w, d_x = jax.vjp(stage, w, x)[1](dy)
    return d_w, d_x

  rng = np.random.default_rng(0)
  w = [jnp.asarray(rng.normal(size=(16, 16)), jnp.float32) for _ in range(3)]
  x, dy = (jnp.asarray(rng.normal(size=(4, 16)), jnp.float32) for _ in range(2))
  split = backward_split.split_backward(backward, w, x, dy)
  assert _dots(backward, w, x, dy) == 9
  handoff = [jnp.zeros(h.shape, h.dtype) for h in split.handoff]
  assert _dots(split.weight_pass, handoff, w, x, dy) == 3
  assert _dots(split.input_pass, w, x, dy) == 5
  assert _dots(lambda *a: split.weight_pass(split.input_pass(*a)[1], *a), w, x, dy) == 8
  assert split.handoff and all(h.shape[0] == 4 for h in split.handoff), split.handoff
  d_x, handoff = split.input_pass(w, x, dy)
  want_w, want_x = backward(w, x, dy)
  np.testing.assert_allclose(d_x, want_x, rtol=1e-6)
  for got, want in zip(split.weight_pass(handoff, w, x, dy), want_w, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

  # Without the input gradient (a first stage, whose input is the batch), I computes
  # only the chain both gradients share: the 2 forward reruns and the 2 input-gradient
  # products the lower layers' dY need, not the first layer's dX.
  first = backward_split.split_backward(backward, w, x, dy, input_gradient=False)
  handoff = [jnp.zeros(h.shape, h.dtype) for h in first.handoff]
  assert _dots(first.input_pass, w, x, dy) == 4
  assert _dots(first.weight_pass, handoff, w, x, dy) == 3
  nothing, handoff = first.input_pass(w, x, dy)
  assert nothing is None
  for got, want in zip(first.weight_pass(handoff, w, x, dy), want_w, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

  # A value both passes read that W can rebuild from its own inputs by moving data
  # (here the reshaped stage input, which I needs for the gate's product rule and W
  # for the first product's dW) is not handed off: I hands W only the first
  # product's dY and the second product's X.
  def gated(w, x):
    x = x.reshape(4, 16)
    return (x * jax.nn.sigmoid(x @ w[0])) @ w[1]

  def gated_backward(w, x, dy):
    return jax.vjp(gated, w, x)[1](dy)

  x3 = x.reshape(4, 2, 8)
  split = backward_split.split_backward(gated_backward, w[:2], x3, dy)
  assert len(split.handoff) == 2, split.handoff
  d_x, handoff = split.input_pass(w[:2], x3, dy)
  want_w, want_x = gated_backward(w[:2], x3, dy)
  np.testing.assert_allclose(d_x, want_x, rtol=1e-6)
  for got, want in zip(split.weight_pass(handoff, w[:2], x3, dy), want_w, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _scanned_stack(x, layers=8, width=256):
  # Layers as one `lax.scan` over stacked weights (what `hk.layer_stack` builds): the
  # scan's transpose computes the stack's weight gradient and the input gradient in
  # one equation.
  x = jnp.tanh(hk.Linear(width)(x))
  w = hk.get_parameter("stack", (layers, width, width), init=hk.initializers.RandomNormal(0.05))
  x = lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]
  return hk.Linear(10)(x)


def test_a_weight_pass_reruns_a_scan_rather_than_take_its_weight_gradient_from_i():
  def backward(w, x, dy):
    stage = lambda w, x: lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]
    return jax.vjp(stage, w, x)[1](dy)

  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.normal(size=(3, 16, 16)) * 0.3, jnp.float32)
  x, dy = (jnp.asarray(rng.normal(size=(4, 16)), jnp.float32) for _ in range(2))
  split = backward_split.split_backward(backward, w, x, dy)
  # I hands W the scan's residuals (3 layers x the batch), never the stack's gradient;
  # W reruns the backward scan, not the forward one.
  assert split.handoff and all(h.shape[1] == 4 for h in split.handoff), split.handoff
  handoff = [jnp.zeros(h.shape, h.dtype) for h in split.handoff]
  eqns = jax.make_jaxpr(split.weight_pass)(handoff, w, x, dy).jaxpr.eqns
  assert [e.primitive.name for e in eqns].count("scan") == 1, eqns
  d_x, handoff = split.input_pass(w, x, dy)
  want_w, want_x = backward(w, x, dy)
  np.testing.assert_allclose(d_x, want_x, rtol=1e-6)
  np.testing.assert_allclose(split.weight_pass(handoff, w, x, dy), want_w, rtol=1e-5, atol=1e-6)


def test_a_weight_pass_takes_a_long_scans_small_weight_gradient_rather_than_rerun_it():
  # A recurrence over 64 time steps with an 8 x 8 weight: the scan's residuals (64 steps
  # of the batch) outweigh the weight's gradient, so I hands W that gradient and W
  # reruns no scan.
  def backward(w, xs, dy):
    def stage(w, xs):
      return lax.scan(lambda h, x_t: (jnp.tanh(h @ w + x_t), None), jnp.zeros_like(xs[0]), xs)[0]

    return jax.vjp(stage, w, xs)[1](dy)

  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.normal(size=(8, 8)) * 0.3, jnp.float32)
  xs = jnp.asarray(rng.normal(size=(64, 4, 8)), jnp.float32)
  dy = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
  split = backward_split.split_backward(backward, w, xs, dy)
  assert [h.shape for h in split.handoff] == [(8, 8)], split.handoff
  handoff = [jnp.zeros(h.shape, h.dtype) for h in split.handoff]
  eqns = jax.make_jaxpr(split.weight_pass)(handoff, w, xs, dy).jaxpr.eqns
  assert "scan" not in [e.primitive.name for e in eqns], eqns
  d_xs, handoff = split.input_pass(w, xs, dy)
  want_w, want_xs = backward(w, xs, dy)
  np.testing.assert_allclose(d_xs, want_xs, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(split.weight_pass(handoff, w, xs, dy), want_w, rtol=1e-5, atol=1e-6)


def _temp_mib(strategy, model, x, y) -> float:
  """The step's compiled temporaries per device on a batch like (x, y), in MiB (SGD)."""
  trainer = strategy(model, optax.sgd(0.1))
  state = trainer.init_abstract(jax.random.key(0), x[:1])
  batch = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(y.shape, y.dtype))
  return trainer.lower(state, batch).compile().memory_analysis().temp_size_in_bytes / 2**20


def test_zero_bubble_with_a_scanned_stack_matches_one_device_and_holds_no_weight_sized_handoff():
  small = hk.transform(functools.partial(_scanned_stack, layers=3, width=16))
  pipe = functools.partial(parstrat.PipelineModelParallel, stages=2, cuts=(1,))
  parstrat.testing.check_strategy(
    pipe(microbatches=4, schedule="zb_h1", bubble_value=float("nan")),
    small,
    [optax.sgd(0.1), optax.adam(1e-2)],
    steps=2,
    batch=16,
    features=12,
  )
  # Handing the stack's gradient (2 MiB here) from I to W would keep one per handoff
  # slot: ZB-H1's temporaries would exceed 1F1B's by 4 MiB, not by the residuals.
  x, y = np.zeros((64, 16), np.float32), np.zeros((64,), np.int32)
  temp = {
    schedule: _temp_mib(pipe(microbatches=8, schedule=schedule), hk.transform(_scanned_stack), x, y)
    for schedule in ("1f1b", "zb_h1")
  }
  assert temp["zb_h1"] - temp["1f1b"] < 1.0, temp


def _inputs_halved_in_a_loop(x):
  # A data-dependent `lax.while_loop` on the batch (each entry halved until it is at
  # most 1 in size): reverse-mode autodiff cannot cross it, and the weights' gradient
  # never needs to.
  x = lax.while_loop(
    lambda v: jnp.any(jnp.abs(v) > 1.0), lambda v: jnp.where(jnp.abs(v) > 1.0, v / 2, v), x * 4
  )
  for _ in range(3):
    x = jax.nn.swish(hk.Linear(16)(x))
  return hk.Linear(10)(x)


@pytest.mark.parametrize(
  "schedule, activations",
  [("zb_h1", "recompute"), ("zb_h1", "save"), ("zb_h1", "dots_saveable"), ("1f1b", "save")],
)
def test_a_first_stage_whose_inputs_have_no_derivative_trains(schedule, activations):
  # ZB-H1 cuts the first stage's backward as traced with respect to its float inputs
  # too; where the inputs cannot be differentiated, that stage keeps its unsplit
  # backward (W runs it whole), as 1F1B does. Kept residuals are those of the
  # stage's parameters alone there (the vjp over the inputs failed to transpose).
  parstrat.testing.check_strategy(
    parstrat.PipelineModelParallel(
      stages=2,
      microbatches=4,
      schedule=schedule,
      activations=activations,
      bubble_value=float("nan"),
    ),
    hk.transform(_inputs_halved_in_a_loop),
    [optax.sgd(0.1)],
    steps=2,
    batch=16,
    features=12,
  )


def test_any_other_failure_to_cut_the_first_stage_is_raised(monkeypatch):
  original = backward_split.split_backward

  def broken(*args, input_gradient=True):
    if not input_gradient:
      raise RuntimeError("the cut failed")
    return original(*args)

  monkeypatch.setattr(backward_split, "split_backward", broken)
  strategy = parstrat.PipelineModelParallel(stages=2, microbatches=4, schedule="zb_h1")
  trainer = strategy(mlp([16, 16, 10]), optax.sgd(0.1))
  x, y = np.ones((16, 12), np.float32), np.zeros((16,), np.int32)
  with pytest.raises(RuntimeError, match="the cut failed"):
    trainer.step(trainer.init(jax.random.key(0), x), (x, y))


def _first_stage_input_pass_writes(model, batch) -> int:
  """The buffer writes in ZB-H1's I pass of model stage 0 (P=2), traced, not run."""
  strategy = parstrat.PipelineModelParallel(stages=2, microbatches=4, schedule="zb_h1")
  trainer = strategy(model, optax.sgd(0.1))
  state = trainer.init_abstract(jax.random.key(0), batch[0][:1])
  sharding = trainer._batch_sharding()
  abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in batch]
  (branches,) = _switches(trainer._compiled_step.trace(state, abstract).jaxpr.jaxpr)
  keys, _ = engine.branch_table(pipeline.build_schedule("zb_h1", 2, 4))
  branch = branches[keys.index((pipeline.Action.BACKWARD_INPUT, 0))]
  return _count(branch.jaxpr, "dynamic_update_slice")


def test_a_first_stage_fed_only_tokens_hands_nothing_from_i_to_w():
  # Integer inputs have no gradient chain through the first stage: its I pass has
  # nothing to compute or hand off, so it writes no handoff slot; a float-fed first
  # stage's I pass writes one.
  def tokens(t):
    x = hk.Embed(32, 16)(t)
    for _ in range(3):
      x = jax.nn.swish(hk.Linear(16)(x))
    return hk.Linear(10)(x)

  labels = np.zeros((16,), np.int32)
  token_batch = (np.zeros((16,), np.int32), labels)
  assert _first_stage_input_pass_writes(hk.transform(tokens), token_batch) == 0
  float_batch = (np.zeros((16, 12), np.float32), labels)
  assert _first_stage_input_pass_writes(mlp([16, 16, 16, 16]), float_batch) == 1


def test_a_first_stage_whose_handoff_is_the_largest_stays_unsplit():
  # The CNN's first stage holds its full-resolution activations: cut, its handoff would
  # size every device's handoff slots (ZB-H1's temporaries 0.171 MiB against 1F1B's
  # 0.094); unsplit, ZB-H1 stays near 1F1B.
  x, y = models.image_batches(1, 64)[0]
  assert _first_stage_input_pass_writes(models.CNN.model, (x, y)) == 0
  pipe = functools.partial(parstrat.PipelineModelParallel, stages=2, microbatches=8)
  temp = {
    schedule: _temp_mib(pipe(schedule=schedule), models.CNN.model, x, y)
    for schedule in ("1f1b", "zb_h1")
  }
  assert temp["zb_h1"] < 1.2 * temp["1f1b"], temp


def test_gpipe_keeps_an_input_or_residuals_per_microbatch_never_its_params():
  M = 8
  recompute, save = (_compiled_cost(M, "gpipe", a) for a in ("recompute", "save"))
  # "save" keeps the residuals and drops the forward rerun of "recompute".
  assert recompute[0] < save[0] and save[1] < recompute[1], (recompute, save)
  # Each extra microbatch keeps its stage input ("recompute": one slot) or its
  # residuals, never a copy of the stage's params (4,160 floats: 8 slots).
  for activations, most in (("recompute", 1.5), ("save", 6)):
    costs = [_compiled_cost(m, "gpipe", activations)[0] for m in (M, 2 * M)]
    more = costs[1] - costs[0]
    assert M <= more <= most * M, (activations, more)


@pytest.mark.parametrize("activations", ["save", "dots_saveable"])
def test_gpipe_keeping_activations_matches_jit(activations):
  # NaN in the bubbles: an idle tick's output is never read, forward or backward.
  strategy = parstrat.PipelineModelParallel(
    stages=4,
    microbatches=4,
    schedule="gpipe",
    activations=activations,
    bubble_value=float("nan"),
  )
  parstrat.testing.check_strategy(
    strategy, DEEP_MLP, [optax.sgd(0.1), optax.adam(1e-3)], steps=3, batch=16
  )


def _check_nan_bubbles_with_sgd(schedule, activations, virtual_stages, **options):
  """P = M = 4 on DEEP_MLP matches single-device jit with SGD, NaN in every bubble."""
  strategy = parstrat.PipelineModelParallel(
    stages=4,
    microbatches=4,
    schedule=schedule,
    virtual_stages=virtual_stages,
    activations=activations,
    bubble_value=float("nan"),
    **options,
  )
  parstrat.testing.check_strategy(strategy, DEEP_MLP, [optax.sgd(0.1)], steps=3, batch=16)


@pytest.mark.parametrize(
  "schedule, activations, virtual_stages",
  # ZB-H1 "save" with NaN bubbles: test_a_first_stage_whose_inputs_have_no_derivative_trains
  # and test_the_leaves_alike_in_every_stage_are_cut_once_per_step (P = 2), and at P = 4
  # test_values_from_the_model_inputs_are_recomputed_by_the_stages_that_read_them.
  [("interleaved_1f1b", "dots_saveable", 2)],
)
def test_saved_activations_match_jit(schedule, activations, virtual_stages):
  _check_nan_bubbles_with_sgd(schedule, activations, virtual_stages)


# Two ticks between message exchanges (a forward and a backward per exchange in the
# steady state): the exchange carries the one activation and the one gradient each
# device sent in either tick, NaN in every bubble. SGD (it fails if a gradient is
# scaled or misrouted); Adam runs with exchange_every=2 in the model matrix (the LM).
@pytest.mark.parametrize(
  "schedule, activations, virtual_stages",
  [
    ("1f1b", "save", None),
    ("zb_h1", "recompute", None),
    ("zb_h1", "dots_saveable", None),
    ("interleaved_1f1b", "save", 2),
  ],
)
def test_an_exchange_every_two_ticks_matches_jit(schedule, activations, virtual_stages):
  _check_nan_bubbles_with_sgd(schedule, activations, virtual_stages, exchange_every=2)


# Unrolled ticks: the same passes and exchanges as straight-line code, each tick's
# switch indexed among its own passes. SGD, NaN in every bubble: a pass picked from
# the wrong tick, or an exchange moving another's messages, changes the params.
# Interleaved at P = 3, M = 6 (six model stages) is the smallest table where messages
# wait on their sender and other exchanges take two ppermutes. (ZB-H1's I and W
# passes and "save"'s residual slots, two ticks per exchange, unrolled:
# tests/test_hybrid_model_axis.py.)
def test_unrolled_ticks_match_jit():
  plan = engine.exchange_plan(pipeline.build_schedule("interleaved_1f1b", 3, 6, virtual_stages=2))
  assert plan.waits and engine.BOTH_WAYS in plan.ways
  strategy = parstrat.PipelineModelParallel(
    stages=3,
    microbatches=6,
    schedule="interleaved_1f1b",
    virtual_stages=2,
    exchange_every=1,
    unroll=True,
    bubble_value=float("nan"),
  )
  parstrat.testing.check_strategy(strategy, DEEP_MLP, [optax.sgd(0.1)], steps=2, batch=12)


@pytest.mark.parametrize(
  "options",
  [dict(schedule="zb_h1"), dict(schedule="interleaved_1f1b", virtual_stages=2, exchange_every=1)],
  ids=lambda options: options["schedule"],
)
def test_unrolled_ticks_run_no_loop_and_each_exchange_its_own_ppermutes(options):
  schedule = pipeline.build_schedule(
    options["schedule"], 4, 8, virtual_stages=options.get("virtual_stages", 1)
  )
  plan = engine.exchange_plan(schedule)
  ways = [plan.ways[i] for i in plan.way_index]
  expected = sum(2 if way == engine.BOTH_WAYS else int(bool(way)) for way in ways)
  rolled, unrolled = _step_jaxpr(**options), _step_jaxpr(unroll=True, **options)
  for jaxpr in (rolled, unrolled):
    switches = [e for e in _eqns(jaxpr) if e.primitive.name == "cond"]
    assert switches, "no switch at all: the step was not read"
  # Rolled: one loop over the exchanges, its switch holding every pass of the table.
  assert [e.primitive.name for e in _eqns(rolled) if e.primitive.name in ("scan", "while")]
  # Unrolled: no loop; every ppermute outside any switch, one per exchange that moves
  # messages (two where two messages reach one device and neither can wait).
  assert not [e for e in _eqns(unrolled) if e.primitive.name in ("scan", "while")]
  assert not [e for e in _eqns(unrolled) if e.primitive.name == "cond" and _count_in(e, "ppermute")]
  assert _count(unrolled, "ppermute") == expected
  # Each tick's switch holds only the passes some device runs in it: P at most.
  passes = lambda jaxpr: [
    len(e.params["branches"]) for e in _eqns(jaxpr) if e.primitive.name == "cond"
  ]
  assert max(passes(unrolled)) <= 4 < max(passes(rolled))


def _row_slices_in_branches(trainer, state, batch) -> int:
  """How many times the step's per-stage branches slice a leaf out of a params row."""
  size = state.params.shape[-1]

  def walk(jaxpr, in_branch):
    for eqn in jaxpr.eqns:
      if in_branch and eqn.primitive.name == "dynamic_slice":
        yield eqn.invars[0].aval.shape == (size,)
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns"):
            yield from walk(sub, in_branch or eqn.primitive.name == "cond")

  return sum(walk(trainer._compiled_step.trace(state, batch).jaxpr.jaxpr, False))


# Leaves at the same place in every stage's buffer (same shape, same offset) are cut
# from the device's row once per step, outside the tick loop (their gradients are
# accumulated apart and put back after it); the others in every pass that uses them.
# SGD: a gradient lost or added twice on either path changes the params.
@pytest.mark.parametrize(
  "widths, features, shared",
  [([16, 16, 16, 16], 16, (0, 1, 2, 3)), ([16, 16, 16, 10], 8, (0,))],
)
@pytest.mark.parametrize(
  "options",
  [
    dict(schedule="gpipe", cuts=(2,)),
    dict(schedule="1f1b", cuts=(2,)),
    dict(schedule="zb_h1", cuts=(2,), activations="save"),
    dict(schedule="interleaved_1f1b", virtual_stages=2, cuts=(1, 2, 3)),
  ],
  ids=lambda options: options["schedule"],
)
def test_the_leaves_alike_in_every_stage_are_cut_once_per_step(widths, features, shared, options):
  model = mlp(widths)
  params = model.init(jax.random.key(0), jnp.zeros((1, features)))
  # Two layers (bias, weight each) per stage, as cuts=(2,) gives.
  layout = engine.FlatLayout.build(params, ((0, 1, 2, 3), (4, 5, 6, 7)))
  assert layout.shared_leaves() == shared
  strategy = parstrat.PipelineModelParallel(
    stages=2, microbatches=2, bubble_value=float("nan"), **options
  )
  parstrat.testing.check_strategy(
    strategy, model, [optax.sgd(0.1)], steps=3, batch=8, features=features
  )
  trainer = strategy(model, optax.sgd(0.1))
  images, labels = parstrat.testing.random_batches(1, 8, features=features)
  state = trainer.init(jax.random.key(0), images[0][:1])
  slices = _row_slices_in_branches(trainer, state, (images[0], labels[0]))
  assert (slices == 0) == (len(shared) == len(layout.stage_leaves[0]))


# The gradient accumulators go into every tick's `lax.switch` and come back: added to
# in place by B and W passes, unchanged by the others. The step compiles with copy
# insertion's region analysis (`STEP_COMPILER_OPTIONS`), without which each of those
# branches copies them (a mutation that drops the option fails here).
@pytest.mark.parametrize(
  "options", [dict(schedule="1f1b"), dict(schedule="zb_h1", activations="save")], ids=str
)
def test_ticks_that_leave_the_gradients_alone_do_not_copy_them(options):
  model = mlp([16, 16, 16, 16])
  trainer = parstrat.PipelineModelParallel(stages=2, microbatches=2, cuts=(2,), **options)(
    model, optax.sgd(0.1)
  )
  images, labels = parstrat.testing.random_batches(1, 8, features=16)
  state = trainer.init(jax.random.key(0), images[0][:1])
  text = trainer.lower(state, (images[0], labels[0])).compile().as_text()
  copies = [line for kind, _, line in hlo_check.branch_instructions(text) if kind == "copy"]
  assert copies, "no branch copies at all: the HLO was not read"  # (the fills are copied)
  # The accumulators are f32[16,16] and f32[16] per layer; activations are [4, 16].
  assert not [line for line in copies if "f32[16,16]" in line or "f32[16]" in line]


# ------------------------------------------------------------------ placement
def test_each_device_holds_only_its_stage():
  trainer = parstrat.PipelineModelParallel(stages=4, microbatches=4)(DEEP_MLP, optax.adam(1e-3))
  images, labels = parstrat.testing.random_batches(2, 16)
  state = trainer.init(jax.random.key(0), images[0][:1])
  state, _ = trainer.step(state, (images[0], labels[0]))
  layout_rows = np.asarray(jax.device_get(state.params))
  stage_of = {d: i for i, d in enumerate(trainer.mesh.devices.flat)}
  for leaf in [state.params, *jax.tree.leaves(state.opt_state)]:
    if leaf.ndim == 0:
      continue
    assert leaf.shape[0] == 4
    for shard in leaf.addressable_shards:
      assert shard.data.shape == (1, leaf.shape[1])
      assert shard.index[0] == slice(stage_of[shard.device], stage_of[shard.device] + 1)
  # Each stage's row holds exactly its own layers' params (then zero padding).
  params = trainer.params(state)
  plan = pipeline.plan_stages(
    _apply(DEEP_MLP), params, jax.ShapeDtypeStruct((1, 784), jnp.float32), 4
  )
  names = [layer.name for layer in plan.layers]
  for s, group in enumerate(plan.stage_layers):
    own = np.concatenate(
      [np.asarray(params[names[i]][k]).reshape(-1) for i in group for k in ("b", "w")]
    )
    np.testing.assert_array_equal(layout_rows[s, : own.size], own)
    assert not np.any(layout_rows[s, own.size :])
  # ... padded to the largest stage and no further.
  sizes = [sum(params[names[i]][k].size for i in group for k in ("b", "w")) for group in
           plan.stage_layers]  # fmt: skip
  assert layout_rows.shape == (4, max(sizes)), (layout_rows.shape, sizes)


def test_nan_bubbles_never_leak():
  for schedule in ("gpipe", "1f1b"):
    strategy = parstrat.PipelineModelParallel(
      stages=4, microbatches=3, schedule=schedule, bubble_value=float("nan")
    )
    # SGD only: whether a bubble leaks does not depend on the optimizer.
    reports = parstrat.testing.check_strategy(
      strategy, DEEP_MLP, [optax.sgd(0.1)], steps=3, batch=24
    )
    assert all(np.isfinite(r.losses).all() for r in reports)


def test_apply_matches_the_model():
  trainer = parstrat.PipelineModelParallel(stages=8, microbatches=2)(DEEP_MLP, optax.sgd(0.1))
  images, labels = parstrat.testing.random_batches(1, 16)
  state = trainer.init(jax.random.key(0), images[0][:1])
  np.testing.assert_allclose(
    trainer.apply(state, images[0]),
    DEEP_MLP.apply(trainer.params(state), None, images[0]),
    atol=1e-6,
  )
