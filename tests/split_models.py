"""Models for the tensor-split tests: a residual MLP and a small transformer."""

import haiku as hk
import jax
import jax.numpy as jnp

FEATURES = 12  # the transformer reads them as 4 tokens of 3 features


def residual_mlp(x):
  x = hk.Linear(16)(x)
  for _ in range(2):
    x = x + hk.Linear(16)(jax.nn.relu(hk.Linear(32)(x)))
  return hk.Linear(10)(x)


def transformer(x):
  h = hk.Linear(16)(x.reshape(x.shape[0], 4, 3))
  a = hk.LayerNorm(-1, True, True)(h)
  # No biases: a key bias has a zero gradient (softmax ignores it), which Adam
  # turns into noise-sized steps that no two summation orders agree on.
  attention = hk.MultiHeadAttention(
    num_heads=4, key_size=4, w_init=hk.initializers.VarianceScaling(), with_bias=False
  )
  h = h + attention(a, a, a, mask=jnp.tril(jnp.ones((1, 1, 4, 4))))
  m = hk.LayerNorm(-1, True, True)(h)
  h = h + hk.Linear(16)(jax.nn.gelu(hk.Linear(32)(m)))
  return hk.Linear(10)(hk.LayerNorm(-1, True, True)(h).mean(axis=1))


RESIDUAL_MLP = hk.transform(residual_mlp)
TRANSFORMER = hk.transform(transformer)
