"""The `parstrat` command line: train MNIST with any strategy, list strategies, draw schedules."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import pathlib
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

# Importing these starts no backend (the package is imported before this module
# anyway): `--devices` can still set the CPU device count afterwards.
from parstrat._src import messages
from parstrat._src.pipeline.residuals import ACTIVATIONS
from parstrat._src.pipeline.schedule import ORDERS

DEFAULT_DEVICES = 8
#: How long process 0 stays, after an error every process raised alike, for the others
#: to report it (the test's processes, delayed by 2 s on purpose, still reported in time).
LEADER_GRACE_S = 3.0
SCHEDULES = tuple(ORDERS)  # the pipeline schedules `build_schedule` knows


class UsageError(Exception):
  """A bad command line; reported in one line with exit code 2."""


class TrainingError(Exception):
  """Training cannot go on (e.g. non-finite numbers); one line, exit code 1."""


class Interrupted(Exception):
  """Training stopped on SIGINT or SIGTERM, after its step; exit code 128 + the signal."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.signum = signum


class _StopRequests:
  """Turns the first SIGINT (Ctrl-C) or SIGTERM into a request to stop after the step.

  The step in flight finishes, and the run saves and closes as at its end; a
  second signal stops at once (the default handlers are back). In the main
  thread of a single process only: elsewhere the signals keep their defaults
  (one process of several cannot stop alone without hanging the others): a
  process of several leaves at once (see `main`), and the others stop with an
  error when its heartbeat does.
  """

  def __init__(self, say):
    self.signum = None
    self._say = say
    self._previous = {}

  def install(self) -> _StopRequests:
    import signal
    import threading

    import jax

    if threading.current_thread() is threading.main_thread() and jax.process_count() == 1:
      for signum in (signal.SIGINT, signal.SIGTERM):
        self._previous[signum] = signal.signal(signum, self._request)
    return self

  def _request(self, signum, frame) -> None:
    import signal

    self.signum = signum
    self.close()
    self._say(
      f"\n{signal.Signals(signum).name}: stopping after this step (again to stop at once)",
      flush=True,
    )

  def close(self) -> None:
    """Gives the signals back their previous handlers."""
    import signal

    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}


def _strategy_option(text: str) -> tuple[str, str]:
  """An argparse type: "KEY=VALUE" -> (key, VALUE's text); read later by `_option_value`.

  Example:
    >>> _strategy_option("hosts=4"), _strategy_option("max-size=two levels")
    (('hosts', '4'), ('max_size', 'two levels'))
  """
  key, sep, value = text.partition("=")
  key = key.strip().replace("-", "_")
  if not sep or not key.isidentifier():
    raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. hosts=4), got {text!r}")
  return key, value


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


