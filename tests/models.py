"""A small zoo of ordinary Haiku models, with their batches and losses, for the tests.

Every model is tiny (widths 8-64) so compiling it is cheap; most are deep
enough to be cut into 4 pipeline stages. Each `ModelSpec` says how to build a
batch of `batch` examples for a step and which loss to train with; the batches
are pairs `(inputs, labels)` (float features or images with integer class
labels, or integer token ids with integer next-token targets), or for the
untied LM dicts `{"tokens", "targets"}` read through `model_inputs`.

Widths are multiples of 8 so that every tensor-parallel split (T = 2, 4, 8)
divides them. `jit_run` is the single-device oracle on a spec's batches.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import numpy as np
import optax

import parstrat
import parstrat.testing

#: Features of the vector models' inputs, and classes of every classifier.
FEATURES = 12
CLASSES = 10
#: The token models: vocabulary, sequence length, model width, heads.
VOCAB = 16
SEQ = 8
WIDTH = 16
HEADS = 2

# Non-zero bias init, so that an optimizer mask that wrongly decays biases shows.
_BIAS = hk.initializers.RandomNormal(0.1)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A model of the zoo with its data and loss.

  Attributes:
    name: short name used in test ids.
    model: the `hk.Transformed`.
    batches: `(steps, batch, seed) -> list of (inputs, labels)`, deterministic.
    loss_fn: `(outputs, labels) -> scalar` mean loss (or `(outputs, batch)`
      with `model_inputs`), or None for the default softmax cross-entropy on
      `[B]` integer labels.
    model_inputs: for batches that are not `(inputs, labels)` pairs, `batch ->
      inputs` (the trainer's `model_inputs`).
    uses_rng: the model calls `hk.next_rng_key()` (its apply needs a key).
  """

  name: str
  model: hk.Transformed
  batches: Callable[[int, int, int], list[tuple[Any, Any]]]
  loss_fn: Callable[[jax.Array, Any], jax.Array] | None = None
  model_inputs: Callable[[Any], Any] | None = None
  uses_rng: bool = False

  def sample(self, seed: int = 0) -> Any:
    """One example's inputs (batch of 1), for `trainer.init`."""
    batch = self.batches(1, 1, seed)[0]
    return batch[0] if self.model_inputs is None else self.model_inputs(batch)

  def trainer_options(self) -> dict[str, Any]:
    """`loss_fn` and `model_inputs` for `strategy(model, optimizer, **options)`."""
    return {"loss_fn": self.loss_fn, "model_inputs": self.model_inputs}


# ---------------------------------------------------------------- data
def feature_batches(steps: int, batch: int, seed: int = 0) -> list[tuple[Any, Any]]:
  """Float features `[batch, FEATURES]` in [0, 1) and labels `[batch]` in [0, CLASSES)."""
  rng = np.random.default_rng(seed)
  return [
    (
      rng.random((batch, FEATURES), dtype=np.float32),
      rng.integers(0, CLASSES, batch).astype(np.int32),
    )
    for _ in range(steps)
  ]


def image_batches(steps: int, batch: int, seed: int = 0) -> list[tuple[Any, Any]]:
  """Float images `[batch, 8, 8, 1]` and labels `[batch]`."""
  rng = np.random.default_rng(seed)
  return [
    (
      rng.random((batch, 8, 8, 1), dtype=np.float32),
      rng.integers(0, CLASSES, batch).astype(np.int32),
    )
    for _ in range(steps)
  ]


def token_batches(steps: int, batch: int, seed: int = 0) -> list[tuple[Any, Any]]:
  """Integer tokens `[batch, SEQ]` and their next tokens `[batch, SEQ]` as targets.

  The sequences follow a simple rule (each token is the previous one plus a
  per-sequence stride, mod VOCAB) so a model can learn them.
  """
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    start = rng.integers(0, VOCAB, (batch, 1))
    stride = rng.integers(1, 4, (batch, 1))
    seq = (start + stride * np.arange(SEQ + 1)) % VOCAB
    out.append((seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)))
  return out


