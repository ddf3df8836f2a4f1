"""Reading collectives out of compiled HLO text: which ones sit inside conditional branches.

The pipeline runs each device's stage in a `lax.switch` branch, so a
collective XLA's partitioner puts inside a branch is only reached by the
devices that take that branch: those of one (data, stage) pair. A collective
whose participants reach beyond them waits forever (on CPU the runtime aborts
after 40 s: "Termination timeout for collective permute"). `branch_problems`
finds such collectives in `compiled.as_text()`.

Participants are read the way the runtimes rendezvous: each replica group of
an all-reduce, all-gather, all-to-all or reduce-scatter on its own, and a
collective-permute as one group of every device named in its pairs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator

import jax
import numpy as np
from jax.sharding import Mesh

_COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z\-]+)\(")
_CALLED = re.compile(
  r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")

#: The `jax.named_scope` of code whose `lax.switch`es and `lax.cond`s take an index
#: that is the same on every device (the pipeline's exchange, picked by the tick;
#: the optimizer's update on global arrays, e.g. `optax.apply_if_finite`): every
#: device runs the branch it takes, so the collectives inside it are reached by all
#: their participants. Every conditional traced under it, nested ones included, but
#: not one inside a `shard_map` within it: that runs per device again (a line
#: search's `value_fn` runs the pipeline, stage switches and all, inside the
#: optimizer's update), and is uniform only under a mark of its own inside the map.
UNIFORM_SCOPE = "uniform_switch"
_UNIFORM = re.compile(
  rf' conditional\(.*\bop_name="[^"]*/{UNIFORM_SCOPE}/(?:(?!shard_map)[^"])*cond"'
)


#: JAX's setting that puts the whole name stack in each instruction's `op_name`:
#: set to False (JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS=false), XLA's `op_name`
#: keeps only the innermost scope ("cond"), and `UNIFORM_SCOPE` is no longer in it.
_FULL_LOCATIONS = "jax_include_full_tracebacks_in_locations"


@contextlib.contextmanager
def scopes_in_op_names() -> Iterator[None]:
  """Lowers with every `jax.named_scope` in the compiled HLO's `op_name`s, whatever JAX's setting.

  With `jax_include_full_tracebacks_in_locations` False (JAX's default is True),
  the scopes of a lowering go into the stack-frame table instead, and the
  conditionals traced under `UNIFORM_SCOPE` could not be told from a stage's
  own branches. Inside this context the setting is True for this thread
  (JAX's own thread-local form of it, which also wins over a thread-local
  False of the caller's; other threads keep theirs; where that internal form
  is missing, the process-wide setting, set back after, which other threads
  lowering meanwhile see too). Lower a program whose HLO
  `branch_problems` or `uniform_switches` will read inside it (the setting
  changes only the debug information, not the program).

  Yields:
    None, with the setting on for lowerings on this thread.

  Example:
    >>> import jax
    >>> with scopes_in_op_names():
    ...   print(jax.config.jax_include_full_tracebacks_in_locations)
    True
  """
  try:  # internal: JAX exports no thread-local context manager for this setting
    from jax._src import config as jax_config  # noqa: PLC0415

    thread_local = getattr(jax_config, _FULL_LOCATIONS.removeprefix("jax_"))(True)
  except (ImportError, AttributeError, TypeError):
    thread_local = None
  if thread_local is not None:
    with thread_local:
      works = getattr(jax.config, _FULL_LOCATIONS)  # (a JAX where it does nothing: below)
      if works:
        yield
    if works:
      return
  # Process-wide, set back as it was: a lowering on another thread meanwhile sees it too.
  before = getattr(jax.config, _FULL_LOCATIONS)
  jax.config.update(_FULL_LOCATIONS, True)
  try:
    yield
  finally:
    jax.config.update(_FULL_LOCATIONS, before)


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction found inside a conditional branch.

  Attributes:
    kind: e.g. "all-reduce" or "collective-permute".
    name: the instruction's name.
    groups: the device ids (indices into the mesh's devices) that rendezvous
      together, or None when the text could not be read.
    line: the instruction's text.
  """

  kind: str
  name: str
  groups: tuple[tuple[int, ...], ...] | None
  line: str


def _iota(text: str) -> np.ndarray | None:
  """`[4,2]<=[8]`, `[2,4]<=[4,2]T(1,0)`, `[2,2,2]T(1,0,2)` or a plain `3,2,1,0` -> device ids.

  (`[2,2,2]T(1,0,2)`, as a mesh's `device_ids`, is an iota of that shape,
  transposed, read in order.)
  """
  if re.fullmatch(r"\d+(?:,\d+)*", text.strip()):
    return np.array([int(x) for x in text.split(",")])
  m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
  if m:
    dims = [int(x) for x in m.group(1).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(2):
      ids = ids.transpose([int(x) for x in m.group(2).split(",")])
    return ids.reshape(-1)
  m = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
  if not m:
    return None
  shape = [int(x) for x in m.group(1).split(",")]
  dims = [int(x) for x in m.group(2).split(",")]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  if m.group(3):
    ids = ids.transpose([int(x) for x in m.group(3).split(",")])
  return ids.reshape(shape)


def _groups(line: str, kind: str) -> tuple[tuple[int, ...], ...] | None:  # noqa: PLR0911
  if kind == "collective-permute":
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    if not m:
      return None
    ids = sorted({int(x) for x in re.findall(r"\d+", m.group(1))})
    return (tuple(ids),)
  m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
  if m:
    return tuple(
      tuple(int(x) for x in g.split(",") if x) for g in re.findall(r"\{([\d,]*)\}", m.group(1))
    )
  m = re.search(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", line)
  if m:
    ids = _iota(m.group(1))
    return None if ids is None else tuple(tuple(int(x) for x in row) for row in ids)
  # `device_ids=(...)` is left out when the mesh's devices are 0, 1, ... in order.
  m = re.search(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", line
  )
  if m:
    sizes = [int(s) for s in re.findall(r"=(\d+)", m.group(1))]
    names = re.findall(r"'([^']+)'=", m.group(1))
    ids = np.arange(int(np.prod(sizes))) if m.group(2) is None else _iota(m.group(2))
    across = re.findall(r"'([^']+)'", m.group(3))
    if ids is None or ids.size != int(np.prod(sizes)) or not set(across) <= set(names):
      return None
    ids = ids.reshape(sizes)
    moved = [names.index(a) for a in across]
    kept = [k for k in range(len(names)) if k not in moved]
    ids = ids.transpose(kept + moved).reshape(-1, int(np.prod([sizes[k] for k in moved])))
    return tuple(tuple(int(x) for x in row) for row in ids)
  if "replica_groups={}" in line:
    return None  # every device: never confined to one branch's devices
  return None


def _computations(text: str) -> dict[str, list[str]]:
  comps: dict[str, list[str]] = {}
  current = None
  for line in text.splitlines():
    if current is None:
      m = _COMPUTATION.match(line)
      if m and "=" not in line.split("{")[0].split("(")[0]:
        current = m.group(1)
        comps[current] = []
      continue
    if line.strip() == "}":
      current = None
      continue
    comps[current].append(line)
  return comps


def uniform_switches(text: str) -> set[str]:
  """The names of the `conditional`s traced under `UNIFORM_SCOPE` in compiled HLO `text`.

  Every device takes the same branch of these (the pipeline's exchange, and
  the optimizer's own conditionals). A profiler trace names its events after
  the instructions, so these names tell them apart from the per-tick pass
  switch there too (the benchmark's measured bubble counts neither as a
  stage's work).
  """
  return {
    m.group(1)
    for line in text.splitlines()
    if _UNIFORM.search(line)
    for m in [_INSTRUCTION.match(line)]
    if m
  }


def branch_instructions(text: str) -> list[tuple[str, str, str]]:
  """`(opcode, name, line)` of every instruction reachable from a `conditional`'s branches.

  Conditionals traced under `UNIFORM_SCOPE` are left out. Async pairs are read by
  their start (`all-reduce-start` as "all-reduce").
  """
  comps = _computations(text)
  roots: list[str] = []
  for lines in comps.values():
    for line in lines:
      if _UNIFORM.search(line):
        continue
      m = _BRANCHES.search(line)
      if m:
        roots += [name.strip().lstrip("%") for name in m.group(1).split(",")]
      elif " conditional(" in line:
        roots += re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", line)
  return _reachable(comps, roots)


def loop_instructions(text: str) -> list[tuple[str, str, str]]:
  """`(opcode, name, line)` of every instruction reachable from a `while` loop's body.

  What runs once per iteration: for a pipeline, once per tick (its branches included).
  Async pairs are read by their start, as in `branch_instructions`.
  """
  comps = _computations(text)
  roots = [name for lines in comps.values() for line in lines for name in _BODY.findall(line)]
  return _reachable(comps, roots)


def _reachable(comps: dict[str, list[str]], roots: list[str]) -> list[tuple[str, str, str]]:
  """`(opcode, name, line)` of every instruction in `roots` and the computations they call."""
  seen: set[str] = set()
  found = []
  while roots:
    name = roots.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    for line in comps[name]:
      roots += _CALLED.findall(line)
      m = _BRANCHES.search(line)
      if m:
        roots += [n.strip().lstrip("%") for n in m.group(1).split(",")]
      m = _INSTRUCTION.match(line)
      if m:
        found.append((m.group(2).removesuffix("-start"), m.group(1), line.strip()))
  return found


def branch_collectives(text: str) -> list[Collective]:
  """Every collective reachable from a `conditional`'s branch computations in HLO `text`."""
  return [
    Collective(kind, name, _groups(line, kind), line)
    for kind, name, line in branch_instructions(text)
    if kind in _COLLECTIVES
  ]


def branch_problems(text: str, mesh: Mesh, vary: tuple[str, ...] = ("model",)) -> list[str]:
  """The collectives inside conditional branches whose participants differ off `vary`.

  Inside a per-stage branch, only devices that share every mesh coordinate
  except those along `vary` are sure to run the same branch.

  Args:
    text: compiled HLO (`trainer.lower(state, batch).compile().as_text()`).
    mesh: the mesh the program was compiled for (device id i is
      `mesh.devices.flat[i]`).
    vary: the axes a branch's collective may span.

  Returns:
    One line per offending collective (empty when there is none).
  """
  shape = mesh.devices.shape
  fixed = [k for k, name in enumerate(mesh.axis_names) if name not in vary]
  problems = []
  for c in branch_collectives(text):
    if c.groups is None:
      problems.append(f"{c.kind} {c.name}: its participants could not be read")
      continue
    for group in c.groups:
      differ = [
        mesh.axis_names[k]
        for k in fixed
        if len({int(np.unravel_index(i, shape)[k]) for i in group}) > 1
      ]
      if differ:
        problems.append(
          f"{c.kind} {c.name} inside a conditional branch spans devices {list(group)}, which "
          f"differ along {differ}"
        )
        break
  return problems
