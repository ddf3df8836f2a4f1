"""Optimizers by name for `parstrat train`: optax's, with warm-up, cosine decay and clipping.

Also `update`, how every trainer calls an optimizer: with the step's loss
where the optimizer takes extra arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import optax


def update(optimizer: Any, grads: Any, state: Any, params: Any, loss: Any) -> tuple[Any, Any]:
  """`optimizer.update(grads, state, params)`, with `value=loss` where it takes that.

  Transforms that read the loss (`optax.contrib.reduce_on_plateau`,
  `optax.scale_by_polyak`) get it as `value`: an optimizer whose `update`
  has a `value` parameter or takes `**kwargs` (an optax chain, `MultiSteps`)
  is called with it. Where that call is refused for the keyword (a chain
  holding `optax.contrib.sam`, whose update takes no extra arguments) it is
  called without it, as it was before any optimizer got the loss.

  Args:
    optimizer: an optax optimizer (or anything with optax's `update`).
    grads, state, params: as for `optimizer.update`.
    loss: the step's loss (the mean over the global batch).

  Returns:
    `(updates, new_state)`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> opt = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=0))
    >>> params = {"w": jnp.ones(2)}
    >>> state = opt.init(params)
    >>> for loss in (1.0, 2.0, 2.0):  # no improvement: the scale drops
    ...   updates, state = update(opt, params, state, params, jnp.float32(loss))
    >>> float(state[1].scale) < 1.0
    True
  """
  if not _takes_value(optimizer):
    return optimizer.update(grads, state, params)
  try:
    return optimizer.update(grads, state, params, value=loss)
  except TypeError as e:
    if "unexpected keyword argument 'value'" not in str(e):
      raise
    refused = e
  try:
    return optimizer.update(grads, state, params)
  except TypeError as e:  # (both fail: the first refusal is the cause to show)
    raise e from refused


def _takes_value(optimizer: Any) -> bool:
  """Whether `optimizer.update` has a `value` parameter or takes `**kwargs`."""
  try:
    parameters = inspect.signature(optimizer.update).parameters.values()
  except (TypeError, ValueError):  # (no signature to read: called as before)
    return False
  return any(p.name == "value" or p.kind is p.VAR_KEYWORD for p in parameters)


def _with_l2(make):
  """An optimizer without its own weight decay: decay added to the gradient (L2)."""

  def build(learning_rate, weight_decay):
    optimizer = make(learning_rate)
    if weight_decay:
      return optax.chain(optax.add_decayed_weights(weight_decay), optimizer)
    return optimizer

  return build


#: name -> `(learning_rate, weight_decay) -> optax.GradientTransformation`.
OPTIMIZERS: dict[str, Callable[[optax.ScalarOrSchedule, float], optax.GradientTransformation]] = {
  "adam": _with_l2(optax.adam),
  "adamw": lambda lr, wd: optax.adamw(lr, weight_decay=wd),
  "sgd": _with_l2(optax.sgd),
  "momentum": _with_l2(lambda lr: optax.sgd(lr, momentum=0.9)),
  "lamb": lambda lr, wd: optax.lamb(lr, weight_decay=wd),
  "lion": lambda lr, wd: optax.lion(lr, weight_decay=wd),
  "rmsprop": _with_l2(optax.rmsprop),
  "adafactor": lambda lr, wd: optax.adafactor(lr, weight_decay_rate=wd or None),
}
LR_SCHEDULES = ("constant", "cosine")


def learning_rate_schedule(
  learning_rate: float, *, schedule: str, warmup_steps: int, total_steps: int | None
) -> optax.Schedule:
  """Linear warm-up from 0 over `warmup_steps`, then constant or cosine decay to 0.

  Args:
    learning_rate: the peak learning rate.
    schedule: "constant" or "cosine" (decays over the steps after the warm-up).
    warmup_steps: steps of linear warm-up (0: none).
    total_steps: the run's length in steps; needed by "cosine".

  Returns:
    An optax schedule, step -> learning rate.

  Raises:
    ValueError: for an unknown schedule, or "cosine" without a length.

  Example:
    >>> s = learning_rate_schedule(1.0, schedule="cosine", warmup_steps=2, total_steps=6)
    >>> [round(float(s(i)), 3) for i in range(7)]
    [0.0, 0.5, 1.0, 0.854, 0.5, 0.146, 0.0]
  """
  if schedule not in LR_SCHEDULES:
    raise ValueError(f"Unknown learning-rate schedule {schedule!r}; choose one of {LR_SCHEDULES}.")
  if schedule == "constant":
    if not warmup_steps:
      return optax.constant_schedule(learning_rate)
    return optax.join_schedules(
      [optax.linear_schedule(0.0, learning_rate, warmup_steps),
       optax.constant_schedule(learning_rate)],
      [warmup_steps],
    )  # fmt: skip
  if total_steps is None:
    raise ValueError(
      "The cosine schedule needs the run's length: pass --steps (the dataset has no length)."
    )
  if total_steps <= warmup_steps:
    raise ValueError(
      f"The cosine schedule decays after the warm-up, but the run has {total_steps} steps "
      f"and --warmup-steps is {warmup_steps}."
    )
  return optax.warmup_cosine_decay_schedule(
    0.0, learning_rate, warmup_steps, total_steps, end_value=0.0
  )


def make_optimizer(
  name: str,
  learning_rate: optax.ScalarOrSchedule,
  *,
  weight_decay: float = 0.0,
  clip_norm: float | None = None,
) -> optax.GradientTransformation:
  """An optax optimizer by name, with weight decay and global-norm clipping.

  adamw, lamb, lion and adafactor apply `weight_decay` themselves (decoupled);
  for adam, sgd, momentum and rmsprop a nonzero `weight_decay` adds
  `optax.add_decayed_weights` before them (L2 on the gradient).

  Args:
    name: one of `OPTIMIZERS`.
    learning_rate: a float or an optax schedule.
    weight_decay: the decay rate (0: none).
    clip_norm: clip the gradients' global norm to this (`optax.clip_by_global_norm`).

  Returns:
    The `optax.GradientTransformation`.

  Raises:
    ValueError: for an unknown name (with the closest one).

  Example:
    >>> tx = make_optimizer("adamw", 1e-3, weight_decay=1e-4, clip_norm=1.0)
    >>> isinstance(tx, optax.GradientTransformation)
    True
  """
  if name not in OPTIMIZERS:
    from parstrat._src.config import did_you_mean

    raise ValueError(
      f"Unknown optimizer {name!r} (choose one of {', '.join(OPTIMIZERS)})"
      f"{did_you_mean(name, list(OPTIMIZERS))}"
    )
  optimizer = OPTIMIZERS[name](learning_rate, weight_decay)
  if clip_norm is not None:
    optimizer = optax.chain(optax.clip_by_global_norm(clip_norm), optimizer)
  return optimizer
