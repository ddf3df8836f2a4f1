"""Does an optimizer act leaf by leaf, so a plan may run it on its own stored layout?

The `Trainer` runs the optimizer on the params as the plan stores them. For
most plans that is the model's own layout; the pipeline and `Hybrid` store
each stage's parameters as one flat buffer. An element-wise optimizer (SGD,
Adam, AdamW without a mask, `clip_by_global_norm`, `MultiSteps`) gives the
same update either way; a per-leaf one (a weight-decay mask, `optax.masked`,
`optax.multi_transform`, LARS/LAMB trust ratios) does not: its masks and norms
would see whole stages instead of the model's leaves, and train something
else without a word. `check_layout` finds out by running the optimizer for a
few steps on both layouts and refuses when they differ; `needs_model_layout`
instead answers True where the plan has an `optimizer_view` (the pipeline's
stage rows seen in the model's layout), on which the trainer then runs it.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

from parstrat._src import optimizers as optimizers_lib
from parstrat._src import trees
from parstrat._src.messages import first_line


def stores_model_layout(plan, abstract_params) -> bool:
  """Whether `plan` stores params (like `abstract_params`, the model's) in their own layout:
  the same tree, shapes and dtypes (`data_parallel`, `fsdp`, `tensor`), not, e.g., a
  pipeline's stage buffers."""
  stored = jax.eval_shape(plan.to_stored, abstract_params)
  shapes = lambda tree: [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]  # noqa: E731
  return jax.tree.structure(stored) == jax.tree.structure(abstract_params) and shapes(
    stored
  ) == shapes(abstract_params)


#: Steps the probe runs: some per-leaf behaviour shows only after the first
#: (a learning-rate warmup from 0).
STEPS = 3

#: The most steps the probe runs when none of the first `STEPS` moved the params:
#: an optimizer may apply nothing for a while (`MultiSteps` accumulating, inside
#: another wrapper where the probe cannot reach its inner optimizer). It stops
#: at the first update that moves them.
MAX_STEPS = 32

#: The tolerance past the first `STEPS` steps. An optimizer that moved nothing in
#: them (`MultiSteps` accumulating) first applies an average of several random
#: gradients: some elements cancel to about Adam's eps, where its normalisation
#: turns the layouts' float32 rounding into relative differences of about 1e-4
#: of the leaf's scale. A per-leaf transform on whole stages differs by far more
#: (a trust ratio, a weight decay masked in or out).
LATE_TOLERANCE = 1e-2


#: Leaf `i`'s probe values are scaled by `SCALES[i % 3]`, so per-leaf norms and
#: clipping thresholds (trust ratios, `clip_by_block_rms`) differ between leaves
#: as they do in a real model, instead of all being about 1.
SCALES = (1.0, 1e-3, 1e3)


def needs_model_layout(optimizer, plan, abstract_params: Any, strategy: Any) -> bool:
  """Whether `optimizer` must run on the model's layout instead of the plan's stored one.

  True when it acts differently on the stored layout (see `check_layout`) and
  the plan has an `optimizer_view` to run it on; False when it acts the same
  (or the plan stores the model's own layout).

  Raises:
    ValueError: as `check_layout` does, when the plan has no `optimizer_view`.

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp, optax, parstrat
    >>> model = hk.transform(lambda x: hk.nets.MLP([8, 8, 4])(x))
    >>> mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
    >>> trainer = parstrat.PipelineModelParallel(stages=2)(model, optax.adamw(1e-3, mask=mask))
    >>> state = trainer.init(jax.random.key(0), jnp.zeros((1, 4)))
    >>> trainer.plan.optimizer_view is not None  # the mask runs on the model's layout
    True
    >>> jax.tree.structure(state.opt_state[0].mu) == jax.tree.structure(trainer.params(state))
    True
  """
  if plan.optimizer_view is None:
    check_layout(optimizer, plan, abstract_params, strategy)
    return False
  if stores_model_layout(plan, abstract_params):
    return False
  return bool(_detail(optimizer, plan, abstract_params, strategy))


def check_layout(optimizer, plan, abstract_params: Any, strategy: Any) -> None:
  """Refuses `optimizer` when it would act differently on the plan's stored layout.

  Nothing is run when the plan stores the model's own layout. Otherwise the
  optimizer runs `STEPS` updates from random params on the model's layout and
  on the stored one (random gradients, every leaf at its own scale), and, if
  none of them moved the params, goes on with the last gradients until one
  does (at most `MAX_STEPS` updates in all); the updates and the optimizer
  states (the stored one mapped back to the model's layout) must agree after
  every step. The inner optimizer of an `optax.MultiSteps` given as the
  optimizer is probed instead of going on. A per-leaf transform that first
  acts after `MAX_STEPS` updates inside a wrapper the probe cannot open (e.g.
  `MultiSteps` with k > 32 under `apply_if_finite`) is not detected.

  The probe runs on the host's CPU device with full-size values: `STEPS`
  optimizer updates (up to `MAX_STEPS` for an optimizer that applies nothing
  in them, e.g. a learning rate of 0), and host memory for a few copies of the params (params,
  gradients and the optimizer state, in both layouts), once per trainer
  whose layout is not the model's, `init_abstract` included (so once per
  pipeline or hybrid candidate of "auto").

  Args:
    optimizer: the optax optimizer.
    plan: the strategy's `Plan`.
    abstract_params: the params in the model's layout (shapes and dtypes).
    strategy: the strategy, for the message.

  Raises:
    ValueError: if the updates or states differ, or the optimizer fails on the
      stored layout (e.g. a mask function that reads Haiku module names); or if
      the plan's `to_params` does not give back what its `to_stored` took.
  """
  if stores_model_layout(plan, abstract_params):
    return
  detail = _detail(optimizer, plan, abstract_params, strategy)
  if detail:
    raise ValueError(
      f"{strategy!r} stores the parameters in a layout of its own (its plan's to_stored), "
      f"not the model's, and the optimizer does not act leaf by leaf ({detail}). Per-leaf "
      "transforms (masks such as optax.adamw(mask=...), optax.masked, "
      "optax.multi_transform, LARS/LAMB trust ratios) are not supported on that layout "
      "without a view of it in the model's layout: give the plan an optimizer_view, or use "
      "data_parallel, fsdp, tensor, pipeline or hybrid, or an element-wise optimizer (sgd, "
      "adam, adamw without a mask, clip_by_global_norm, MultiSteps)."
    )


#: The probe's answers by (optimizer, the plan's layout functions, the params'
#: structure, shapes and dtypes): trainers of one layout given the same optimizer
#: object ("auto"'s candidates, a trainer built again) probe it once. Bounded.
_ANSWERS: dict[Any, str | None] = {}
_MAX_ANSWERS = 256


def _detail(optimizer, plan, abstract_params: Any, strategy: Any) -> str | None:
  """What differs between the optimizer on the two layouts (None: nothing), remembered."""
  leaves, treedef = jax.tree.flatten(abstract_params)
  key = (
    optimizer,
    _by_value(plan.to_stored),
    _by_value(plan.to_params),
    treedef,
    tuple((tuple(x.shape), np.dtype(x.dtype)) for x in leaves),
  )
  try:
    return _ANSWERS[key]
  except TypeError:  # (something unhashable, e.g. a layout holding arrays: not remembered)
    return _probe(optimizer, plan, abstract_params, strategy)
  except KeyError:
    pass
  answer = _probe(optimizer, plan, abstract_params, strategy)
  if len(_ANSWERS) >= _MAX_ANSWERS:
    _ANSWERS.clear()
  _ANSWERS[key] = answer
  return answer


def _by_value(function: Any) -> Any:
  """A bound method as (its object, its function): layouts built alike compare equal
  (bound methods compare their objects by identity)."""
  owner = getattr(function, "__self__", None)
  return function if owner is None else (owner, function.__func__)


def _probe(optimizer, plan, abstract_params: Any, strategy: Any) -> str | None:
  """What differs between the optimizer on the two layouts (None: nothing)."""
  # On the host's CPU device: never an accelerator's memory, and always one of
  # this process's own devices (jax.devices()[0] is not, in a multi-process run).
  # `optax.MultiSteps` applies nothing before its k-th step, which may be
  # later than the probe's last: its inner optimizer is probed instead of going on.
  inner = getattr(optimizer, "inner_opt", None)
  with jax.default_device(jax.local_devices(backend="cpu")[0]):
    detail = _difference(optimizer, plan, abstract_params, strategy, go_on=inner is None)
    if not detail and inner is not None:
      detail = _difference(inner, plan, abstract_params, strategy)
      detail = detail and f"inside MultiSteps, {detail}"
  return detail


def _check_round_trip(params: Any, back: Any, strategy: Any) -> None:
  """Raises a ValueError unless `back`, the params stored and read back, is `params`."""
  if jax.tree.structure(back) != jax.tree.structure(params):
    raise ValueError(
      f"{strategy!r}'s plan: to_params(to_stored(params)) has the structure "
      f"{jax.tree.structure(back)}, not the params' {jax.tree.structure(params)}; the two "
      "functions must be inverses."
    )
  flat = jax.tree_util.tree_leaves_with_path(params)
  for (path, a), b in zip(flat, jax.tree.leaves(back), strict=True):
    if np.shape(a) != np.shape(b) or not np.array_equal(a, b):
      raise ValueError(
        f"{strategy!r}'s plan: to_params(to_stored(params)) changes params"
        f"{jax.tree_util.keystr(path)}; the two functions must be inverses."
      )


def _difference(
  optimizer, plan, abstract_params: Any, strategy: Any, go_on: bool = True
) -> str | None:
  """What differs between the optimizer on the model's layout and on the stored one.

  With `go_on`, when none of the first `STEPS` updates moves the params, the
  probe goes on until one does (at most `MAX_STEPS`).

  Raises:
    ValueError: if the plan's `to_params` does not give back what `to_stored` took.
  """
  rng = np.random.default_rng(0)
  leaves, treedef = jax.tree.flatten(abstract_params)

  def draw():
    return jax.tree.unflatten(
      treedef,
      [
        np.asarray(SCALES[i % len(SCALES)] * rng.standard_normal(x.shape), x.dtype)
        for i, x in enumerate(leaves)
      ],
    )

  # Every function is compiled once per layout and reused at every step. Run
  # eagerly, each of their operations would compile on its own, per leaf shape
  # (a few seconds per probe of a deep model), and control flow such as
  # MultiSteps' `lax.cond` would be traced and compiled again at every step.
  # (A loss for the optimizers that read one, e.g. reduce_on_plateau: a constant,
  # so the same on both layouts; and a loss function for line searches, e.g.
  # lbfgs: half the params' squared norm, which the flat layout's zero padding
  # does not change.)
  init = jax.jit(lambda p: optimizers_lib.init(optimizer, p))
  update = jax.jit(
    lambda g, s, p: optimizers_lib.update(
      optimizer, g, s, p, np.float32(1.0), optimizers_lib.stand_in_loss
    )
  )
  to_stored, to_params = jax.jit(plan.to_stored), jax.jit(plan.to_params)
  apply_updates = jax.jit(optax.apply_updates)
  params = draw()
  stored = to_stored(params)
  _check_round_trip(params, to_params(stored), strategy)
  want_state = init(params)
  try:
    got_state = init(stored)
  except Exception as e:  # noqa: BLE001 - any failure on the flat layout is the answer
    return f"on the flat layout it fails: {type(e).__name__}: {first_line(e)}"
  moved = False
  for step in range(MAX_STEPS if go_on else STEPS):
    if step >= STEPS and moved:
      break
    if step < STEPS:  # (past them, the last gradients again: it waits for an update)
      grads = draw()
    tolerance = 1e-4 if step < STEPS else LATE_TOLERANCE
    want, want_state = update(grads, want_state, params)
    moved = moved or any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(want))
    try:
      got, got_state = update(to_stored(grads), got_state, stored)
    except Exception as e:  # noqa: BLE001
      return f"on the flat layout it fails: {type(e).__name__}: {first_line(e)}"
    if not _close(to_params(got), want, tolerance):
      return f"its update {step + 1} on the flat layout differs from the one on the model's layout"
    back = trees.map_param_like(got_state, stored, to_params)
    if jax.tree.structure(back) != jax.tree.structure(want_state):
      return "its state on the flat layout has another structure than on the model's layout"
    if not _close(back, want_state, tolerance):
      return f"its state after update {step + 1} on the flat layout differs"
    params, stored = apply_updates(params, want), apply_updates(stored, got)
  return None


def _close(got: Any, want: Any, tolerance: float = 1e-4) -> bool:
  """Leaf by leaf equal up to float32 rounding, relative to each leaf's own scale.

  `tolerance` is the relative one (the absolute one is 1/100 of it, times the
  leaf's largest value).
  """
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    a, b = (np.asarray(_data(x), np.float64) for x in (a, b))
    if a.shape != b.shape:
      return False
    scale = float(np.abs(a).max()) if a.size else 0.0
    if not np.allclose(a, b, rtol=tolerance, atol=tolerance / 100 * scale, equal_nan=True):
      return False
  return True


def _data(x: Any) -> Any:
  """An array's values; a typed PRNG key's raw bits (e.g. a noise transform's key)."""
  if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
    return jax.random.key_data(x)
  return x
