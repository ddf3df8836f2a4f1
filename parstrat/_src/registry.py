"""The strategy registry: names to `Strategy` classes."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any
from typing import TypeVar

from parstrat._src import messages

_REGISTRY: dict[str, type] = {}

S = TypeVar("S", bound=type)


def register(name: str, *, overwrite: bool = False) -> Callable[[S], S]:
  """Registers a strategy class under `name`; use as a class decorator.

  Args:
    name: the name users pass to `parstrat.get`.
    overwrite: replace a strategy already registered under `name`.

  Returns:
    A decorator that registers the class and returns it unchanged.

  Raises:
    ValueError: if `name` is empty, holds spaces or commas or starts with
      "-", or is taken and
      `overwrite` is False (a class of the same module and qualified name as
      the registered one counts as the same class seen again, e.g. its module
      reloaded, and replaces it).
    TypeError: if the decorated object is not a `parstrat.Strategy` subclass,
      or leaves an abstract method (`make_plan`) unimplemented; for
      `@parstrat.register` without a name.

  Example:
    >>> import parstrat
    >>> _ = parstrat.register("dp")(parstrat.DataParallel)  # a second name
    >>> parstrat.get("dp", data=2)
    DataParallel(data=2)
    >>> parstrat.unregister("dp")

    See examples/custom_strategy.py for a strategy written from scratch.
  """
  if isinstance(name, type):  # `@parstrat.register` without a name
    raise TypeError(
      f"@parstrat.register needs a name: write @parstrat.register('my_name') above "
      f"class {name.__qualname__}."
    )
  if not isinstance(name, str) or not name:
    raise ValueError(f"A strategy name must be a non-empty string, got {name!r}.")
  if "," in name or any(c.isspace() for c in name) or name.startswith("-"):
    # (`parstrat train --compare a,b` splits names on commas and strips them;
    # `--strategy -x` reads -x as a flag)
    raise ValueError(
      f"A strategy name may not hold spaces or commas or start with '-', got {name!r}."
    )

  def decorator(cls: S) -> S:
    from parstrat._src.strategy import Strategy  # noqa: PLC0415 (import cycle)

    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
      raise TypeError(
        f"@parstrat.register({name!r}) needs a subclass of parstrat.Strategy, got {cls!r}."
      )
    if inspect.isabstract(cls):  # (else `get` fails later, and "auto" skips it silently)
      missing = ", ".join(sorted(cls.__abstractmethods__))
      raise TypeError(
        f"@parstrat.register({name!r}): {cls.__qualname__} does not implement {missing}."
      )
    if name in _REGISTRY and not overwrite and not _same_definition(_REGISTRY[name], cls):
      raise ValueError(
        f"A strategy is already registered as {name!r} ({_REGISTRY[name].__qualname__}); "
        "pass overwrite=True to replace it."
      )
    _REGISTRY[name] = cls
    return cls

  return decorator


def _same_definition(a: type, b: type) -> bool:
  """True for one class seen twice (a module imported again or reloaded)."""
  return a is b or (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def unregister(name: str) -> None:
  """Removes the strategy registered under `name`.

  Raises:
    KeyError: if no strategy is registered under `name`.
  """
  if name not in _REGISTRY:
    raise KeyError(_unknown_name_message(name))
  del _REGISTRY[name]


def available() -> list[str]:
  """Returns the sorted names of every registered strategy."""
  return sorted(_REGISTRY)


def lookup(name: str) -> type:
  """Returns the strategy class registered under `name`.

  Raises:
    KeyError: if `name` is not registered; the message lists the registered
      names and the closest match.
  """
  try:
    return _REGISTRY[name]
  except (KeyError, TypeError):
    raise KeyError(_unknown_name_message(name)) from None


def get(name: str, /, **config: Any):
  """Builds the strategy registered under `name` with keyword `config`.

  `parstrat.get("data_parallel", data=4)` is `parstrat.DataParallel(data=4)`.

  Args:
    name: a registered strategy name (see `parstrat.available()`).
    **config: the strategy's keyword arguments.

  Returns:
    A `parstrat.Strategy` instance; call it with a model and an optimizer.

  Raises:
    KeyError: if `name` is not registered.
    TypeError, ValueError: if `config` does not fit the strategy.

  Example:
    >>> import parstrat
    >>> parstrat.get("data_parallel", data=2)
    DataParallel(data=2)
  """
  cls = lookup(name)
  options, any_keyword = options_of(cls)
  if not any_keyword:
    unknown = sorted(set(config) - set(options))
    if unknown:
      close = messages.closest(unknown[0], options)
      raise TypeError(
        f"Strategy {name!r} has no option {', '.join(map(repr, unknown))}; "
        f"its options are {', '.join(options)}." + (f" Did you mean {close!r}?" if close else "")
      )
  return cls(**config)


def options_of(cls: type) -> tuple[list[str], bool]:
  """The keyword options a strategy class takes, from its constructor's signature.

  For a dataclass, its fields that `__init__` takes; for a class with an
  `__init__` of its own (or a mixin's), that one's parameters.

  Returns:
    `(names, takes_any)`: the parameter names, and whether it also takes
    `**kwargs` (then any name may be passed on).
  """
  try:
    parameters = inspect.signature(cls).parameters.values()
  except (TypeError, ValueError):  # (no signature to read: let the class decide)
    return [], True
  names = [p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
  return names, any(p.kind == p.VAR_KEYWORD for p in parameters)


def _unknown_name_message(name: object) -> str:
  names = available()
  message = f"Unknown strategy {name!r}; registered strategies: {', '.join(names) or 'none'}."
  close = messages.closest(str(name), names)
  if close:
    message += f" Did you mean {close!r}?"
  return message
