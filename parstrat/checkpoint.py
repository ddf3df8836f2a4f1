"""Checkpoints (orbax) that survive crashes and move between strategies."""

from parstrat._src.checkpoint import Checkpointer

__all__ = ["Checkpointer"]
