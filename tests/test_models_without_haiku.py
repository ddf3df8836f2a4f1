"""A model that is not Haiku's: any `init(rng, inputs)` / `apply(params, rng, inputs)` pair.

The strategies depend on that contract, not on Haiku's internals: a model whose
params are a Flax-style variables tree (`{"params": {"Dense_0": {"kernel", "bias"}}}`,
three levels where Haiku has two) is cut into stages by its layers and split
tensor-parallel like a Haiku one.
"""

import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import parstrat
import parstrat.testing

FEATURES = 12
WIDTHS = (FEATURES, 16, 16, 10)


def _init(rng, inputs):
  del inputs
  keys = jax.random.split(rng, len(WIDTHS) - 1)
  return {
    "params": {
      f"Dense_{i}": {
        "kernel": jax.random.normal(key, (fan_in, fan_out)) / np.sqrt(fan_in),
        "bias": jnp.zeros(fan_out),
      }
      for i, (key, fan_in, fan_out) in enumerate(zip(keys, WIDTHS[:-1], WIDTHS[1:], strict=True))
    }
  }


def _apply(variables, rng, x):
  del rng
  for i in range(len(WIDTHS) - 1):
    dense = variables["params"][f"Dense_{i}"]
    x = x @ dense["kernel"] + dense["bias"]
    x = jax.nn.gelu(x) if i < len(WIDTHS) - 2 else x
  return x


#: A plain-JAX model with a Flax-style variables tree: no Haiku anywhere.
FLAX_STYLE = types.SimpleNamespace(init=_init, apply=_apply)


def _decay_mask(params):
  return jax.tree.map(lambda p: p.ndim > 1, params)


@pytest.mark.parametrize(
  ("strategy", "optimizer"),
  [
    (parstrat.TensorParallel(model=2), optax.sgd(0.1)),
    (parstrat.PipelineModelParallel(stages=3, microbatches=4), optax.adamw(1e-2, mask=_decay_mask)),
    (parstrat.Hybrid(data=2, stages=2, model=2), optax.sgd(0.1)),
  ],
  ids=["tensor, sgd", "pipeline of 3, adamw with a mask", "hybrid 2x2x2, sgd"],
)
def test_a_model_without_haiku_is_cut_and_split_by_its_layers_and_trains_like_jit(
  strategy, optimizer
):
  # The pipeline took the top-level key for a layer: {"params": ...} was one layer,
  # and stages=2 was refused ("exceeds the model's 1 layers"); Hybrid(model=2) failed
  # with KeyError: 'params'.
  parstrat.testing.check_strategy(
    strategy, FLAX_STYLE, {"optimizer": optimizer}, steps=3, batch=8, features=FEATURES
  )
  trainer = strategy(FLAX_STYLE, optimizer)
  state = trainer.init(jax.random.key(0), np.zeros((1, FEATURES), np.float32))
  if isinstance(strategy, parstrat.TensorParallel):  # Dense_0 by columns, Dense_1 by rows
    specs = jax.tree.map(lambda x: x.sharding.spec, state.params)["params"]
    assert specs["Dense_0"] == {"kernel": P(None, "model"), "bias": P("model")}
    assert specs["Dense_1"]["kernel"] == P("model", None)
  else:  # the stage table names each layer by its path
    for i in range(3):
      assert f"params/Dense_{i}" in trainer.plan.description


def _apply_refusing_no_key(variables, rng, x):
  if rng is None:  # as Flax's `module.apply(v, x, rngs={"dropout": rng})` does
    raise ValueError("The `rngs` argument passed to an apply function should be a PRNGKey.")
  return _apply(variables, rng, x)


@pytest.mark.parametrize(
  "strategy",
  [parstrat.DataParallel(data=2), parstrat.FSDP(data=2), parstrat.TensorParallel(model=2)],
  ids=["data_parallel", "fsdp", "tensor"],
)
def test_a_model_that_reads_no_key_still_gets_one(strategy):
  # A Flax module behind the adapter `apply=lambda v, rng, x: module.apply(v, x,
  # rngs={"dropout": rng})`, with no dropout (or at rate 0, or deterministic): the
  # key reaches no equation, so the trainer passed None, and Flax raised at the first
  # step. Such a model is still not a dropout model (`uses_rng` is False).
  model = types.SimpleNamespace(init=_init, apply=_apply_refusing_no_key)
  parstrat.testing.check_strategy(
    strategy, model, {"optimizer": optax.sgd(0.1)}, steps=2, batch=8, features=FEATURES
  )
  trainer = strategy(model, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), np.zeros((1, FEATURES), np.float32))
  assert not trainer.uses_rng
  assert trainer.apply(state, np.ones((4, FEATURES), np.float32)).shape == (4, 10)