def token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy over every position: logits `[B, T, V]`, targets `[B, T]`."""
  return optax.losses.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def token_dict_batches(steps: int, batch: int, seed: int = 0) -> list[dict[str, Any]]:
  """`token_batches` as dicts `{"tokens", "targets"}`."""
  return [{"tokens": x, "targets": y} for x, y in token_batches(steps, batch, seed)]


def token_dict_loss(logits: jax.Array, batch: dict[str, Any]) -> jax.Array:
  """`token_loss` on a `{"tokens", "targets"}` batch."""
  return token_loss(logits, batch["targets"])


# ---------------------------------------------------------------- models
def _mlp(x):
  return hk.nets.MLP([16, 16, 16, CLASSES], b_init=_BIAS, activation=jax.nn.relu)(x)


def _mlp_layernorm(x):
  for width in (16, 16, 16):
    x = hk.Linear(width, b_init=_BIAS)(x)
    x = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x)
    x = jax.nn.relu(x)
  return hk.Linear(CLASSES, b_init=_BIAS)(x)


def _residual_mlp(x):
  x = hk.Linear(16, b_init=_BIAS, name="embed")(x)
  for i in range(2):  # x = x + Linear(relu(Linear(x)))
    h = jax.nn.relu(hk.Linear(32, b_init=_BIAS, name=f"block{i}_in")(x))
    x = x + hk.Linear(16, b_init=_BIAS, name=f"block{i}_out")(h)
  return hk.Linear(CLASSES, b_init=_BIAS, name="head")(x)


def _cnn(x):
  x = jax.nn.relu(hk.Conv2D(8, 3, b_init=_BIAS)(x))  # [B, 8, 8, 8]
  x = jax.nn.relu(hk.Conv2D(8, 3, stride=2, b_init=_BIAS)(x))  # [B, 4, 4, 8]
  x = hk.Flatten()(x)
  x = jax.nn.relu(hk.Linear(16, b_init=_BIAS)(x))
  return hk.Linear(CLASSES, b_init=_BIAS)(x)


def _shared_weights(x):
  x = jax.nn.relu(hk.Linear(16, b_init=_BIAS, name="embed")(x))
  shared = hk.Linear(16, b_init=_BIAS, name="shared")
  x = jax.nn.relu(shared(x))
  x = jax.nn.relu(hk.Linear(16, b_init=_BIAS, name="middle")(x))
  x = jax.nn.relu(shared(x))  # the same weights again, two layers later
  return hk.Linear(CLASSES, b_init=_BIAS, name="head")(x)


def dropout_mlp(rate: float) -> Callable[[jax.Array], jax.Array]:
  """An MLP with `hk.dropout(hk.next_rng_key(), rate, .)` after each hidden layer."""

  def net(x):
    for width in (16, 16, 16):
      x = jax.nn.relu(hk.Linear(width, b_init=_BIAS)(x))
      x = hk.dropout(hk.next_rng_key(), rate, x)
    return hk.Linear(CLASSES, b_init=_BIAS)(x)

  return net


def _load_example(name: str):
  path = pathlib.Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"examples_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


#: examples/transformer_lm.py: the LM of the example is the zoo's LM, smaller.
transformer_lm_example = _load_example("transformer_lm")


def transformer_lm(tied: bool = True) -> hk.Transformed:
  """The example's decoder-only LM with tiny sizes: tokens `[B, SEQ]` -> `[B, SEQ, VOCAB]`."""
  lm = transformer_lm_example.causal_lm
  config = dict(vocab=VOCAB, width=WIDTH, heads=HEADS, blocks=2, tied=tied)
  return hk.transform(lambda tokens: lm(tokens, **config))


MLP = ModelSpec("mlp", hk.transform(_mlp), feature_batches)
MLP_LAYERNORM = ModelSpec("mlp_layernorm", hk.transform(_mlp_layernorm), feature_batches)
RESIDUAL_MLP = ModelSpec("residual_mlp", hk.transform(_residual_mlp), feature_batches)
CNN = ModelSpec("cnn", hk.transform(_cnn), image_batches)
LM = ModelSpec("lm", transformer_lm(tied=True), token_batches, token_loss)
#: The untied LM takes dict batches `{"tokens", "targets"}`.
LM_UNTIED = ModelSpec(
  "lm_untied",
  transformer_lm(tied=False),
  token_dict_batches,
  token_dict_loss,
  model_inputs=lambda batch: batch["tokens"],
)
SHARED = ModelSpec("shared", hk.transform(_shared_weights), feature_batches)
#: Rate 0: it draws keys like any dropout model but must match jit exactly.
DROPOUT = ModelSpec("dropout", hk.transform(dropout_mlp(0.0)), feature_batches, uses_rng=True)

ZOO = {m.name: m for m in (MLP, MLP_LAYERNORM, RESIDUAL_MLP, CNN, LM, LM_UNTIED, SHARED, DROPOUT)}


# ---------------------------------------------------------------- optimizers
def no_decay_mask(params: Any) -> Any:
  """True for weights; False for biases and LayerNorm scales and offsets (Haiku names)."""

  def decays(path, _):
    module, name = str(path[0].key), str(path[-1].key)
    return not (name in ("b", "offset", "scale") or "ln" in module or "layer_norm" in module)

  return jax.tree_util.tree_map_with_path(decays, params)


#: lr * weight_decay = 1e-2: a mask that is ignored moves a bias of 0.1 by
#: 1e-3 per step, ten times the Adam tolerance (lr / 10).
ADAMW_LR = 1e-3
ADAMW_DECAY = 10.0


def optimizers() -> dict[str, optax.GradientTransformation]:
  """The optimizers of the matrix, by name."""
  return {
    "sgd_momentum": optax.sgd(0.1, momentum=0.9),
    "adam": optax.adam(1e-3),
    "clip_sgd": optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1)),
    "adamw_mask": optax.adamw(ADAMW_LR, weight_decay=ADAMW_DECAY, mask=no_decay_mask),
    "multisteps": optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2),
  }


#: Optimizers that divide by sqrt(v): params compared to lr / 10 (see testing.py).
ADAM_LIKE = ("adam", "adamw_mask")


# ---------------------------------------------------------------- the oracle
def jit_run(
  spec: ModelSpec, optimizer: optax.GradientTransformation, steps: int, batch: int, seed: int
) -> parstrat.testing.Reference:
  """Plain single-device jit training (`parstrat.testing.reference_train`) on `spec`'s batches.

  Params come from `spec.model.init` with `jax.random.key(seed)`, the key a
  trainer is initialised with; a model that draws randomness gets the keys a
  trainer derives from it.
  """
  key = jax.random.key(seed)
  params = jax.jit(spec.model.init)(key, spec.sample())
  return parstrat.testing.reference_train(
    spec.model,
    optimizer,
    spec.batches(steps, batch, seed),
    params,
    loss_fn=spec.loss_fn or parstrat.softmax_cross_entropy,
    model_inputs=spec.model_inputs,
    rng=key if spec.uses_rng else None,
  )
