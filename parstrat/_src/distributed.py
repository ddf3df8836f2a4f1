"""Multi-controller JAX: one process per host, every process runs the same program."""

from __future__ import annotations

import faulthandler
import sys

import jax
from jax.sharding import NamedSharding


def initialize(
  coordinator: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  local_cpu_devices: int | None = None,
  timeout_s: int = 120,
  heartbeat_timeout_s: int = 30,
) -> None:
  """Joins this process to a multi-process JAX run (call before any JAX op).

  On CPU it selects the gloo collectives and gives the process
  `local_cpu_devices` virtual devices. With no arguments, JAX finds the
  cluster itself (SLURM, Open MPI, Kubernetes, or the `JAX_COORDINATOR_ADDRESS`,
  `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` environment variables).

  Args:
    coordinator: "host:port" of process 0's coordination service.
    num_processes: how many processes take part.
    process_id: this process's index in [0, num_processes).
    local_cpu_devices: virtual CPU devices for this process.
    timeout_s: how long to wait for every process to join.
    heartbeat_timeout_s: after this long without a heartbeat from a process,
      the others stop with an error instead of waiting for it forever.

  Raises:
    ValueError: for an inconsistent process id or count.
  """
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"num_processes must be at least 1, got {num_processes}.")
  if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}.")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if local_cpu_devices is not None:
    jax.config.update("jax_num_cpu_devices", local_cpu_devices)
  # JAX's own initialization timeout does not cover every wait (a process that
  # never starts leaves the others blocked in C++ device discovery, holding the
  # GIL), so bound the whole join with faulthandler's C-level watchdog: it
  # prints where the process waited and exits.
  where = coordinator or "the detected coordinator"
  print(
    f"parstrat: joining {num_processes or 'all'} processes at {where} "
    f"(giving up after {timeout_s} s)",
    file=sys.stderr,
    flush=True,
  )
  faulthandler.dump_traceback_later(timeout_s, exit=True)
  try:
    jax.distributed.initialize(
      coordinator_address=coordinator,
      num_processes=num_processes,
      process_id=process_id,
      initialization_timeout=timeout_s,
      heartbeat_timeout_seconds=heartbeat_timeout_s,
    )
    jax.devices()  # returns once every process has joined
  finally:
    faulthandler.cancel_dump_traceback_later()


def is_primary() -> bool:
  """True on the process that writes metrics, checkpoints and reports (process 0)."""
  return jax.process_index() == 0


def local_rows(sharding: NamedSharding, global_batch: int) -> slice:
  """The rows of a global batch that this process's devices hold under `sharding`.

  Raises:
    ValueError: if those rows are not one contiguous block.
  """
  indices = sharding.addressable_devices_indices_map((global_batch,))
  starts = sorted(
    {
      (idx[0].start or 0, global_batch if idx[0].stop is None else idx[0].stop)
      for idx in indices.values()
    }
  )
  start, stop = starts[0][0], starts[0][1]
  for a, b in starts[1:]:
    if a > stop:
      raise ValueError(f"This process's rows {starts} are not contiguous.")
    stop = max(stop, b)
  return slice(start, stop)