def _apply_with_bias_reshaped(variables, rng, x):
  del rng
  for i in range(len(WIDTHS) - 1):
    dense = variables["params"][f"Dense_{i}"]
    # As Flax's nn.Dense (and nnx.Linear) add it: reshaped to [1, N], broadcast by `add`.
    x = x @ dense["kernel"] + jnp.reshape(dense["bias"], (1,) * (x.ndim - 1) + (-1,))
    x = jax.nn.gelu(x) if i < len(WIDTHS) - 2 else x
  return x


@pytest.mark.parametrize(
  "strategy",
  [parstrat.TensorParallel(model=2), parstrat.Hybrid(data=2, stages=2, model=2)],
  ids=["tensor", "hybrid 2x2x2"],
)
def test_a_bias_reshaped_to_one_row_is_split_with_its_layer(strategy):
  # Flax's Dense adds its bias as `y + reshape(b, (1, N))`: the analysis knew a bias
  # only broadcast from 1-D, called this one "a parameter that is not a bias", and
  # split nothing ("0 split group(s)"), silently, for every Flax model.
  model = types.SimpleNamespace(init=_init, apply=_apply_with_bias_reshaped)
  for optimizer in (optax.sgd(0.1), optax.adam(1e-2)):
    parstrat.testing.check_strategy(
      strategy, model, {"optimizer": optimizer}, steps=2, batch=8, features=FEATURES
    )
  sample = np.zeros((1, FEATURES), np.float32)
  trainer = strategy(model, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), sample)
  if isinstance(strategy, parstrat.TensorParallel):
    specs = jax.tree.map(lambda x: x.sharding.spec, state.params)["params"]
    assert specs["Dense_0"] == {"kernel": P(None, "model"), "bias": P("model")}
    assert specs["Dense_1"]["kernel"] == P("model", None)
  # The same split as the model that adds its bias from 1-D.
  plain = strategy(FLAX_STYLE, optax.sgd(0.1))
  plain.init(jax.random.key(0), sample)
  assert "1 split group(s)" in trainer.plan.description
  assert trainer.plan.description == plain.plan.description


@jax.tree_util.register_pytree_with_keys_class
class _Variable:
  """Holds one array, flattened by the key path `.value`, as Flax nnx's `Variable` is."""

  def __init__(self, value):
    self.value = value

  def tree_flatten_with_keys(self):
    return ((jax.tree_util.GetAttrKey("value"), self.value),), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    del aux
    return cls(*children)


def _init_variables(rng, inputs):
  params = _init(rng, inputs)["params"]
  return {name: {k: _Variable(v) for k, v in layer.items()} for name, layer in params.items()}


def _apply_variables(variables, rng, x):
  params = {name: {k: v.value for k, v in layer.items()} for name, layer in variables.items()}
  return _apply({"params": params}, rng, x)


def test_arrays_held_by_variables_are_cut_by_their_layers():
  # An nnx.State flattens each parameter to a path ending in `.value`: the pipeline took
  # each Variable for a layer of its own and cut between a layer's matmul and its bias
  # add (4 stages of a 2-layer net were accepted, one kernel or bias per stage).
  model = types.SimpleNamespace(init=_init_variables, apply=_apply_variables)
  strategy = parstrat.PipelineModelParallel(stages=3, microbatches=4)
  parstrat.testing.check_strategy(
    strategy, model, {"optimizer": optax.sgd(0.1)}, steps=2, batch=8, features=FEATURES
  )
  trainer = strategy(model, optax.sgd(0.1))
  sample = np.zeros((1, FEATURES), np.float32)
  trainer.init(jax.random.key(0), sample)
  for i in range(3):
    assert f"  Dense_{i}\n" in trainer.plan.description + "\n", trainer.plan.description
  with pytest.raises(ValueError, match="exceeds the model's 3 layers"):
    parstrat.PipelineModelParallel(stages=4)(model, optax.sgd(0.1)).init(jax.random.key(0), sample)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Attention:
  """A block whose three weights are fields; one of them is named `value`."""

  query: jax.Array
  key: jax.Array
  value: jax.Array


