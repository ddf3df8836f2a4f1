"""Run configuration for `parstrat train`: TOML files and `module:function` entry points.

A config file holds the command line's flags as keys (`batch-size = 128` or
`batch_size = 128`); flags given on the command line override it. The model,
the dataset and the optimizer are named by strings so that they fit in such a
file: `package.module:function` or `path/to/file.py:function`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import pathlib
import sys
import tomllib
from collections.abc import Sequence
from typing import Any

from parstrat._src import messages

#: Flags that are not config keys: those that make no sense inside a config file,
#: and `progress`, which only undoes a file's `no-progress = true` from the command
#: line (as a key, `progress = false` would read as "hide it" and do nothing).
NOT_IN_CONFIG = ("config", "help", "progress")


class ConfigError(ValueError):
  """A bad config file or entry point; the message is one line naming the value."""


def did_you_mean(word: str, choices: Sequence[str]) -> str:
  """`"; did you mean 'x'?"` for the closest of `choices`, or "" when none is close.

  Example:
    >>> did_you_mean("batchsize", ["batch-size", "seed"])
    "; did you mean 'batch-size'?"
  """
  match = messages.closest(word, choices)
  return f"; did you mean {match!r}?" if match else ""


def load_toml(path: str | pathlib.Path) -> dict[str, Any]:
  """Reads a TOML file into a dict (a `[train]` table, if present, is the config).

  Raises:
    ConfigError: if the file cannot be read or is not valid TOML, or mixes a
      `[train]` table with keys outside it.
  """
  try:
    with open(path, "rb") as f:
      data = tomllib.load(f)
  except OSError as e:
    raise ConfigError(f"--config {path}: cannot read it ({e.strerror or e})") from None
  except tomllib.TOMLDecodeError as e:
    raise ConfigError(f"--config {path}: not valid TOML ({e})") from None
  if isinstance(data.get("train"), dict):
    if set(data) == {"train"}:
      return data["train"]
    others = ", ".join(sorted(set(data) - {"train"}))
    raise ConfigError(
      f"--config {path}: keys both in a [train] table and outside it ({others}); put them all "
      "in [train], or all at the top level without one"
    )
  return data


def _long_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
  options = {}
  for action in parser._actions:  # noqa: SLF001 - argparse has no public listing
    for option in action.option_strings:
      if option.startswith("--"):
        options[option[2:]] = action
  return options


def config_to_argv(
  config: dict[str, Any], parser: argparse.ArgumentParser, source: str
) -> list[str]:
  """Turns a config dict into the flags it stands for, checked like the flags themselves.

  Keys are flag names without the dashes, with `-` or `_`. A `true` boolean
  key is the flag, `false` leaves it out; a list fills a flag that takes
  several values.

  Args:
    config: from `load_toml`.
    parser: the subcommand's parser (its long options are the valid keys).
    source: the file name, for messages.

  Returns:
    Command-line tokens, to be parsed before the real command line so that
    the flags given there win.

  Raises:
    ConfigError: for an unknown key (with the closest valid one) or a bad value.

  Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> _ = p.add_argument("--batch-size", type=int)
    >>> config_to_argv({"batch_size": 64}, p, "run.toml")
    ['--batch-size', '64']
  """
  options = _long_options(parser)
  # A `--no-x` of an on/off flag is the command line's way to undo a file's `x = true`;
  # as a key of its own, `no-x = false` would do nothing: the file writes `x = false`.
  negated = {
    k
    for k, a in options.items()
    if isinstance(a, argparse.BooleanOptionalAction) and k[:3] == "no-"
  }
  valid = sorted(k for k in options if k not in NOT_IN_CONFIG and k not in negated)
  argv: list[str] = []
  for key, value in config.items():
    name = key.replace("_", "-")
    if name not in valid:
      raise ConfigError(f"{source}: unknown key {key!r}{did_you_mean(name, valid)}")
    action = options[name]
    flag = f"--{name}"
    where = f"{source}: {key} = {toml_value(value)}"  # (as the file writes it)
    if isinstance(value, dict) and action.dest == "strategy_options":
      # ([strategy-option] hosts = 4: each key one KEY=VALUE, the value in TOML again)
      argv += [flag, *(f"{k}={toml_value(v)}" for k, v in value.items())]
      continue
    if isinstance(value, dict):
      raise ConfigError(f"{where}: expected a value, got a table")
    if action.nargs == 0:  # store_true and friends
      if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false")
      argv += [flag] if value else []
      continue
    values = value if isinstance(value, list) else [value]
    if isinstance(value, list) and action.nargs not in ("+", "*"):
      raise ConfigError(f"{where}: expected one value, got a list")
    if not values and action.nargs == "+":
      raise ConfigError(f"{where}: expected at least one value")
    if any(isinstance(v, (bool, dict, list)) for v in values):
      several = action.nargs in ("+", "*")
      raise ConfigError(
        f"{where}: expected {'numbers or strings' if several else 'a number or a string'}"
      )
    tokens = [str(v) for v in values]
    for token in tokens:
      try:
        converted = action.type(token) if action.type else token
      except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None
      if action.choices is not None and converted not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{where}: choose one of {choices}")
    argv += [flag, *tokens]
  return argv


def toml_value(value: Any) -> str:
  """`value` written as TOML (a string quoted, a bool as true/false, a table inline).

  Example:
    >>> toml_value({"hosts": 4, "fast": True, "name": "x", "sizes": [1, 2]})
    '{hosts = 4, fast = true, name = "x", sizes = [1, 2]}'
  """
  import json

  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, dict):
    return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
  if isinstance(value, list):
    return "[" + ", ".join(map(toml_value, value)) + "]"
  return json.dumps(value) if isinstance(value, str) else str(value)


def _import_file(path: pathlib.Path):
  name = f"_parstrat_user_{path.stem}_{abs(hash(str(path.resolve())))}"
  if name in sys.modules:
    return sys.modules[name]
  spec = importlib.util.spec_from_file_location(name, path)
  if spec is None or spec.loader is None:
    raise ConfigError(f"cannot import {path} as Python")
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses and pickling look modules up by name
  sys.path.insert(0, str(path.parent))  # so the file can import its neighbours
  try:
    spec.loader.exec_module(module)
  except BaseException:
    del sys.modules[name]
    raise
  finally:
    sys.path.remove(str(path.parent))
  return module


def _is_file(target: str) -> bool:
  """Whether an entry point's target names a file (`path/to/file.py`), not a module."""
  return target.endswith(".py") or "/" in target or "\\" in target


