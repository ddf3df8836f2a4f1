"""What a pipeline exchange costs: K = 1 steps at a width where stages compute next to nothing.

At P=4, M=8 the hand-written GPipe loop (+ metrics, `references.py`) and parstrat's
schedules run 22 to 38 exchanges a step. At width 16 their stages compute next to
nothing, so the step time over the exchange count is what one exchange costs (its
`ppermute`, the loop iteration, the buffer updates); at width 512 (the benchmark's)
compute comes back. A schedule whose gap to the loop is the same at both widths
loses it in its exchanges; one that matches the loop at width 16 loses it in its
passes. Ratios are medians of per-pass ratios within this one run.

Run: python benchmarks/exchange_overhead.py [--passes 5] [--repeats 15] [--widths 16 512]
"""

import argparse

import parstrat.testing

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--passes", type=int, default=5)
parser.add_argument("--repeats", type=int, default=15)
parser.add_argument("--widths", type=int, nargs="+", default=[16, 512])
ARGS = parser.parse_args()
parstrat.testing.use_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from references import median_step_time  # noqa: E402
from references import mlp  # noqa: E402
from references import shard_map_gpipe_reference  # noqa: E402

import parstrat  # noqa: E402
from parstrat import pipeline  # noqa: E402
from parstrat._src.pipeline import engine  # noqa: E402

STAGES, MICRO, LAYERS, BATCH = 4, 8, 8, 1024
#: The K = 1 pipeline rows: (label, options).
ROWS = (
  ("gpipe", {"schedule": "gpipe"}),
  ("1f1b", {"schedule": "1f1b"}),
  ("zb_h1", {"schedule": "zb_h1"}),
  ("zb_h1 save", {"schedule": "zb_h1", "activations": "save"}),
  ("interleaved_1f1b K1", {"schedule": "interleaved_1f1b", "virtual_stages": 2}),
)


def collectives(options: dict) -> tuple[int, int]:
  """(`ppermute`s, exchanges) per step of a K = 1 row (`engine.exchange_plan`)."""
  schedule = pipeline.build_schedule(
    options["schedule"], STAGES, MICRO, virtual_stages=options.get("virtual_stages")
  )
  plan = engine.exchange_plan(schedule)
  count = {(): 0, engine.BOTH_WAYS: 2}
  return sum(count.get(plan.ways[i], 1) for i in plan.way_index), schedule.num_exchanges


def main() -> None:
  optimizer = optax.adam(1e-3)
  for width in ARGS.widths:
    images, labels = parstrat.testing.random_batches(1, BATCH, features=width, classes=width)
    batch = (images[0], labels[0])
    step, state, put = shard_map_gpipe_reference(
      width, STAGES, MICRO, optimizer, LAYERS // STAGES, True
    )
    rows = {"hand GPipe + metrics": [step, state, put(batch), (2 * (MICRO + STAGES - 1),) * 2]}
    for label, options in ROWS:
      trainer = parstrat.PipelineModelParallel(
        stages=STAGES, microbatches=MICRO, exchange_every=1, **options
      )(mlp([width] * LAYERS), optimizer)
      state = trainer.init(jax.random.key(0), images[0][:1])
      placed = jax.device_put(batch, NamedSharding(trainer.mesh, trainer.plan.batch_spec))
      rows[label] = [lambda s, b, t=trainer: t.step(s, b)[0], state, placed, collectives(options)]
    times: dict[str, list[float]] = {label: [] for label in rows}
    for _ in range(ARGS.passes):
      for label, row in rows.items():
        step, state, placed, _ = row
        seconds, row[1] = median_step_time(step, state, placed, ARGS.repeats)
        times[label].append(seconds)
    hand = np.array(times["hand GPipe + metrics"])
    print(f"width {width} (P={STAGES}, M={MICRO}, batch {BATCH}, {ARGS.passes} passes):")
    for label, row in rows.items():
      ms = float(np.median(times[label])) * 1e3
      ppermutes, exchanges = row[3]
      ratio = float(np.median(np.array(times[label]) / hand))
      print(
        f"  {label:22s} {ms:6.1f} ms  {exchanges:3d} exchanges ({ppermutes:3d} ppermutes)"
        f"  {ms / exchanges:5.2f} ms per exchange  {ratio:.3f}x the loop",
        flush=True,
      )


if __name__ == "__main__":
  main()