def test_a_weight_named_value_beside_others_keeps_its_own_name():
  # Seeing through `.value` took any field of that name for a variable's array: the
  # value weight of each block below was named by the block list, so the pipeline
  # found no cut between blocks (review of the change above).
  def init(rng, inputs):
    del inputs
    keys = jax.random.split(rng, 9).reshape(3, 3)
    return {
      "blocks": [
        _Attention(*(jax.random.normal(k, (FEATURES, FEATURES)) / FEATURES for k in ks))
        for ks in keys
      ]
    }

  def apply(params, rng, x):
    del rng
    for b in params["blocks"]:
      x = x + jax.nn.sigmoid((x @ b.query) * (x @ b.key)) * (x @ b.value)
    return x[:, :10]

  model = types.SimpleNamespace(init=init, apply=apply)
  strategy = parstrat.PipelineModelParallel(stages=3, microbatches=4)
  parstrat.testing.check_strategy(
    strategy, model, {"optimizer": optax.sgd(0.1)}, steps=2, batch=8, features=FEATURES
  )
  trainer = strategy(model, optax.sgd(0.1))
  trainer.init(jax.random.key(0), np.zeros((1, FEATURES), np.float32))
  for i in range(3):
    assert f"  blocks/{i}\n" in trainer.plan.description + "\n", trainer.plan.description


def test_params_that_are_not_floats_are_refused_at_init_naming_the_leaf():
  # Flax nnx's `nnx.Dropout(rate, rngs=rngs)` keeps its random key and counter in the
  # module: `nnx.split` put them among the params, and the first step failed inside
  # jax.grad ("grad requires real- or complex-valued inputs ... but got uint32"),
  # naming neither the leaf nor the fix.
  def init(rng, inputs):
    params = _init(rng, inputs)
    params["rngs"] = {"dropout": {"count": jnp.zeros((), jnp.uint32)}}
    return params

  model = types.SimpleNamespace(init=init, apply=_apply)
  trainer = parstrat.DataParallel(data=2)(model, optax.sgd(0.1))
  with pytest.raises(TypeError, match=re.escape(
    "params['rngs']['dropout']['count'] has dtype uint32: the params must all be floats"
  )):  # fmt: skip
    trainer.init(jax.random.key(0), np.zeros((1, FEATURES), np.float32))


class _FlaxAdapter:
  """A user's own class with the contract's two methods, the key named `key`."""

  def init(self, key, inputs):
    return _init(key, inputs)

  def apply(self, variables, key, x):
    return _apply(variables, key, x)


def test_a_class_of_the_users_own_trains_like_jit():
  # Its apply does not name an `rng`, so the trainer wrapped it, rebuilding the object
  # as `type(model)(init=..., apply=...)`: "_FlaxAdapter.__init__() got an unexpected
  # keyword argument 'init'".
  parstrat.testing.check_strategy(
    parstrat.DataParallel(data=2), _FlaxAdapter(), {"optimizer": optax.sgd(0.1)}, steps=2,
    batch=8, features=FEATURES,
  )  # fmt: skip


def _init_weight_first(rng, inputs):
  # An equinox `Linear`'s leaves: `weight` [out, in] and `bias` [out].
  return {
    f"Linear_{i}": {"weight": layer["kernel"].T, "bias": layer["bias"]}
    for i, layer in enumerate(_init(rng, inputs)["params"].values())
  }


def _apply_weight_first(params, rng, x):
  del rng

  def one(x):  # one example, as an equinox model is written: `weight @ x + bias`
    for i in range(len(WIDTHS) - 1):
      x = params[f"Linear_{i}"]["weight"] @ x + params[f"Linear_{i}"]["bias"]
      x = jax.nn.gelu(x) if i < len(WIDTHS) - 2 else x
    return x

  return jax.vmap(one)(x)