def _not_negative(convert, what: str):
  """An argparse type: `convert(text)`, refusing values below 0 with "expected {what}"."""

  def parse(text: str):
    try:
      value = convert(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not value >= 0:
      raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value

  return parse


_non_negative = _not_negative(int, "an integer >= 0")


def _seed(text: str) -> int:
  """`--seed`: 0 to 2**32 - 1, what a JAX key holds without x64 (2**32 is seed 0 again)."""
  value = _non_negative(text)
  if value >= 2**32:
    raise argparse.ArgumentTypeError(
      f"expected an integer from 0 to {2**32 - 1}, got {value} (a JAX key keeps 32 bits of "
      "it without 64-bit mode: it would train as another seed)"
    )
  return value


_non_negative_float = _not_negative(float, "a number >= 0")


class _RenamedStore(argparse.Action):
  """Stores a value; the second and later option strings are old names that print a warning."""

  def __call__(self, parser, namespace, values, option_string=None):
    if option_string in self.option_strings[1:] and not getattr(self, "warned", False):
      self.warned = True
      print(
        f"parstrat: warning: {option_string} is deprecated and will be removed; "
        f"use {self.option_strings[0]}",
        file=sys.stderr,
      )
    setattr(namespace, self.dest, values)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Shows each flag's default, unless its help already says what the default does."""

  def _get_help_string(self, action):
    if "default" in (action.help or ""):
      return action.help
    if action.default is None and action.option_strings:
      return f"{action.help} (default: none)"
    return super()._get_help_string(action)


class _Version(argparse.Action):
  """`--version`: imports parstrat (and JAX) only when asked."""

  def __init__(self, option_strings, dest, **kwargs):
    super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

  def __call__(self, parser, namespace, values, option_string=None):
    import parstrat

    print(f"parstrat {parstrat.__version__}")
    parser.exit()


class _Parser(argparse.ArgumentParser):
  """argparse with one-line errors and a "did you mean" for misspelt flags and commands."""

  def parse_known_args(self, args=None, namespace=None):
    self._given = list(sys.argv[1:] if args is None else args)  # (for `error`)
    return super().parse_known_args(args, namespace)

  def error(self, message: str):  # noqa: D401 - argparse's hook
    if message.startswith("the following arguments are required"):
      # argparse names a missing flag before a misspelt one: `--stagse 3` for `--stages`.
      flags = self._option_string_actions
      unknown = [
        token
        for token in getattr(self, "_given", [])
        if token.startswith("--") and not any(f.startswith(token.split("=")[0]) for f in flags)
      ]
      if unknown:
        message += f"; unrecognized arguments: {unknown[0]}"
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
  close = messages.closest(word, sorted(candidates))
  return f" (did you mean {close}?)" if close else ""


def build_parser() -> argparse.ArgumentParser:
  defaults = _HelpFormatter
  parser = _Parser(
    prog="parstrat",
    description="Parallelism strategies for Haiku models on JAX.",
    formatter_class=defaults,
  )
  parser.add_argument("--version", action=_Version, help="print the version and exit")
  sub = parser.add_subparsers(dest="command", required=True)

  train = sub.add_parser(
    "train",
    help="train a model (default: an MLP on MNIST) with a strategy",
    formatter_class=defaults,
    description="Train a Haiku model with a parallelism strategy. Every flag is also a key "
    "of a --config TOML file; flags on the command line override the file.",
  )
  train.add_argument("--config", default=None, help="TOML file of flags (batch-size = 128, ...)")
  train.add_argument("--strategy", default="data_parallel", help="a registered strategy name")
  _add_import(train)
  train.add_argument(
    "--model-fn",
    default=None,
    help="your model: 'package.module:function' or 'path/file.py:function' returning an "
    'hk.Transformed, (hk.Transformed, loss_fn) or {"model": ..., **trainer options}; '
    "default: an MLP of --hidden widths",
  )
  train.add_argument(
    "--dataset",
    default="mnist",
    help="'mnist' (tfds or the bundled sample, see --source), any tfds dataset name, or "
    "'package.module:function' / 'path/file.py:function' returning (train, eval) batches",
  )
  train.add_argument("--epochs", type=_positive, default=3, help="passes over the training data")
  train.add_argument("--batch-size", type=_positive, default=256, help="global batch size")
  train.add_argument("--optimizer", default="adam", help="adam, adamw, sgd, momentum, lamb, "
                     "lion, rmsprop or adafactor (optax)")  # fmt: skip
  train.add_argument("--lr", type=_positive_float, default=1e-3, help="peak learning rate")
  train.add_argument(
    "--lr-schedule",
    choices=("constant", "cosine"),
    default="constant",
    help="after the warm-up: constant, or cosine decay to 0 at the last step",
  )
  train.add_argument(
    "--warmup-steps", type=_non_negative, default=0, help="linear learning-rate warm-up steps"
  )
  train.add_argument(
    "--schedule-steps",
    type=_positive,
    default=None,
    help="the cosine schedule's length in steps (default: the run's last step, from --steps "
    "or --epochs; for data of unknown length, --steps, so a run whose data ends first "
    "stops above 0); give it to train in legs (--steps 500, then --steps 1000 --resume) "
    "on one schedule",
  )
  train.add_argument(
    "--weight-decay",
    type=_non_negative_float,
    default=0.0,
    help="weight decay (default 0: none; adamw, lamb, lion and adafactor decay by it "
    "themselves, so --optimizer adamw without it is adam, not optax's default 1e-4)",
  )
  train.add_argument(
    "--clip-norm",
    type=_positive_float,
    default=None,
    help="clip the gradients' global norm to this (optax.clip_by_global_norm)",
  )
  train.add_argument(
    "--seed", type=_seed, default=0, help="params and data-order seed, 0 to 2**32 - 1"
  )
  train.add_argument(
    "--devices",
    type=_positive,
    default=None,
    help="devices to use (default: every accelerator; on a CPU-only machine, "
    f"{DEFAULT_DEVICES} virtual CPU devices, and --devices N makes N)",
  )
  train.add_argument(
    "--hidden",
    type=_positive,
    nargs="+",
    default=None,
    help="hidden widths of the built-in MLP (default: 512; not used with --model-fn)",
  )
  train.add_argument(
    "--source",
    choices=("auto", "tfds", "sample"),
    default="auto",
    help="where --dataset mnist comes from: tfds, the bundled 10,000-image sample, or auto "
    "(tfds when reachable, else the sample)",
  )
  train.add_argument("--data-dir", default=None, help="tensorflow-datasets data directory")
  mesh_axes = (  # flag, its old name (deprecated), mesh axis, what the size counts
    ("--data-parallel", "--data", "data", "data-parallel replicas"),
    ("--stages", None, "stage", "pipeline stages"),
    ("--tensor-parallel", "--model", "model", "tensor-parallel devices"),
  )
  for flag, old, axis, what in mesh_axes:
    train.add_argument(
      *([flag, old] if old else [flag]),
      dest=flag[2:] if old is None else old[2:],
      action=_RenamedStore,
      type=_positive,
      default=None,
      metavar="N",
      help=f"{what} (mesh axis '{axis}'; default: the strategy's own split"
      + (f"; {old} is the old name)" if old else ")"),
    )
  train.add_argument(
    "--microbatches", type=_positive, default=None, help="pipeline microbatches (default: stages)"
  )
  train.add_argument("--zero", type=int, choices=(1, 2, 3), default=None, help="fsdp's ZeRO stage")
  train.add_argument(
    "--replicate-below",
    type=_non_negative,
    default=None,
    metavar="N",
    help="fsdp: keep parameter leaves of fewer than N elements replicated (default: 0)",
  )
  train.add_argument(
    "--memory-budget",
    default=None,
    help="for --strategy auto: bytes per device, e.g. 512MiB (default: no limit)",
  )
  train.add_argument(
    "--strategy-option",
    dest="strategy_options",
    metavar="KEY=VALUE",
    type=_strategy_option,
    nargs="+",
    action="extend",
    default=None,
    help="an option of the strategy that no flag above sets, e.g. a field of a strategy of "
    "your own: hosts=4 (VALUE read by the field's type: true/false, a number, text; an "
    "unannotated field as TOML); in a config file, a [strategy-option] table",
  )
  train.add_argument(
    "--precision",
    default=None,
    help="mixed precision: mixed_bfloat16 (bfloat16 compute, float32 params) or a jmp policy",
  )
  train.add_argument(
    "--accumulate", type=_positive, default=1, help="gradient accumulation microsteps per step"
  )
  train.add_argument(
    "--schedule",
    choices=SCHEDULES,
    default=None,
    help="pipeline schedule (default: the strategy's, 1f1b)",
  )
  train.add_argument(
    "--virtual-stages",
    type=_positive,
    default=None,
    help="model chunks per device for --schedule interleaved_1f1b (default: 2)",
  )
  train.add_argument(
    "--activations",
    choices=ACTIVATIONS,
    default=None,
    help="what a pipeline stage keeps from its forward for its backward "
    "(default: the strategy's, recompute)",
  )
  train.add_argument(
    "--exchange-every",
    type=_positive,
    default=None,
    help="pipeline ticks (passes) each device runs between two message exchanges "
    "(default: the strategy's, 2 for interleaved_1f1b, else 1; 2 also suits 1f1b)",
  )
  train.add_argument(
    "--unroll",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="trace a pipeline's ticks as straight-line code, not a loop: a faster step, "
    "a longer compilation (default: the loop; --no-unroll: the loop, over a config file's "
    "unroll = true)",
  )
  train.add_argument("--no-progress", action="store_true", help="hide the progress bar")
  train.add_argument(
    "--progress",
    action="store_false",
    dest="no_progress",
    default=argparse.SUPPRESS,  # (the default is --no-progress's)
    help="show the progress bar, as by default (over a config file's no-progress = true)",
  )
  train.add_argument(
    "--steps",
    type=_positive,
    default=None,
    help="stop at this step, counted from the run's start (a resumed run too), or at the "
    "end of --epochs if that comes first",
  )
  train.add_argument(
    "--log-every",
    type=_positive,
    default=1,
    help="write metrics (metrics.jsonl, TensorBoard) every N steps: mean loss over those steps; "
    "with --no-progress and N > 1 also print a line",
  )
  train.add_argument(
    "--eval-every",
    type=_positive,
    default=None,
    help="also evaluate every N steps (default: at the end of each epoch only)",
  )
  train.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (orbax)")
  train.add_argument("--save-every", type=_positive, default=None, help="save every K steps")
  train.add_argument(
    "--keep", type=_positive, default=None, help="checkpoints to keep (default: 3)"
  )
  train.add_argument(
    "--resume",
    action=argparse.BooleanOptionalAction,
    default=False,
    help="continue from the newest checkpoint in --checkpoint-dir",
  )
  train.add_argument(
    "--resume-if-exists",
    action=argparse.BooleanOptionalAction,
    default=False,
    help="--resume where --checkpoint-dir holds a checkpoint, else start there afresh: for a "
    "job its scheduler restarts with the same command (preempted, requeued)",
  )
  train.add_argument(
    "--overwrite",
    action=argparse.BooleanOptionalAction,
    default=False,
    help="start afresh in a --checkpoint-dir that is not empty (its checkpoints are deleted) "
    "or an --out that holds another run (its metrics and event files are replaced)",
  )
  train.add_argument(
    "--allow-config-change",
    action=argparse.BooleanOptionalAction,
    default=False,
    help="--resume with another --lr, optimizer or --precision than the checkpoint's",
  )
  train.add_argument(
    "--fresh-optimizer",
    action=argparse.BooleanOptionalAction,
    default=False,
    help="with --resume: restore the params, step and data position but start the optimizer "
    "state anew (optimizer.init of the restored params), to go on with another --optimizer "
    "or with clipping or weight decay switched on or off; its learning-rate schedule starts "
    "again at the resumed step",
  )
  train.add_argument(
    "--stop-on-nonfinite",
    action=argparse.BooleanOptionalAction,
    default=False,
    help="stop at a NaN/inf loss or gradient (default: skip that update and count it)",
  )
  train.add_argument(
    "--metrics",
    default=None,
    help="write the metrics (every --log-every steps, and each eval) to this JSONL file "
    "(with --compare, one file per strategy: m.jsonl -> m.data_parallel.jsonl, ...)",
  )
  train.add_argument(
    "--out",
    default=None,
    help="run directory for metrics.jsonl, TensorBoard event files and report.png "
    "(default: --checkpoint-dir)",
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
  multi.add_argument("--num-processes", type=_positive, default=None, help="processes in the run")
  multi.add_argument("--process-id", type=int, default=None, help="this process's index")
  multi.add_argument(
    "--join-timeout", type=_positive, default=120, help="seconds to wait for all processes"
  )
  multi.add_argument(
    "--heartbeat-timeout",
    type=_positive,
    default=30,
    help="seconds without a heartbeat after which a lost process stops the others",
  )

  sched = sub.add_parser(
    "schedule", help="print and draw a pipeline schedule", formatter_class=defaults
  )
  sched.add_argument("--stages", type=_positive, required=True, help="pipeline stages P")
  sched.add_argument("--microbatches", type=_positive, required=True, help="microbatches M")
  sched.add_argument(
    "--schedule",
    choices=SCHEDULES,
    default="1f1b",
    help="the schedule to build",
  )
  sched.add_argument(
    "--virtual-stages",
    type=_positive,
    default=None,
    help="model chunks per device, interleaved_1f1b only (default: 2 for it, else 1)",
  )
  sched.add_argument(
    "--exchange-every",
    type=_positive,
    default=None,
    help="ticks (passes) each device runs between two message exchanges "
    "(default: what the strategies run, 2 for interleaved_1f1b, else 1)",
  )
  sched.add_argument(
    "--out",
    default=None,
    help="image file to draw the timeline into (.png, .svg, .pdf; no extension: .png)",
  )
  sched.add_argument(
    "--csv", default=None, help="CSV file to write the schedule into (torch.distributed format)"
  )

  _add_import(
    sub.add_parser("list", help="list the registered strategies", formatter_class=defaults)
  )
  return parser


def _add_import(parser: argparse.ArgumentParser) -> None:
  """Adds `--import MODULE...` (modules that register strategies of one's own)."""
  parser.add_argument(
    "--import",
    dest="imports",
    metavar="MODULE",
    nargs="+",
    action="extend",
    default=None,
    help="import these first ('package.module' or 'path/file.py'), e.g. a module that "
    "registers your own strategy with @parstrat.register",
  )


def _import_modules(args: argparse.Namespace) -> None:
  """Imports `--import`'s modules (a strategy of one's own registers on import).

  Raises:
    UsageError: for a module that cannot be imported, naming it.
  """
  from parstrat._src import config

  for target in args.imports or ():
    try:
      config.import_module(target, "--import")
    except ValueError as e:  # ConfigError is a ValueError
      raise UsageError(f"{e}{messages.raised_at(e)}") from None


def _train_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
  sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
  return sub.choices["train"]


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
  """Parses the command line; `train --config FILE` reads FILE's keys as flags first."""
  from parstrat._src import config

  argv = list(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(argv)
  if getattr(args, "config", None) is None:
    return args
  try:
    table = config.load_toml(args.config)
    tokens = config.config_to_argv(table, _train_parser(parser), args.config)
  except config.ConfigError as e:
    raise UsageError(str(e)) from None
  at = argv.index("train") + 1
  merged = parser.parse_args([*argv[:at], *tokens, *argv[at:]])
  # What only the file set: a strategy named on the command line may not take it.
  merged.from_config = {k for k, v in vars(merged).items() if getattr(args, k, None) != v}
  # Each key's value as the file writes it, for messages (argparse may hold a number as text).
  merged.config_written = {k.replace("-", "_"): config.toml_value(v) for k, v in table.items()}
  # Likewise each [strategy-option] key only the file set (the command line's win), by
  # the name `--strategy-option` gives it; a later table's key wins, as its flag does.
  typed = dict(args.strategy_options or ())
  merged.options_written = {}
  for key, options in table.items():  # (`strategy-option = ["hosts=2"]` is flags' text)
    if key.replace("_", "-") == "strategy-option" and isinstance(options, dict):
      for k, v in options.items():
        if (name := k.strip().replace("-", "_")) not in typed:
          merged.options_written[name] = f"[{key}] {k} = {config.toml_value(v)}"
  return merged


def _as_written(args: argparse.Namespace, flag: str, value: Any) -> str:
  """The value of `flag` ("data-parallel") as the --config file writes it."""
  from parstrat._src import config

  written = getattr(args, "config_written", {}).get(flag.replace("-", "_"))
  return config.toml_value(value) if written is None else written


def _option_as_given(args: argparse.Namespace, key: str) -> str:
  """A strategy option as given: `[strategy-option] hosts = 2` when only the --config
  file set it, as the file writes it; else `--strategy-option hosts=2`."""
  written = getattr(args, "options_written", {}).get(key)
  return written or f"--strategy-option {key}={_strategy_options(args)[key]}"


def _check_not_empty(args: argparse.Namespace, key: str) -> None:
  """Refuses an empty path for option `key` (an unset shell variable: nothing would be written).

  Raises:
    UsageError: naming the flag, or the config file that set it.
  """
  value = getattr(args, key)
  if value is not None and not str(value).strip():
    flag = "--" + key.replace("_", "-")
    if key in getattr(args, "from_config", ()):  # (the file's line names the value)
      raise _bad_option(args, key, f"{flag} is an empty path; give one, or leave the key out")
    raise UsageError(
      f"{flag} is an empty path ({value!r}: an unset variable?); give one, or leave the flag out"
    )


def _bad_option(args: argparse.Namespace, key: str, message: str) -> UsageError:
  """The error for a bad value of option `key`, naming the config file where it was set."""
  if key in getattr(args, "from_config", ()):
    flag = key.replace("_", "-")
    return UsageError(f"{args.config}: {flag} = {_as_written(args, flag, getattr(args, key))}: "
                      f"{message}")  # fmt: skip
  return UsageError(message)


def _setup_devices(count: int) -> None:
  """Makes `count` virtual CPU devices; must run before JAX starts its backend."""
  import jax

  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError:
    pass  # the backend already runs (parstrat called from Python): use its devices


def _strategy_config(
  args: argparse.Namespace, name: str, *, compare: bool
) -> tuple[dict, list[str]]:
  """The strategy flags given, and those left out: the ones it does not take.

  A flag the strategy does not take is left out with --compare (each strategy
  takes what it understands) or when only the --config file set it (a file
  written for `hybrid` also serves `--strategy fsdp`); given on the command
  line, it reaches the strategy, which refuses it by name. "auto" chooses the
  mesh and the pipeline options itself: it takes only --memory-budget, and
  every other strategy flag is left out. `--strategy-option`s always reach
  the strategy but with --compare, read by the type of the field they set
  (`_option_value`).
  """
  import parstrat
  from parstrat._src import distributed

  config = {}
  keys = ("data", "stages", "model", "microbatches", "schedule", "virtual_stages", "activations",
          "exchange_every", "unroll", "zero", "replicate_below", "memory_budget")  # fmt: skip
  for key in keys:
    value = getattr(args, key)
    if value is not None:
      config[key] = value
  flags = {"data": "data-parallel", "model": "tensor-parallel"}
  cls = parstrat._src.registry.lookup(name)
  from_config = getattr(args, "from_config", set()) - {"strategy_options"}
  for key, text in _strategy_options(args).items():  # (the command line's, after the file's)
    if key == "devices":
      raise UsageError(
        f"{_option_as_given(args, key)}: the devices come from --devices; give that instead"
      )
    if key in config:
      raise UsageError(
        f"{_option_as_given(args, key)}: {key} is already set by "
        f"--{flags.get(key, key.replace('_', '-'))}; give it once"
      )
    config[key] = _option_value(cls, key, text, _option_as_given(args, key))
    flags[key] = f"strategy-option {key}"

  def as_typed(key: str) -> str:
    """A strategy option as given: "stages = 2" from the --config file, "--stages 2" or
    "--no-unroll" from the command line."""
    if flags.get(key, "").startswith("strategy-option"):
      return _option_as_given(args, key)
    flag, value = flags.get(key, key.replace("_", "-")), config[key]
    if key in from_config:
      return f"{flag} = {_as_written(args, flag, value)}"
    if isinstance(value, bool):
      return f"--{'' if value else 'no-'}{flag}"
    return f"--{flag} {value}"

  if cls.deferred:  # "auto" measures the real batch
    unused = [k for k in config if k != "memory_budget"]
    config.update(batch_size=args.batch_size, verbose=distributed.is_primary())
  else:
    names, takes_any = parstrat._src.registry.options_of(cls)
    unused = [
      k for k in config if not takes_any and k not in names and (compare or k in from_config)
    ]
    refused = [k for k in config if not takes_any and k not in names and k not in unused]
    if refused:  # (named by its flag: the strategy's own message names its fields)

      def flag_of(key: str) -> str:
        if key == "devices":
          return "--devices"
        if key in keys or key in flags:
          return "--" + flags.get(key, key.replace("_", "-"))
        return f"--strategy-option {key}=VALUE"

      key = refused[0]
      typed = flags.get(key, "").startswith("strategy-option")  # (a name typed: a typo?)
      match = messages.closest(key, names) if typed else None
      takes = ", ".join(flag_of(k) for k in names) or "no strategy flags"
      raise UsageError(
        f"{as_typed(key)}: {name} has no option {key!r}"
        + (f"; did you mean {match!r}?" if match else "")
        + f" (it takes {takes})"
      )

  return {k: v for k, v in config.items() if k not in unused}, [as_typed(k) for k in unused]


def _strategy_options(args: argparse.Namespace) -> dict[str, str]:
  """`--strategy-option`'s KEY -> VALUE text; a key given again (on the command line
  after the file's) takes the later value."""
  return dict(args.strategy_options or ())


def _option_value(cls: type, key: str, text: str, where: str | None = None) -> Any:  # noqa: PLR0911
  """A `--strategy-option` VALUE read by the type of `cls`'s field `key`.

  bool fields take true/false (also 1/0, yes/no, on/off), int and float
  fields a number, str fields the text itself (or a quoted TOML string), a
  `Literal` one of its values, an optional field also `none`; other fields
  (or one whose annotation cannot be evaluated, `_option_type`) a TOML value
  (`[1, 2]`, `"text"`), or a bare word as text.

  Args:
    cls: the strategy class.
    key: the field.
    text: the VALUE.
    where: the option as given, for errors (`_option_as_given`; by default
      `--strategy-option KEY=VALUE`).

  Raises:
    UsageError: for an empty value or one the field's type cannot take,
      naming the key, the value and the type.
  """
  import tomllib
  import types
  import typing

  where = where or f"--strategy-option {key}={text}"
  if not text.strip():
    raise UsageError(f"{where}: give a value after '='")
  hint = _option_type(cls, key)
  if typing.get_origin(hint) is typing.Literal:
    choices = typing.get_args(hint)
    chosen = [c for c in choices if str(c) == text.strip()]
    if not chosen:
      raise UsageError(f"{where}: {key} is one of {', '.join(map(str, choices))}")
    return chosen[0]
  kinds = (
    typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
  )
  if type(None) in kinds and text.strip().lower() == "none":
    return None
  kinds = [k for k in kinds if k is not type(None)]

  def as_toml():
    try:
      return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
      return _UNREAD

  if kinds == [bool]:
    words = {"true": True, "1": True, "yes": True, "on": True,
             "false": False, "0": False, "no": False, "off": False}  # fmt: skip
    if text.strip().lower() not in words:
      raise UsageError(f"{where}: {key} is a bool; give true or false")
    return words[text.strip().lower()]
  if kinds in ([int], [float]):
    try:
      value = kinds[0](text)
    except ValueError:
      raise UsageError(f"{where}: {key} is {kinds[0].__name__}; give a number") from None
    return value
  if kinds == [str]:
    value = as_toml()
    return value if isinstance(value, str) else text
  value = as_toml()
  if value is not _UNREAD and not isinstance(value, (dict, *_datetime_types())):
    return value
  if text in ("True", "False", "None"):  # (Python's spelling)
    return {"True": True, "False": False, "None": None}[text]
  if re.fullmatch(r"\w[\w.\-/:]*", text):
    return text
  raise UsageError(f"{where}: cannot read the value (give a number, true/false, a word, "
                   "a quoted \"text\" or a TOML list)")  # fmt: skip


_UNREAD = object()


def _option_type(cls: type, key: str) -> Any:
  """The annotation of option `key` of `cls` (a dataclass field, or an `__init__`
  parameter), evaluated on its own; None when absent or not evaluable (a name
  imported only for type checkers): that option alone is then read as TOML."""
  import inspect

  annotation, module = None, cls.__module__
  for klass in cls.__mro__:
    if key in klass.__dict__.get("__annotations__", {}):
      annotation, module = klass.__dict__["__annotations__"][key], klass.__module__
      break
  if annotation is None:
    try:
      parameter = inspect.signature(cls).parameters.get(key)
    except (TypeError, ValueError):
      parameter = None
    if parameter is not None and parameter.annotation is not parameter.empty:
      annotation = parameter.annotation
  if isinstance(annotation, str):  # (`from __future__ import annotations`)
    namespace = vars(sys.modules[module]) if module in sys.modules else {}
    try:
      annotation = eval(annotation, dict(namespace))  # noqa: S307 - the class's own annotation
    except Exception:  # noqa: BLE001
      return None
  return annotation


def _datetime_types() -> tuple[type, ...]:
  """TOML's date and time types (read as text instead: `x=2024-01-01` is a word)."""
  import datetime

  return (datetime.date, datetime.time, datetime.datetime)


def _previous_run(out: pathlib.Path, compare: str | None) -> str | None:
  """What of an earlier run `--out` holds (its metrics or event files), or None."""
  from parstrat._src import tensorboard_log

  directories = [out] + [out / n.strip() for n in compare.split(",")] if compare else [out]
  for directory in directories:
    if (directory / "metrics.jsonl").is_file():
      return str(directory / "metrics.jsonl")
    if any(directory.glob(f"{tensorboard_log.PREFIX}*")):
      return f"TensorBoard event files in {directory}"
  return None


def _check_paths(args: argparse.Namespace, primary: bool = True) -> None:
  """Finds the file-system problems of `train`'s flags before anything is loaded or trained.

  A path the system will not even look at (a name too long, a folder it may not
  read) is told in one line too.

  `primary`: whether this is the process that writes the metrics, event files
  and reports (process 0 of several), which alone tells a stopped leg's files
  from another run's for `--resume-if-exists` (the others' `--metrics` and
  `--out` are not written, and they cannot know process 0's).

  Raises:
    UsageError: for an empty path (an unset shell variable: the run would save
      nothing), checkpoint flags without `--checkpoint-dir`, a path that
      is a file where a directory is needed (or the other way round), a
      missing or unwritable directory, or a non-empty checkpoint directory
      without `--resume` or `--overwrite`; an OSError of the checks.
  """
  try:
    _check_paths_of(args, primary)
  except OSError as e:
    raise UsageError(f"cannot check the paths given: {e}") from None


def _check_paths_of(args: argparse.Namespace, primary: bool) -> None:
  for key in ("checkpoint_dir", "out", "metrics", "data_dir"):
    _check_not_empty(args, key)
  if args.resume_if_exists:
    _resolve_resume_if_exists(args, primary)
  given = [flag for flag, value in (("--resume", args.resume), ("--save-every", args.save_every),
           ("--keep", args.keep), ("--overwrite", args.overwrite)) if value]  # fmt: skip
  if given == ["--overwrite"] and (args.out is not None or args.metrics is not None):
    given = []  # --overwrite replaces the run in --out, or the --metrics file
  if args.checkpoint_dir is None and given:
    raise UsageError(f"{given[0]} needs --checkpoint-dir")
  if args.resume and args.overwrite:
    raise UsageError("--resume continues the checkpoints that --overwrite would delete: pick one")
  if args.fresh_optimizer and not args.resume:
    raise UsageError("--fresh-optimizer restarts the optimizer of a resumed run: add --resume")
  if args.fresh_optimizer and args.lr_schedule == "cosine" and not args.schedule_steps:
    raise UsageError(
      "--fresh-optimizer starts the cosine schedule again at the resumed step: pass "
      "--schedule-steps N, its length from there (it would decay over the whole run's length)"
    )
  if args.checkpoint_dir is not None:
    directory = pathlib.Path(args.checkpoint_dir)
    _check_writable_dir(directory, "--checkpoint-dir")
    runs = _run_dirs(args, directory)
    if args.resume and not any(_holds_checkpoints(run) for run in runs):
      raise UsageError(  # (nothing created)
        f"--resume: no checkpoint in {directory} (--resume-if-exists starts there when there "
        "is none, as a job restarted with the same command needs)"
      )
    if directory.is_dir() and any(directory.iterdir()) and not (args.resume or args.overwrite):
      raise UsageError(
        f"--checkpoint-dir {directory} is not empty (another run?): pass --resume to continue "
        "it or --overwrite to start afresh"
      )
  if args.out is not None:
    _check_writable_dir(pathlib.Path(args.out), "--out")
    previous = _previous_run(pathlib.Path(args.out), args.compare)
    if previous and not (args.resume or args.overwrite):
      raise UsageError(
        f"--out {args.out} holds another run ({previous}): pass --overwrite to replace it"
        + (" or --resume to continue it" if args.checkpoint_dir else "")
      )
  if args.metrics is not None:
    path = pathlib.Path(args.metrics)
    if path.is_dir() or str(args.metrics).endswith(("/", os.sep)):
      raise UsageError(f"--metrics {args.metrics} is a directory; give a file name")
    if not path.parent.is_dir():
      raise UsageError(f"--metrics {path}: the directory {path.parent} does not exist")
    _check_writable_dir(path.parent, "--metrics")
    if primary:  # (the process that writes it)
      names = _compare_names(args) if args.compare else []
      for target in [_strategy_metrics(path, n) for n in names] or [path]:
        _check_metrics_file(args, target)


def _check_metrics_file(args: argparse.Namespace, path: pathlib.Path) -> None:
  """Refuses a `--metrics` file the run must not replace (it is written by a rename).

  Raises:
    UsageError: for a link, pipe or device; the run's report picture or one of
      its input files (its config, model, data or `--import` file); or another
      run's metrics on a fresh run without `--overwrite`.
  """
  if path.is_symlink() or (path.exists() and not path.is_file()):
    raise UsageError(
      f"--metrics {path} is not a plain file (a link, a pipe or a device): the metrics are "
      "written to a new file renamed over it, which would replace it; give a file's path"
    )
  if args.checkpoint_dir is not None and path.name.isdecimal():
    if path.parent.resolve() in [
      d.resolve() for d in _run_dirs(args, pathlib.Path(args.checkpoint_dir))
    ]:
      raise UsageError(
        f"--metrics {path} is where --checkpoint-dir saves step {int(path.name)}: give the "
        "metrics another name"
      )
  out = args.out or args.checkpoint_dir  # (where the report is drawn, at the end)
  picture = "compare.png" if args.compare else "report.png"
  if out is not None and path.resolve() == (pathlib.Path(out) / picture).resolve():
    raise UsageError(f"--metrics {path} is the report picture: give the metrics another name")
  if not path.exists():
    return
  from parstrat._src import config

  # (the files the entry points load, found as they are: a module's too, unimported)
  inputs = [("--config", getattr(args, "config", None))] + [
    (flag, config.entry_point_source(spec)) for flag, spec in
    [("--model-fn", args.model_fn), ("--dataset", args.dataset)]
    + [("--import", f"{target}:_") for target in args.imports or ()]
  ]  # fmt: skip
  for flag, other in inputs:
    other = other.rpartition(":")[0] if other and flag != "--config" else other
    if other and pathlib.Path(other).is_file() and path.samefile(other):
      raise UsageError(f"--metrics {path} is the {flag} file: give the metrics another name")
  if path.stat().st_size and not (args.resume or args.overwrite):
    raise UsageError(
      f"--metrics {path} already holds metrics (another run's?): pass --overwrite to "
      "replace it" + (" or --resume to continue it" if args.checkpoint_dir else "")
    )


def _resolve_resume_if_exists(args: argparse.Namespace, primary: bool = True) -> None:
  """Turns `--resume-if-exists` into `--resume`, or where no checkpoint is, `--overwrite`.

  A leg killed before its first checkpoint leaves its metrics and event files
  (and unfinished saves and writes: see `_first_foreign`): the run starts
  afresh over them, as `--overwrite` would, with no checkpoint to delete;
  anything else in `--checkpoint-dir` or `--out` is refused, by the `primary`
  process (the others start as it does, or stop with it: see `_join`).

  Raises:
    UsageError: without `--checkpoint-dir`, or with `--resume`, `--overwrite`
      or `--fresh-optimizer` (which would start the optimizer anew at every
      leg's resume).
  """
  clashes = {
    "--resume": "it resumes where there is a checkpoint: drop --resume",
    "--overwrite": "it continues the checkpoints that --overwrite would delete: pick one",
    "--fresh-optimizer": "the optimizer would start anew at every leg's resume: resume "
    "once with --resume --fresh-optimizer",
  }
  from_config = getattr(args, "from_config", ())

  def named(flag: str) -> str:  # (a config file's key is named with the file)
    key = flag[2:].replace("-", "_")
    return f"{flag} (set in {args.config})" if key in from_config else flag

  for flag, why in clashes.items():
    if getattr(args, flag[2:].replace("-", "_")):
      raise UsageError(f"{named('--resume-if-exists')} with {named(flag)}: {why}")
  if args.checkpoint_dir is None:
    raise UsageError("--resume-if-exists needs --checkpoint-dir")
  directory = pathlib.Path(args.checkpoint_dir)
  runs = _run_dirs(args, directory)
  if any(_holds_checkpoints(run) for run in runs):
    args.resume = True
    return
  if not primary:  # (what is there was left by process 0, whose --metrics it cannot know)
    args.overwrite = True
    return
  folders, files = _leg_paths(args)
  anyway = "run once with --overwrite instead of --resume-if-exists to start there anyway"
  foreign = _first_foreign(directory, folders, files)
  if foreign is not None:
    raise UsageError(
      f"--resume-if-exists: --checkpoint-dir {directory} holds no checkpoint but {foreign} "
      "(another run?): it starts only in an empty folder or one a stopped leg left (metrics, "
      f"event files, unfinished saves); {anyway}"
    )
  foreign = _first_foreign(pathlib.Path(args.out), folders, files) if args.out else None
  if foreign is not None:
    raise UsageError(
      f"--resume-if-exists: --out {args.out} holds {foreign}, which no stopped leg of this "
      f"run leaves (another run?); {anyway}"
    )
  previous = _previous_run(pathlib.Path(args.out), args.compare) if args.out else None
  if previous and not directory.exists():  # (a stopped leg made --checkpoint-dir first)
    raise UsageError(
      f"--resume-if-exists: --out {args.out} holds another run ({previous}) and "
      f"--checkpoint-dir {directory} none; {anyway}"
    )
  args.overwrite = True


def _resume_flag(args: argparse.Namespace) -> str:
  """The flag the user gave that resumes: messages name it."""
  return "--resume-if-exists" if args.resume_if_exists else "--resume"


#: What a leg of `parstrat train` leaves in its folders when stopped before its
#: first checkpoint: `--resume-if-exists` starts over it. (Not the report: it is
#: drawn only when every strategy has trained, after a last checkpoint.)
_LEFTOVER_FILES = ("metrics.jsonl",)


def _first_foreign(
  directory: pathlib.Path, folders: frozenset = frozenset(), files: frozenset = frozenset()
) -> str | None:
  """The first entry of `directory` that no stopped leg of this run leaves, or None.

  A leg leaves its metrics, TensorBoard event files, unfinished orbax saves
  (`N.orbax-checkpoint-tmp*`), the temporary files of writes it was killed in
  (`.metrics.jsonl-XXXX`), and, given as resolved paths, its own `files`
  (`--metrics`) and `folders` (`--compare`'s strategies, `--out`, the folder of
  `--metrics`), whose entries are checked alike.
  """
  from parstrat._src import tensorboard_log

  if not directory.is_dir():
    return None
  own = (*_LEFTOVER_FILES, *(f.name for f in files))
  for entry in sorted(directory.iterdir()):
    name, resolved = entry.name, entry.resolve()
    if entry.is_dir() and not entry.is_symlink():
      if re.fullmatch(r"\d+\.orbax-checkpoint-tmp.*", name):
        continue
      if resolved in folders:
        inner = _first_foreign(entry, folders, files)
        if inner is None:
          continue
        return inner
    elif entry.is_file() and (
      name in _LEFTOVER_FILES
      or resolved in files
      or name.startswith(tensorboard_log.PREFIX)
      or any(name.startswith(f".{leftover}-") for leftover in own)
    ):
      continue
    return str(entry)
  return None


def _leg_paths(args: argparse.Namespace) -> tuple[frozenset, frozenset]:
  """(folders, files) this run writes besides its checkpoints, resolved: see `_first_foreign`."""
  names = _compare_names(args) if args.compare else []
  folders = set()
  for base in filter(None, (args.checkpoint_dir, args.out)):
    folders.add(pathlib.Path(base).resolve())
    folders.update(pathlib.Path(base).resolve() / n for n in names)
  files = set()
  if args.metrics:
    given = pathlib.Path(args.metrics).resolve()
    files.add(given)
    files.update(_strategy_metrics(given, n) for n in names)
    bases = set(folders)
    for parent in given.parents:  # (--metrics ckpt/logs/m.jsonl: ckpt/logs is the run's)
      if any(parent.is_relative_to(base) and parent != base for base in bases):
        folders.add(parent)
  return frozenset(folders), frozenset(files)


def _run_dirs(args: argparse.Namespace, directory: pathlib.Path) -> list[pathlib.Path]:
  """Where the run's checkpoints go under `directory`: a folder per `--compare` strategy."""
  return [directory / n for n in _compare_names(args)] if args.compare else [directory]


def _strategy_metrics(path: pathlib.Path, name: str) -> pathlib.Path:
  """`--compare`'s metrics file of strategy `name`: m.jsonl -> m.<name>.jsonl."""
  return path.with_name(f"{path.stem}.{name}{path.suffix}")


def _holds_checkpoints(path: pathlib.Path) -> bool:
  """Whether `path` holds a checkpoint's step folder (complete or not)."""
  return path.is_dir() and any(c.name.isdigit() and c.is_dir() for c in path.iterdir())


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


def _entry_point_sources(args: argparse.Namespace) -> dict:
  """The files `--model-fn` and `--dataset` loaded (`train` finds them once, after loading)."""
  from parstrat._src import config

  if not hasattr(args, "entry_point_sources"):
    return {
      f"{k}_source": config.entry_point_source(getattr(args, k)) for k in ("model_fn", "dataset")
    }
  return args.entry_point_sources


def _run_config(args: argparse.Namespace, data) -> dict:
  """What a checkpoint records of the run, beyond the model's shapes (which orbax records)."""
  cosine = args.lr_schedule == "cosine"
  return {"optimizer": args.optimizer, "lr": args.lr, "lr_schedule": args.lr_schedule,
          "schedule_steps": _schedule_steps(args, data) if cosine else None,
          "warmup_steps": args.warmup_steps, "weight_decay": args.weight_decay,
          "clip_norm": args.clip_norm, "precision": args.precision or "float32",
          "accumulate": args.accumulate, "batch_size": args.batch_size, "seed": args.seed,
          "dataset": args.dataset, "data": data.description, "model_fn": args.model_fn,
          **_entry_point_sources(args),
          "data_batches_per_epoch": data.steps_per_epoch,
          "data_first_example": data.example_hash,
          "data_order": data.order}  # fmt: skip


#: Changes to these need --allow-config-change on --resume. ("data" is what `dataset`
#: turned out to be: `--source auto` reads MNIST from tfds, or the bundled sample offline;
#: the batches per epoch of data with a length tell a dataset function's other data; its
#: first example may differ legitimately, e.g. drawn without a seed, so that is printed.)
GUARDED = ("optimizer", "lr", "lr_schedule", "schedule_steps", "warmup_steps", "weight_decay",
           "clip_norm", "precision", "dataset", "data", "data_batches_per_epoch",
           "model_fn")  # fmt: skip


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


def _resumable_changes(args, meta: dict, data) -> list[str]:
  """The changes from a checkpoint's run to this one that `--resume` accepts.

  Raises:
    UsageError: for another seed or batch size (the data order would differ),
      or a guarded change (`GUARDED`) without `--allow-config-change`.
  """
  changed = [
    f"--{flag} {meta.get(key)} (now {getattr(args, key)})"
    for flag, key in (("seed", "seed"), ("batch-size", "batch_size"))
    if meta.get(key) != getattr(args, key)
  ]
  if changed:
    raise UsageError(
      f"{_resume_flag(args)}: the checkpoint was written with {' and '.join(changed)}, which "
      "set the order of the data: pass the same to continue it (no flag allows another)"
    )
  from parstrat._src import config
  from parstrat._src import run_data

  saved = dict(meta.get("config", {}))
  if saved.get("data_order") == run_data.SHUFFLED:  # (older parstrat wrote it for any data)
    saved["data_order"] = data.order
  current = _run_config(args, data)
  # The same file written another way is no change. What the checkpoint's run loaded is
  # the file it found then (an older checkpoint's: only an absolute path tells it). The
  # files only forgive another spelling: the same spelling is compared as written (the
  # same code in another folder, a copied or moved project, is no change).
  for key in ("model_fn", "dataset"):
    source = saved.pop(f"{key}_source", None)
    if source is None and pathlib.Path(str(saved.get(key)).rpartition(":")[0]).is_absolute():
      source = config.entry_point_source(saved.get(key))
    if source is not None and source == current[f"{key}_source"]:
      if key == "dataset" and saved.get("data") == saved.get("dataset"):  # (described by it)
        saved["data"] = current["data"]
      saved[key] = current[key]
  guarded, other = _config_changes(saved, current)
  if guarded and not args.allow_config_change:
    raise UsageError(
      f"{_resume_flag(args)}: the checkpoint was written with another configuration "
      f"({', '.join(guarded)});"
      " pass --allow-config-change to continue with the new one"
    )
  return guarded + other


#: Trainer options the command line sets from its own flags.
_OPTION_FLAGS = {
  "optimizer": "--optimizer and its flags (an optax optimizer of your own needs the Python API)",
  "precision": "--precision",
  "accumulate": "--accumulate",
  "skip_nonfinite": "--stop-on-nonfinite",
}


def _check_model_options(strategy, options: dict) -> None:
  """Refuses keys of `--model-fn`'s dict that the trainer does not take from it.

  Raises:
    UsageError: for a key the command line sets from a flag (naming the flag),
      or one `strategy(model, optimizer, ...)` does not take (naming those it does).
  """
  import inspect

  from parstrat._src import config

  try:
    parameters = inspect.signature(strategy.__call__).parameters
  except (TypeError, ValueError):  # (no signature to read: the strategy's call decides)
    return
  takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
  kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
  takes = sorted(
    name for name, p in parameters.items()
    if p.kind in kinds and name not in (*_OPTION_FLAGS, "self", "model")
  )  # fmt: skip
  for key in options:
    if key in _OPTION_FLAGS:
      raise UsageError(
        f"--model-fn returned {key!r} in its dict: on the command line it comes from "
        f"{_OPTION_FLAGS[key]}"
      )
    if not takes_any and key not in parameters:
      raise UsageError(
        f"--model-fn returned {key!r} in its dict, which the trainer does not take (it takes "
        f"{', '.join(takes) or 'none'}){config.did_you_mean(key, takes)}"
      )


def _compare_names(args) -> list[str]:
  """The strategy names `--compare` lists."""
  return [name.strip() for name in args.compare.split(",")]


def _open_checkpoints(args, strategy, trainer, say, data):
  """The run's `Checkpointer`, and for `--resume` the restored state and its metadata.

  Returns `(checkpointer, state or None, meta or None)`. Closes the
  checkpointer itself if anything fails.

  Raises:
    UsageError: no checkpoint to resume, none intact, a model that does not
      fit, or a run configuration that differs (see `_config_changes`).
  """
  from parstrat._src.checkpoint import Checkpointer
  from parstrat._src.checkpoint import CheckpointError
  from parstrat._src.checkpoint import OptimizerDoesNotFit

  directory = pathlib.Path(args.checkpoint_dir)
  if args.compare:
    directory = directory / strategy_name(strategy)
  ckpt = Checkpointer(
    directory, save_every=args.save_every or 10**9, keep=args.keep or 3, clean_unfinished=True
  )
  try:
    if args.overwrite and ckpt.all_steps():
      say(f"--overwrite: deleting checkpoints {ckpt.all_steps()} in {directory}")
      for old in ckpt.all_steps():
        ckpt.delete(old)
    if args.resume_if_exists and not args.resume:
      say(f"--resume-if-exists: no checkpoint in {directory}: {strategy_name(strategy)} starts")
    if not args.resume:
      return ckpt, None, None
    if ckpt.latest_step() is None:
      # (only this --compare's other strategies: not any run that shares the parent)
      names = _compare_names(args) if args.compare else []
      others = [directory.parent / n for n in names if n != directory.name]
      if any(_holds_checkpoints(other) for other in others):
        # A --compare stopped before this strategy's first checkpoint: it starts now.
        say(
          f"{_resume_flag(args)}: no checkpoint in {directory} yet: "
          f"{strategy_name(strategy)} starts"
        )
        return ckpt, None, None
      raise UsageError(f"{_resume_flag(args)}: no checkpoint in {directory}")
    try:  # the run's configuration is checked before any array is read
      changes = _resumable_changes(args, ckpt.metadata(), data)
    except CheckpointError:  # a damaged newest checkpoint: restore falls back past it
      changes = None
    with _warnings_as_lines(say):
      try:
        state, meta = ckpt.restore(trainer, fresh_optimizer=args.fresh_optimizer)
      except OptimizerDoesNotFit as e:
        changed = f"This run changes {', '.join(changes)}: a" if changes else "A"
        fresh = (
          "resume once with --resume --fresh-optimizer (not --resume-if-exists)"
          if args.resume_if_exists
          else "add --fresh-optimizer"
        )
        raise UsageError(
          f"{_resume_flag(args)}: {e} {changed} change that gives the optimizer state another "
          "layout (another --optimizer, clipping on or off, weight decay on or off, a schedule "
          f"for a constant rate) cannot be resumed with the saved optimizer state: {fresh} to "
          "start it anew from the restored params, or resume with the saved values"
        ) from None
      except (ValueError, CheckpointError) as e:
        raise UsageError(f"{_resume_flag(args)}: {e}") from None
    changes = _resumable_changes(args, meta, data)
    if changes:
      say(f"resuming with a changed configuration: {', '.join(changes)}")
    return ckpt, state, meta
  except BaseException:
    ckpt.close()
    raise


@contextlib.contextmanager
def _warnings_as_lines(say):
  """Each warning raised inside, once more if shown before, as a line of the run's output
  (`warning: ...`), said when the block ends, also when it raises; what is silenced (-W,
  PYTHONWARNINGS, a test session's filterwarnings) stays silenced: the filters in their
  order, any action but "ignore" as "always". A warning raised more than once inside (a
  model's trace-time warning, traced for the loss check and again for the step) is said
  once."""
  import warnings

  with warnings.catch_warnings(record=True) as caught:
    given = list(warnings.filters)
    warnings.simplefilter("always")
    pattern = lambda regex: getattr(regex, "pattern", regex) or ""  # noqa: E731
    for action, message, category, module, lineno in reversed(given):
      action = "ignore" if action == "ignore" else "always"  # noqa: PLW2901
      warnings.filterwarnings(action, pattern(message), category, pattern(module), lineno)
    try:
      yield
    finally:
      said = set()
      for warning in caught:
        line = f"warning: {warning.message}"
        if (warning.category, line) not in said:
          said.add((warning.category, line))
          say(line)


def _multi_process(args: argparse.Namespace) -> bool:
  """True when this run joins others: `--coordinator` or `JAX_COORDINATOR_ADDRESS` is set."""
  import os

  return args.coordinator is not None or "JAX_COORDINATOR_ADDRESS" in os.environ


def _on_cpu(devices) -> bool:
  return not devices or devices[0].platform == "cpu"


def _cpu_hint(needed: int) -> str:
  """How to get `needed` devices on a machine with fewer accelerators."""
  return f"to try it on virtual CPU devices: JAX_PLATFORMS=cpu parstrat train --devices {needed}"


def _devices_hint(e, devices) -> str:
  if not _on_cpu(devices):
    return f"{e.base} T{_cpu_hint(e.needed)[1:]}."
  return f"{e.base} Pass --devices {e.needed} (on CPU, that many virtual devices are made)."


#: The built-in MLP's hidden widths when `--hidden` is not given.
DEFAULT_HIDDEN = [512]


def _default_model(hidden: list[int], classes: int):
  import haiku as hk
  import jax

  widths = [*hidden, classes]

  def mlp(x):
    return hk.nets.MLP(widths, activation=jax.nn.swish)(x.reshape(x.shape[0], -1))

  return hk.transform(mlp)


#: Flags each process of a run may set for itself; every other flag must be the same.
PER_PROCESS = ("process_id", "coordinator", "metrics", "out", "no_progress", "data_dir",
               "join_timeout", "heartbeat_timeout")  # fmt: skip


def _run_flags(args: argparse.Namespace) -> dict[str, str]:
  """The flags every process of a run must share, as `{"--flag": repr(value)}`.

  Every flag but `PER_PROCESS` and `--config`, whose keys are already merged
  into `args` (so a comment in one copy of the file does not count).

  Args:
    args: the parsed `parstrat train` flags.

  Returns:
    Each flag's first option string -> the repr of its value.
  """
  flags = {
    flag: repr(getattr(args, dest, None))
    for dest, flag in _train_flags().items()
    if dest not in (*PER_PROCESS, "config", "help", "strategy_options")
  }
  flags["--strategy-option"] = repr(sorted(_strategy_options(args).items()))  # (any order)
  return flags


def _train_flags() -> dict[str, str]:
  """`parstrat train`'s flags: each destination -> its first option string."""
  actions = _train_parser(build_parser())._actions  # noqa: SLF001
  return {a.dest: a.option_strings[0] for a in actions if a.option_strings}


def _join(args: argparse.Namespace) -> None:
  """Joins the processes of a multi-process run and checks they were started alike.

  Args:
    args: the parsed `parstrat train` flags (`--coordinator`, ...).

  Raises:
    UsageError: an address that cannot be served, a bad process id or count,
      processes with different numbers of devices or other flags, or paths
      that any of them refuses (`_check_paths`: every process stops).
  """

  from parstrat._src import distributed

  source = "--coordinator" if args.coordinator else "JAX_COORDINATOR_ADDRESS"
  try:
    distributed.initialize(
      args.coordinator,
      args.num_processes,
      args.process_id,
      local_cpu_devices=args.devices or DEFAULT_DEVICES,
      timeout_s=args.join_timeout,
      heartbeat_timeout_s=args.heartbeat_timeout,
    )
  except ValueError as e:
    raise UsageError(str(e)) from None
  except ConnectionError as e:
    raise UsageError(f"{source}: {e}") from None
  # Before anything else: processes started with other flags would run other
  # programs, and hang or abort in their first collective.
  try:
    distributed.check_same_everywhere("flags", _run_flags(args))
  except ValueError as e:
    allowed = ", ".join(_train_flags()[k] for k in PER_PROCESS)
    raise UsageError(
      f"{e} Start every process with the same flags (only {allowed} may differ)."
    ) from None
  # After joining: the processes share whether one refused its paths, and all stop if
  # one does (each with its own line), rather than leave the others in a collective.
  problem = None
  try:
    _check_paths(args, primary=distributed.is_primary())
  except UsageError as e:
    problem = e
  try:
    distributed.check_same_everywhere("path checks", {"refused": str(problem is not None)})
  except ValueError:
    raise problem or UsageError(
      "another process of the run refused its paths (its line says why): this one stops too"
    ) from None
  if problem is not None:
    raise problem


def train(args: argparse.Namespace) -> dict:
  from parstrat._src import distributed

  if _multi_process(args):
    _join(args)
  else:
    _check_paths(args)
    _setup_devices(args.devices or DEFAULT_DEVICES)
  import jax

  import parstrat
  from parstrat._src import config
  from parstrat._src import run_data
  from parstrat._src.messages import TooFewDevicesError

  primary = distributed.is_primary()
  say = print if primary else (lambda *a, **k: None)
  devices = jax.devices()
  if jax.process_count() == 1 and args.devices is not None:
    if args.devices > len(devices):
      raise UsageError(
        f"--devices {args.devices}: only {len(devices)} {devices[0].platform} devices are "
        f"available" + ("" if _on_cpu(devices) else f"; {_cpu_hint(args.devices)}")
      )
    devices = devices[: args.devices]
  _import_modules(args)
  names = _compare_names(args) if args.compare else [args.strategy]
  twice = sorted({name for name in names if names.count(name) > 1})
  if twice:  # (each run writes DIR/<name>/: the second would overwrite the first)
    raise UsageError(f"--compare names {', '.join(twice)} twice: name each strategy once")
  strategies = {}
  taken: set[str] = set()  # the --strategy-options some strategy takes
  for name in names:
    try:
      options, unused = _strategy_config(args, name, compare=bool(args.compare))
      taken.update(options)
      if unused and parstrat._src.registry.lookup(name).deferred:
        say(f"{name} chooses the mesh and pipeline options itself; not used: {', '.join(unused)}")
      elif unused and not args.compare:
        say(f"{args.config}: not used by {name} (it takes no such option): {', '.join(unused)}")
      strategies[name] = parstrat.get(name, devices=devices, **options)
      if not strategies[name].deferred:  # fail on an impossible mesh before loading data
        strategies[name].make_mesh()
    except KeyError as e:  # (with --compare the names come from the command line)
      message = (
        f"{e.args[0]} (--import {' '.join(args.imports)} registered no such name.)"
        if args.imports
        else f"{e.args[0]} A strategy of your own is registered when its module is "
        "imported: pass --import MODULE."
      )
      raise (
        UsageError(message) if args.compare else _bad_option(args, "strategy", message)
      ) from None
    except TooFewDevicesError as e:
      raise UsageError(_devices_hint(e, devices)) from None
    except (TypeError, ValueError) as e:
      raise UsageError(str(e)) from None
  untaken = [k for k in _strategy_options(args) if k not in taken]
  if untaken and not any(s.deferred for s in strategies.values()):  # ("auto" named them)
    given = ", ".join(_option_as_given(args, k) for k in untaken)
    raise UsageError(f"{given}: none of {', '.join(names)} takes it")
  # The names checked before any data loads: a typo costs nothing.
  from parstrat._src import optimizers
  from parstrat._src import precision

  for key, check in (
    ("optimizer", lambda name: optimizers.make_optimizer(name, 1.0)),
    ("precision", precision.resolve_policy),
  ):
    try:
      check(getattr(args, key))
    except ValueError as e:
      raise _bad_option(args, key, str(e)) from None

  try:
    data = run_data.load(
      args.dataset,
      source=args.source,
      data_dir=args.data_dir,
      batch_size=args.batch_size,
      seed=args.seed,
      log=say,
    )
    if args.model_fn is None:
      hidden = args.hidden or DEFAULT_HIDDEN
      model, model_options = _default_model(hidden, data.num_classes or 10), {}
      eval_model = None
    else:
      model, model_options = config.load_model(args.model_fn, seed=args.seed)
      eval_model = model_options.pop("eval_model", None)
      if eval_model is not None and data.eval_batches is None:
        say(f"--model-fn {args.model_fn}: its eval_model not used, --dataset {args.dataset} "
            "gives no eval data")  # fmt: skip
      if args.hidden is not None:
        widths = " ".join(map(str, args.hidden))
        say(f"--hidden {widths}: not used, the model is --model-fn {args.model_fn}")
  except ValueError as e:  # ConfigError is a ValueError
    raise UsageError(f"{e}{messages.raised_at(e)}") from None
  # The files they loaded, found once: checkpoints record them (see _resumable_changes).
  args.entry_point_sources = {f"{key}_source": config.entry_point_source(getattr(args, key))
                              for key in ("model_fn", "dataset")}  # fmt: skip
  say(f"data: {data.description}")
  ignored = (
    [f"--source {args.source}"] if args.source != "auto" and args.dataset != run_data.MNIST else []
  )
  if args.data_dir is not None and ":" in args.dataset:  # (tfds reads --data-dir; a function not)
    ignored.append(f"--data-dir {args.data_dir}")
  if ignored:  # (as --hidden with --model-fn: a flag that does nothing is said)
    say(f"{', '.join(ignored)}: not used, the data is --dataset {args.dataset}")
  try:  # (each process reads the data itself: from its own --data-dir, its own tfds)
    distributed.check_same_everywhere("data", _data_fingerprint(data))
  except ValueError as e:
    raise UsageError(f"{e} Every process must read the same data.") from None
  if data.one_shot and len(strategies) > 1:
    raise UsageError(
      f"--compare: the train data of --dataset {args.dataset} is a one-shot iterator (a "
      "generator): the first strategy would use it up and the others train on nothing. "
      "Return a list, an object whose __iter__ starts over, or a function of the epoch."
    )
  for strategy in strategies.values():  # (all before --compare trains the first)
    _check_model_options(strategy, model_options or {})
  if data.eval_batches is not None:  # (found at the first eval before, after an epoch)
    try:
      sample = data.sample_inputs((model_options or {}).get("model_inputs"))
    except Exception:  # noqa: BLE001 - the trainer's init names what is wrong with it
      sample = None
    unlike = None if sample is None else run_data.eval_inputs_unlike(data.eval_batches(), sample)
    if unlike:
      raise UsageError(unlike)
  for strategy in list(strategies.values())[1:]:
    # --compare: each later strategy's layout and batch split, checked before the first
    # trains (laid out only: nothing placed); "auto" chooses when its turn comes.
    if not strategy.deferred:
      optimizer, _ = _optimizer(args, data)
      trainer, _, _ = _start(args, strategy, model, data, model_options, optimizer, abstract=True)
      _local_rows(args, trainer)
  # The report goes next to the checkpoints unless --out says otherwise.
  out_dir = args.out or args.checkpoint_dir
  out = pathlib.Path(out_dir) if out_dir else None
  runs = {}
  for name, strategy in strategies.items():
    metrics_path = args.metrics
    if args.compare and metrics_path is not None:
      metrics_path = _strategy_metrics(pathlib.Path(metrics_path), name)
    run_dir = None
    made: list[pathlib.Path] = []  # the folders made here, the deepest first
    if out is not None:
      run_dir = out / name if args.compare else out
      if primary:
        made = [d for d in (run_dir, *run_dir.parents) if not d.exists()]
        run_dir.mkdir(parents=True, exist_ok=True)
      if args.metrics is None:
        metrics_path = run_dir / "metrics.jsonl"
    try:
      runs[name] = _train_one(
        args, strategy, model, data, metrics_path if primary else None, say,
        model_options=model_options, devices=devices, log_dir=run_dir if primary else None,
        eval_model=eval_model,
      )  # fmt: skip
    except BaseException:  # (refused, Ctrl-C before a step): no empty folder left behind
      for folder in made:
        with contextlib.suppress(OSError):  # (not empty: something was written there)
          folder.rmdir()
      raise
  picture = None if out is None else out / ("compare.png" if args.compare else "report.png")
  complete = all(r.get("complete") for r in runs.values())
  records = {n: r["records"] for n, r in runs.items()}
  if picture is not None and primary and not (complete and picture.exists()):
    # (a complete run draws it only if missing: the leg that ended was killed drawing it)
    from parstrat._src import report

    if complete and not any(records.values()):  # (its metrics deleted, or elsewhere)
      say(f"report: {picture} not drawn: this complete run has no metrics to draw it from")
    else:
      report.draw_training_report(records, picture)
      say(f"report: {picture}")
  return runs


def _data_fingerprint(data) -> dict[str, str]:
  """What tells one process's data from another's.

  Args:
    data: a loaded `run_data.RunData`.

  Returns:
    Its description, batches per epoch and a hash of its first example (shapes,
    dtypes and bytes), as texts for `distributed.check_same_everywhere`.
  """
  return {
    "description": data.description,
    "batches per epoch": str(data.steps_per_epoch),
    "first example": data.example_hash,
  }


def _batch_rows_and_shape(batch, default_rows: int) -> tuple[int, tuple]:
  """A batch's rows (its first leaf's leading size) and what `jit` compiles a step for."""
  import jax
  import numpy as np

  leaves, structure = jax.tree.flatten(batch)
  rows = np.shape(leaves[0])[0] if leaves and np.ndim(leaves[0]) else default_rows
  return int(rows), (structure, tuple((np.shape(x), np.result_type(x).str) for x in leaves))


def strategy_name(strategy) -> str:
  import parstrat

  for name in parstrat.available():
    if type(strategy) is parstrat._src.registry.lookup(name):
      return name
  return type(strategy).__name__


def _total_steps(args, data) -> int | None:
  if args.steps is not None:
    if data.steps_per_epoch is None:
      return args.steps
    return min(args.steps, args.epochs * data.steps_per_epoch)
  return None if data.steps_per_epoch is None else args.epochs * data.steps_per_epoch


def _schedule_steps(args, data) -> int | None:
  """The learning-rate schedule's length: --schedule-steps, else the run's last step."""
  return args.schedule_steps or _total_steps(args, data)


def _optimizer(args, data):
  """The optimizer and its learning-rate schedule from the flags."""
  from parstrat._src import optimizers

  try:
    schedule = optimizers.learning_rate_schedule(
      args.lr,
      schedule=args.lr_schedule,
      warmup_steps=args.warmup_steps,
      total_steps=_schedule_steps(args, data),
    )
    # A constant rate goes in as a number: the optimizer state then has no schedule
    # counter, and checkpoints restore with a plain `optax.adam(lr)`.
    constant = args.lr_schedule == "constant" and not args.warmup_steps
    optimizer = optimizers.make_optimizer(
      args.optimizer,
      args.lr if constant else schedule,
      weight_decay=args.weight_decay,
      clip_norm=args.clip_norm,
    )
  except ValueError as e:
    raise UsageError(str(e)) from None
  return optimizer, schedule


def _complete_records(args, metrics_path, say, log_dir) -> list[dict]:
  """A complete run's records, for a picture drawn again.

  `--compare` draws its picture again for the other strategies; a run's own
  report is drawn again only where it is missing (the leg that ended was killed
  while drawing it).
  """
  from parstrat._src.history import read_history

  drawn = args.compare or (
    log_dir is not None and not (pathlib.Path(log_dir) / "report.png").exists()
  )
  if not drawn or metrics_path is None or not pathlib.Path(metrics_path).is_file():
    return []
  try:
    return read_history(metrics_path)
  except (OSError, ValueError) as e:
    say(f"warning: {e}: its curves are left out of the picture")
    return []


def _start(args, strategy, model, data, model_options, optimizer, *, abstract=False):
  """The run's trainer of `strategy`, its initial state and the sample inputs given to it.

  With `abstract`, the state is laid out only (`Trainer.init_abstract`): nothing
  is computed or placed on the devices.

  Raises:
    UsageError: for a strategy that cannot lay the model out (its message).
  """
  import jax

  try:
    trainer = strategy(
      model,
      optimizer,
      **(model_options or {}),
      skip_nonfinite=not args.stop_on_nonfinite,
      precision=args.precision,
      accumulate=args.accumulate,
    )
    sample = data.sample_inputs((model_options or {}).get("model_inputs"))
    init = trainer.init_abstract if abstract else trainer.init
    state = init(jax.random.key(args.seed), sample, sample_batch=data.example)
  except (TypeError, ValueError) as e:  # (the model's own code is named where it raised)
    raise UsageError(f"{e}{messages.raised_at(e)}") from None
  return trainer, state, sample


def _eval_trainer(args, model, trainer, eval_model, data, model_options, optimizer):
  """A trainer on `trainer`'s strategy and mesh, laid out only, whose `apply` runs
  `eval_model` on `trainer`'s state.

  It initialises with `model`'s `init` (an eval model need not initialise: Haiku's
  BatchNorm cannot in eval mode), so its state is `trainer`'s; the strategy may
  lay the eval model's params out otherwise (`tensor` splitting a pair of the model
  that the eval model sums over): its `apply` then moves them, as `jit` does.

  Args:
    args: the command line.
    model: the model the run trains.
    trainer: the run's trainer, initialised.
    eval_model: `--model-fn`'s `eval_model`.
    data, model_options, optimizer: those the run's trainer was built with.

  Returns:
    The eval model's trainer; pass it `trainer`'s states.

  Raises:
    UsageError: if the eval model keeps state and the model does not (or the
      other way round), or cannot run on the model's params and state (its
      message, naming the eval model).
  """
  import types

  import haiku as hk

  where = f"--model-fn {args.model_fn}: its eval_model"
  stateful = [isinstance(m, hk.TransformedWithState) for m in (model, eval_model)]
  if stateful[0] != stateful[1]:
    keeps = lambda s: "keeps state" if s else "keeps none"  # noqa: E731
    raise UsageError(
      f"{where} {keeps(stateful[1])} and its model {keeps(stateful[0])}: give both the same "
      "kind (hk.transform_with_state for both, or hk.transform)"
    )
  haiku = isinstance(model, hk.Transformed | hk.TransformedWithState)
  kind = type(model) if haiku else types.SimpleNamespace
  try:
    evaluator, _, _ = _start(
      args,
      trainer.strategy,
      kind(init=model.init, apply=eval_model.apply),
      data,
      model_options,
      optimizer,
      abstract=True,
    )
  except UsageError as e:
    raise UsageError(f"{where} cannot run on the model's params and state: {e}") from None
  return evaluator


def _stores_alike(plan, other) -> bool:
  """Whether two plans provably store the same params alike: the same stored specs, and
  `to_stored` the method of two equal layout objects (frozen dataclasses, such as a
  pipeline's `FlatLayout` and `SplitLayout`, whose fields fix every element's place).
  False where that cannot be told (another kind of `to_stored`), though they may."""
  import dataclasses

  layouts = [getattr(p.to_stored, "__self__", None) for p in (plan, other)]
  return (
    dataclasses.is_dataclass(layouts[0])
    and type(layouts[0]) is type(layouts[1])
    and layouts[0] == layouts[1]
    and plan.param_spec == other.param_spec
  )


def _eval_state(trainer, evaluator, state, say):
  """How `evaluator` (from `_eval_trainer`) reads `trainer`'s states.

  Where the strategy stores the params in the model's own layout (`data_parallel`,
  `fsdp`, `tensor`), the state itself: each leaf is the same array, which the eval
  model's `apply` moves to its own sharding if it has another. Where it stores
  them otherwise (a pipeline's stage buffers, laid out from each model's own
  analysis: its cuts, its tensor-split pairs), also the state itself when the two
  plans provably store alike (`_stores_alike`); else the state moved to the eval
  model's layout at each eval (`export_state`, then `import_state`), which is
  said once.

  Returns:
    A function of `trainer`'s state to the state `evaluator.apply` reads.
  """
  import jax

  from parstrat._src import optimizer_probe

  model_layout = jax.eval_shape(trainer.params, state)
  own_layout = optimizer_probe.stores_model_layout(trainer.plan, model_layout)
  if own_layout or _stores_alike(trainer.plan, evaluator.plan):
    return lambda state: state
  say(
    f"eval: the eval_model's plan under {strategy_name(trainer.strategy)} is not the "
    "model's (other stage cuts or split pairs): each eval moves the state to its layout"
  )
  return lambda state: evaluator.import_state(trainer.export_state(state))


def _local_rows(args, trainer) -> slice:
  """The rows of each `--batch-size` batch this process loads (see `local_batch_rows`).

  Raises:
    UsageError: for a batch size the trainer cannot split, naming the flag.
  """
  try:
    return trainer.local_batch_rows(args.batch_size)
  except ValueError as e:
    raise UsageError(f"--batch-size {args.batch_size}: {e}") from None


def _train_one(
  args,
  strategy,
  model,
  data,
  metrics_path,
  say,
  *,
  model_options=None,
  devices=(),
  log_dir=None,
  eval_model=None,
) -> dict:
  """Trains one strategy; writes metrics every --log-every steps and each eval.

  The eval runs `eval_model` (`--model-fn`'s dict key, e.g. the model with dropout
  off) on the trained params, where given; else the model as it trains.
  """
  import jax
  import numpy as np
  from tqdm import tqdm

  from parstrat._src import banner
  from parstrat._src import run_data
  from parstrat._src import tensorboard_log
  from parstrat._src.history import History
  from parstrat._src.history import MetricsWriteError

  optimizer, lr_schedule = _optimizer(args, data)
  trainer, state, sample = _start(args, strategy, model, data, model_options, optimizer)
  evaluator, to_evaluator = trainer, lambda state: state
  if eval_model is not None and data.eval_batches is not None:
    evaluator = _eval_trainer(args, model, trainer, eval_model, data, model_options, optimizer)
    to_evaluator = _eval_state(trainer, evaluator, state, say)
  who = "the model" if evaluator is trainer else "the eval_model"  # (whose outputs are read)
  outputs = None if data.eval_batches is None else evaluator._abstract_outputs(sample)  # noqa: SLF001
  if getattr(outputs, "shape", None):
    # An eval label the model cannot predict counts as wrong: with the default loss
    # (training refuses such labels) it is a mistake in the data, named before training.
    outside = run_data.eval_label_outside(
      data.eval_batches(), len(outputs.shape), outputs.shape[-1], who
    )
    if outside and trainer.uses_default_loss and evaluator is trainer:
      raise UsageError(f"{outside}; training stops on such labels too")
    if outside:  # (a loss of one's own may skip them, e.g. -1 for padding)
      say(f"{outside}: the eval accuracy counts them as wrong")
  rows = _local_rows(args, trainer)
  name = strategy_name(trainer.strategy)
  for line in banner.lines(trainer, state, devices or jax.devices(), name):
    say(line)
  if jax.process_count() > 1:
    say(f"processes: {jax.process_count()}, {jax.local_device_count()} devices each")
  if trainer.plan.description:
    say(trainer.plan.description)
  used = int(trainer.mesh.devices.size)
  steps_per_epoch = data.steps_per_epoch
  # Throughput counts the rows each step trained on, over the steps that ran a program
  # already compiled: a step whose batch has a new shape (the first, a short last batch
  # of a user's dataset) compiles inside its time.
  timed_examples, timed_steps, timed_seconds = 0, 0, 0.0
  batch_shapes: set = set()
  step = 0
  skipped: list[int] = []  # this session's skipped steps
  # Sums that span checkpoints: kept in each checkpoint's meta, so that a resumed run's
  # epoch loss, logged rows and skipped count are those of the run it continues.
  running = {"epoch_loss": [0.0, 0], "window_loss": [0.0, 0], "skipped_steps": 0,
             "last_row_step": 0, "last_skipped_step": 0,
             "skipped_before_optimizer": 0}  # fmt: skip
  accuracy = None
  ckpt = None
  first_epoch, skip_batches = 0, 0
  resume_step = None
  # Where this run's metrics go, kept in its checkpoints (a resumed leg that writes them
  # elsewhere says where the run's are).
  where = {"metrics": None if metrics_path is None else str(pathlib.Path(metrics_path).resolve())}
  restored_where = where
  optimizer_start = 0  # the step the optimizer state (and its lr schedule) started at
  if args.checkpoint_dir:
    ckpt, restored, meta = _open_checkpoints(args, strategy, trainer, say, data)
    if restored is not None:
      state = restored
      step, first_epoch, skip_batches = meta["batches_seen"], meta["epoch"], meta["batch"]
      resume_step = step
      optimizer_start = step if args.fresh_optimizer else meta.get("optimizer_start", 0)
      running.update(meta.get("running", {}))  # older checkpoints: from the resume on
      if args.fresh_optimizer:  # (its schedule counts only the updates after this step)
        running["skipped_before_optimizer"] = running["skipped_steps"]
      earlier = meta.get("metrics")
      # (kept as saved in a checkpoint of this step again: the same meta writes nothing)
      restored_where = {"metrics": earlier} if "metrics" in meta else {}
      if (
        earlier is not None
        and metrics_path is not None
        and pathlib.Path(earlier) != pathlib.Path(metrics_path).resolve()
        and pathlib.Path(earlier).is_file()
        and not (pathlib.Path(metrics_path).is_file() and pathlib.Path(metrics_path).stat().st_size)
      ):  # (a leg without the first's --out or --metrics: its history went on elsewhere)
        say(
          f"the run's metrics up to step {step} are in {earlier}; this leg writes "
          f"{metrics_path} (give the first leg's --out or --metrics to continue that file)"
        )
      if first_epoch >= args.epochs or (args.steps is not None and step >= args.steps):
        ckpt.close()
        if args.steps is not None and step > args.steps:
          say(f"the run in {ckpt.directory} is at step {step}, past --steps {args.steps}: "
              "nothing to train")  # fmt: skip
        else:
          say(f"the run in {ckpt.directory} is already complete at step {step}: nothing to train")
        records = _complete_records(args, metrics_path, say, log_dir)
        return {"accuracy": accuracy, "records": records, "state": state, "skipped": [],
                "complete": True}  # fmt: skip
  try:
    history = History(metrics_path, resume_step=resume_step)
  except (OSError, ValueError) as e:
    if ckpt is not None:
      ckpt.close()
    # (read_history's errors name the file and line already)
    raise UsageError(f"metrics file {e}" if isinstance(e, ValueError) else f"metrics file "
                     f"{metrics_path}: {e}") from None  # fmt: skip
  records = history.records
  if any(r["step"] == resume_step and "loss" in r for r in records):
    # The run that saved it logged its last steps' row after the save.
    running["window_loss"], running["last_row_step"] = [0.0, 0], resume_step
  # A resumed run drops the curves' points after its checkpoint (TensorBoard's purge_step).
  purge = None if resume_step is None else resume_step + 1
  if (args.overwrite or (args.resume and resume_step is None)) and log_dir is not None:
    # the old run's curves go with it (a --compare strategy that starts: a stopped leg's)
    for old in pathlib.Path(log_dir).glob(f"{tensorboard_log.PREFIX}*"):
      old.unlink()
  board = tensorboard_log.ScalarWriter(log_dir, purge) if log_dir is not None else None

  def record(row: dict) -> None:
    try:
      history.append(row)
      if board is not None:
        board.write(row["step"], row)
    except OSError as e:  # (a MetricsWriteError, or the events file's)
      what = str(e) if isinstance(e, MetricsWriteError) else _events_unwritable(log_dir, e)
      newest = None if ckpt is None else ckpt.latest_step()
      kept = (
        ""
        if ckpt is None
        else "; no checkpoint was saved yet"
        if newest is None
        else f"; the newest checkpoint is step {newest}: {_after_the_fix(args)}"
      )
      raise TrainingError(f"{what}{kept}") from None

  unusable_eval: list[int] = []

  def evaluate(epoch: int) -> float | None:
    if data.eval_batches is None:
      return None
    # A dropout model's eval key: the same for a step on every run, and not a training key.
    rng = jax.random.fold_in(jax.random.key(args.seed + 1), step)
    accuracy = run_data.eval_accuracy(
      evaluator, to_evaluator(state), data.eval_batches(), args.batch_size, rows, rng=rng
    )
    if accuracy is not None:
      record({"step": step, "epoch": epoch + 1, "eval_accuracy": accuracy})
    elif not unusable_eval:  # (said once: the eval data was given, and nothing comes of it)
      unusable_eval.append(step)
      batches = data.eval_batches()
      if isinstance(batches, Sequence) and not batches:  # (a dataset function's sizes)
        say(
          f"eval: no accuracy: --dataset {args.dataset} gave no eval batches (at "
          f"--batch-size {args.batch_size})"
        )
      else:
        say(
          "eval: no accuracy: the eval data must be a non-empty iterable of (inputs, integer "
          f"labels) pairs whose labels match {who}'s outputs (one class score per label): "
          + run_data.no_accuracy_reason(batches, evaluator._abstract_outputs, who)  # noqa: SLF001
        )
    return accuracy

  if resume_step is not None:
    say(
      f"resumed from {ckpt.directory} at step {step} (epoch {first_epoch + 1}, "
      f"batch {skip_batches})"
    )
    if args.fresh_optimizer:
      say(f"--fresh-optimizer: the optimizer state starts anew at step {step}")

  def position(epoch: int, batch: int) -> dict:
    sums = {key: list(value) if isinstance(value, list) else value
            for key, value in running.items()}  # fmt: skip
    if batch == steps_per_epoch:  # a resume starts the next epoch
      epoch, batch = epoch + 1, 0
      sums["epoch_loss"] = [0.0, 0]
    return {"epoch": epoch, "batch": batch, "batches_seen": step, "seed": args.seed,
            "batch_size": args.batch_size, "config": _run_config(args, data),
            "running": sums, "optimizer_start": optimizer_start,
            **(restored_where if step == resume_step else where)}  # fmt: skip

  def save_checkpoint(epoch: int, batch: int, force: bool = False) -> None:
    """Saves the state if due (or `force`); a failed write stops the run in one line."""
    from parstrat._src.checkpoint import CheckpointError

    try:
      ckpt.save(trainer, state, position(epoch, batch), step=step, force=force)
    except CheckpointError as e:
      if e.__cause__ is None:  # (not the write: another run's checkpoints in the way)
        raise TrainingError(str(e)) from None
      raise TrainingError(f"{e}: {_after_the_fix(args)}") from None

  # Since the last logged row: its steps, rows and seconds (this session's only: a
  # rate needs both), and its finite losses in running["window_loss"].
  window_steps, window_examples, window_seconds = 0, 0, 0.0

  def optimizer_count() -> int:
    """The optimizer's update count at this step: a skipped update leaves it (and the
    learning-rate schedule) where it was."""
    skipped = running["skipped_steps"] - running["skipped_before_optimizer"]
    skipped -= running["last_skipped_step"] == step  # (this step's own skip, if any)
    return step - 1 - optimizer_start - skipped

  def log(epoch: int, loss: float, metrics: dict) -> None:
    """One row for the steps since the last: their mean loss and examples/s."""
    nonlocal window_steps, window_examples, window_seconds
    total, finite_steps = running["window_loss"]
    row = {
      "step": step,
      "epoch": epoch + 1,
      "loss": total / finite_steps if finite_steps else loss,
      "grad_norm": float(metrics["grad_norm"]),
      "examples_per_s": window_examples / window_seconds,
      "learning_rate": float(lr_schedule(optimizer_count())),
      "skipped_steps": running["skipped_steps"],
    }
    if running["last_skipped_step"] > running["last_row_step"]:
      row["skipped"] = True
    record(row)
    if args.no_progress and args.log_every > 1:
      say(f"step {step}: loss {row['loss']:.4f}, lr {row['learning_rate']:.3g}")
    running["window_loss"], running["last_row_step"] = [0.0, 0], step
    window_steps, window_examples, window_seconds = 0, 0, 0.0

  epoch = first_epoch
  batch_in_epoch = skip_batches
  stopped_early = False  # by a signal, before the run's end: exit 128 + the signal
  stop = _StopRequests(say).install()
  failed = False  # (then what closing fails to write is not said over why the run stopped)
  first_step = True  # (its warnings are said as lines: a loss that is not a mean, say)
  try:
    for epoch in range(first_epoch, args.epochs):
      if args.steps is not None and step >= args.steps:
        break
      batches = data.train_epoch(epoch)
      if epoch == first_epoch and skip_batches:
        batches = itertools.islice(batches, skip_batches, None)
      batch_in_epoch = skip_batches if epoch == first_epoch else 0
      bar = tqdm(
        batches,
        total=steps_per_epoch,
        desc=f"epoch {epoch + 1}/{args.epochs}",
        initial=batch_in_epoch,
        disable=args.no_progress or jax.process_index() != 0,
        leave=True,
      )
      if epoch != first_epoch or not skip_batches:
        running["epoch_loss"] = [0.0, 0]
      epoch_start_step = step
      for batch in bar:
        examples, shape = _batch_rows_and_shape(batch, args.batch_size)
        if jax.process_count() > 1:  # this process passes only its own rows of the batch
          batch = jax.tree.map(lambda x: np.asarray(x)[rows], batch)
        tick = time.perf_counter()
        try:
          # (the first step's warnings, e.g. a loss that is not a mean, as lines)
          with _warnings_as_lines(say) if first_step else contextlib.nullcontext():
            state, metrics = trainer.step(state, batch)
          first_step = False
        except (TypeError, ValueError) as e:  # (checked before the step ran: nothing lost)
          raise UsageError(
            f"step {step + 1}: batch {batch_in_epoch + 1} of epoch {epoch + 1}: {e}"
          ) from None
        step += 1
        if "labels_in_range" in metrics and not bool(metrics["labels_in_range"]):
          classes = trainer._num_classes(data.sample_inputs())  # noqa: SLF001
          raise TrainingError(
            f"step {step}: batch {batch_in_epoch + 1} of epoch {epoch + 1} has labels outside "
            f"[0, {classes}), the model's classes; stopping (nothing of this step is saved)"
          )
        loss = float(metrics["loss"])  # waits for the step
        seconds = time.perf_counter() - tick
        if shape in batch_shapes:
          timed_examples, timed_steps = timed_examples + examples, timed_steps + 1
          timed_seconds += seconds
        batch_shapes.add(shape)
        window_steps, window_examples = window_steps + 1, window_examples + examples
        window_seconds += seconds
        finite = bool(metrics["finite"])
        if not finite:
          if args.stop_on_nonfinite:
            raise TrainingError(
              f"step {step} (epoch {epoch + 1}): the loss or gradients are not finite "
              f"(loss {loss}); stopping before the update"
            )
          skipped.append(step)
          running["skipped_steps"] += 1
          running["last_skipped_step"] = step
        else:
          for key in ("window_loss", "epoch_loss"):
            total, finite_steps = running[key]
            running[key] = [total + loss, finite_steps + 1]
        batch_in_epoch += 1
        if step % args.log_every == 0:
          log(epoch, loss, metrics)
        if ckpt is not None:
          save_checkpoint(epoch, batch_in_epoch)
        if not args.no_progress:
          bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        if args.eval_every and step % args.eval_every == 0:
          accuracy = evaluate(epoch)
          if args.no_progress and accuracy is not None:
            say(f"step {step}: eval accuracy {accuracy:.4f}")
        if args.steps is not None and step >= args.steps:
          break
        if stop.signum is not None:
          break
      steps_done = args.steps is not None and step >= args.steps
      if stop.signum is not None and batch_in_epoch != steps_per_epoch and not steps_done:
        stopped_early = True
        break
      if stop.signum is not None and ckpt is not None:
        # Stopped at the epoch's (or the run's) last batch: its eval and summary come
        # first, and the checkpoint before them, so that a second signal loses neither.
        save_checkpoint(epoch, batch_in_epoch, force=True)
      if step == epoch_start_step and epoch == first_epoch and skip_batches:
        # Resumed from a checkpoint of the epoch's last batch, in data of no known
        # length (a function of the epoch): that epoch was done; the next one starts.
        say(f"epoch {epoch + 1} ended at batch {skip_batches}, where the checkpoint was taken")
        continue
      if step == epoch_start_step:  # e.g. a generator, exhausted by the previous epoch
        say(f"epoch {epoch + 1}: the train data had no batches left; stopping")
        break
      if not (args.eval_every and step % args.eval_every == 0):
        accuracy = evaluate(epoch)
      shown = "" if accuracy is None else f", eval accuracy {accuracy:.4f}"
      total, finite_steps = running["epoch_loss"]
      if finite_steps:
        mean = total / finite_steps
        if board is not None:
          board.write(step, {"epoch_loss": mean})
        say(f"epoch {epoch + 1}: loss {mean:.4f} (mean of {finite_steps} steps){shown}")
      else:
        say(f"epoch {epoch + 1}: no finite loss (every step was skipped){shown}")
      if args.steps is not None and step >= args.steps:
        break
      if stop.signum is not None:
        stopped_early = epoch < args.epochs - 1
        break
    if window_steps:  # the last steps, fewer than --log-every
      log(epoch, loss, metrics)
    if ckpt is not None:
      save_checkpoint(epoch, batch_in_epoch, force=True)
  except BaseException:
    failed = True
    raise
  finally:
    stop.close()
    try:
      with contextlib.suppress(OSError) if failed else contextlib.nullcontext():
        history.close()  # may raise (a full disk), the checkpointer closes anyway
    finally:
      if ckpt is not None:
        ckpt.close()
      if board is not None:
        _close_board(board, log_dir, quiet=failed)
  if stopped_early:
    import signal

    again = "run the same command again" if args.resume_if_exists else "continue with --resume"
    saved = (f"checkpoint saved in {ckpt.directory}; {again}"
             if ckpt is not None else "nothing saved (no --checkpoint-dir)")  # fmt: skip
    raise Interrupted(
      f"{signal.Signals(stop.signum).name} at step {step}, after the step: {saved}", stop.signum
    )
  if accuracy is not None:
    say(f"eval accuracy: {accuracy:.4f} ({data.description})")
  platform = trainer.mesh.devices.flat[0].platform
  if timed_steps:
    throughput = f"{timed_examples / timed_seconds:,.0f} examples/s over the "
    throughput += f"{timed_steps:,} step{'s' * (timed_steps != 1)} "
    if len(batch_shapes) == 1:
      throughput += "after the first (compiling) one"
    else:  # e.g. a short last batch
      throughput += (
        f"({timed_examples:,} examples) that reused a compiled step; not timed: the "
        f"{len(batch_shapes)} steps that compiled for a new batch shape"
      )
  elif len(batch_shapes) > 1:
    throughput = (
      f"not measured (each of the {len(batch_shapes)} steps compiled for a new batch shape)"
    )
  else:
    throughput = "not measured (only the first, compiling, step ran)"
  say(f"throughput: {throughput}, on {used} of {len(devices) or used} {platform} devices")
  say(f"mesh: {dict(trainer.mesh.shape)}")
  if running["skipped_steps"]:
    line = f"skipped {running['skipped_steps']} update(s) with non-finite loss or gradients"
    earlier = running["skipped_steps"] - len(skipped)  # before a resume
    if skipped:
      line += f": steps {skipped}" + (f" since the resume, {earlier} before it" * bool(earlier))
    else:
      line += ", all before the resume"
    say(line)
  return {"accuracy": accuracy, "records": records, "state": state, "skipped": skipped}


def schedule(args: argparse.Namespace) -> None:
  from parstrat._src.hybrid import schedule_for
  from parstrat._src.pipeline import schedule as schedule_lib

  try:  # the table the strategies run for these options
    table = schedule_for(
      args.schedule, args.stages, args.microbatches, args.virtual_stages, args.exchange_every
    )
  except ValueError as e:
    raise UsageError(str(e)) from None
  # The files first: a reader that stops early (`| head`) must not cost them.
  for key in ("out", "csv"):
    _check_not_empty(args, key)
  wrote = []
  if args.out:
    from parstrat._src.pipeline import drawing

    if pathlib.Path(args.out).is_dir():
      raise UsageError(f"--out {args.out} is a directory; give an image file, e.g. schedule.png")
    try:
      wrote.append(drawing.draw_schedule(table, args.out))
    except ValueError as e:
      raise UsageError(f"--out: {e}") from None
    except OSError as e:
      raise UsageError(f"cannot write {args.out}: {e.strerror or e}") from None
  if args.csv:
    from parstrat._src.pipeline import schedule_csv

    try:
      with open(args.csv, "w", encoding="utf-8") as f:
        f.write(schedule_csv.to_csv(table))
    except OSError as e:
      raise UsageError(f"cannot write {args.csv}: {e.strerror or e}") from None
    K = table.exchange_every
    wrote.append(
      args.csv
      + (f" (ticks only: read it back with pipeline.from_csv(text, exchange_every={K}))" * (K > 1))
    )
  print(table)
  theory = table.theoretical_bubble()
  print(
    f"bubble fraction: {table.bubble_fraction():.4f} idle share of the tick table, "
    + (
      f"{theory:.4f} theory {schedule_lib.THEORY[table.name].formula}"
      if theory is not None
      else table.theory_text()
    )
    + f"; peak live activations per {'stage' if table.virtual_stages == 1 else 'device'}: "
    + f"{table.max_live_activations()}"
  )
  print(
    "lock-step time (each exchange waits for the slowest device), in forwards of one "
    f"stage: {table.lockstep_time('recompute'):g} recomputing activations, "
    f"{table.lockstep_time('save'):g} saving them"
  )
  for path in wrote:
    print(f"wrote {path}")


def list_strategies() -> None:
  import parstrat

  rows = []
  for name in parstrat.available():
    cls = parstrat._src.registry.lookup(name)
    doc = (cls.__doc__ or "").strip().splitlines()
    axes = "chosen" if cls.deferred else ", ".join(cls.axis_names) or "-"
    rows.append((name, f"axes: {axes}", doc[0] if doc else ""))
  widths = [max(16, *(len(r[0]) for r in rows)), max(26, *(len(r[1]) for r in rows))]
  for name, axes, doc in rows:  # (columns as wide as a strategy of your own needs)
    print(f"{name:<{widths[0]}} {axes:<{widths[1]}} {doc}".rstrip())


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line; returns its exit code.

  A process of a multi-process run that fails leaves at once (`os._exit`):
  JAX's exit handler would otherwise wait at a shutdown barrier for the others,
  while they wait for it in their next collective, for minutes. Without it
  they stop when its heartbeat does.
  """
  try:
    code = _main(argv)
  except BaseException:
    if not _joined_several():
      raise
    import traceback

    import jax

    traceback.print_exc()
    error = sys.exc_info()[1]
    first = (str(error).strip().splitlines() or [""])[0]
    hint = (
      " (a collective failed: another process has probably stopped; see its output)"
      if isinstance(error, jax.errors.JaxRuntimeError) and "gloo" in str(error).lower()
      else ""
    )
    print(
      f"parstrat: process {jax.process_index()} of {jax.process_count()} stops: "
      f"{type(error).__name__}: {first}{hint}",
      file=sys.stderr,
    )
    code = 1
  if code and _joined_several():
    import os

    import jax

    from parstrat._src import distributed

    sys.stdout.flush()
    sys.stderr.flush()
    if distributed.stops_on_every_process() and jax.process_index() == 0:
      # The others stop on the same error: let them say so before the coordination
      # service, which this process serves, goes (their JAX client then aborts them).
      time.sleep(LEADER_GRACE_S)
    os._exit(code)
  return code


def _close_board(board, log_dir, quiet: bool) -> None:
  """Closes the TensorBoard writer; what it cannot write (a full disk) is one line, or
  nothing when the run already stops on an error (`quiet`) that it would hide."""
  try:
    board.close()
  except OSError as e:
    if not quiet:
      raise TrainingError(_events_unwritable(log_dir, e)) from None
    # (else the error the run stops on is the one to say)


def _events_unwritable(log_dir, error: OSError) -> str:
  return f"cannot write the TensorBoard events in {log_dir} ({error.strerror or error})"


def _after_the_fix(args: argparse.Namespace) -> str:
  """How a run stopped by a write that failed goes on from its newest checkpoint."""
  again = "the same command goes on" if args.resume_if_exists else "--resume goes on"
  return f"once the cause is fixed, {again} from there"


def _joined_several() -> bool:
  """True in a process of a multi-process JAX run (without importing JAX)."""
  if "jax" not in sys.modules:
    return False
  import jax

  return jax.distributed.is_initialized() and jax.process_count() > 1


def _main(argv: Sequence[str] | None) -> int:
  from parstrat._src.history import MetricsWriteError

  parser = build_parser()
  try:
    args = parse_args(parser, argv)
  except UsageError as e:
    print(f"parstrat train: error: {e}", file=sys.stderr)
    return 2
  try:
    if args.command == "train":
      train(args)
    elif args.command == "schedule":
      schedule(args)
    elif args.command == "list":
      _import_modules(args)
      list_strategies()
    sys.stdout.flush()  # inside the try: a closed pipe is found here, not at exit
  except UsageError as e:
    print(f"parstrat {args.command}: error: {e}", file=sys.stderr)
    return 2
  except (TrainingError, MetricsWriteError) as e:  # (the latter closing the metrics file)
    print(f"parstrat {args.command}: stopped: {e}", file=sys.stderr)
    return 1
  except (Interrupted, KeyboardInterrupt) as e:
    if not isinstance(e, Interrupted):  # outside a training loop: loading, compiling, ...
      where = "in a process of several" if _joined_several() else "outside a training step"
      e = Interrupted(  # noqa: PLW2901
        f"SIGINT {where}; checkpoints already written are kept", 2
      )
    print(f"parstrat {args.command}: interrupted: {e}", file=sys.stderr)
    return 128 + e.signum
  except BrokenPipeError:  # `parstrat ... | head`: the reader left; no traceback
    import os

    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own advice
    return 141  # 128 + SIGPIPE, as a shell reports a command its pipe ended
  return 0
