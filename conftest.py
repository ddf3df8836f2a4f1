"""Runs before any test or doctest module: 8 virtual CPU devices for the whole session.

The tests compile hundreds of small programs on 2 cores and run each for a few
steps, so XLA's CPU backend is told to skip LLVM's optimisation passes: about a
quarter less compile time. Every comparison (strategy vs single-device jit,
memory of one layout vs another) is between programs compiled the same way.
Subprocesses the tests start (the CLI, the examples) inherit the setting.
"""

import os

import parstrat.testing

os.environ["XLA_FLAGS"] = " ".join(
  [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]
).strip()
parstrat.testing.use_cpu_devices(8)

# Start the backend now: an in-process `parstrat train --devices 2` (the CLI
# tests) would otherwise set JAX's CPU device count for every later test when
# it happens to be the first thing to touch JAX.
import jax  # noqa: E402

assert len(jax.devices()) == 8, jax.devices()