@contextlib.contextmanager
def _cwd_on_path():
  """The current directory on `sys.path` meanwhile, as `python -m` has it."""
  cwd = str(pathlib.Path.cwd())
  added = cwd not in sys.path
  if added:
    sys.path.insert(0, cwd)
  try:
    yield
  finally:
    if added:
      sys.path.remove(cwd)


def _import(target: str, flag: str, spec: str):
  if _is_file(target):
    path = pathlib.Path(target)
    if not path.is_file():
      raise ConfigError(f"{flag} {spec!r}: no file {target}")
    return _import_file(path)
  with _cwd_on_path():
    try:
      return importlib.import_module(target)
    except ModuleNotFoundError as e:
      if e.name and target.startswith(e.name):
        raise ConfigError(f"{flag} {spec!r}: no module named {e.name!r}") from None
      raise


def import_module(target: str, flag: str, spec: str | None = None) -> Any:
  """Imports `package.module` (the current directory on the path) or `path/to/file.py`.

  `spec` is what the user wrote, for messages (default: `target`).

  Raises:
    ConfigError: naming what is missing, or why importing it failed.
  """
  spec = target if spec is None else spec
  try:
    return _import(target, flag, spec)
  except ConfigError:
    raise
  except Exception as e:  # noqa: BLE001 - the user's code failed: say where, in one line
    raise ConfigError(f"{flag} {spec!r}: importing {target} failed: {type(e).__name__}: {e}") from e


def entry_point_source(spec: Any) -> str | None:
  """The file and name an entry point loads (`/absolute/file.py:name`), if found unimported.

  `path/to/file.py:name` and `module:name` of the same file give the same answer,
  however the path was written. A module is looked up as `load_object` imports
  it (the current directory on the path); a submodule only where its package is
  imported already.

  Args:
    spec: what `load_object` takes (anything else: None).

  Returns:
    The resolved file and the name, or None if the spec names no file that
    can be found that way (a built-in dataset's name, a missing file).

  Example:
    >>> entry_point_source("mnist") is None
    True
  """
  target, sep, attr = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
  if not sep or not target or not attr:
    return None
  if _is_file(target):
    origin = target
  elif "." in target and target.rpartition(".")[0] not in sys.modules:
    origin = None  # (finding it would import its package)
  else:
    with _cwd_on_path():
      try:
        origin = getattr(importlib.util.find_spec(target), "origin", None)
      except (ImportError, ValueError):
        origin = None
  if not origin or not pathlib.Path(origin).is_file():
    return None
  return f"{pathlib.Path(origin).resolve()}:{attr}"


