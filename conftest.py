"""Runs before any test or doctest module: 8 virtual CPU devices for the whole session.

The tests compile hundreds of small programs on 2 cores and run each for a few
steps, so XLA's CPU backend is told to skip LLVM's optimisation passes (about a
quarter less compile time) and to emit fusions with its older loop emitters
rather than the MLIR fusion emitters (about a third less CPU time for the whole
suite again, measured on this machine), and to compile each program's LLVM module
in one piece rather than split into parts for a thread pool (with two workers on
two cores the splitting costs more than the threads gain: about an eighth less
CPU time again), and to run each operation on its device's own thread rather than
Eigen's thread pool (8 virtual devices on 2 cores gain nothing from more threads:
about a twentieth less CPU time again). Every comparison (strategy
vs single-device jit, memory of one layout vs another) is between programs
compiled the same way.

Many tests compile the same program again (the single-device reference of a
model and optimizer, the same CLI run before and after a resume, in this
process or a subprocess), so the session shares JAX's persistent compilation
cache, in a temporary folder made here and deleted when the session ends:
about a quarter less time again. A cache hit still counts as a compilation for
`parstrat.testing.check_strategy` (JAX times a hit under the same event), so a
recompile after the first step is caught either way.

Subprocesses the tests start (the CLI, the examples) inherit these settings,
and the filter for JAX's warning about half a cache entry (below).
"""

import atexit
import os
import shutil
import tempfile

# (A flag already in XLA_FLAGS is left as given: XLA_FLAGS=--xla_cpu_use_fusion_emitters=true
# runs the suite with XLA's defaults for emitters.)
_FLAGS = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
  [_FLAGS]
  + [
    f"--{flag}={value}"
    for flag, value in (
      ("xla_backend_optimization_level", 0),
      ("xla_cpu_use_fusion_emitters", "false"),
      ("xla_cpu_parallel_codegen_split_count", 1),
      ("xla_cpu_multi_thread_eigen", "false"),
    )
    if f"--{flag}=" not in _FLAGS
  ]
).strip()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  # Set before pytest-xdist starts its workers, so that they share it.
  _CACHE = tempfile.mkdtemp(prefix="parstrat-tests-jax-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
# Cache every program, however small or quick to compile (JAX's defaults skip
# those compiled in under a second, nearly all of ours).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# JAX writes a cache entry in place, so a process reading it meanwhile (the
# other worker, a CLI subprocess, the other process of a two-process test) can
# read half of it: JAX then warns "Error reading persistent compilation cache
# entry ... truncated" and compiles the program itself, as on a miss (a writer
# killed mid-entry leaves it half written for the session: a miss each time).
# Silenced through PYTHONWARNINGS, which the workers and the subprocesses here
# inherit (and pyproject's filterwarnings), where it would be a line more on an
# output some tests read.
_CACHE_READ = "ignore:Error reading persistent compilation cache entry:UserWarning"
if _CACHE_READ not in os.environ.get("PYTHONWARNINGS", "").split(","):
  os.environ["PYTHONWARNINGS"] = ",".join(
    filter(None, [os.environ.get("PYTHONWARNINGS", ""), _CACHE_READ])
  )

import parstrat.testing  # noqa: E402

parstrat.testing.use_cpu_devices(8)

# Start the backend now: an in-process `parstrat train --devices 2` (the CLI
# tests) would otherwise set JAX's CPU device count for every later test when
# it happens to be the first thing to touch JAX.
import jax  # noqa: E402

assert len(jax.devices()) == 8, jax.devices()

# Tracing makes millions of small objects, so Python's cyclic garbage collector
# ran 3796 times in `test_model_matrix.py` alone (8.3 s; the file took 118 s).
# Collected less often, and without scanning what the imports above made, it ran
# 325 times (2.6 s) and the file took 105 s, one run after the other: 13 s less,
# more than the collector's own 5.7 s. Every test still runs with the collector on.
import gc  # noqa: E402

gc.freeze()
gc.set_threshold(20000, 20, 20)
