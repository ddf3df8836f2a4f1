"""Benchmarks: every strategy next to the code a user would otherwise write, in one run.

Measures, on the same model and global batch:

* data parallel: single-device `jax.jit`, hand-written `jax.pmap` (replicated
  params, `pmean` of gradients) and `parstrat.DataParallel`;
* pipeline: single-device `jax.jit`, a hand-written `shard_map` + `ppermute`
  GPipe loop (homogeneous stages, autodiff through the loop), and
  `parstrat.PipelineModelParallel` (gpipe and 1f1b) and `parstrat.Hybrid`;
* memory: per-device parameter + optimizer bytes from the arrays' addressable
  shards, and the compiled step's temporary bytes from `memory_analysis()`,
  for gpipe vs 1f1b at P=4, M=16.

Times are medians of repeated steps after a warm-up; ratios compare programs
measured in the same run, which is all that virtual CPU devices (all sharing
this machine's cores) can honestly support.

Run: python benchmarks/run.py [--devices 8] [--repeats 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time

import parstrat.testing


def _parse() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=30)
  parser.add_argument("--json", default="benchmarks/results.json")
  return parser.parse_args()


ARGS = _parse()
parstrat.testing.use_cpu_devices(ARGS.devices)

import haiku as hk  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import parstrat  # noqa: E402

LR = 1e-3


def mlp(widths):
  return hk.transform(lambda x: hk.nets.MLP(widths, activation=jax.nn.swish)(x))


def loss_of(model):
  def loss(params, x, y):
    return parstrat.softmax_cross_entropy(model.apply(params, None, x), y)

  return loss


def timed(step, state, batches, repeats):
  """Median and spread (IQR) of `repeats` steps after two warm-up steps; plus compile time."""
  start = time.perf_counter()
  state = step(state, batches[0])
  jax.block_until_ready(state)
  compile_s = time.perf_counter() - start
  state = step(state, batches[1])
  jax.block_until_ready(state)
  times = []
  for i in range(repeats):
    start = time.perf_counter()
    state = step(state, batches[i % len(batches)])
    jax.block_until_ready(state)
    times.append(time.perf_counter() - start)
  q = np.percentile(times, [25, 50, 75])
  row = {"median_s": float(q[1]), "iqr_s": float(q[2] - q[0]), "first_step_s": compile_s}
  return row, state


# ----------------------------------------------------------------- references
def jit_reference(model, optimizer, params):
  loss = loss_of(model)

  @jax.jit
  def step(carry, batch):
    params, opt_state = carry
    grads = jax.grad(loss)(params, *batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  device = jax.devices()[0]
  state = jax.device_put((params, optimizer.init(params)), device)
  return step, state, lambda b: jax.device_put(b, device)


def pmap_reference(model, optimizer, params, n):
  loss = loss_of(model)

  @functools.partial(jax.pmap, axis_name="batch", donate_argnums=0)
  def step(carry, batch):
    params, opt_state = carry
    grads = lax.pmean(jax.grad(loss)(params, *batch), "batch")
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  devices = jax.devices()[:n]
  state = (params, optimizer.init(params))
  stacked = jax.tree.map(lambda x: np.broadcast_to(x, (n, *np.shape(x))), state)
  state = jax.pmap(lambda x: x, devices=devices)(stacked)

  def shard(batch):
    return jax.tree.map(lambda a: a.reshape(n, a.shape[0] // n, *a.shape[1:]), batch)

  return step, state, shard


def shard_map_gpipe_reference(width, stages, microbatches, optimizer):
  """A hand-written GPipe: one Linear(width)+swish per stage, stacked weights."""
  mesh = jax.make_mesh(
    (stages,),
    ("stage",),
    devices=jax.devices()[:stages],
    axis_types=(jax.sharding.AxisType.Auto,),
  )
  key = jax.random.key(0)
  w = jax.random.normal(key, (stages, width, width)) / np.sqrt(width)
  b = jnp.zeros((stages, width))
  params = (w, b)

  def pipeline_logits(params, x):
    w, b = params  # this stage's [1, width, width], [1, width]
    stage = lax.axis_index("stage")
    M = microbatches
    xs = x.reshape(M, -1, width)

    def tick(carry, t):
      act, outs = carry
      inp = jnp.where(stage == 0, xs[jnp.clip(t, 0, M - 1)], act)
      h = inp @ w[0] + b[0]
      h = jnp.where(stage == stages - 1, h, jax.nn.swish(h))
      m = t - (stages - 1)
      outs = jnp.where(
        (stage == stages - 1) & (m >= 0), outs.at[jnp.clip(m, 0, M - 1)].set(h), outs
      )
      act = lax.ppermute(h, "stage", [(i, (i + 1) % stages) for i in range(stages)])
      return (act, outs), None

    init = (jnp.zeros_like(xs[0]), jnp.zeros_like(xs))
    init = lax.pcast(init, ("stage",), to="varying")
    (_, outs), _ = lax.scan(tick, init, jnp.arange(M + stages - 1))
    return lax.psum(jnp.where(stage == stages - 1, outs, 0.0), "stage").reshape(x.shape)

  logits = jax.shard_map(pipeline_logits, mesh=mesh, in_specs=(P("stage"), P()), out_specs=P())
  stage_sharding = NamedSharding(mesh, P("stage"))
  params = jax.device_put(params, stage_sharding)
  opt_state = jax.tree.map(
    lambda x: jax.device_put(x, stage_sharding if x.ndim else NamedSharding(mesh, P())),
    optimizer.init(params),
  )

  @functools.partial(jax.jit, donate_argnums=0)
  def step(carry, batch):
    params, opt_state = carry
    x, y = batch
    grads = jax.grad(lambda p: parstrat.softmax_cross_entropy(logits(p, x), y))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  replicated = NamedSharding(mesh, P())
  return step, (params, opt_state), lambda batch: jax.device_put(batch, replicated)


def parstrat_step(trainer, sample):
  state = trainer.init(jax.random.key(0), sample)

  def step(state, batch):
    return trainer.step(state, batch)[0]

  return step, state


def bytes_per_device(tree) -> int:
  """Parameter + optimizer bytes on the first device, from addressable shards."""
  device = jax.devices()[0]
  total = 0
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      if shard.device == device:
        total += shard.data.nbytes
  return total


def run_data_parallel(results, repeats):
  n = ARGS.devices
  model = mlp([512, 10])
  batch = 64 * n
  images, labels = parstrat.testing.random_batches(4, batch)
  batches = list(zip(images, labels, strict=True))
  optimizer = optax.adam(LR)
  params = jax.jit(model.init)(jax.random.key(0), images[0][:1])
  rows = {}
  step, state, put = jit_reference(model, optimizer, params)
  rows["jit (1 device)"], _ = timed(step, state, [put(b) for b in batches], repeats)
  step, state, put = pmap_reference(model, optimizer, params, n)
  rows[f"pmap by hand ({n})"], _ = timed(step, state, [put(b) for b in batches], repeats)
  trainer = parstrat.DataParallel(data=n)(model, optimizer)
  step, state = parstrat_step(trainer, images[0][:1])
  rows[f"data_parallel ({n})"], state = timed(step, state, batches, repeats)
  rows[f"data_parallel ({n})"]["param_opt_bytes_per_device"] = bytes_per_device(state)
  for row in rows.values():
    row["examples_per_s"] = batch / row["median_s"]
  results["data_parallel"] = {
    "model": "784-512-10 swish, adam",
    "global_batch": batch,
    "rows": rows,
    "ratio_data_parallel_vs_pmap": rows[f"data_parallel ({n})"]["median_s"]
    / rows[f"pmap by hand ({n})"]["median_s"],
  }


def run_pipeline(results, repeats):
  width, stages, microbatches = 512, 4, 8
  batch = 256
  model = mlp([width] * stages)
  images, labels = parstrat.testing.random_batches(4, batch, features=width, classes=width)
  batches = list(zip(images, labels, strict=True))
  optimizer = optax.adam(LR)
  params = jax.jit(model.init)(jax.random.key(0), images[0][:1])
  rows = {}
  step, state, put = jit_reference(model, optimizer, params)
  rows["jit (1 device)"], _ = timed(step, state, [put(b) for b in batches], repeats)
  step, state, put = shard_map_gpipe_reference(width, stages, microbatches, optimizer)
  rows["shard_map GPipe by hand"], _ = timed(step, state, [put(b) for b in batches], repeats)
  for schedule in ("gpipe", "1f1b"):
    trainer = parstrat.PipelineModelParallel(
      stages=stages, microbatches=microbatches, schedule=schedule
    )(model, optimizer)
    step, state = parstrat_step(trainer, images[0][:1])
    name = f"pipeline {schedule}"
    rows[name], state = timed(step, state, batches, repeats)
    rows[name]["param_opt_bytes_per_device"] = bytes_per_device(state)
  trainer = parstrat.Hybrid(data=2, stages=stages, microbatches=microbatches // 2)(model, optimizer)
  step, state = parstrat_step(trainer, images[0][:1])
  rows["hybrid 2x4"], _ = timed(step, state, batches, repeats)
  for row in rows.values():
    row["examples_per_s"] = batch / row["median_s"]
  results["pipeline"] = {
    "model": f"{width}-{width}x{stages} swish, adam; P={stages}, M={microbatches}",
    "global_batch": batch,
    "rows": rows,
    "bubble_theory": parstrat.pipeline.theoretical_bubble(stages, microbatches),
  }


def run_memory(results):
  width, stages, microbatches, batch = 512, 4, 16, 2048
  model = mlp([width] * stages)
  images, labels = parstrat.testing.random_batches(1, batch, features=width, classes=width)
  out = {}
  for schedule in ("gpipe", "1f1b"):
    trainer = parstrat.PipelineModelParallel(
      stages=stages, microbatches=microbatches, schedule=schedule
    )(model, optax.adam(LR))
    state = trainer.init(jax.random.key(0), images[0][:1])
    analysis = trainer.lower(state, (images[0], labels[0])).compile().memory_analysis()
    out[schedule] = {
      "temp_bytes": int(analysis.temp_size_in_bytes),
      "argument_bytes": int(analysis.argument_size_in_bytes),
      "param_opt_bytes_per_device": bytes_per_device(state),
      "activation_slots": trainer.plan.description.split("ticks, ")[1].split(",")[-1].strip(),
    }
  results["memory_P4_M16"] = {"global_batch": batch, "rows": out}


def main():
  results = {
    "machine": f"{platform.machine()}, {jax.device_count()} virtual {jax.devices()[0].platform} "
    f"devices on {__import__('os').cpu_count()} cores, jax {jax.__version__}",
    "repeats": ARGS.repeats,
  }
  run_data_parallel(results, ARGS.repeats)
  run_pipeline(results, ARGS.repeats)
  run_memory(results)
  print(f"machine: {results['machine']}")
  for section in ("data_parallel", "pipeline"):
    block = results[section]
    print(f"\n{section}: {block['model']}, global batch {block['global_batch']}")
    print(f"{'':28} {'median ms':>10} {'IQR ms':>8} {'examples/s':>11} {'first step s':>13}")
    for name, row in block["rows"].items():
      print(
        f"{name:28} {1e3 * row['median_s']:10.2f} {1e3 * row['iqr_s']:8.2f} "
        f"{row['examples_per_s']:11,.0f} {row['first_step_s']:13.2f}"
      )
  dp = results["data_parallel"]["ratio_data_parallel_vs_pmap"]
  print(f"\ndata_parallel / hand-written pmap step time: {dp:.3f}")
  print(f"pipeline bubble (theory, P=4, M=8): {results['pipeline']['bubble_theory']:.3f}")
  print("\nmemory at P=4, M=16 (per device):")
  for schedule, row in results["memory_P4_M16"]["rows"].items():
    print(
      f"  {schedule:6} temp {row['temp_bytes'] / 2**20:8.2f} MiB, params+opt "
      f"{row['param_opt_bytes_per_device'] / 2**20:.2f} MiB"
    )
  with open(ARGS.json, "w") as f:
    json.dump(results, f, indent=2)
  print(f"\nwrote {ARGS.json}")


if __name__ == "__main__":
  main()
