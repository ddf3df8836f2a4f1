"""The start-up banner of `parstrat train`: what runs where, and what is left idle."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class Layout:
  """What a trainer's layout uses, read from its mesh and its state's shardings.

  Attributes:
    used: the devices in the mesh.
    available: the devices the run could have used.
    mesh: axis name -> size.
    param_bytes: parameter bytes on one device (the largest shard set).
    opt_bytes: optimizer-state bytes on one device.
    batch_split: how many ways the batch's leading axis is split.
    params_split: whether any parameter is sharded (not replicated).
  """

  used: int
  available: int
  mesh: dict[str, int]
  param_bytes: int
  opt_bytes: int
  batch_split: int
  params_split: bool

  @property
  def idle(self) -> int:
    return self.available - self.used


def _per_device_bytes(tree: Any) -> int:
  from parstrat._src.auto import _per_device_bytes as leaf_bytes

  return sum(leaf_bytes(x) for x in jax.tree.leaves(tree))


def layout(trainer, state, available: Sequence[jax.Device]) -> Layout:
  """Reads the `Layout` of an initialised trainer and its state."""
  params = jax.tree.leaves(state.params)
  return Layout(
    used=int(trainer.mesh.devices.size),
    available=len(available),
    mesh={str(k): int(v) for k, v in trainer.mesh.shape.items()},
    param_bytes=_per_device_bytes(state.params),
    opt_bytes=_per_device_bytes(state.opt_state),
    batch_split=trainer._batch_split(),  # noqa: SLF001
    params_split=any(not x.sharding.is_fully_replicated for x in params),
  )


def options(trainer) -> list[str]:
  """The trainer's active options: precision, accumulate, pipeline schedule and microbatches."""
  shown = []
  if trainer.precision is not None:
    shown.append(f"precision={trainer.precision}")
  if trainer.accumulate > 1:
    shown.append(f"accumulate={trainer.accumulate}")
  strategy = trainer.strategy
  if trainer.mesh.shape.get("stage", 1) > 1:  # a pipeline: its schedule and microbatches
    if getattr(strategy, "schedule", None) is not None:
      shown.append(f"schedule={strategy.schedule}")
    default = " (default: one per stage)" if getattr(strategy, "microbatches", 0) is None else ""
    shown.append(f"microbatches={trainer.plan.batch_multiple}{default}")
  if trainer.skip_nonfinite:
    shown.append("non-finite steps skipped")
  return shown


def warnings(found: Layout, strategy_name: str) -> list[str]:
  """Warnings for devices left idle and for a layout that parallelises nothing."""
  lines = []
  if found.idle > 0:
    lines.append(
      f"warning: {found.idle} of {found.available} devices idle: the mesh "
      f"{_mesh_text(found.mesh)} uses {found.used}"
    )
  if found.used > 1 and found.batch_split == 1 and not found.params_split:
    lines.append(
      f"warning: {strategy_name} parallelises nothing here: no parameter is split and the "
      f"batch is not split, so each of the {found.used} devices repeats the whole step"
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
