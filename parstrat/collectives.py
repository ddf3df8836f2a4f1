"""Collectives over several named axes at once."""

from parstrat._src.collectives import global_normalize
from parstrat._src.collectives import normalize_on_mesh

__all__ = ["global_normalize", "normalize_on_mesh"]
