"""Multi-controller JAX: one process per host, every process runs the same program."""

from __future__ import annotations

import faulthandler
import hashlib
import os
import sys
from collections.abc import Mapping

import jax
import numpy as np
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
  cluster itself (SLURM, Open MPI, Kubernetes); the coordinator may also come
  from the `JAX_COORDINATOR_ADDRESS` environment variable (JAX reads no such
  variable for the process count or id).

  Args:
    coordinator: "host:port" of process 0's coordination service.
    num_processes: how many processes take part.
    process_id: this process's index in [0, num_processes).
    local_cpu_devices: virtual CPU devices for this process.
    timeout_s: how long to wait for every process to join.
    heartbeat_timeout_s: after this long without a heartbeat from a process,
      the others stop with an error instead of waiting for it forever.

  JAX's preemption service is left off: it would take SIGTERM for itself and
  let the run go on. A process of several stopped by a signal dies at once,
  and the others stop when its heartbeat does (`heartbeat_timeout_s`).

  Raises:
    ValueError: for an inconsistent process id or count, or processes with
      different numbers of devices.
    ConnectionError: when the coordination service cannot start or be
      reached (an address already in use), naming the address.
  """
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"num_processes must be at least 1, got {num_processes}.")
  if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}.")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_enable_preemption_service", False)
  if local_cpu_devices is not None:
    jax.config.update("jax_num_cpu_devices", local_cpu_devices)
  address = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if process_id == 0 and address:
    _check_port_free(address)
  # JAX's own initialization timeout does not cover every wait (a process that
  # never starts leaves the others blocked in C++ device discovery, holding the
  # GIL), so bound the whole join with faulthandler's C-level watchdog: it
  # prints where the process waited and exits.
  where = address or "the detected coordinator"
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
    check_devices_alike()
  except jax.errors.JaxRuntimeError as e:
    detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ConnectionError(f"cannot join the run at {where}: {detail}") from None
  finally:
    faulthandler.cancel_dump_traceback_later()


def _check_port_free(coordinator: str) -> None:
  """Checks that process 0 can serve the run at `coordinator` ("host:port").

  JAX's coordination service, started on a port already taken, sometimes
  crashes the process (SIGSEGV) rather than raising. The port can still be
  taken between this check and JAX's; `initialize` then reports JAX's error.

  Raises:
    ValueError: for an address without a numeric port.
    ConnectionError: when the port is taken, naming it.
  """
  import socket

  _, _, port = coordinator.rpartition(":")
  if not port.isdigit():
    raise ValueError(f"coordinator must be HOST:PORT, got {coordinator!r}.")
  for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):  # noqa: S104
    try:
      probe = socket.socket(family)
    except OSError:  # no IPv6 here
      continue
    with probe:
      probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      try:
        probe.bind((host, int(port)))
      except OSError as e:
        raise ConnectionError(
          f"process 0 cannot serve the run at {coordinator}: port {port} is taken "
          f"({e.strerror or e}); choose another port"
        ) from None
    return


_ROW = 72  # bytes per gathered text: 8 of its hash, 1 "cut short", up to 63 of the text


def _encode(text: str) -> np.ndarray:
  """`text` as a row of `_ROW` bytes: its hash (all of it counts), cut-short flag, text."""
  raw = text.encode()
  row = hashlib.sha256(raw).digest()[:8] + bytes([len(raw) > _ROW - 9]) + raw[: _ROW - 9]
  return np.frombuffer(row.ljust(_ROW, b"\0"), np.uint8)


def _decode(row: np.ndarray) -> str:
  """The text of an `_encode`d row, with "..." where it was cut short."""
  text = bytes(row[9:]).rstrip(b"\0").decode(errors="ignore")
  return text + ("..." if row[8] else "")


class ProcessesDisagree(ValueError):
  """What the processes of a run were given differs: raised alike on every one of them,
  after they compared it, so that each stops on its own (`stops_on_every_process`)."""


#: Whether this process raised `ProcessesDisagree` (then so did every other).
_DISAGREED = False


def _disagree(message: str) -> ProcessesDisagree:
  global _DISAGREED  # noqa: PLW0603 - one flag per process, read as it leaves
  _DISAGREED = True
  return ProcessesDisagree(message)


def stops_on_every_process() -> bool:
  """Whether this process stops on an error every process of the run raised alike.

  Then process 0, which serves the run's coordination, waits for the others
  to report it before it leaves: when it is gone, JAX's coordination client in
  each other process aborts that process (SIGABRT) before it can say why.
  """
  return _DISAGREED


def check_devices_alike() -> None:
  """Checks that every process of the run has as many devices (no collective).

  Raises:
    ValueError: naming each process's device count.
  """
  counts: dict[int, int] = {}
  for device in jax.devices():
    counts[device.process_index] = counts.get(device.process_index, 0) + 1
  if len(set(counts.values())) > 1:
    each = ", ".join(f"{n} on process {p}" for p, n in sorted(counts.items()))
    raise _disagree(
      f"The processes have different numbers of devices: {each}. Give each process as "
      "many (parstrat train --devices, or local_cpu_devices=)."
    )


def check_same_everywhere(what: str, values: Mapping[str, str]) -> None:
  """Checks that every process of the run passes the same `values` (two small collectives).

  Every process must call it at the same point of the program (it gathers).
  With one process it does nothing.

  Args:
    what: what the values are, for the error (e.g. "flags").
    values: name -> text. Texts are compared whole (by a hash) and shown up to
      63 bytes.

  Raises:
    ValueError: naming each value that differs, with its text on each process,
      or the names some process did not pass (the same error on every process,
      so all of them stop); or for processes with different numbers of devices.

  Example:
    >>> check_same_everywhere("flags", {"--batch-size": "64"})  # one process: a no-op
  """
  if jax.process_count() == 1:
    return
  check_devices_alike()  # (gathering needs as many devices on each process)
  from jax.experimental import multihost_utils

  def gather(x: np.ndarray) -> np.ndarray:
    return np.asarray(multihost_utils.process_allgather(x))

  names = sorted(values)
  counts = gather(np.asarray(len(names), np.int32))
  width = int(counts.max())
  if width == 0:
    return
  blank = [_encode("")] * (width - len(names))
  mine = [*map(_encode, names), *blank, *(_encode(str(values[n])) for n in names), *blank]
  rows = gather(np.stack(mine))  # [process, name... value..., byte]
  if (counts != counts[0]).any() or (rows[:, :width] != rows[0, :width]).any():
    seen = [[_decode(row) for row in rows[p, : counts[p]]] for p in range(len(rows))]
    everyone = set().union(*seen)
    lacks = [
      f"process {p} has no {', '.join(sorted(everyone - set(names_p)))}"
      for p, names_p in enumerate(seen)
      if everyone - set(names_p)
    ]
    detail = "; ".join(lacks) or "names that differ after their first 63 bytes"
    raise _disagree(f"The processes passed different {what}: {detail}.")
  differ = []
  for i, name in enumerate(names):
    column = rows[:, width + i]
    if (column != column[0]).any():
      texts = [_decode(row) for row in column]
      each = ", ".join(f"{text} on process {p}" for p, text in enumerate(texts))
      further = " (they differ further on)" if len(set(texts)) == 1 else ""
      differ.append(f"{name} is {each}{further}")
  if differ:
    raise _disagree(f"The processes were given different {what}: {'; '.join(differ)}.")


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