@pytest.mark.parametrize(
  ("strategy", "column", "row"),
  [
    (parstrat.TensorParallel(model=2), 0, 1),
    # Cut after Linear_0: the pair in stage 1 (as the Flax-style model's).
    (parstrat.Hybrid(data=2, stages=2, model=2), 1, 2),
  ],
  ids=["tensor", "hybrid 2x2x2"],
)
def test_a_weight_on_the_left_as_equinox_multiplies_is_split_with_its_layer(strategy, column, row):
  # An equinox `Linear` computes `weight @ x + bias` per example under `jax.vmap`: the
  # jaxpr's matmul is `dot_general(w, x)` contracting the weight's dim 1 with the
  # input's last axis, its output [out, batch] then transposed. The analysis took only
  # `x @ w` for a linear layer, and split nothing ("0 split group(s)").
  model = types.SimpleNamespace(init=_init_weight_first, apply=_apply_weight_first)
  for optimizer in (optax.sgd(0.1), optax.adam(1e-2)):
    parstrat.testing.check_strategy(
      strategy, model, {"optimizer": optimizer}, steps=2, batch=8, features=FEATURES
    )
  # (A masked adamw runs per leaf: under the pipeline its moments keep the model's
  # layout, each leaf's spec naming "model" where the step splits it.)
  trainer = strategy(model, optax.adamw(1e-2, mask=_decay_mask))
  state = trainer.init(jax.random.key(0), np.zeros((1, FEATURES), np.float32))
  if isinstance(strategy, parstrat.TensorParallel):
    specs = jax.tree.map(lambda x: x.sharding.spec, state.params)
  else:
    specs = jax.tree.map(lambda x: x.sharding.spec, state.opt_state[0].mu)

  def model_dims(spec):  # the dimensions split over "model"
    return [d for d, entry in enumerate(spec) if "model" in jax.tree.leaves(entry)]

  dims = jax.tree.map(model_dims, specs, is_leaf=lambda x: isinstance(x, P))
  # Column-parallel by the weight's output features (its dim 0), the bias with them;
  # row-parallel by its input features (dim 1), the bias whole; the other layer whole.
  (other,) = {0, 1, 2} - {column, row}
  assert dims[f"Linear_{column}"] == {"weight": [0], "bias": [0]}, specs
  assert dims[f"Linear_{row}"] == {"weight": [1], "bias": []}, specs
  assert dims[f"Linear_{other}"] == {"weight": [], "bias": []}, specs
  text = trainer.plan.description
  assert "1 split group(s)" in text
  assert (
    f"Linear_{column}: column-parallel (split by output features; consumed by Linear_{row})" in text
  )
  assert f"Linear_{row}: row-parallel" in text
  # The plan's costs are those of the `x @ w` model: an all-reduce of 16 features per
  # example (the [16, batch] output was counted whole, 8 times too wide) and the same FLOPs.
  sample = jnp.zeros((8, FEATURES))
  ours, flax_style = (parstrat.tensor_split_plan(m, sample) for m in (model, FLAX_STYLE))
  assert [g.reduce_widths for g in ours.groups] == [(16, 0)]
  assert [g.reduce_widths for g in flax_style.groups] == [(16, 0)]
  assert ours.split_flops == flax_style.split_flops


def _tensor_trainer_checked_against_jit(model):
  """`TensorParallel(model=2)` on `model`, checked against single-device `jit` with SGD and
  Adam; returns an SGD trainer of it and its initial state."""
  strategy = parstrat.TensorParallel(model=2)
  for optimizer in (optax.sgd(0.1), optax.adam(1e-2)):
    parstrat.testing.check_strategy(
      strategy, model, {"optimizer": optimizer}, steps=2, batch=8, features=FEATURES
    )
  trainer = strategy(model, optax.sgd(0.1))
  return trainer, trainer.init(jax.random.key(0), np.zeros((1, FEATURES), np.float32))