def load_object(spec: str, flag: str) -> Any:
  """Loads `package.module:name` or `path/to/file.py:name` (dots in `name` go deeper).

  A module is imported with the current directory on the path, as `python -m`
  would; a file is imported by path.

  Args:
    spec: the entry point.
    flag: the flag it came from, for messages (e.g. "--model-fn").

  Returns:
    The object.

  A file given to `parstrat train` should not start JAX's backend when it is
  imported (e.g. guard `parstrat.testing.use_cpu_devices` under
  `if __name__ == "__main__":`): the command line has set the devices already.

  Raises:
    ConfigError: naming what is missing, or why importing it failed.
  """
  target, sep, attr = spec.rpartition(":")
  if not sep or not target or not attr:
    raise ConfigError(
      f"{flag} {spec!r}: expected 'package.module:function' or 'path/to/file.py:function'"
    )
  obj = import_module(target, flag, spec)
  for part in attr.split("."):
    if not hasattr(obj, part):
      names = [n for n in dir(obj) if not n.startswith("_")]
      raise ConfigError(
        f"{flag} {spec!r}: {target} has no attribute {part!r}{did_you_mean(part, names)}"
      )
    obj = getattr(obj, part)
  return obj


def call_with_known(fn, **kwargs) -> Any:
  """Calls `fn` with those of `kwargs` that its signature names (a `**kw` catch-all gets none).

  Raises:
    ConfigError: if `fn` needs an argument besides those (checked before the call).

  Example:
    >>> call_with_known(lambda batch_size, **config: (batch_size, config), batch_size=8, seed=0)
    (8, {})
  """
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):
    return fn()
  params = signature.parameters
  named = {
    name
    for name, p in params.items()
    if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
  }
  known = {k: v for k, v in kwargs.items() if k in named}
  try:
    signature.bind(**known)
  except TypeError as e:  # (before the call: a TypeError inside it keeps its traceback)
    raise ConfigError(
      f"cannot call {getattr(fn, '__qualname__', fn)}: {e} (it is called with those of "
      f"{', '.join(kwargs)} that it names)"
    ) from None
  return fn(**known)


def load_model(spec: str, **kwargs) -> tuple[Any, dict[str, Any]]:
  """The user's model from `--model-fn`: `(hk.Transformed, options for the trainer)`.

  The entry point is a function returning an `hk.Transformed`, a pair
  `(hk.Transformed, loss_fn)`, or a dict `{"model": hk.Transformed, ...}`
  whose other keys are keyword arguments of the trainer (`strategy(model,
  optimizer, **options)`, e.g. `loss_fn`); it may itself be the
  `hk.Transformed`. The dict's `eval_model` (the model as evaluated, e.g.
  with dropout off: the same params) is not the trainer's; the caller takes it
  out of `options`. The function is called with those of `kwargs` (e.g.
  `seed`) that it names.

  Returns:
    `(model, options)`; `options` is `{}` or holds `loss_fn` and the rest.

  Raises:
    ConfigError: if it returns something else.
  """
  obj = load_object(spec, "--model-fn")
  is_model = lambda m: callable(getattr(m, "init", None)) and callable(getattr(m, "apply", None))  # noqa: E731
  try:
    result = obj if is_model(obj) else call_with_known(obj, **kwargs) if callable(obj) else obj
  except ConfigError as e:  # an argument besides those it is given
    raise ConfigError(f"--model-fn {spec!r}: {e}") from None
  options: dict[str, Any] = {}
  if isinstance(result, tuple) and len(result) == 2 and is_model(result[0]):
    result, options = result[0], {"loss_fn": result[1]}
  elif isinstance(result, dict) and "model" in result:
    options = {k: v for k, v in result.items() if k != "model"}
    result = result["model"]
  if options.get("loss_fn") is not None and not callable(options["loss_fn"]):
    raise ConfigError(
      f"--model-fn {spec!r}: the loss it returned is not callable: {options['loss_fn']!r}"
    )
  if "eval_model" in options and not is_model(options["eval_model"]):
    raise ConfigError(
      f"--model-fn {spec!r}: its eval_model is not a model (no init and apply): "
      f"{options['eval_model']!r}"
    )
  if not is_model(result):
    raise ConfigError(
      f"--model-fn {spec!r} gave {type(result).__name__}; expected an hk.Transformed "
      "(from hk.transform), a pair (hk.Transformed, loss_fn) or a dict with a 'model'"
    )
  return result, options
