"""parstrat: interchangeable parallelism strategies for Haiku models and optax."""

from parstrat import checks, pipeline
from parstrat._src.data_parallel import DataParallel
from parstrat._src.hybrid import Hybrid
from parstrat._src.pipeline_parallel import PipelineModelParallel
from parstrat._src.registry import available, get, register, unregister
from parstrat._src.strategy import (
  Plan,
  Strategy,
  Trainer,
  TrainState,
  build_mesh,
  softmax_cross_entropy,
)

__version__ = "0.1.0"

__all__ = [
  "DataParallel",
  "Hybrid",
  "PipelineModelParallel",
  "Plan",
  "Strategy",
  "TrainState",
  "Trainer",
  "available",
  "build_mesh",
  "checks",
  "get",
  "pipeline",
  "register",
  "softmax_cross_entropy",
  "unregister",
]
