"""A character-level transformer language model on Python's own documentation.

A small decoder-only transformer (token and position embeddings, pre-LayerNorm
blocks of causal multi-head self-attention and an MLP, each with a residual
connection, a final LayerNorm, and a head that is a linear layer or, with
`tied=True`, the token embedding itself) learns to predict the next character
of an excerpt of the Python documentation bundled with parstrat
(`parstrat/data/python_docs.txt.gz`, under the PSF licence: see
`parstrat/data/LICENSE-python-docs.txt`). Tokens are integer ids, so batches
are pairs `(tokens [B, T] int32, targets [B, T] int32)`, the targets being the
tokens shifted by one.

`main` trains the same model from the same seed on the same batches under
data_parallel, pipeline, hybrid, fsdp and tensor with Adam and prints their
losses. Each strategy computes the same step as plain `jax.jit` up to float
rounding (tests/test_transformer_lm.py checks that step by step, with
SGD); Adam amplifies those rounding differences over tens of steps, so the
printed losses agree to about 1e-6 for the first few steps and to a few
hundredths after 50 (with SGD they stay within 1e-5). With `--tied` the
pipeline and hybrid refuse the model: the head reuses the embedding, a weight
on both sides of every cut.

The module-level `model` and `dataset` are what `parstrat train --model-fn
examples/transformer_lm.py:model --dataset examples/transformer_lm.py:dataset`
loads: `model()` returns `(hk.Transformed, loss_fn)` and `dataset(...)`
returns `(train, eval)` lists of batches.

Run: python examples/transformer_lm.py [--steps 50] [--tied]
"""

from __future__ import annotations

import argparse
import gzip
import importlib.resources
import string
from typing import Any
from typing import NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

CORPUS = "python_docs.txt.gz"
#: Every character of the corpus: printable ASCII and the newline (96 ids).
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
UNKNOWN = ALPHABET.index("?")
assert set(ALPHABET) <= set(string.printable)

#: The example's model size (about 0.1M parameters) and batches.
CONFIG = dict(width=64, heads=4, blocks=2)
SEQ_LEN = 64
BATCH_SIZE = 32

STRATEGIES = {
  "data_parallel": dict(data=8),
  "pipeline": dict(stages=4, microbatches=4),
  "hybrid": dict(data=2, stages=2, model=2),
  "fsdp": dict(data=8),
  "tensor": dict(model=4),
}


# ---------------------------------------------------------------- data
def load_text() -> str:
  """The bundled corpus: about 131,000 characters of the Python 3.11 documentation."""
  raw = (importlib.resources.files("parstrat") / "data" / CORPUS).read_bytes()
  return gzip.decompress(raw).decode("ascii")


def encode(text: str) -> np.ndarray:
  """Characters -> int32 ids in `[0, len(ALPHABET))` (anything else becomes '?')."""
  table = {c: i for i, c in enumerate(ALPHABET)}
  return np.array([table.get(c, UNKNOWN) for c in text], np.int32)


def decode(ids) -> str:
  """int ids -> characters."""
  return "".join(ALPHABET[int(i)] for i in np.asarray(ids).reshape(-1))


