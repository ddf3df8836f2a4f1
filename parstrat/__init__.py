"""parstrat: interchangeable parallelism strategies for Haiku models and optax."""

from parstrat import checks
from parstrat import collectives
from parstrat import datasets
from parstrat import pipeline
from parstrat._src.auto import Auto
from parstrat._src.auto import Candidate
from parstrat._src.auto import Choice
from parstrat._src.auto import CostModel
from parstrat._src.data_parallel import DataParallel
from parstrat._src.fsdp import FSDP
from parstrat._src.hybrid import Hybrid
from parstrat._src.pipeline_parallel import PipelineModelParallel
from parstrat._src.registry import available
from parstrat._src.registry import get
from parstrat._src.registry import register
from parstrat._src.registry import unregister
from parstrat._src.strategy import LossNotAMeanWarning
from parstrat._src.strategy import Plan
from parstrat._src.strategy import Strategy
from parstrat._src.strategy import Trainer
from parstrat._src.strategy import TrainState
from parstrat._src.strategy import accumulate_gradients
from parstrat._src.strategy import build_mesh
from parstrat._src.strategy import model_loss
from parstrat._src.strategy import softmax_cross_entropy
from parstrat._src.tensor_parallel import TensorParallel
from parstrat._src.tensor_split import tensor_split_plan

__version__ = "0.1.0"

__all__ = [
  "Auto",
  "Candidate",
  "Choice",
  "CostModel",
  "DataParallel",
  "FSDP",
  "Hybrid",
  "LossNotAMeanWarning",
  "PipelineModelParallel",
  "Plan",
  "Strategy",
  "TensorParallel",
  "TrainState",
  "Trainer",
  "accumulate_gradients",
  "available",
  "build_mesh",
  "checks",
  "collectives",
  "datasets",
  "get",
  "model_loss",
  "pipeline",
  "register",
  "softmax_cross_entropy",
  "tensor_split_plan",
  "unregister",
]
