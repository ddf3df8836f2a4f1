"""Tools for testing strategies: fake CPU devices and the conformance kit."""

from parstrat._src.testing import (
  Report,
  check_strategy,
  random_batches,
  reference_run,
  seed_mlp,
  use_cpu_devices,
)

__all__ = [
  "Report",
  "check_strategy",
  "random_batches",
  "reference_run",
  "seed_mlp",
  "use_cpu_devices",
]
