"""What `unroll=True` costs in compilation: each pipeline row compiled looped and unrolled.

Run from the repository root: `python benchmarks/unroll_compile.py`. It prints, for the
benchmark's model (512 -> 8 x Linear(512), Adam, global batch 1024) at P=4 and each M,
the seconds `lower(...).compile()` took and the compiled step's temporaries, looped
and unrolled. Compile times are of one machine and one moment: compare within a run.
"""

import argparse
import time

import parstrat.testing

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 32])
ARGS = parser.parse_args()
parstrat.testing.use_cpu_devices(8)

import jax  # noqa: E402
import optax  # noqa: E402
from references import mlp  # noqa: E402

import parstrat  # noqa: E402

ROWS = {
  "1f1b": dict(schedule="1f1b"),
  "zb_h1": dict(schedule="zb_h1"),
  "zb_h1 save": dict(schedule="zb_h1", activations="save"),
  "interleaved_1f1b K1": dict(schedule="interleaved_1f1b", virtual_stages=2, exchange_every=1),
}


def main() -> None:
  model = mlp([512] * 8)
  images, labels = parstrat.testing.random_batches(1, 1024, features=512, classes=512)
  print("row, M: compile s looped -> unrolled; temp MiB looped -> unrolled")
  for name, options in ROWS.items():
    for microbatches in ARGS.microbatches:
      seconds, temps = [], []
      for unroll in (False, True):
        strategy = parstrat.PipelineModelParallel(
          stages=4, microbatches=microbatches, unroll=unroll, **options
        )
        trainer = strategy(model, optax.adam(1e-3))
        state = trainer.init(jax.random.key(0), images[0][:1])
        start = time.perf_counter()
        compiled = trainer.lower(state, (images[0], labels[0])).compile()
        seconds.append(time.perf_counter() - start)
        temps.append(compiled.memory_analysis().temp_size_in_bytes / 2**20)
      print(
        f"{name}, M{microbatches}: {seconds[0]:.1f} -> {seconds[1]:.1f} s; "
        f"{temps[0]:.2f} -> {temps[1]:.2f} MiB",
        flush=True,
      )


if __name__ == "__main__":
  main()
