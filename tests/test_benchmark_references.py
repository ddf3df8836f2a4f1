"""parstrat's data-parallel steps compile to the programs a user writes by hand.

On 8 virtual devices sharing the machine's cores a step time cannot resolve a
2% overhead: two copies of one hand-written program differ by that much from
one benchmark pass to the next. So "no overhead over hand-written code" is
checked here on the compiled programs, against the hand-written steps that
`benchmarks/run.py` times (`benchmarks/references.py`), each returning the same
metrics as parstrat's step: XLA's cost analysis (flops, transcendentals, bytes
accessed), the compiled temporaries, and every collective with its shapes.
"""

import collections
import re

import jax
import numpy as np
import optax
import pytest
from helpers import benchmark_module
from helpers import mlp
from jax.sharding import NamedSharding

import parstrat

REFERENCES = benchmark_module("references")
MODEL = mlp([64, 64, 64, 32])
BATCH = 64
OPTIMIZERS = {"sgd": optax.sgd(0.1), "adam": optax.adam(1e-3)}
#: Bytes per element of the dtypes in the collectives' shapes.
ITEM_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1, "u8": 1}
COLLECTIVE = re.compile(
  r"= (.+?) (all-reduce|reduce-scatter|all-gather|collective-permute|all-to-all)(?:-start)?\("
)


def _batch():
  rng = np.random.default_rng(0)
  images = rng.normal(size=(BATCH, 48)).astype(np.float32)
  return images, (np.arange(BATCH) % 32).astype(np.int32)


def _program(compiled):
  """The costs and collectives of a compiled step."""
  costs = compiled.cost_analysis()
  collectives = collections.Counter(COLLECTIVE.findall(compiled.as_text()))
  return {
    "flops": costs["flops"],
    "transcendentals": costs["transcendentals"],
    "bytes accessed": costs["bytes accessed"],
    "temp": compiled.memory_analysis().temp_size_in_bytes,
  }, collectives


def _array_bytes(collectives) -> list[tuple[str, int]]:
  """Each collective as `(op, bytes of its results but scalars)`, sorted."""
  out = []
  for (shapes, op), count in collectives.items():
    arrays = re.findall(r"([a-z]+\d*)\[([\d,]+)\]", shapes)  # e.g. f32[64,48]; not f32[]
    size = sum(
      ITEM_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",")])) for dtype, dims in arrays
    )
    out += [(op, size)] * count
  return sorted(out)


def _scalars(collectives) -> int:
  """How many scalars (`f32[]`, ...) the collectives move in all."""
  return sum(shapes.count("[]") * count for (shapes, _), count in collectives.items())


def _by_hand(builder, optimizer, *args, **kwargs):
  images, labels = _batch()
  params = jax.device_get(jax.jit(MODEL.init)(jax.random.key(0), images[:1]))
  step, state, put = builder(MODEL, optimizer, params, 8, True, *args, **kwargs)
  return _program(step.lower(state, put((images, labels))).compile())


def _parstrat(strategy, optimizer):
  images, labels = _batch()
  trainer = strategy(MODEL, optimizer)
  state = trainer.init(jax.random.key(0), images[:1])
  batch = jax.device_put((images, labels), NamedSharding(trainer.mesh, trainer.plan.batch_spec))
  return _program(trainer.lower(state, batch).compile())


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("replicate_below", [0, 100])
def test_fsdp_compiles_to_the_hand_written_fsdp_step(optimizer, replicate_below):
  """The same collectives, temporaries and work as `jit` on FSDP-sharded params.

  parstrat's step only adds its step counter's increment (one flop, a few bytes).
  (On GPU or TPU, where collectives may be wrapped in async ops, the pattern
  would need their names; this runs on the CPU devices of the test session.)
  """
  optimizer = OPTIMIZERS[optimizer]
  ours, our_collectives = _parstrat(
    parstrat.FSDP(data=8, replicate_below=replicate_below), optimizer
  )
  hand, hand_collectives = _by_hand(
    REFERENCES.fsdp_reference, optimizer, replicate_below=replicate_below
  )
  assert hand_collectives  # (a pattern that found none would make the next line vacuous)
  assert our_collectives == hand_collectives
  assert ours["temp"] == hand["temp"]
  assert ours["transcendentals"] == hand["transcendentals"]
  for cost in ("flops", "bytes accessed"):
    assert abs(ours[cost] - hand[cost]) <= hand[cost] * 1e-4, (cost, ours, hand)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_data_parallel_compiles_to_no_more_work_than_the_hand_written_step(optimizer):
  """Against `jit(shard_map)` with one `pmean` of the loss and gradients, plus the metrics.

  parstrat's step takes the gradients' norm from each device's 1/N of them (less
  work and memory traffic than every device taking all of it), at the price of
  one more collective, of scalars; the gradients' all-reduce is the same.
  """
  ours, our_collectives = _parstrat(parstrat.DataParallel(data=8), OPTIMIZERS[optimizer])
  hand, hand_collectives = _by_hand(REFERENCES.shard_map_dp_reference, OPTIMIZERS[optimizer])
  for cost in ("flops", "transcendentals", "bytes accessed", "temp"):
    assert ours[cost] <= hand[cost], (cost, ours, hand)

  # The gradients' all-reduce moves the same arrays; ours has one more of scalars only,
  # and one more scalar in all: the norm's (the loss and the label count are in both).
  assert hand_collectives
  expected = sorted([*_array_bytes(hand_collectives), ("all-reduce", 0)])
  assert _array_bytes(our_collectives) == expected
  assert _scalars(our_collectives) == _scalars(hand_collectives) + 1