def _apply_pytorch_style(form):
  """`_apply_weight_first` on the whole batch, its `[out, in]` weights multiplied as written
  in code ported from PyTorch (`F.linear(x, w, b)` is `x @ w.T + b`)."""
  matmuls = {
    "x @ w.T": lambda x, w: x @ w.T,  # the weight transposed, then `x @ w`
    "einsum": lambda x, w: jnp.einsum("bi,oi->bo", x, w),  # the weight contracted on dim 1
    "w @ x.T": lambda x, w: (w @ x.T).T,  # the input's transpose contracted on axis 0
  }

  def apply(params, rng, x):
    del rng
    for i in range(len(WIDTHS) - 1):
      x = matmuls[form](x, params[f"Linear_{i}"]["weight"]) + params[f"Linear_{i}"]["bias"]
      x = jax.nn.gelu(x) if i < len(WIDTHS) - 2 else x
    return x

  return apply


@pytest.mark.parametrize("form", ["x @ w.T", "einsum", "w @ x.T"])
def test_a_weight_held_out_by_in_is_split_however_the_matmul_is_written(form):
  # A weight [out, in] contracted on its dim 1 from the right (`einsum("bi,oi->bo")`)
  # was "not used as `x @ w`": the analysis took the weight's operand slot for its
  # output dimension, so only `w @ x.T` with the weight on the left could hold one. And
  # `x @ w.T` (how PyTorch's `F.linear` is ported) was "used by `transpose`".
  model = types.SimpleNamespace(init=_init_weight_first, apply=_apply_pytorch_style(form))
  trainer, state = _tensor_trainer_checked_against_jit(model)
  specs = jax.tree.map(lambda x: x.sharding.spec, state.params)
  assert specs["Linear_0"] == {"weight": P("model", None), "bias": P("model")}, specs
  assert specs["Linear_1"] == {"weight": P(None, "model"), "bias": P()}, specs
  assert specs["Linear_2"] == {"weight": P(), "bias": P()}, specs
  assert "1 split group(s)" in trainer.plan.description
  # The plan's costs are those of `x @ w`: the model's input, transposed or not, needs
  # no backward all-reduce (`(w @ x.T).T` counted its 12 features).
  sample = jnp.zeros((8, FEATURES))
  ours, flax_style = (parstrat.tensor_split_plan(m, sample) for m in (model, FLAX_STYLE))
  assert [g.reduce_widths for g in ours.groups] == [(16, 0)]
  assert ours.split_flops == flax_style.split_flops


def _bias_less_chain(widths, form="one vmap"):
  """Bias-less linear layers with gelu between them.

  `form` "one vmap": as equinox `Linear(use_bias=False)`s chained inside one `jax.vmap`
  (`w3 @ gelu(w2 @ gelu(w1 @ x))` per example, the weights `[out, in]`): after the
  first layer the activations are feature-major `[features, batch]`, each layer
  contracting its input's axis 0. "vmap each": the same layers, each under a `jax.vmap`
  of its own (the batch leading between them). "x @ w": on a batch-leading input, the
  weights held as `[in, out]`.
  """
  weight_on_left = form != "x @ w"

  def init(rng, inputs):
    del inputs
    keys = jax.random.split(rng, len(widths) - 1)
    return {
      f"Linear_{i}": {
        "weight": (
          jax.random.normal(key, (fan_out, fan_in)) / np.sqrt(fan_in)
          if weight_on_left
          else jax.random.normal(key, (fan_in, fan_out)) / np.sqrt(fan_in)
        )
      }
      for i, (key, fan_in, fan_out) in enumerate(zip(keys, widths[:-1], widths[1:], strict=True))
    }

  def apply(params, rng, x):
    del rng
    weights = [params[f"Linear_{i}"]["weight"] for i in range(len(widths) - 1)]

    def chain(h, matmul):
      for i, w in enumerate(weights):
        h = matmul(w, h)
        h = jax.nn.gelu(h) if i < len(weights) - 1 else h
      return h

    if form == "one vmap":
      return jax.vmap(lambda x: chain(x, lambda w, h: w @ h))(x)
    if form == "vmap each":
      return chain(x, lambda w, h: jax.vmap(lambda h: w @ h)(h))
    return chain(x, lambda w, h: h @ w)

  return types.SimpleNamespace(init=init, apply=apply)