def windows(ids: np.ndarray, batch_size: int, seq_len: int, order=None) -> list:
  """Non-overlapping windows of `seq_len + 1` ids cut into `(tokens, targets)` batches."""
  count = (len(ids) - 1) // seq_len
  starts = np.arange(count) * seq_len
  if order is not None:
    starts = starts[order(count)]
  batches = []
  for b in range(len(starts) // batch_size):
    rows = [ids[s : s + seq_len + 1] for s in starts[b * batch_size : (b + 1) * batch_size]]
    block = np.stack(rows)
    batches.append((block[:, :-1], block[:, 1:]))
  return batches


def dataset(
  batch_size: int = BATCH_SIZE, seq_len: int = SEQ_LEN, seed: int = 0, eval_fraction: float = 0.1
) -> tuple[list, list]:
  """(train, eval) lists of `(tokens [B, T], targets [B, T])` int32 batches.

  The corpus's last `eval_fraction` is held out; the training windows come in
  an order shuffled by `seed`; each list is one epoch.
  """
  ids = encode(load_text())
  split = int(len(ids) * (1 - eval_fraction))
  rng = np.random.default_rng(seed)
  train = windows(ids[:split], batch_size, seq_len, order=rng.permutation)
  return train, windows(ids[split:], batch_size, seq_len)


# ---------------------------------------------------------------- model
def causal_lm(
  tokens: jax.Array,
  *,
  vocab: int = len(ALPHABET),
  width: int = 64,
  heads: int = 4,
  blocks: int = 2,
  tied: bool = False,
) -> jax.Array:
  """A decoder-only transformer: int tokens `[B, T]` -> next-token logits `[B, T, vocab]`.

  Token and position embeddings, `blocks` pre-LayerNorm blocks (causal
  multi-head self-attention, then a 4x MLP, each added back to the residual
  stream), a final LayerNorm, and the head: a linear layer, or with `tied` the
  embedding matrix itself (`logits = x @ embeddings.T`; Haiku's `hk.Embed` has
  no `attend` method, so the product is written out).
  """
  seq = tokens.shape[-1]
  init = hk.initializers.TruncatedNormal(0.02)
  embed = hk.Embed(vocab, width, w_init=init, name="embed")
  positions = hk.get_parameter("positions", [seq, width], init=init)
  x = embed(tokens) + positions
  mask = jnp.tril(jnp.ones((seq, seq), bool))[None, None]
  for i in range(blocks):
    h = hk.LayerNorm(-1, True, True, name=f"block{i}_ln_attn")(x)
    attention = hk.MultiHeadAttention(heads, width // heads, w_init=init, name=f"block{i}_attn")
    x = x + attention(h, h, h, mask=mask)
    h = hk.LayerNorm(-1, True, True, name=f"block{i}_ln_mlp")(x)
    h = jax.nn.gelu(hk.Linear(4 * width, w_init=init, name=f"block{i}_mlp_in")(h))
    x = x + hk.Linear(width, w_init=init, name=f"block{i}_mlp_out")(h)
  x = hk.LayerNorm(-1, True, True, name="ln_final")(x)
  if tied:
    return x @ embed.embeddings.T
  return hk.Linear(vocab, w_init=init, name="head")(x)


def loss_fn(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy over every position of every sequence."""
  return optax.losses.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def model(tied: bool = False, **config) -> tuple[hk.Transformed, object]:
  """`(hk.Transformed, loss_fn)` of the LM (`causal_lm`'s keyword arguments)."""
  config = {**CONFIG, **config}
  return hk.transform(lambda tokens: causal_lm(tokens, tied=tied, **config)), loss_fn


# ---------------------------------------------------------------- training
class Result(NamedTuple):
  """What `train` returns."""

  losses: list[float]
  params: Any
  eval_loss: float
  mesh: dict[str, int]


def train(
  strategy,
  steps: int,
  *,
  optimizer: optax.GradientTransformation | None = None,
  tied: bool = False,
  seed: int = 0,
  batch_size: int = BATCH_SIZE,
  seq_len: int = SEQ_LEN,
  eval_batches: int | None = None,
  **config,
) -> Result:
  """Trains the LM under `strategy` (a registered name, or a `parstrat.Strategy`).

  Args:
    strategy: a name of `STRATEGIES` (with its mesh) or a strategy instance.
    steps: training steps, one batch each (the epoch repeats if needed).
    optimizer: default `optax.adam(3e-3)`.
    tied, **config: the model (see `causal_lm`).
    seed: params and batch order.
    batch_size, seq_len: the batches (see `dataset`).
    eval_batches: evaluate on the first this many held-out batches (default: all).

  Returns:
    A `Result`: per-step losses, final params, the mean eval loss, the mesh.
  """
  import parstrat  # noqa: PLC0415 - after main has set the device count

  if isinstance(strategy, str):
    strategy = parstrat.get(strategy, **STRATEGIES[strategy])
  net, loss = model(tied=tied, **config)
  train_batches, held_out = dataset(batch_size, seq_len, seed)
  trainer = strategy(net, optax.adam(3e-3) if optimizer is None else optimizer, loss_fn=loss)
  state = trainer.init(jax.random.key(seed), train_batches[0][0][:1])
  losses = []
  for step in range(steps):
    state, metrics = trainer.step(state, train_batches[step % len(train_batches)])
    losses.append(float(metrics["loss"]))
  params = trainer.params(state)
  evaluate = jax.jit(lambda p, x, y: loss(net.apply(p, None, x), y))
  eval_loss = float(np.mean([evaluate(params, x, y) for x, y in held_out[:eval_batches]]))
  return Result(losses, params, eval_loss, dict(trainer.mesh.shape))


def main(steps: int = 50, tied: bool = False) -> dict[str, Result]:
  results = {}
  for name in STRATEGIES:
    try:
      result = results[name] = train(name, steps, tied=tied)
    except ValueError as e:  # e.g. a tied head under the pipeline
      print(f"{name:14} refused: {str(e).splitlines()[0]}")
      continue
    losses = result.losses
    shown = ", ".join(f"{losses[i]:.4f}" for i in (0, steps // 2, steps - 1))
    print(
      f"{name:14} mesh {result.mesh}: train loss (steps 1, {steps // 2 + 1}, {steps}) "
      f"{shown}; eval loss after {steps} steps {result.eval_loss:.4f}"
    )
  return results


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=50)
  parser.add_argument("--tied", action="store_true", help="tie the head to the embedding")
  args = parser.parse_args()
  import parstrat.testing

  parstrat.testing.use_cpu_devices(8)
  main(args.steps, args.tied)
