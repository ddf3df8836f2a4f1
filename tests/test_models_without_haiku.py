"""A model that is not Haiku's: any `init(rng, inputs)` / `apply(params, rng, inputs)` pair.

The strategies depend on that contract, not on Haiku's internals: a model whose
params are a Flax-style variables tree (`{"params": {"Dense_0": {"kernel", "bias"}}}`,
three levels where Haiku has two) is cut into stages by its layers and split
tensor-parallel like a Haiku one.
"""

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