def test_bias_less_layers_chained_in_one_vmap_are_split_on_their_feature_major_input():
  # Bias-less equinox `Linear`s inside one `jax.vmap` compute `W2 @ H` with H the
  # `[features, batch]` output of `W1 @ X.T`: the second layer contracts its input's
  # axis 0, with no transpose between. The analysis took a linear layer's input only on
  # its last axis: "0 split group(s)", the first layer's split "contracted with
  # something other than a linear layer's weight", the others "not used as `x @ w` or
  # `w @ x.T` on the input's last axis".
  model = _bias_less_chain(WIDTHS)
  trainer, state = _tensor_trainer_checked_against_jit(model)

  def model_dims(param):  # the dimensions split over "model"
    return [d for d, entry in enumerate(param.sharding.spec) if "model" in jax.tree.leaves(entry)]

  # Column-parallel by the weight's output features (dim 0), row-parallel by its input
  # features (dim 1), the output layer whole.
  dims = jax.tree.map(model_dims, state.params)
  assert dims == {
    "Linear_0": {"weight": [0]},
    "Linear_1": {"weight": [1]},
    "Linear_2": {"weight": []},
  }, dims
  text = trainer.plan.description
  assert "1 split group(s)" in text
  assert "Linear_0: column-parallel (split by output features; consumed by Linear_1)" in text
  assert "Linear_1: row-parallel" in text
  # The plan's costs are those of the same layers as `x @ w` on a batch-leading input:
  # the row's all-reduce of 16 features per example (its output [16, batch]) and, with
  # a first layer of 15 outputs left whole, the column's input read back from the
  # [15, batch] activation (15 per example; counted whole, it is batch times wider).
  sample = jnp.zeros((8, FEATURES))
  for widths, expected in ((WIDTHS, [(16, 0)]), ((FEATURES, 15, 16, 10), [(10, 15)])):
    ours, batch_major = (
      parstrat.tensor_split_plan(_bias_less_chain(widths, form), sample)
      for form in ("one vmap", "x @ w")
    )
    assert [g.reduce_widths for g in ours.groups] == expected, ours
    assert [g.reduce_widths for g in batch_major.groups] == expected, batch_major
    assert ours.split_flops == batch_major.split_flops
  # The pipeline cannot cut between such layers (no activation between them has the
  # batch leading), and says so, naming the fix; one stage splits over "model" as
  # `tensor` does.
  hybrid = parstrat.Hybrid(data=2, stages=2, model=2)
  with pytest.raises(
    ValueError, match=r"cannot be cut into 2 stages: only 0 of its 2 .* feature-major"
  ):
    hybrid(model, optax.sgd(0.1)).init(jax.random.key(0), np.zeros((1, FEATURES), np.float32))
  # With a `jax.vmap` per layer it is cut after Linear_0, the pair split in stage 1.
  trainer = hybrid(_bias_less_chain(WIDTHS, "vmap each"), optax.sgd(0.1))
  trainer.init(jax.random.key(0), np.zeros((1, FEATURES), np.float32))
  text = trainer.plan.description
  assert (
    "stage 1: Linear_1: column-parallel (split by output features; consumed by Linear_2)" in text
  )
  assert "stage 1: Linear_2: row-parallel" in text
  parstrat.testing.check_strategy(
    parstrat.Hybrid(data=2, stages=1, model=2), model, {"optimizer": optax.sgd(0.1)}, steps=2,
    batch=8, features=FEATURES,
  )  # fmt: skip


TOKENS, HEADS, HEAD_DIM = 3, 4, 2
EMBED = FEATURES // TOKENS  # (each [B, 12] input is read as 3 tokens of 4 features)


def _init_head_kernels(rng, inputs):
  """Flax linen's `MultiHeadDotProductAttention` params (query, key and value kernels
  `[in, heads, head_dim]` with `[heads, head_dim]` biases; an output kernel `[heads,
  head_dim, out]`), then a `Dense` head over the flattened tokens."""
  del inputs
  keys = iter(jax.random.split(rng, 9))
  normal = lambda shape, fan_in: jax.random.normal(next(keys), shape) / np.sqrt(fan_in)  # noqa: E731
  attention = {
    name: {"kernel": normal((EMBED, HEADS, HEAD_DIM), EMBED), "bias": normal((HEADS, HEAD_DIM), 8)}
    for name in ("query", "key", "value")
  }
  attention["out"] = {
    "kernel": normal((HEADS, HEAD_DIM, EMBED), HEADS * HEAD_DIM),
    "bias": normal((EMBED,), 8),
  }
  head = {"kernel": normal((TOKENS * EMBED, 10), TOKENS * EMBED), "bias": jnp.zeros(10)}
  return {"params": {"MultiHeadDotProductAttention_0": attention, "Dense_0": head}}


