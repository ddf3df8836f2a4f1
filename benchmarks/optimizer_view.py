"""What a per-leaf optimizer costs a pipeline: the model-layout view against the stage rows.

`optax.adamw(mask=...)` (decay on weight matrices only) does not act leaf by leaf
on the pipeline's flat stage rows, so the trainer runs it on the model's layout,
each leaf sharded over "stage" (`parstrat/_src/pipeline/optimizer_view.py`): every
step moves the gradients and params there and the updates back. Plain
`optax.adamw` (no mask) runs on the rows themselves. Both rows train the
benchmark's model (784-512-(8x512)-10, swish) at P=4, M=16 on the same batch.
Printed: each row's median step time, its ratio to the unmasked row (median
of per-pass ratios, within this one run), and from the compiled step its
temporaries and the optimizer state per device.

Run: python benchmarks/optimizer_view.py [--passes 5] [--repeats 10]
"""

import argparse

import parstrat.testing

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--passes", type=int, default=5)
parser.add_argument("--repeats", type=int, default=10)
ARGS = parser.parse_args()
parstrat.testing.use_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from references import median_step_time  # noqa: E402
from references import mlp  # noqa: E402

import parstrat  # noqa: E402

STAGES, MICRO, BATCH = 4, 16, 1024
MODEL = mlp([512] * 9 + [10])


def decay_mask(params):
  """Weight decay on weight matrices only: not on biases."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


ROWS = {
  "adamw (stage rows)": optax.adamw(1e-3),
  "adamw mask (model-layout view)": optax.adamw(1e-3, mask=decay_mask),
}


def per_device_mib(tree) -> float:
  """MiB one device holds of `tree`'s arrays, from their shardings."""
  leaves = jax.tree.leaves(tree)
  return sum(np.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves) / 2**20


def main() -> None:
  images, labels = parstrat.testing.random_batches(1, BATCH, features=784)
  batch = (images[0], labels[0])
  rows = {}
  for label, optimizer in ROWS.items():
    trainer = parstrat.PipelineModelParallel(stages=STAGES, microbatches=MICRO)(MODEL, optimizer)
    state = trainer.init(jax.random.key(0), images[0][:1])
    placed = jax.device_put(batch, NamedSharding(trainer.mesh, trainer.plan.batch_spec))
    memory = trainer.lower(state, placed).compile().memory_analysis()
    viewed = trainer.plan.optimizer_view is not None
    rows[label] = [trainer, state, placed, memory.temp_size_in_bytes / 2**20, viewed]
  times: dict[str, list[float]] = {label: [] for label in rows}
  for _ in range(ARGS.passes):
    for label, row in rows.items():
      trainer, state, placed = row[:3]
      step = lambda s, b, t=trainer: t.step(s, b)[0]  # noqa: E731
      seconds, row[1] = median_step_time(step, state, placed, ARGS.repeats)
      times[label].append(seconds)
  base = np.array(times["adamw (stage rows)"])
  print(f"P={STAGES}, M={MICRO}, batch {BATCH}, {ARGS.passes} passes of {ARGS.repeats} steps:")
  for label, (_, state, _, temporaries, viewed) in rows.items():
    ms = float(np.median(times[label])) * 1e3
    ratio = float(np.median(np.array(times[label]) / base))
    print(
      f"  {label:32s} {ms:6.1f} ms  {ratio:.3f}x  temporaries {temporaries:5.2f} MiB  "
      f"optimizer state {per_device_mib(state.opt_state):4.2f} MiB per device  "
      f"(view: {'yes' if viewed else 'no'})",
      flush=True,
    )


if __name__ == "__main__":
  main()
