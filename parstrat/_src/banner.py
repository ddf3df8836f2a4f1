"""The start-up banner of `parstrat train`: what runs where, and what is left idle."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from parstrat._src import messages


@dataclasses.dataclass(frozen=True)
class Layout:
  """What a trainer's layout uses, read from its mesh and its state's shardings.

  Attributes:
    used: the devices in the mesh.
    available: the devices the run could have used.
    mesh: axis name -> size.
    param_bytes: parameter bytes on one device (the largest shard set).
    opt_bytes: optimizer-state bytes on one device.
    split_axes: the mesh axes that split the batch or at least `MIN_SHARE` of the
      per-device parameter and optimizer state (a buffer of padding does not count).
  """

  used: int
  available: int
  mesh: dict[str, int]
  param_bytes: int
  opt_bytes: int
  split_axes: frozenset[str]

  @property
  def idle(self) -> int:
    return self.available - self.used


#: The share of the per-device state an axis must split to count as splitting it.
MIN_SHARE = 0.01


def _per_device_bytes(tree: Any) -> int:
  from parstrat._src.auto import _per_device_bytes as leaf_bytes

  return sum(leaf_bytes(x) for x in jax.tree.leaves(tree))


def _spec_axes(spec) -> set[str]:
  axes = set()
  for entry in spec or ():
    if isinstance(entry, str):
      axes.add(entry)
    elif isinstance(entry, tuple):
      axes.update(entry)
  return axes


def layout(trainer, state, available: Sequence[jax.Device]) -> Layout:
  """Reads the `Layout` of an initialised trainer and its state."""
  from parstrat._src.auto import _per_device_bytes as leaf_bytes

  leaves = jax.tree.leaves((state.params, state.opt_state))
  total = sum(leaf_bytes(x) for x in leaves)
  on_axis: dict[str, int] = {}
  for x in leaves:
    if not x.sharding.is_fully_replicated:
      for axis in _spec_axes(getattr(x.sharding, "spec", None)):
        on_axis[axis] = on_axis.get(axis, 0) + leaf_bytes(x)
  split = _spec_axes(trainer.plan.batch_spec)
  split |= {axis for axis, size in on_axis.items() if size >= MIN_SHARE * total}
  return Layout(
    used=int(trainer.mesh.devices.size),
    available=len(available),
    mesh={str(k): int(v) for k, v in trainer.mesh.shape.items()},
    param_bytes=_per_device_bytes(state.params),
    opt_bytes=_per_device_bytes(state.opt_state),
    split_axes=frozenset(split),
  )


def options(trainer) -> list[str]:
  """The trainer's active options: precision, accumulate, a pipeline's schedule options."""
  shown = []
  if trainer.precision is not None:
    shown.append(f"precision={trainer.precision}")
  if trainer.accumulate > 1:
    shown.append(f"accumulate={trainer.accumulate}")
  strategy = trainer.strategy
  if trainer.mesh.shape.get("stage", 1) > 1:  # a pipeline: its schedule and microbatches
    if getattr(strategy, "schedule", None) is not None:
      shown.append(f"schedule={strategy.schedule}")
    for name, default in (
      ("virtual_stages", None),
      ("activations", "recompute"),
      ("exchange_every", None),
      ("unroll", False),
    ):
      value = getattr(strategy, name, default)
      if value != default:
        shown.append(f"{name}={value}")
    default = messages.microbatches_default(strategy)
    shown.append(f"microbatches={trainer.plan.batch_multiple}{default}")
  if trainer.skip_nonfinite:
    shown.append("non-finite steps skipped")
  return shown


def warnings(found: Layout, strategy_name: str) -> list[str]:
  """Warnings for devices left idle and for mesh axes that split nothing.

  Example:
    >>> found = Layout(used=6, available=8, mesh={"stage": 2, "model": 3}, param_bytes=0,
    ...                opt_bytes=0, split_axes=frozenset({"stage"}))
    >>> for line in warnings(found, "hybrid"):
    ...   print(line)
    warning: 2 of 8 devices idle: the mesh stage=2 x model=3 uses 6
    warning: mesh axis 'model' (3 devices) splits (almost) nothing here: the same work on each
  """
  lines = []
  if found.idle > 0:
    lines.append(
      f"warning: {found.idle} of {found.available} devices idle: the mesh "
      f"{_mesh_text(found.mesh)} uses {found.used}"
    )
  idle_axes = [a for a, n in found.mesh.items() if n > 1 and a not in found.split_axes]
  if idle_axes and len(idle_axes) == sum(n > 1 for n in found.mesh.values()):
    lines.append(
      f"warning: {strategy_name} parallelises (almost) nothing here: no mesh axis splits the "
      f"batch or {MIN_SHARE:.0%} of the state, so each of the {found.used} devices repeats the "
      "whole step"
    )
  else:
    for axis in idle_axes:
      lines.append(
        f"warning: mesh axis '{axis}' ({found.mesh[axis]} devices) splits (almost) nothing "
        "here: the same work on each"
      )
  return lines


def _mesh_text(mesh: dict[str, int]) -> str:
  return " x ".join(f"{axis}={size}" for axis, size in mesh.items())


def lines(trainer, state, available: Sequence[jax.Device], strategy_name: str) -> list[str]:
  """The banner: devices used and idle, mesh, options, per-device state, warnings.

  Args:
    trainer: an initialised `Trainer`.
    state: its `TrainState`.
    available: the devices the run was given.
    strategy_name: the registered name, for the warnings.

  Returns:
    Lines to print.
  """
  from parstrat._src.auto import format_bytes

  found = layout(trainer, state, available)
  platform = available[0].platform if available else "?"
  devices = f"devices: {found.used} of {found.available} {platform} devices used"
  if found.idle:
    devices += f", {found.idle} idle"
  out = [
    devices,
    f"mesh: {_mesh_text(found.mesh)} ({trainer.strategy!r})",
    f"options: {', '.join(options(trainer)) or 'none'}",
    f"state per device: params {format_bytes(found.param_bytes)} + optimizer "
    f"{format_bytes(found.opt_bytes)}",
  ]
  return out + warnings(found, strategy_name)
