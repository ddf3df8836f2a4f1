"""Benchmarks: every strategy next to the code a user would otherwise write, in one run.

Measures, on the same model and global batch:

* data parallel: single-device `jax.jit`, hand-written `jax.pmap` and
  `jit(shard_map)` (replicated params, one `pmean` of loss and gradients), a
  hand-written FSDP (`jit` on params and optimizer state sharded over "data"),
  `parstrat.DataParallel` and `parstrat.FSDP`;
* pipeline: a hand-written `shard_map` + `ppermute` GPipe loop (homogeneous
  stages, autodiff through the loop), and `parstrat.PipelineModelParallel`
  under every schedule (gpipe, 1f1b, zb_h1, interleaved_1f1b) at the same
  P and M, and `parstrat.Hybrid`; each with the idle share of its tick table,
  and the share of its pipeline loop a device spends outside its stage
  computations, measured from a `jax.profiler` trace of one compiled step;
* memory: per-device parameter + optimizer bytes from the arrays' addressable
  shards, and the compiled step's temporary bytes from `memory_analysis()`,
  for the four schedules (and `activations="save"`) at P=4, M=16.

Every row's batches are placed on the devices before timing (as the
hand-written references' are), so no row pays a host-to-device copy.

Times are medians of repeated steps after a warm-up; ratios compare programs
measured in the same run, which is all that virtual CPU devices (all sharing
this machine's cores) can honestly support. Each row also records its page
faults per step: the process asks glibc to keep freed memory (no `mmap` for
large blocks, no trimming below 1 GiB; `--allocator default` leaves glibc as it is), since
otherwise a program with a large temporary buffer may have it unmapped after
each step and fault it back in, page by page (on 2 cores the hand-written GPipe
loop's 31.5 MiB took 8,000-16,000 faults a step, the other rows next to none, in a
check of five rows; in the whole benchmark on 2 cores rows still fault with the
setting, so the faults column is what to read).

Run: python benchmarks/run.py [--devices 8] [--repeats 30] [--passes 3] [--batch 1024] [--quick]
[--allocator steady|default] [--json benchmarks/results.json]
(also writes the charts beside the JSON: results_strategies.png, results_scaling_bubble.png)
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import glob
import gzip
import json
import os
import platform
import resource
import tempfile
import time

import parstrat.testing


def _parse() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=30)
  parser.add_argument("--passes", type=int, default=3, help="timing passes over every row")
  parser.add_argument(
    "--batch",
    type=int,
    default=1024,
    help="global batch of the timed rows (1024: microbatches of 128 at M=8, as in issue #15)",
  )
  parser.add_argument("--json", default="benchmarks/results.json")
  parser.add_argument(
    "--quick", action="store_true", help="only the strategy and memory tables (no charts)"
  )
  parser.add_argument(
    "--allocator",
    choices=("steady", "default"),
    default="steady",
    help="steady: glibc keeps freed memory for the next step (see above); default: as it comes",
  )
  return parser.parse_args()


#: glibc's `mallopt` parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4


def steady_allocator() -> str:
  """Asks glibc to serve every block from its heap and keep what is freed; says what it did.

  A temporary buffer larger than glibc's mmap threshold (dynamic, at most
  32 MiB) gets its own `mmap` and is unmapped when freed, so the next step
  faults it back in page by page; whether glibc maps a block of a given size
  depends on what was freed before (its threshold moves). Every row runs under
  the same setting, made before any JAX allocation.
  """
  if ARGS.allocator == "default":
    return "default"
  try:
    libc = ctypes.CDLL("libc.so.6")
  except OSError:
    return "default (no glibc)"
  done = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1
  return "glibc, no mmap, trim above 1 GiB" if done else "default (mallopt refused)"


ARGS = _parse()
ALLOCATOR = steady_allocator()
parstrat.testing.use_cpu_devices(ARGS.devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from references import fsdp_reference  # noqa: E402
from references import jit_reference  # noqa: E402
from references import mlp  # noqa: E402
from references import pmap_reference  # noqa: E402
from references import shard_map_dp_reference  # noqa: E402
from references import shard_map_gpipe_reference  # noqa: E402

import parstrat  # noqa: E402
from parstrat._src import hlo_check  # noqa: E402
from parstrat._src.hybrid import schedule_for  # noqa: E402

LR = 1e-3


def timed(step, state, batches, repeats):
  """Median and spread (IQR) of `repeats` steps after two warm-up steps; compile time; faults."""
  start = time.perf_counter()
  state = step(state, batches[0])
  jax.block_until_ready(state)
  compile_s = time.perf_counter() - start
  state = step(state, batches[1])
  jax.block_until_ready(state)
  times = []
  faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for i in range(repeats):
    start = time.perf_counter()
    state = step(state, batches[i % len(batches)])
    jax.block_until_ready(state)
    times.append(time.perf_counter() - start)
  faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
  q = np.percentile(times, [25, 50, 75])
  row = {
    "median_s": float(q[1]),
    "iqr_s": float(q[2] - q[0]),
    "first_step_s": compile_s,
    "page_faults_per_step": faults / repeats,
  }
  return row, state


def parstrat_step(trainer, sample):
  state = trainer.init(jax.random.key(0), sample)

  def step(state, batch):
    return trainer.step(state, batch)[0]

  return step, state


def measured_bubble(trainer, state, batch):
  """The share of the pipeline loop each device spends outside its stage computations.

  From a `jax.profiler` trace of one compiled step: per device (the trace's
  `device_ordinal`), the loop's span from its first to its last `conditional`
  (the engine's `lax.switch` over the tick's pass) minus the time inside them,
  over the span; the mean over devices. The exchange's switch (every device
  takes the same branch: `hlo_check.uniform_switches` names it in the compiled
  step) is not a pass and counts as outside. This counts idle ticks and also
  the messages and buffer updates between ticks; on virtual CPU devices sharing
  cores, a device waiting for a core looks busy, so the number is a rough one.

  Returns:
    `(mean share, new state)`, or `(None, state)` when the trace has no such events.
  """
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder, create_perfetto_trace=True):
      state, _ = trainer.step(state, batch)
      jax.block_until_ready(state)
    files = glob.glob(f"{folder}/**/perfetto_trace.json.gz", recursive=True)
    if not files:
      return None, state
    with gzip.open(files[0]) as f:
      trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  exchanges = hlo_check.uniform_switches(trainer.lower(state, batch).compile().as_text())
  spans: dict[str, list[tuple[float, float]]] = {}
  for e in events:
    args = e.get("args", {})
    name = e.get("name", "")
    passes = name.startswith("conditional") and name not in exchanges
    if e.get("ph") == "X" and passes and "device_ordinal" in args:
      spans.setdefault(args["device_ordinal"], []).append((e["ts"], e["ts"] + e["dur"]))
  shares = []
  for intervals in spans.values():
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    busy = sum(end - start for start, end in intervals)
    shares.append(1 - busy / span if span > 0 else 0.0)
  return (float(np.mean(shares)) if shares else None), state


def bytes_per_device(tree) -> int:
  """Parameter + optimizer bytes on the first device, from addressable shards."""
  device = jax.devices()[0]
  total = 0
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      if shard.device == device:
        total += shard.data.nbytes
  return total


WIDTH, LAYERS, BATCH = 512, 8, ARGS.batch
STAGES, MICRO = 4, 8
HYBRID_DATA, HYBRID_MICRO = 2, 4
SAVE, K2 = {"activations": "save"}, {"exchange_every": 2}
UNROLL = {"unroll": True}
#: The `fsdp` row's second layout: leaves under this many elements stay replicated
#: (DeepSpeed ZeRO-3's default `stage3_param_persistence_threshold`; here the biases).
REPLICATE_BELOW = 100_000
DOTS = {"activations": "dots_saveable"}
#: The pipeline rows: (schedule, options). "save" keeps each forward's residuals
#: (no rerun in the backward, as in the hand-written GPipe), "dots_saveable" its
#: matmul outputs (the backward reruns the element-wise work), "K2" exchanges
#: messages every two ticks (a forward and a backward between exchanges),
#: "unrolled" traces the ticks as straight-line code (`unroll=True`).
PIPELINES = (
  ("gpipe", {}),
  ("gpipe", DOTS),
  ("gpipe", SAVE),
  ("1f1b", {}),
  ("1f1b", UNROLL),
  ("1f1b", DOTS),
  ("1f1b", SAVE),
  ("1f1b", {**SAVE, **K2}),
  ("zb_h1", {}),
  ("zb_h1", UNROLL),
  ("zb_h1", K2),
  ("zb_h1", {**DOTS, **K2}),
  ("zb_h1", SAVE),
  ("zb_h1", {**SAVE, **UNROLL}),
  ("zb_h1", {**SAVE, **K2}),
  ("interleaved_1f1b", {"virtual_stages": 2, "exchange_every": 1}),
  ("interleaved_1f1b", {"virtual_stages": 2, "exchange_every": 1, **UNROLL}),
  ("interleaved_1f1b", {"virtual_stages": 2, **K2}),
  ("interleaved_1f1b", {"virtual_stages": 2, **DOTS, **K2}),
  ("interleaved_1f1b", {"virtual_stages": 2, **SAVE, **K2}),
)


#: The hand-written GPipe loop a pipeline row's activation policy compares with: the
#: `jax.checkpoint` policy its stage computation is wrapped in (None: autodiff through
#: the loop keeps every residual, as "save" does).
HAND_REMAT = {
  "recompute": "nothing_saveable",
  "nothing_saveable": "nothing_saveable",
  "dots_saveable": "dots_saveable",
  "dots_with_no_batch_dims_saveable": "dots_with_no_batch_dims_saveable",
  "save": None,
}


def hand_gpipe_with(remat: str | None, data: int = 1, microbatches: int = MICRO) -> str:
  """The row name of a hand-written GPipe (with metrics) under checkpoint policy `remat`."""
  remat = "" if remat is None else f", remat {remat}"
  pipelines = "GPipe" if data == 1 else f"{data} x GPipe"
  return f"shard_map {pipelines} by hand{remat}, P{STAGES} M{microbatches} + metrics"


def pipeline_label(schedule: str, options: dict) -> str:
  """E.g. "1f1b save K2" for ("1f1b", {"activations": "save", "exchange_every": 2})."""
  extra = [options["activations"]] if "activations" in options else []
  extra += [f"K{options['exchange_every']}"] if "exchange_every" in options else []
  extra += ["unrolled"] if options.get("unroll") else []
  return " ".join([schedule, *extra])


def pipeline_table(strategy):
  """The tick table a `PipelineModelParallel` or `Hybrid` row runs."""
  return schedule_for(
    strategy.schedule,
    strategy.stages,
    strategy.microbatches,
    strategy.virtual_stages,
    strategy.exchange_every,
  )


def _row(step, state, batches, repeats, lower=None):
  compiled = None
  if lower is not None:  # lower + compile on their own, before anything ran
    start = time.perf_counter()
    compiled = lower(state).compile()
    compile_s = time.perf_counter() - start
  row, state = timed(step, state, batches, repeats)
  row["examples_per_s"] = BATCH / row["median_s"]
  row["param_opt_bytes_per_device"] = bytes_per_device(state)
  if compiled is not None:
    row["compile_s"] = compile_s
    row["temp_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
  return row, state


def run_strategies(results, repeats):
  """Every strategy and hand-written reference on one model and global batch."""
  n = ARGS.devices
  model = mlp([WIDTH] * LAYERS)
  images, labels = parstrat.testing.random_batches(4, BATCH, features=WIDTH, classes=WIDTH)
  batches = list(zip(images, labels, strict=True))
  optimizer = optax.adam(LR)
  # On the host: each reference places its own copy (a donated step deletes its buffers).
  params = jax.device_get(jax.jit(model.init)(jax.random.key(0), images[0][:1]))
  rows, timers = {}, {}

  def reference(name, built):
    step, state, put = built
    placed = [put(b) for b in batches]
    rows[name], state = _row(step, state, placed, repeats, lambda s: step.lower(s, placed[0]))
    timers[name] = [step, state, placed]

  reference("jit, 1 device", jit_reference(model, optimizer, params))
  reference(f"pmap by hand, {n}", pmap_reference(model, optimizer, params, n))
  # Each multi-device reference twice: the bare update, and "+ metrics", which also
  # returns the loss, global gradient norm and finite flag that every parstrat step does.
  hand_dp, hand_fsdp = f"jit(shard_map) by hand, {n}", f"FSDP jit by hand, {n}"
  hand_gpipe = f"shard_map GPipe by hand, P{STAGES} M{MICRO}"
  per_stage = LAYERS // STAGES
  for metrics, suffix in ((False, ""), (True, " + metrics")):
    reference(hand_dp + suffix, shard_map_dp_reference(model, optimizer, params, n, metrics))
    reference(hand_fsdp + suffix, fsdp_reference(model, optimizer, params, n, metrics))
    reference(
      hand_gpipe + suffix,
      shard_map_gpipe_reference(WIDTH, STAGES, MICRO, optimizer, per_stage, metrics),
    )
  # The same hand-written FSDP + metrics once more, as its own row: the ratio of two
  # identical programs is this run's noise floor for the parity rows.
  hand_fsdp_copy = f"{hand_fsdp}, second copy + metrics"
  reference(hand_fsdp_copy, fsdp_reference(model, optimizer, params, n, True))
  # The hand-written FSDP with small leaves replicated: `fsdp`'s second layout, by hand.
  hand_fsdp_small = f"{hand_fsdp}, under {REPLICATE_BELOW:,} replicated + metrics"
  reference(
    hand_fsdp_small,
    fsdp_reference(model, optimizer, params, n, True, replicate_below=REPLICATE_BELOW),
  )
  # The hand-written GPipe loop under each activation policy, as the counterpart of the
  # pipeline rows that use it (with the metrics every parstrat step returns).
  policies = {options.get("activations", "recompute") for _, options in PIPELINES}
  for remat in sorted({HAND_REMAT[policy] for policy in policies} - {None}):
    reference(
      hand_gpipe_with(remat),
      shard_map_gpipe_reference(WIDTH, STAGES, MICRO, optimizer, per_stage, True, remat),
    )
  # And Hybrid's: HYBRID_DATA such loops side by side, the batch split between them.
  for remat in (None, HAND_REMAT["recompute"]):
    reference(
      hand_gpipe_with(remat, HYBRID_DATA, HYBRID_MICRO),
      shard_map_gpipe_reference(
        WIDTH, STAGES, HYBRID_MICRO, optimizer, per_stage, True, remat, HYBRID_DATA
      ),
    )
  dp, fsdp = f"data_parallel, {n}", f"fsdp, {n}"
  fsdp_small = f"fsdp replicate_below={REPLICATE_BELOW:,}, {n}"
  configs = {
    dp: parstrat.DataParallel(data=n),
    fsdp: parstrat.FSDP(data=n),
    fsdp_small: parstrat.FSDP(data=n, replicate_below=REPLICATE_BELOW),
  }
  for schedule, options in PIPELINES:
    name = f"pipeline {pipeline_label(schedule, options)}, P{STAGES} M{MICRO}"
    configs[name] = parstrat.PipelineModelParallel(
      stages=STAGES, microbatches=MICRO, schedule=schedule, **options
    )
  # `Hybrid` as it comes (1F1B, "recompute"), and keeping its residuals as the
  # hand-written loops do.
  hybrids = []
  for options in ({}, SAVE):
    label = " ".join(["hybrid", f"{HYBRID_DATA}x{STAGES}", *options.values()])
    hybrids.append(f"{label}, M{HYBRID_MICRO}")
    configs[hybrids[-1]] = parstrat.Hybrid(
      data=HYBRID_DATA, stages=STAGES, microbatches=HYBRID_MICRO, **options
    )
  for name, strategy in configs.items():
    trainer = strategy(model, optimizer)
    step, state = parstrat_step(trainer, images[0][:1])
    sharding = NamedSharding(trainer.mesh, trainer.plan.batch_spec)
    placed = [jax.device_put(b, sharding) for b in batches]
    rows[name], state = _row(
      step, state, placed, repeats, lambda s, t=trainer, b=placed[0]: t.lower(s, b)
    )
    if name.startswith(("pipeline", "hybrid")):
      schedule = pipeline_table(strategy)
      rows[name]["bubble_scheduled"] = schedule.bubble_fraction()
      rows[name]["bubble_theory"] = schedule.theoretical_bubble()
      # (the "dots" policies rerun only element-wise work: priced as "save")
      rerun_all = strategy.activations in ("recompute", "nothing_saveable")
      cost = "recompute" if rerun_all else "save"
      rows[name]["bubble_lockstep"] = schedule.lockstep_bubble(cost)
      rows[name]["lockstep_forwards"] = schedule.lockstep_time(cost)
      rows[name]["bubble_measured"], state = measured_bubble(trainer, state, placed[0])
    timers[name] = [step, state, placed]
  ratios = {}
  for suffix in ("", " + metrics"):
    ratios[f"data_parallel / {hand_dp}{suffix}"] = (dp, hand_dp + suffix)
    ratios[f"fsdp / {hand_fsdp}{suffix}"] = (fsdp, hand_fsdp + suffix)
  for suffix in ("", " + metrics"):  # against FSDP as a user writes it: every leaf split
    ratios[f"{fsdp_small} / {hand_fsdp}{suffix}"] = (fsdp_small, hand_fsdp + suffix)
  ratios[f"{fsdp_small} / {hand_fsdp}, same layout + metrics"] = (fsdp_small, hand_fsdp_small)
  ratios[f"control: {hand_fsdp_copy} / {hand_fsdp} + metrics"] = (
    hand_fsdp_copy,
    hand_fsdp + " + metrics",
  )
  ratios[f"fsdp / {hand_dp}"] = (fsdp, hand_dp)
  ratios[f"data_parallel / pmap by hand, {n}"] = (dp, f"pmap by hand, {n}")
  for suffix in ("", " + metrics"):
    for name in configs:
      if name.startswith("pipeline"):
        ratios[f"{name} / hand GPipe{suffix}"] = (name, hand_gpipe + suffix)
  for name, strategy in configs.items():
    if name.startswith("pipeline"):
      counterpart = hand_gpipe_with(HAND_REMAT[strategy.activations])
      ratios[f"{name} / hand GPipe, same activations + metrics"] = (name, counterpart)
  hand_hybrid = functools.partial(hand_gpipe_with, data=HYBRID_DATA, microbatches=HYBRID_MICRO)
  for hybrid in hybrids:
    ratios[f"{hybrid} / hand {HYBRID_DATA} x GPipe + metrics"] = (hybrid, hand_hybrid(None))
    ratios[f"{hybrid} / hand {HYBRID_DATA} x GPipe, same activations + metrics"] = (
      hybrid,
      hand_hybrid(HAND_REMAT[configs[hybrid].activations]),
    )
  # More passes over every row, one after the other, so that a burst of load on the
  # shared cores hits all rows of a pass alike: step times are the median over passes,
  # and each ratio the median of its per-pass ratios. Each later pass times the rows
  # in its own (seeded) random order, so that no row always runs just after the same
  # one, or always first: the order the rows were built in stays the first pass's.
  for row in rows.values():
    row["pass_medians_s"] = [row["median_s"]]
    row["pass_page_faults_per_step"] = [row.pop("page_faults_per_step")]
  names = list(timers)
  for index in range(1, ARGS.passes):
    for name in np.random.default_rng(index).permutation(names):
      timer = timers[name]
      more, timer[1] = timed(*timer, repeats)
      rows[name]["pass_medians_s"].append(more["median_s"])
      rows[name]["pass_page_faults_per_step"].append(more["page_faults_per_step"])
  for row in rows.values():
    row["median_s"] = float(np.median(row["pass_medians_s"]))
    row["examples_per_s"] = BATCH / row["median_s"]

  def ratio(a, b):
    per_pass = np.divide(rows[a]["pass_medians_s"], rows[b]["pass_medians_s"])
    return float(np.median(per_pass))

  results["strategies"] = {
    "model": f"{WIDTH} -> {LAYERS} x Linear({WIDTH}), swish, Adam",
    "global_batch": BATCH,
    "passes": ARGS.passes,
    "rows": rows,
    "ratios": {k: ratio(a, b) for k, (a, b) in ratios.items()},
    "ratio_rows": {k: [a, b] for k, (a, b) in ratios.items()},
  }


def run_scaling(results, repeats):
  """Examples/s against device count, data parallel and pipeline, same global batch."""
  model = mlp([WIDTH] * LAYERS)
  images, labels = parstrat.testing.random_batches(4, BATCH, features=WIDTH, classes=WIDTH)
  batches = list(zip(images, labels, strict=True))
  out = {"data_parallel": {}, "pipeline 1f1b": {}}
  for count in (1, 2, 4, 8):
    if count > ARGS.devices:
      continue
    trainer = parstrat.DataParallel(data=count)(model, optax.adam(LR))
    step, state = parstrat_step(trainer, images[0][:1])
    out["data_parallel"][count] = _row(step, state, batches, repeats)[0]["examples_per_s"]
    if count <= LAYERS:
      trainer = parstrat.PipelineModelParallel(stages=count, microbatches=8)(model, optax.adam(LR))
      step, state = parstrat_step(trainer, images[0][:1])
      out["pipeline 1f1b"][count] = _row(step, state, batches, repeats)[0]["examples_per_s"]
  results["scaling"] = out


def run_bubble(results, repeats):
  """Pipeline bubble against microbatches at P=4: theory, the executed table, step time."""
  model = mlp([WIDTH] * LAYERS)
  images, labels = parstrat.testing.random_batches(4, BATCH, features=WIDTH, classes=WIDTH)
  batches = list(zip(images, labels, strict=True))
  out = {}
  for m in (1, 2, 4, 8, 16):
    schedule = parstrat.pipeline.build_schedule("1f1b", 4, m)
    trainer = parstrat.PipelineModelParallel(stages=4, microbatches=m)(model, optax.adam(LR))
    step, state = parstrat_step(trainer, images[0][:1])
    out[m] = {
      "theory": schedule.theoretical_bubble(),
      "scheduled": schedule.bubble_fraction(),
      "median_s": _row(step, state, batches, max(5, repeats // 3))[0]["median_s"],
    }
  results["bubble_P4"] = out


def run_memory(results):
  """Compiled temporaries per device of every schedule at P=4, M=16 (lowered abstractly)."""
  microbatches, batch = 16, 2048
  model = mlp([WIDTH] * LAYERS)
  sample = np.zeros((1, WIDTH), np.float32)
  abstract_batch = (
    jax.ShapeDtypeStruct((batch, WIDTH), jnp.float32),
    jax.ShapeDtypeStruct((batch,), jnp.int32),
  )
  out = {}
  for schedule, options in PIPELINES:
    strategy = parstrat.PipelineModelParallel(
      stages=STAGES, microbatches=microbatches, schedule=schedule, **options
    )
    trainer = strategy(model, optax.adam(LR))
    state = trainer.init_abstract(jax.random.key(0), sample)
    analysis = trainer.lower(state, abstract_batch).compile().memory_analysis()
    table = pipeline_table(strategy)
    out[pipeline_label(schedule, options)] = {
      "temp_bytes": int(analysis.temp_size_in_bytes),
      "param_opt_bytes_per_device": sum(
        int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(state)
      ),
      "activation_slots": table.num_act_slots,
      "peak_live": max(table.max_live_activations()),
    }
  results["memory_P4_M16"] = {"global_batch": batch, "rows": out}


def draw_charts(results, prefix):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = results["strategies"]["rows"]
  names = list(rows)
  fig, axes = plt.subplots(1, 2, figsize=(12, max(4.2, 1.2 + 0.3 * len(names))), dpi=110)
  ms = [1e3 * rows[k]["median_s"] for k in names]
  iqr = [1e3 * rows[k]["iqr_s"] / 2 for k in names]
  axes[0].barh(names, ms, xerr=iqr, color="#4C72B0")
  axes[0].invert_yaxis()
  axes[0].set_xlabel("median step time, ms (IQR bars)")
  axes[0].set_title("step time, same model and global batch")
  mib = 2**20
  params = [rows[k]["param_opt_bytes_per_device"] / mib for k in names]
  temps = [rows[k].get("temp_bytes", 0) / mib for k in names]
  axes[1].barh(names, params, color="#55A868", label="params + optimizer")
  axes[1].barh(names, temps, left=params, color="#C44E52", label="compiled temporaries")
  axes[1].invert_yaxis()
  axes[1].set_yticklabels([])
  axes[1].set_xlabel("MiB per device")
  axes[1].set_title("memory per device")
  axes[1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(f"{prefix}_strategies.png")
  plt.close(fig)

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.0), dpi=110)
  for name, series in results["scaling"].items():
    counts = sorted(int(c) for c in series)
    axes[0].plot(counts, [series[c] for c in counts], marker="o", label=name)
  axes[0].set_xscale("log", base=2)
  axes[0].set_xlabel("devices (virtual CPU devices sharing the cores)")
  axes[0].set_ylabel("examples/s")
  axes[0].set_title("scaling with device count")
  axes[0].legend(fontsize=8)
  bubble = results["bubble_P4"]
  ms_ = sorted(int(m) for m in bubble)
  axes[1].plot(ms_, [bubble[m]["theory"] for m in ms_], "k--", label="theory (P-1)/(M+P-1)")
  axes[1].plot(ms_, [bubble[m]["scheduled"] for m in ms_], "o", label="idle share of the table")
  axes[1].set_xscale("log", base=2)
  axes[1].set_xlabel("microbatches M (P = 4, 1f1b)")
  axes[1].set_ylabel("bubble fraction")
  twin = axes[1].twinx()
  twin.plot(ms_, [1e3 * bubble[m]["median_s"] for m in ms_], color="#DD8452", marker="s",
            label="step time")  # fmt: skip
  twin.set_ylabel("median step time, ms", color="#DD8452")
  axes[1].set_title("pipeline bubble vs microbatches")
  axes[1].legend(fontsize=8, loc="upper center")
  fig.tight_layout()
  fig.savefig(f"{prefix}_scaling_bubble.png")
  plt.close(fig)


def main():
  results = {
    "machine": f"{platform.machine()}, {jax.device_count()} virtual {jax.devices()[0].platform} "
    f"devices on {os.cpu_count()} cores, jax {jax.__version__}",
    "repeats": ARGS.repeats,
    "allocator": ALLOCATOR,
  }
  run_memory(results)
  run_strategies(results, ARGS.repeats)
  if not ARGS.quick:
    run_scaling(results, ARGS.repeats)
    run_bubble(results, ARGS.repeats)
  block = results["strategies"]
  print(f"machine: {results['machine']}, allocator: {results['allocator']}")
  print(f"model: {block['model']}, global batch {block['global_batch']}")
  header = (
    f"{'':34} {'median ms':>9} {'IQR ms':>7} {'ex/s':>7} {'compile s':>9} {'1st step s':>10} "
    f"{'params+opt MiB':>14} {'temp MiB':>8} {'faults/step':>11} "
    f"{'bubble: table (theory) lock-step trace':>38}"
  )
  print(header)
  for name, row in block["rows"].items():
    bubble = ""
    if "bubble_scheduled" in row:
      measured, theory = row["bubble_measured"], row["bubble_theory"]
      bubble = (
        f"{row['bubble_scheduled']:.3f} ({'n/a' if theory is None else f'{theory:.3f}'}) "
        f"{row['bubble_lockstep']:.3f} " + (f"{measured:.3f}" if measured is not None else "n/a")
      )
    print(
      f"{name:34} {1e3 * row['median_s']:9.2f} {1e3 * row['iqr_s']:7.2f} "
      f"{row['examples_per_s']:7,.0f} {row.get('compile_s', float('nan')):9.2f} "
      f"{row['first_step_s']:10.2f} "
      f"{row['param_opt_bytes_per_device'] / 2**20:14.2f} "
      f"{row.get('temp_bytes', 0) / 2**20:8.2f} "
      f"{max(row['pass_page_faults_per_step']):11,.0f} {bubble:>38}"
    )
  print(
    f"\nstep time ratios (same run, median over {block['passes']} passes; "
    "the lowest and highest per-pass ratio):"
  )
  for name, ratio in block["ratios"].items():
    a, b = (block["rows"][row]["pass_medians_s"] for row in block["ratio_rows"][name])
    per_pass = np.divide(a, b)
    print(f"  {name:56} {ratio:.3f}  [{per_pass.min():.3f}, {per_pass.max():.3f}]")
  print(
    f"\nlock-step time in stage forwards (each exchange waits for the slowest device; "
    f"the hand-written GPipe: {3 * (MICRO + STAGES - 1)}, (M + P - 1)(F + B)):"
  )
  for name, row in block["rows"].items():
    if "lockstep_forwards" in row:
      print(f"  {name:56} {row['lockstep_forwards']:.1f}")
  if "scaling" in results:
    print("\nscaling (examples/s):")
    for name, series in results["scaling"].items():
      print(f"  {name:14} " + "  ".join(f"{c} dev: {v:,.0f}" for c, v in series.items()))
    print("\nbubble at P=4 (1f1b): M, theory, idle share of the table, median step ms")
    for m, row in results["bubble_P4"].items():
      print(f"  M={m:<3} {row['theory']:.3f}  {row['scheduled']:.3f}  {1e3 * row['median_s']:.2f}")
  memory = results["memory_P4_M16"]
  print(f"\nmemory per device at P=4, M=16, global batch {memory['global_batch']}:")
  for schedule, row in memory["rows"].items():
    print(
      f"  {schedule:18} temp {row['temp_bytes'] / 2**20:8.2f} MiB, params+opt "
      f"{row['param_opt_bytes_per_device'] / 2**20:.2f} MiB, "
      f"{row['activation_slots']} activation slots, peak {row['peak_live']} live"
    )
  with open(ARGS.json, "w") as f:
    json.dump(results, f, indent=2)
  prefix = os.path.splitext(ARGS.json)[0]
  if ARGS.quick:
    print(f"\nwrote {ARGS.json}")
    return
  draw_charts(results, prefix)
  print(f"\nwrote {ARGS.json}, {prefix}_strategies.png, {prefix}_scaling_bubble.png")


if __name__ == "__main__":
  main()