def _apply_head_kernels(variables, rng, x):
  """Flax's arithmetic (as traced from flax 0.12): each `DenseGeneral` a `dot_general`
  over the input's last axis (the output projection over the heads and head_dim) plus
  its bias reshaped to `[1, .., heads, head_dim]`; scores and values per head by einsum."""
  del rng
  params = variables["params"]["MultiHeadDotProductAttention_0"]
  tokens = x.reshape(x.shape[0], TOKENS, EMBED)

  def dense_general(x, layer, contract):
    y = jax.lax.dot_general(x, layer["kernel"], ((contract, tuple(range(len(contract)))), ((), ())))
    bias = layer["bias"]
    return y + jnp.reshape(bias, (1,) * (y.ndim - bias.ndim) + bias.shape)

  q, k, v = (dense_general(tokens, params[name], (2,)) for name in ("query", "key", "value"))
  scores = jnp.einsum("...qhd,...khd->...hqk", q / np.sqrt(HEAD_DIM).astype(np.float32), k)
  heads = jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(scores, axis=-1), v)
  y = tokens + dense_general(heads, params["out"], (2, 3))  # (a residual after the all-reduce)
  head = variables["params"]["Dense_0"]
  return y.reshape(x.shape[0], -1) @ head["kernel"] + head["bias"]


def test_attention_kernels_of_heads_are_split_by_heads():
  # Flax's attention keeps its kernels 3-D: the analysis took only 2-D weights, so it
  # was "a 3-D weight" and attention stayed whole ("0 split group(s)"). Query, key and
  # value kernels are now split by their heads (dim 1, with their [heads, head_dim]
  # biases), the output kernel by its heads (dim 0): Megatron's attention split.
  model = types.SimpleNamespace(init=_init_head_kernels, apply=_apply_head_kernels)
  trainer, state = _tensor_trainer_checked_against_jit(model)
  specs = jax.tree.map(lambda x: x.sharding.spec, state.params["params"])
  for name in ("query", "key", "value"):
    assert specs["MultiHeadDotProductAttention_0"][name] == {
      "kernel": P(None, "model", None),
      "bias": P("model", None),
    }, specs
  assert specs["MultiHeadDotProductAttention_0"]["out"] == {
    "kernel": P("model", None, None),
    "bias": P(),
  }, specs
  assert specs["Dense_0"] == {"kernel": P(), "bias": P()}, specs
  (group,) = trainer.plan.description.splitlines()[1:2]
  assert group.strip() == (
    "group 0: column-parallel params/MultiHeadDotProductAttention_0/key, "
    "params/MultiHeadDotProductAttention_0/query, params/MultiHeadDotProductAttention_0/value "
    "-> row-parallel params/MultiHeadDotProductAttention_0/out (1 all-reduce(s) forward)"
  )
  # The costs "auto" reads: the output projection's [tokens, embed] outputs all-reduced
  # forward; the one input of query, key and value backward.
  plan = parstrat.tensor_split_plan(model, jnp.zeros((8, FEATURES)))
  assert [g.reduce_widths for g in plan.groups] == [(TOKENS * EMBED, 0)]
  # A pipeline cuts it after the attention, and Hybrid(2, 2, 2) splits it there as well.
  hybrid = parstrat.Hybrid(data=2, stages=2, model=2)(model, optax.sgd(0.1))
  hybrid.init_abstract(jax.random.key(0), np.zeros((1, FEATURES), np.float32))
  assert group.strip() in hybrid.plan.description
  parstrat.testing.check_strategy(
    parstrat.Hybrid(data=2, stages=2, model=2),
    model,
    [optax.sgd(0.1), optax.adam(1e-2)],
    steps=2,
    batch=8,
    features=FEATURES,
  )
