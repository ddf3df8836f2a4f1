"""Optimizers by name for `parstrat train`: optax's, with warm-up, cosine decay and clipping.

Also `update`, how every trainer calls an optimizer: with the step's loss,
gradient and loss function where the optimizer takes extra arguments.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax


def update(
  optimizer: Any,
  grads: Any,
  state: Any,
  params: Any,
  loss: Any,
  value_fn: Callable[[Any], Any] | None = None,
) -> tuple[Any, Any]:
  """`optimizer.update(grads, state, params)`, with the loss where it takes that.

  optax's convention for optimizers that need more than the gradient is three
  keyword arguments: `value` (the loss at `params`; read by
  `optax.contrib.reduce_on_plateau`, `optax.scale_by_polyak`), `grad` (the
  gradient at `params`) and `value_fn` (the loss as a function of the params;
  the line searches of `optax.lbfgs`, `optax.scale_by_zoom_linesearch` and
  `optax.scale_by_backtracking_linesearch` evaluate and differentiate it at
  other params). Each is passed where `optimizer.update` names it, all three
  where it takes `**kwargs` (an optax chain, `MultiSteps`), and `value_fn` only
  where one is given. Where that call is refused for one of the keywords it
  got through `**kwargs` (a chain holding `optax.contrib.sam`, whose update
  takes no extra arguments, or a transform of one's own that takes `value`
  alone) it is called again without that one, until a call is not refused
  for a keyword. (A refusal of a keyword the update names itself comes from
  inside it, and is raised.)

  Args:
    optimizer: an optax optimizer (or anything with optax's `update`).
    grads, state, params: as for `optimizer.update`.
    loss: the step's loss (the mean over the global batch).
    value_fn: `params -> loss` on the step's batch (see `loss_function`), or None.

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
  offered = {"value": loss, "grad": grads}
  if value_fn is not None:
    offered["value_fn"] = value_fn
  extras, named = _extra_args(optimizer, offered)
  refused = None
  while True:
    try:
      return optimizer.update(grads, state, params, **extras)
    except Exception as e:
      found = isinstance(e, TypeError) and re.search(
        r"unexpected keyword argument '(value|grad|value_fn)'", str(e)
      )
      # A keyword the update names itself was not refused by it: an error inside it.
      if not found or found.group(1) not in extras or found.group(1) in named:
        if refused is None:
          raise
        raise e from refused  # (the first refusal is the cause to show)
      refused = refused or e
      extras = {name: x for name, x in extras.items() if name != found.group(1)}


def init(optimizer: Any, params: Any) -> Any:
  """`optimizer.init(params)`, each leaf typed as `optimizer.update` will return it.

  Some optax states start with weakly typed scalars that their update returns
  strongly typed (`optax.lbfgs`'s line-search info): a step that took such a
  state would compile a second time for its own output. Those leaves are made
  strong here (the value and dtype are unchanged); every other leaf is as
  `optimizer.init` made it.

  Args:
    optimizer: an optax optimizer.
    params: the params (or a pytree of `jax.ShapeDtypeStruct` under `jax.eval_shape`).

  Returns:
    The optimizer's state.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> params = {"w": jnp.ones(2)}
    >>> optax.lbfgs().init(params)[2].info.decrease_error.weak_type
    True
    >>> init(optax.lbfgs(), params)[2].info.decrease_error.weak_type
    False
  """
  state = optimizer.init(params)
  try:  # the state after one update, by its types only (nothing is computed)
    updated = jax.eval_shape(
      lambda s, p: update(optimizer, p, s, p, jnp.float32(0), stand_in_loss)[1], state, params
    )
  except Exception:  # noqa: BLE001 - the step itself reports an update that fails
    return state
  if jax.tree.structure(updated) != jax.tree.structure(state):
    return state

  def settle(x, after):
    if getattr(x, "weak_type", False) and not after.weak_type and x.dtype == after.dtype:
      return jnp.asarray(x, dtype=x.dtype)
    return x

  return jax.tree.map(settle, state, updated)


def stand_in_loss(params: Any) -> jax.Array:
  """Half the params' squared norm: a loss function for an update run by its types
  only, or on another layout of the same params (zero padding does not change it)."""
  return 0.5 * sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(params))


def loss_function(loss_and_grad: Callable[[Any], tuple[Any, Any]]) -> Callable[[Any], Any]:
  """`params -> loss`, differentiated by the gradient `loss_and_grad` computes.

  A line search (`optax.lbfgs`) evaluates and differentiates its `value_fn`
  at trial params. A strategy's loss is computed by its own distributed
  program (a pipeline schedule runs its backward itself), so this function's
  gradient is not found by differentiating that program again: it is the
  gradient the program returns beside the loss (a `jax.custom_vjp`).

  Args:
    loss_and_grad: `params -> (loss, grads)`, grads shaped like the params.

  Returns:
    `value_fn(params) -> loss`, with `jax.grad(value_fn)(params) == grads`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> f = loss_function(lambda w: (jnp.sum(w**2), 2 * w))
    >>> jax.value_and_grad(f)(jnp.array([1.0, 2.0]))
    (Array(5., dtype=float32), Array([2., 4.], dtype=float32))
  """

  @jax.custom_vjp
  def value_fn(params):
    return loss_and_grad(params)[0]

  def forward(params):
    return loss_and_grad(params)

  def backward(grads, cotangent):
    return (jax.tree.map(lambda g: (cotangent * g).astype(g.dtype), grads),)

  value_fn.defvjp(forward, backward)
  return value_fn


def _extra_args(optimizer: Any, offered: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
  """The keywords of `offered` that `optimizer.update` takes (all, for `**kwargs`), and
  those of them it names itself."""
  try:
    parameters = inspect.signature(optimizer.update).parameters.values()
  except (TypeError, ValueError):  # (no signature to read: called as before)
    return {}, set()
  named = {p.name for p in parameters if p.kind is not p.VAR_KEYWORD} & set(offered)
  if any(p.kind is p.VAR_KEYWORD for p in parameters):
    return offered, named
  return {name: x for name, x in offered.items() if name in named}, named


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
