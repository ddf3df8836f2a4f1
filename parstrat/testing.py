"""Tools for testing strategies: fake CPU devices and the conformance kit."""

from parstrat._src.testing import ADAM_PARAM_ATOL
from parstrat._src.testing import Reference
from parstrat._src.testing import Report
from parstrat._src.testing import check_strategy
from parstrat._src.testing import random_batches
from parstrat._src.testing import reference_run
from parstrat._src.testing import reference_train
from parstrat._src.testing import seed_mlp
from parstrat._src.testing import use_cpu_devices

__all__ = [
  "ADAM_PARAM_ATOL",
  "Reference",
  "Report",
  "check_strategy",
  "random_batches",
  "reference_run",
  "reference_train",
  "seed_mlp",
  "use_cpu_devices",
]
