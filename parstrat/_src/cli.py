"""The `parstrat` command line: train MNIST with any strategy, list strategies, draw schedules."""

from __future__ import annotations

import argparse
import difflib
import itertools
import math
import pathlib
import re
import sys
import tempfile
import time
from collections.abc import Sequence

DEFAULT_DEVICES = 8


class UsageError(Exception):
  """A bad command line; reported in one line with exit code 2."""


class TrainingError(Exception):
  """Training cannot go on (e.g. non-finite numbers); one line, exit code 1."""


def _positive(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
  return value


def _positive_float(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
  if not (value > 0 and math.isfinite(value)):
    raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
  return value


class _Parser(argparse.ArgumentParser):
  """argparse with one-line errors and a "did you mean" for misspelt flags and commands."""

  def error(self, message: str):  # noqa: D401 - argparse's hook
    print(f"{self.prog}: error: {message}{_suggestion(self, message)}", file=sys.stderr)
    sys.exit(2)


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
  """The " (did you mean X?)" hint for the first unknown flag or bad choice in `message`."""
  unknown = re.search(r"unrecognized arguments: (\S+)", message)
  choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
  if unknown:
    word, candidates = unknown.group(1).split("=")[0], set()
    parsers = [parser]
    while parsers:  # every flag of every command
      current = parsers.pop()
      candidates.update(current._option_string_actions)  # noqa: SLF001
      for action in current._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
          parsers.extend(action.choices.values())
  elif choice:
    word, candidates = choice.group(1), re.findall(r"'([^']*)'", choice.group(2))
  else:
    return ""
  close = difflib.get_close_matches(word, sorted(candidates), n=1, cutoff=0.6)
  return f" (did you mean {close[0]}?)" if close else ""


def build_parser() -> argparse.ArgumentParser:
  parser = _Parser(prog="parstrat", description="Parallelism strategies for Haiku models on JAX.")
  sub = parser.add_subparsers(dest="command", required=True)

  train = sub.add_parser("train", help="train an MLP on MNIST with a strategy")
  train.add_argument("--strategy", default="data_parallel", help="a registered strategy name")
  train.add_argument("--epochs", type=_positive, default=3)
  train.add_argument("--batch-size", type=_positive, default=256, help="global batch size")
  train.add_argument("--lr", type=_positive_float, default=1e-3, help="Adam learning rate")
  train.add_argument("--seed", type=int, default=0)
  train.add_argument(
    "--devices",
    type=_positive,
    default=DEFAULT_DEVICES,
    help="devices to use; on a CPU-only machine this many virtual CPU devices are made",
  )
  train.add_argument(
    "--hidden", type=_positive, nargs="+", default=[512], help="hidden layer widths"
  )
  train.add_argument("--source", choices=("auto", "tfds", "sample"), default="auto")
  train.add_argument("--data-dir", default=None, help="tensorflow-datasets data directory")
  train.add_argument("--data", type=_positive, default=None, help="data-parallel replicas")
  train.add_argument("--stages", type=_positive, default=None, help="pipeline stages")
  train.add_argument("--model", type=_positive, default=None, help="tensor-parallel devices")
  train.add_argument("--microbatches", type=_positive, default=None)
  train.add_argument("--zero", type=int, choices=(1, 2, 3), default=None, help="fsdp's ZeRO stage")
  train.add_argument(
    "--memory-budget",
    default=None,
    help="for --strategy auto: bytes per device, e.g. 512MiB (default: no limit)",
  )
  train.add_argument(
    "--precision",
    default=None,
    help="mixed precision: mixed_bfloat16 (bfloat16 compute, float32 params) or a jmp policy",
  )
  train.add_argument(
    "--accumulate", type=_positive, default=1, help="gradient accumulation microsteps per step"
  )
  train.add_argument("--schedule", choices=("gpipe", "1f1b"), default=None)
  train.add_argument("--no-progress", action="store_true", help="hide the progress bar")
  train.add_argument("--steps", type=_positive, default=None, help="stop after this many steps")
  train.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (orbax)")
  train.add_argument("--save-every", type=_positive, default=None, help="save every K steps")
  train.add_argument("--keep", type=_positive, default=None, help="checkpoints to keep (default 3)")
  train.add_argument(
    "--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir"
  )
  train.add_argument(
    "--overwrite",
    action="store_true",
    help="start afresh in a --checkpoint-dir that is not empty (its checkpoints are deleted)",
  )
  train.add_argument(
    "--allow-config-change",
    action="store_true",
    help="--resume with another --lr, optimizer or --precision than the checkpoint's",
  )
  train.add_argument(
    "--stop-on-nonfinite",
    action="store_true",
    help="stop at a NaN/inf loss or gradient (default: skip that update and count it)",
  )
  train.add_argument("--metrics", default=None, help="write per-step metrics to this JSONL file")
  train.add_argument(
    "--out",
    default=None,
    help="run directory for metrics.jsonl and report.png (default: --checkpoint-dir)",
  )
  train.add_argument(
    "--compare",
    default=None,
    help="comma-separated strategies to train one after the other and overlay in compare.png",
  )
  multi = train.add_argument_group(
    "multi-process", "run one process per host (JAX's own cluster detection works too)"
  )
  multi.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
  multi.add_argument("--num-processes", type=_positive, default=None)
  multi.add_argument("--process-id", type=int, default=None)
  multi.add_argument(
    "--join-timeout", type=_positive, default=120, help="seconds to wait for all processes"
  )
  multi.add_argument(
    "--heartbeat-timeout",
    type=_positive,
    default=30,
    help="seconds without a heartbeat after which a lost process stops the others",
  )

  sched = sub.add_parser("schedule", help="print and draw a pipeline schedule")
  sched.add_argument("--stages", type=_positive, required=True)
  sched.add_argument("--microbatches", type=_positive, required=True)
  sched.add_argument(
    "--schedule",
    choices=("gpipe", "1f1b", "zb_h1", "interleaved_1f1b"),
    default="1f1b",
    help="the schedule (default: %(default)s)",
  )
  sched.add_argument(
    "--virtual-stages",
    type=_positive,
    default=None,
    help="model chunks per device, interleaved_1f1b only (default: 2 for it, else 1)",
  )
  sched.add_argument("--out", default=None, help="PNG file to draw the timeline into")
  sched.add_argument(
    "--csv", default=None, help="CSV file to write the schedule into (torch.distributed format)"
  )

  sub.add_parser("list", help="list the registered strategies")
  return parser


def _setup_devices(count: int) -> None:
  """Makes `count` virtual CPU devices; must run before JAX starts its backend."""
  import jax

  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError:
    pass  # the backend already runs (parstrat called from Python): use its devices


def _strategy_config(args: argparse.Namespace, name: str, *, compare: bool) -> dict:
  """The strategy flags given on the command line; with --compare, only those it takes."""
  import dataclasses

  import parstrat
  from parstrat._src import distributed

  config = {}
  for key in ("data", "stages", "model", "microbatches", "schedule", "zero", "memory_budget"):
    value = getattr(args, key)
    if value is not None:
      config[key] = value
  if parstrat._src.registry.lookup(name).deferred:  # "auto" measures the real batch
    config = {k: v for k, v in config.items() if k == "memory_budget"}
    config.update(batch_size=args.batch_size, verbose=distributed.is_primary())
  if compare:
    cls = parstrat._src.registry.lookup(name)
    options = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    config = {k: v for k, v in config.items() if k in options}
  return config


def _accuracy(trainer, state, images, labels, batch_size: int, rows: slice) -> float:
  """Eval accuracy; the last partial batch is padded (padding is not counted)."""
  import numpy as np
  from jax.experimental import multihost_utils

  correct = 0
  for start in range(0, len(labels), batch_size):
    x = images[start : start + batch_size]
    n = len(x)
    if n < batch_size:
      x = np.concatenate([x, np.zeros((batch_size - n, *x.shape[1:]), x.dtype)])
    logits = trainer.apply(state, x[rows])
    logits = np.asarray(multihost_utils.process_allgather(logits, tiled=True))[:n]
    correct += int(np.sum(logits.argmax(-1) == labels[start : start + n]))
  return correct / len(labels)


def _check_paths(args: argparse.Namespace) -> None:
  """Finds the file-system problems of `train`'s flags before anything is loaded or trained.

  Raises:
    UsageError: for checkpoint flags without `--checkpoint-dir`, a path that
      is a file where a directory is needed (or the other way round), a
      missing or unwritable directory, or a non-empty checkpoint directory
      without `--resume` or `--overwrite`.
  """
  given = [flag for flag, value in (("--resume", args.resume), ("--save-every", args.save_every),
           ("--keep", args.keep), ("--overwrite", args.overwrite)) if value]  # fmt: skip
  if args.checkpoint_dir is None and given:
    raise UsageError(f"{given[0]} needs --checkpoint-dir")
  if args.resume and args.overwrite:
    raise UsageError("--resume continues the checkpoints that --overwrite would delete: pick one")
  if args.checkpoint_dir is not None:
    directory = pathlib.Path(args.checkpoint_dir)
    _check_writable_dir(directory, "--checkpoint-dir")
    if directory.is_dir() and any(directory.iterdir()) and not (args.resume or args.overwrite):
      raise UsageError(
        f"--checkpoint-dir {directory} is not empty (another run?): pass --resume to continue "
        "it or --overwrite to start afresh"
      )
  if args.out is not None:
    _check_writable_dir(pathlib.Path(args.out), "--out")
  if args.metrics is not None:
    path = pathlib.Path(args.metrics)
    if path.is_dir():
      raise UsageError(f"--metrics {path} is a directory; give a file name")
    if not path.parent.is_dir():
      raise UsageError(f"--metrics {path}: the directory {path.parent} does not exist")
    _check_writable_dir(path.parent, "--metrics")


def _check_writable_dir(path: pathlib.Path, flag: str) -> None:
  """`path` is (or can be created as) a directory we can write into."""
  if path.exists() and not path.is_dir():
    raise UsageError(f"{flag} {path} is a file, not a directory")
  existing = path
  while not existing.exists():  # the nearest existing folder is where we would create it
    existing = existing.parent
  if not existing.is_dir():
    raise UsageError(f"{flag} {path}: {existing} is a file, not a directory")
  try:
    with tempfile.TemporaryFile(dir=existing):
      pass
  except OSError as e:
    raise UsageError(f"{flag} {path}: cannot write in {existing}: {e.strerror or e}") from None


def _run_config(args: argparse.Namespace) -> dict:
  """What a checkpoint records of the run, beyond the model's shapes (which orbax records)."""
  return {"optimizer": "adam", "lr": args.lr, "precision": args.precision or "float32",
          "accumulate": args.accumulate, "batch_size": args.batch_size, "seed": args.seed,
          "data_order": "shuffled per epoch by (seed, epoch)"}  # fmt: skip


#: Changes to these need --allow-config-change on --resume.
GUARDED = ("optimizer", "lr", "precision")


def _config_changes(saved: dict, current: dict) -> tuple[list[str], list[str]]:
  """`(guarded, other)` differences between a checkpoint's run config and this run's.

  Example:
    >>> _config_changes({"lr": 0.1, "accumulate": 1}, {"lr": 0.2, "accumulate": 2})
    (['lr 0.1 -> 0.2'], ['accumulate 1 -> 2'])
  """
  changes = {k: f"{k} {saved[k]} -> {current[k]}" for k in current
             if k in saved and saved[k] != current[k]}  # fmt: skip
  guarded = [text for key, text in changes.items() if key in GUARDED]
  return guarded, [text for key, text in changes.items() if key not in GUARDED]


def _open_checkpoints(args, strategy, trainer, say):
  """The run's `Checkpointer`, and for `--resume` the restored state and its metadata.

  Returns `(checkpointer, state or None, meta or None)`. Closes the
  checkpointer itself if anything fails.

  Raises:
    UsageError: no checkpoint to resume, none intact, a model that does not
      fit, or a run configuration that differs (see `_config_changes`).
  """
  import warnings

  from parstrat._src.checkpoint import Checkpointer
  from parstrat._src.checkpoint import CheckpointError

  directory = pathlib.Path(args.checkpoint_dir)
  if args.compare:
    directory = directory / strategy_name(strategy)
  ckpt = Checkpointer(directory, save_every=args.save_every or 10**9, keep=args.keep or 3)
  try:
    if args.overwrite and ckpt.all_steps():
      say(f"--overwrite: deleting checkpoints {ckpt.all_steps()} in {directory}")
      for old in ckpt.all_steps():
        ckpt.delete(old)
    if not args.resume:
      return ckpt, None, None
    if ckpt.latest_step() is None:
      raise UsageError(f"--resume: no checkpoint in {directory}")
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      try:
        state, meta = ckpt.restore(trainer)
      except (ValueError, CheckpointError) as e:
        raise UsageError(f"--resume: {e}") from None
    for warning in caught:
      say(f"warning: {warning.message}")
    if meta.get("seed") != args.seed or meta.get("batch_size") != args.batch_size:
      raise UsageError(
        f"--resume: the checkpoint was written with --seed {meta.get('seed')} "
        f"--batch-size {meta.get('batch_size')}; pass the same flags to continue exactly"
      )
    guarded, other = _config_changes(meta.get("config", {}), _run_config(args))
    if guarded and not args.allow_config_change:
      raise UsageError(
        f"--resume: the checkpoint was written with another configuration ({', '.join(guarded)});"
        " pass --allow-config-change to continue with the new one"
      )
    if guarded or other:
      say(f"resuming with a changed configuration: {', '.join(guarded + other)}")
    return ckpt, state, meta
  except BaseException:
    ckpt.close()
    raise


def _multi_process(args: argparse.Namespace) -> bool:
  import os

  return args.coordinator is not None or "JAX_COORDINATOR_ADDRESS" in os.environ


def train(args: argparse.Namespace) -> dict:
  from parstrat._src import distributed

  _check_paths(args)
  if _multi_process(args):
    try:
      distributed.initialize(
        args.coordinator,
        args.num_processes,
        args.process_id,
        local_cpu_devices=args.devices,
        timeout_s=args.join_timeout,
        heartbeat_timeout_s=args.heartbeat_timeout,
      )
    except ValueError as e:
      raise UsageError(str(e)) from None
  else:
    _setup_devices(args.devices)
  import haiku as hk
  import jax

  import parstrat
  from parstrat._src import datasets

  primary = distributed.is_primary()
  say = print if primary else (lambda *a, **k: None)
  devices = jax.devices()
  if jax.process_count() == 1:
    if args.devices > len(devices):
      raise UsageError(f"--devices {args.devices}: only {len(devices)} devices are available")
    devices = devices[: args.devices]
  names = [n.strip() for n in args.compare.split(",")] if args.compare else [args.strategy]
  strategies = {}
  for name in names:
    try:
      strategies[name] = parstrat.get(
        name, devices=devices, **_strategy_config(args, name, compare=bool(args.compare))
      )
      if not strategies[name].deferred:  # fail on an impossible mesh before loading data
        strategies[name].make_mesh()
    except KeyError as e:
      raise UsageError(e.args[0]) from None
    except (TypeError, ValueError) as e:
      raise UsageError(str(e)) from None

  widths = [*args.hidden, 10]
  model = hk.transform(lambda x: hk.nets.MLP(widths, activation=jax.nn.swish)(x))
  data = datasets.load_mnist(args.source, data_dir=args.data_dir, log=say)
  say(f"data: {data}")
  if len(data.train_labels) // args.batch_size < 1:
    raise UsageError(
      f"--batch-size {args.batch_size} exceeds the {len(data.train_labels)} training examples"
    )
  # The report goes next to the checkpoints unless --out says otherwise.
  out_dir = args.out or args.checkpoint_dir
  out = pathlib.Path(out_dir) if out_dir else None
  runs = {}
  for name, strategy in strategies.items():
    metrics_path = args.metrics
    if out is not None and args.metrics is None:
      metrics_path = out / name / "metrics.jsonl" if args.compare else out / "metrics.jsonl"
      if primary:
        metrics_path.parent.mkdir(parents=True, exist_ok=True)
    runs[name] = _train_one(args, strategy, model, data, metrics_path if primary else None, say)
  if out is not None and primary and not all(r.get("complete") for r in runs.values()):
    from parstrat._src import report

    picture = out / ("compare.png" if args.compare else "report.png")
    report.draw_training_report({n: r["records"] for n, r in runs.items()}, picture)
    say(f"report: {picture}")
  return runs


def strategy_name(strategy) -> str:
  import parstrat

  for name in parstrat.available():
    if type(strategy) is parstrat._src.registry.lookup(name):
      return name
  return type(strategy).__name__


def _train_one(args, strategy, model, data, metrics_path, say) -> dict:
  """Trains one strategy; writes one JSON line per step and per epoch's eval."""
  import jax
  import optax
  from tqdm import tqdm

  from parstrat._src import datasets
  from parstrat._src.history import History

  try:
    trainer = strategy(
      model,
      optax.adam(args.lr),
      skip_nonfinite=not args.stop_on_nonfinite,
      precision=args.precision,
      accumulate=args.accumulate,
    )
    state = trainer.init(jax.random.key(args.seed), data.train_images[:1])
    rows = trainer.local_batch_rows(args.batch_size)
  except (TypeError, ValueError) as e:
    raise UsageError(str(e)) from None
  say(f"strategy: {trainer.strategy!r} on mesh {dict(trainer.mesh.shape)}")
  if jax.process_count() > 1:
    say(f"processes: {jax.process_count()}, {jax.local_device_count()} devices each")
  if trainer.plan.description:
    say(trainer.plan.description)
  steps_per_epoch = len(data.train_labels) // args.batch_size
  examples = 0
  train_time = 0.0
  step = 0
  skipped: list[int] = []
  accuracy = float("nan")
  ckpt = None
  first_epoch, skip_batches = 0, 0
  resume_step = None
  if args.checkpoint_dir:
    ckpt, restored, meta = _open_checkpoints(args, strategy, trainer, say)
    if restored is not None:
      state = restored
      step, first_epoch, skip_batches = meta["batches_seen"], meta["epoch"], meta["batch"]
      resume_step = step
      if first_epoch >= args.epochs or (args.steps is not None and step >= args.steps):
        ckpt.close()
        say(f"the run in {ckpt.directory} is already complete at step {step}: nothing to train")
        return {"accuracy": accuracy, "records": [], "state": state, "skipped": [],
                "complete": True}  # fmt: skip
  try:
    history = History(metrics_path, resume_step=resume_step)
  except (OSError, ValueError) as e:
    if ckpt is not None:
      ckpt.close()
    raise UsageError(f"metrics file {metrics_path}: {e}") from None
  records = history.records
  record = history.append
  if resume_step is not None:
    say(
      f"resumed from {ckpt.directory} at step {step} (epoch {first_epoch + 1}, "
      f"batch {skip_batches})"
    )

  def position(epoch: int, batch: int) -> dict:
    if batch == steps_per_epoch:
      epoch, batch = epoch + 1, 0
    return {"epoch": epoch, "batch": batch, "batches_seen": step, "seed": args.seed,
            "batch_size": args.batch_size, "config": _run_config(args)}  # fmt: skip

  try:
    for epoch in range(first_epoch, args.epochs):
      if args.steps is not None and step >= args.steps:
        break
      order = datasets.batch_indices(
        len(data.train_labels), args.batch_size, seed=args.seed, epoch=epoch
      )
      if epoch == first_epoch and skip_batches:
        order = itertools.islice(order, skip_batches, None)
      batch_in_epoch = skip_batches if epoch == first_epoch else 0
      bar = tqdm(
        order,
        total=steps_per_epoch,
        desc=f"epoch {epoch + 1}/{args.epochs}",
        initial=batch_in_epoch,
        disable=args.no_progress or jax.process_index() != 0,
        leave=True,
      )
      start = time.perf_counter()
      for index in bar:
        mine = index[rows]  # this process loads only its own rows of the global batch
        tick = time.perf_counter()
        try:
          state, metrics = trainer.step(state, (data.train_images[mine], data.train_labels[mine]))
        except (TypeError, ValueError) as e:
          raise UsageError(str(e)) from None
        step += 1
        if "labels_in_range" in metrics and not bool(metrics["labels_in_range"]):
          classes = trainer._num_classes(data.train_images[:1])  # noqa: SLF001
          raise TrainingError(
            f"step {step}: batch {batch_in_epoch + 1} of epoch {epoch + 1} has labels outside "
            f"[0, {classes}), the model's classes; stopping (nothing of this step is saved)"
          )
        loss = float(metrics["loss"])
        rate = args.batch_size / (time.perf_counter() - tick)
        row = {"step": step, "epoch": epoch + 1, "loss": loss, "examples_per_s": rate}
        if not bool(metrics["finite"]):
          if args.stop_on_nonfinite:
            raise TrainingError(
              f"step {step} (epoch {epoch + 1}): the loss or gradients are not finite "
              f"(loss {loss}); stopping before the update"
            )
          skipped.append(step)
          row["skipped"] = True
        record(row)
        batch_in_epoch += 1
        if ckpt is not None:
          ckpt.save(trainer, state, position(epoch, batch_in_epoch), step=step)
        if not args.no_progress:
          bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        if args.steps is not None and step >= args.steps:
          break
      jax.block_until_ready(state)
      if epoch > first_epoch:  # the first epoch includes compilation
        train_time += time.perf_counter() - start
        examples += steps_per_epoch * args.batch_size
      accuracy = _accuracy(
        trainer, state, data.eval_images, data.eval_labels, args.batch_size, rows
      )
      record({"step": step, "epoch": epoch + 1, "eval_accuracy": accuracy})
      say(f"epoch {epoch + 1}: loss {loss:.4f}, eval accuracy {accuracy:.4f}")
      if args.steps is not None and step >= args.steps:
        break
    if ckpt is not None:
      ckpt.save(trainer, state, position(epoch, batch_in_epoch), step=step, force=True)
  finally:
    try:
      history.close()  # may raise (a full disk), the checkpointer closes anyway
    finally:
      if ckpt is not None:
        ckpt.close()
  rate = examples / train_time if train_time else float("nan")
  say(f"eval accuracy: {accuracy:.4f} on {len(data.eval_labels)} examples ({data.source})")
  say(
    f"throughput: {rate:,.0f} examples/s (epochs after the first) on "
    f"{jax.device_count()} {jax.devices()[0].platform} devices"
  )
  say(f"mesh: {dict(trainer.mesh.shape)}")
  if skipped:
    say(f"skipped {len(skipped)} update(s) with non-finite loss or gradients: steps {skipped}")
  return {"accuracy": accuracy, "records": records, "state": state, "skipped": skipped}


def schedule(args: argparse.Namespace) -> None:
  from parstrat._src.pipeline import schedule as schedule_lib

  try:
    table = schedule_lib.build_schedule(
      args.schedule, args.stages, args.microbatches, virtual_stages=args.virtual_stages
    )
  except ValueError as e:
    raise UsageError(str(e)) from None
  print(table)
  formula = schedule_lib.THEORY[table.name][0]
  print(
    f"bubble fraction: {table.bubble_fraction():.4f} measured, "
    f"{table.theoretical_bubble():.4f} theory {formula}; "
    f"peak live activations per stage: {table.max_live_activations()}"
  )
  if args.out:
    from parstrat._src.pipeline import drawing

    try:
      drawing.draw_schedule(table, args.out)
    except OSError as e:
      raise UsageError(f"cannot write {args.out}: {e.strerror or e}") from None
    print(f"wrote {args.out}")
  if args.csv:
    from parstrat._src.pipeline import schedule_csv

    try:
      with open(args.csv, "w", encoding="utf-8") as f:
        f.write(schedule_csv.to_csv(table))
    except OSError as e:
      raise UsageError(f"cannot write {args.csv}: {e.strerror or e}") from None
    print(f"wrote {args.csv}")


def list_strategies() -> None:
  import parstrat

  for name in parstrat.available():
    cls = parstrat._src.registry.lookup(name)
    doc = (cls.__doc__ or "").strip().splitlines()
    axes = "chosen" if cls.deferred else ", ".join(cls.axis_names) or "-"
    print(f"{name:<16} axes: {axes:<20} {doc[0] if doc else ''}")


def main(argv: Sequence[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    if args.command == "train":
      train(args)
    elif args.command == "schedule":
      schedule(args)
    elif args.command == "list":
      list_strategies()
  except UsageError as e:
    print(f"parstrat {args.command}: error: {e}", file=sys.stderr)
    return 2
  except TrainingError as e:
    print(f"parstrat {args.command}: stopped: {e}", file=sys.stderr)
    return 1
  return 0
