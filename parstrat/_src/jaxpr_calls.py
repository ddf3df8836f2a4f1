"""The call-like primitives a model's jaxpr may wrap its layers in: one list for every analysis.

The pipeline's cut (`pipeline/partition.py`) and the tensor-parallel split
(`tensor_split.py`) both read a model's jaxpr, and both must see through
`jax.jit` and `jax.checkpoint` (what `hk.remat` uses; "remat2" in JAX 0.10)
to find the layers inside: each hands every param it uses to one equation.
"""

from __future__ import annotations

#: Calls that only run their body: the same values, gradients included.
WRAPPERS = frozenset("jit pjit closed_call core_call remat remat2 checkpoint".split())

#: Calls with custom derivatives: their forward values are their body's (an analysis
#: of the forward may look inside), their gradients are not (a retrace keeps them).
CUSTOM_DERIVATIVES = frozenset(("custom_jvp_call", "custom_vjp_call"))
