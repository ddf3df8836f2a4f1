"""Checkpoints (orbax) that survive crashes and move between strategies."""

from parstrat._src.checkpoint import CheckpointDoesNotFit
from parstrat._src.checkpoint import Checkpointer
from parstrat._src.checkpoint import CheckpointError
from parstrat._src.checkpoint import CheckpointWarning
from parstrat._src.checkpoint import OptimizerDoesNotFit

__all__ = [
  "CheckpointDoesNotFit",
  "CheckpointError",
  "CheckpointWarning",
  "Checkpointer",
  "OptimizerDoesNotFit",
]
