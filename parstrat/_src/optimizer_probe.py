"""Does an optimizer act leaf by leaf, so a plan may run it on its own stored layout?

The `Trainer` runs the optimizer on the params as the plan stores them. For
most plans that is the model's own layout; the pipeline and `Hybrid` store
each stage's parameters as one flat buffer. An element-wise optimizer (SGD,
Adam, AdamW without a mask, `clip_by_global_norm`, `MultiSteps`) gives the
same update either way; a per-leaf one (a weight-decay mask, `optax.masked`,
`optax.multi_transform`, LARS/LAMB trust ratios) does not: its masks and norms
would see whole stages instead of the model's leaves, and train something
else without a word. `check_layout` finds out by running the optimizer once on
both layouts and refuses when they differ.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def _same_layout(plan, abstract_params) -> bool:
  stored = jax.eval_shape(plan.to_stored, abstract_params)
  shapes = lambda tree: [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]  # noqa: E731
  return jax.tree.structure(stored) == jax.tree.structure(abstract_params) and shapes(
    stored
  ) == shapes(abstract_params)


def _updates(optimizer, params, grads):
  state = optimizer.init(params)
  updates, _ = optimizer.update(grads, state, params)
  return updates


def check_layout(optimizer, plan, abstract_params: Any, strategy: Any) -> None:
  """Refuses `optimizer` when it would act differently on the plan's stored layout.

  The optimizer's first update is computed on random params in the model's
  layout and in the stored one, with random gradients and with zero
  gradients (where only a weight-decay mask acts), and compared.

  Args:
    optimizer: the optax optimizer.
    plan: the strategy's `Plan`.
    abstract_params: the params in the model's layout (shapes and dtypes).
    strategy: the strategy, for the message.

  Raises:
    ValueError: if the updates differ, or the optimizer fails on the stored
      layout (e.g. a mask function that reads Haiku module names).

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp, optax, parstrat
    >>> model = hk.transform(lambda x: hk.nets.MLP([8, 8, 4])(x))
    >>> trainer = parstrat.PipelineModelParallel(stages=2)(
    ...     model, optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)))
    >>> trainer.init(jax.random.key(0), jnp.zeros((1, 4)))
    Traceback (most recent call last):
    ...
    ValueError: PipelineModelParallel() stores ...
  """
  if _same_layout(plan, abstract_params):
    return
  rng = np.random.default_rng(0)
  draw = lambda x: np.asarray(rng.standard_normal(x.shape), x.dtype)  # noqa: E731
  params = jax.tree.map(draw, abstract_params)
  detail = ""
  with jax.default_device(jax.devices()[0]):
    for grads in (jax.tree.map(draw, abstract_params), jax.tree.map(np.zeros_like, params)):
      want = plan.to_stored(_updates(optimizer, params, grads))
      try:
        got = _updates(optimizer, plan.to_stored(params), plan.to_stored(grads))
      except Exception as e:  # noqa: BLE001 - any failure on the flat layout is the answer
        detail = f"on the flat layout it fails: {type(e).__name__}: {str(e).splitlines()[0]}"
        break
      for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if not np.allclose(a, b, rtol=1e-4, atol=1e-7 * max(1.0, float(np.abs(a).max()))):
          detail = "its update on the flat layout differs from the update on the model's layout"
          break
      if detail:
        break
  if detail:
    raise ValueError(
      f"{strategy!r} stores each pipeline stage's parameters as one flat buffer, and the "
      f"optimizer does not act leaf by leaf ({detail}). Per-leaf transforms (masks such as "
      "optax.adamw(mask=...), optax.masked, optax.multi_transform, LARS/LAMB trust ratios) "
      "are not supported on that flat layout: use data_parallel, fsdp or tensor, which keep "
      "the model's own layout, or an element-wise optimizer (sgd, adam, adamw without a "
      "mask, clip_by_global_norm, MultiSteps)."
    )
