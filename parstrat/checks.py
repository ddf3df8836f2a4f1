"""Assertions about how training state is laid out across devices."""

from parstrat._src.checks import assert_replicas_equal

__all__ = ["assert_replicas_equal"]
