"""Mixed precision with jmp: compute in a low precision, keep params in float32.

A `jmp.Policy` says three dtypes: the params' (what is stored and what the
optimizer updates), the compute dtype (what the model's `apply` sees: params
and inputs are cast to it) and the output dtype (what the loss sees). parstrat
applies the policy around the model's `apply`, so every strategy gets it and
the model needs no change; gradients come back in the params' dtype because
they are taken through the casts.
"""

from __future__ import annotations

from typing import Any

import haiku as hk
import jax.numpy as jnp
import jmp

#: The named policies `precision=` accepts besides a `jmp.Policy` or a jmp string.
NAMED_POLICIES = {
  "float32": "params=float32,compute=float32,output=float32",
  "mixed_bfloat16": "params=float32,compute=bfloat16,output=float32",
}


def resolve_policy(precision: Any) -> jmp.Policy | None:
  """Turns the `precision=` option into a `jmp.Policy` (None: full precision).

  Args:
    precision: None, "float32", "mixed_bfloat16" (params and optimizer in
      float32, compute in bfloat16, loss in float32), a jmp policy string such
      as "params=float32,compute=bfloat16,output=float32", or a `jmp.Policy`.

  Returns:
    The policy, or None when nothing needs casting.

  Raises:
    ValueError: for an unknown name, a float16 params, compute or output dtype
      (it needs loss scaling, which parstrat does not do; use bfloat16), or
      params or output that are not floating point.

  Example:
    >>> from parstrat._src.precision import resolve_policy, describe
    >>> describe(resolve_policy("mixed_bfloat16"))
    'params float32, compute bfloat16, output float32'
    >>> resolve_policy("float32") is None
    True
  """
  if precision is None:
    return None
  if isinstance(precision, jmp.Policy):
    policy = precision
  elif isinstance(precision, str):
    try:
      policy = jmp.get_policy(NAMED_POLICIES.get(precision, precision))
    except ValueError as e:
      raise ValueError(
        f"Unknown precision {precision!r}: use one of {sorted(NAMED_POLICIES)}, a jmp policy "
        f"string such as 'params=float32,compute=bfloat16,output=float32', or a jmp.Policy "
        f"({e})."
      ) from None
  else:
    raise TypeError(f"precision must be a string or a jmp.Policy, got {precision!r}.")
  for role, dtype in (
    ("params", policy.param_dtype),
    ("compute", policy.compute_dtype),
    ("output", policy.output_dtype),
  ):
    if not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(f"precision {precision!r}: {role} dtype must be floating, got {dtype}.")
  half = [r for r, d in (("params", policy.param_dtype), ("compute", policy.compute_dtype),
          ("output", policy.output_dtype)) if jnp.dtype(d) == jnp.float16]  # fmt: skip
  if half:
    raise ValueError(
      f"precision {precision!r} has float16 {' and '.join(half)}, which needs loss scaling "
      "(parstrat does not scale losses); use bfloat16, e.g. precision='mixed_bfloat16'."
    )
  if all(jnp.dtype(d) == jnp.float32 for d in (policy.param_dtype, policy.compute_dtype)):
    if jnp.dtype(policy.output_dtype) == jnp.float32:
      return None
  return policy


def with_policy(model: Any, policy: jmp.Policy | None) -> Any:
  """`model` with `policy` applied around `apply` (params and inputs cast in, output out).

  Only the `init`/`apply` contract is used, so any model with that contract
  works; an `hk.TransformedWithState` stays one (its state is not cast), and
  integer inputs (token ids) are left as they are.
  """
  if policy is None:
    return model
  if isinstance(model, hk.TransformedWithState):

    def init_with_state(rng, inputs):
      params, state = model.init(rng, inputs)
      return policy.cast_to_param(params), state

    def apply_with_state(params, state, rng, inputs):
      outputs, state = model.apply(
        policy.cast_to_compute(params), state, rng, policy.cast_to_compute(inputs)
      )
      return policy.cast_to_output(outputs), state

    return hk.TransformedWithState(init=init_with_state, apply=apply_with_state)

  def init(rng, inputs):
    return policy.cast_to_param(model.init(rng, inputs))

  def apply(params, rng, inputs):
    outputs = model.apply(policy.cast_to_compute(params), rng, policy.cast_to_compute(inputs))
    return policy.cast_to_output(outputs)

  return hk.Transformed(init=init, apply=apply)


def describe(policy: jmp.Policy | None) -> str:
  """A short account of `policy`, e.g. "params float32, compute bfloat16, output float32"."""
  if policy is None:
    return "float32"
  return (
    f"params {jnp.dtype(policy.param_dtype).name}, compute {jnp.dtype(policy.compute_dtype).name}, "
    f"output {jnp.dtype(policy.output_dtype).name}"
  )
