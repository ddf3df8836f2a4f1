"""A conformance kit: does a strategy train exactly like plain single-device `jax.jit`?"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

from parstrat._src import checks
from parstrat._src import optimizers as optimizers_lib
from parstrat._src import precision as precision_lib
from parstrat._src import registry
from parstrat._src.strategy import LossFn
from parstrat._src.strategy import Strategy
from parstrat._src.strategy import as_stateful
from parstrat._src.strategy import bind_axes
from parstrat._src.strategy import is_unbound_axis
from parstrat._src.strategy import softmax_cross_entropy

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
ADAM_LR = 1e-3
#: Adam divides by sqrt(v), so rounding differences in near-zero gradients can
#: move a parameter by up to the learning rate; its params are compared to
#: lr / 10. SGD, compared tightly, is where a wrong gradient scale shows.
ADAM_PARAM_ATOL = ADAM_LR / 10

#: The default optimizers, built once: optax's are pure functions, and a trainer of a
#: layout already probed with the same optimizer object skips the layout probe.
_SGD = optax.sgd(0.1)
_ADAM = optax.adam(ADAM_LR)


def use_cpu_devices(count: int) -> None:
  """Gives JAX `count` virtual CPU devices; call it first thing in a conftest.py.

  It must run before anything starts JAX's backend. Called again after the
  backend started, it passes if the count already matches and fails loudly if
  not, rather than letting tests run on the wrong number of devices.

  Args:
    count: the number of CPU devices.

  Raises:
    RuntimeError: if JAX's backend already started with another CPU count.

  Example (in `conftest.py`)::

    import parstrat.testing
    parstrat.testing.use_cpu_devices(8)
  """
  try:
    chex.set_n_cpu_devices(count)
  except RuntimeError:
    have = len(jax.devices("cpu"))
    if have != count:
      raise RuntimeError(
        f"JAX's backend already started with {have} CPU device(s), so {count} cannot be "
        "set: call parstrat.testing.use_cpu_devices at the top of conftest.py, before "
        "any module uses JAX."
      ) from None


def seed_mlp() -> hk.Transformed:
  """The seed's MLP: 784 -> 512 -> 10 with swish."""
  return hk.transform(lambda x: hk.nets.MLP([512, 10], activation=jax.nn.swish)(x))


def random_batches(
  steps: int, batch: int, features: int = 784, classes: int = 10, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
  """Deterministic random images in [0, 1] `[steps, batch, features]` and int labels."""
  rng = np.random.default_rng(seed)
  images = rng.random((steps, batch, features), dtype=np.float32)
  labels = rng.integers(0, classes, (steps, batch)).astype(np.int32)
  return images, labels


@dataclasses.dataclass(frozen=True)
class Report:
  """What a conformance run compared, for one optimizer."""

  strategy: str
  optimizer: str
  steps: int
  losses: tuple[float, ...]
  reference_losses: tuple[float, ...]
  max_loss_diff: float
  max_param_diff: float
  compiles_after_first_step: int
  #: Leaves the order of the sums decides (see `check_strategy`), compared loosely.
  order_sensitive_leaves: tuple[str, ...] = ()

  def __str__(self) -> str:
    loose = (
      f", {len(self.order_sensitive_leaves)} leaves decided by the order of the sums"
      if self.order_sensitive_leaves
      else ""
    )
    return (
      f"{self.strategy} with {self.optimizer}: {self.steps} steps, loss diff "
      f"{self.max_loss_diff:.2e}, param diff {self.max_param_diff:.2e}, "
      f"{self.compiles_after_first_step} recompiles{loose}"
    )


@contextlib.contextmanager
def _count_compiles() -> Iterator[list[str]]:
  events: list[str] = []

  def listener(name: str, duration: float, **kwargs: Any) -> None:
    del duration, kwargs
    if name == _COMPILE_EVENT:
      events.append(name)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


class Reference(NamedTuple):
  """What plain single-device `jax.jit` training produced, step by step."""

  losses: list[float]
  grad_norms: list[float]
  params: Any
  model_state: Any
  #: With `order_spread=True`: per leaf of the params and of the model state, the
  #: largest |difference| from a second run on the same batches with their rows in
  #: reverse order (the same sums, added in another order); else None.
  param_spread: Any = None
  state_spread: Any = None


def reference_train(
  model: hk.Transformed | hk.TransformedWithState,
  optimizer: optax.GradientTransformation,
  batches: Sequence[Any],
  params: Any,
  *,
  loss_fn: LossFn = softmax_cross_entropy,
  model_inputs: Callable[[Any], Any] | None = None,
  model_state: Any = None,
  rng: jax.Array | None = None,
  order_spread: bool = False,
) -> Reference:
  """Plain single-device `jax.jit` training on `batches`: the oracle every strategy must match.

  Batches follow the trainer's contract: `(inputs, labels)` pairs, or with
  `model_inputs` any pytree (the loss then gets the whole batch). A model
  that draws randomness gets at step t the key the trainer derives from the
  same `rng`, `fold_in(fold_in(rng, 1), t)`, for the whole batch.

  Args:
    model: an `hk.Transformed` or `hk.TransformedWithState`.
    optimizer: the optimizer.
    batches: the global batches, one per step.
    params: the initial params.
    loss_fn, model_inputs: as for the trainer.
    model_state: the initial state of a stateful model.
    rng: the key given to `trainer.init` (None: the model draws no randomness).
    order_spread: also train again on the batches with their rows reversed,
      and `ORDER_SHUFFLES` times shuffled (for a model that draws no randomness
      and treats rows alike), and record how far each leaf of the result moved
      at most: how much the order of the sums alone decides it.

  Returns:
    A `Reference`: per-step losses and global gradient norms, final params
    and model state (and with `order_spread`, the spreads).
  """
  stateful = as_stateful(model)
  inputs_of = (lambda b: b[0]) if model_inputs is None else model_inputs
  targets_of = (lambda b: b[1]) if model_inputs is None else (lambda b: b)
  device = jax.devices()[0]
  params = jax.device_put(params, device)
  model_state = jax.device_put({} if model_state is None else model_state, device)
  # Compiled (eagerly, each leaf's zeros compile apart) and committed to `device`
  # like the params: a state with an uncommitted leaf (Adam's count) would make
  # the second step compile again, for its committed one.
  opt_state = jax.device_put(
    jax.jit(functools.partial(optimizers_lib.init, optimizer))(params), device
  )
  base = None if rng is None else jax.random.fold_in(rng, 1)

  @jax.jit
  def step(params, opt_state, model_state, key, batch):
    def loss(p):
      outputs, new_state = stateful.apply(p, model_state, key, inputs_of(batch))
      return loss_fn(outputs, targets_of(batch)), new_state

    (value, model_state), grads = jax.value_and_grad(loss, has_aux=True)(params)
    value_fn = lambda p: loss(p)[0]  # noqa: E731 - the batch's loss, for line searches
    updates, opt_state = optimizers_lib.update(optimizer, grads, opt_state, params, value, value_fn)
    grad_norm = optax.tree_utils.tree_norm(grads)
    return optax.apply_updates(params, updates), opt_state, model_state, value, grad_norm

  def train(params, opt_state, model_state, batches):
    losses, grad_norms = [], []
    for t, batch in enumerate(batches):
      key = None if base is None else jax.random.fold_in(base, t)
      params, opt_state, model_state, loss, grad_norm = step(
        params, opt_state, model_state, key, jax.device_put(batch, device)
      )
      losses.append(float(loss))
      grad_norms.append(float(grad_norm))
    return Reference(losses, grad_norms, params, model_state)

  if not order_spread:
    return train(params, opt_state, model_state, batches)
  first = train(params, opt_state, jax.tree.map(jnp.copy, model_state), batches)
  others = []
  for order in range(1 + ORDER_SHUFFLES):  # rows reversed, then shuffled
    rows = [
      np.arange(n)[::-1] if order == 0 else np.random.default_rng(order).permutation(n)
      for n in (len(jax.tree.leaves(batch)[0]) for batch in batches)
    ]
    again = [jax.tree.map(lambda x, r=r: x[r], b) for b, r in zip(batches, rows, strict=True)]
    others.append(train(params, opt_state, jax.tree.map(jnp.copy, model_state), again))

  def spread(a, *others):
    a = np.asarray(a, np.float64)
    return max(float(np.abs(a - np.asarray(b, np.float64)).max(initial=0.0)) for b in others)

  return first._replace(
    param_spread=jax.tree.map(spread, first.params, *(o.params for o in others)),
    state_spread=jax.tree.map(spread, first.model_state, *(o.model_state for o in others)),
  )


def reference_run(
  model: hk.Transformed,
  optimizer: optax.GradientTransformation,
  images: np.ndarray,
  labels: np.ndarray,
  params: Any,
  loss_fn: LossFn = softmax_cross_entropy,
) -> tuple[list[float], Any]:
  """`reference_train` on `(images[t], labels[t])` batches: (losses, final params)."""
  batches = list(zip(images, labels, strict=True))
  reference = reference_train(model, optimizer, batches, params, loss_fn=loss_fn)
  return reference.losses, reference.params


def _first_divergence(
  params: Any, reference: Any, rtol: float, atol: float, loose: Any = None
) -> tuple[str, float]:
  """The first leaf of `params` not close to `reference`'s ("" if none), and the largest diff.

  A leaf of another shape, or a tree of another structure, is named as such.
  `loose`, a pytree like `reference` of floats or None, replaces `atol` for
  the leaves where it is not None (and leaves them out of the largest diff).
  """
  if jax.tree.structure(params) != jax.tree.structure(reference):
    return (
      f" the tree's structure: {jax.tree.structure(params)}, not the reference's "
      f"{jax.tree.structure(reference)}",
      float("inf"),
    )
  worst_name, worst = "", 0.0
  flat = jax.tree_util.tree_leaves_with_path(params)
  flat_ref = jax.tree.leaves(reference)
  # (Up to the reference's leaves: a None in the params, as `eqx.partition` leaves for a
  # field that is not an array, is no leaf there, while `loose` holds None per leaf too.)
  flat_loose = (
    [None] * len(flat_ref) if loose is None else jax.tree.structure(reference).flatten_up_to(loose)
  )
  for (path, leaf), ref, leaf_atol in zip(flat, flat_ref, flat_loose, strict=True):
    a, b = np.asarray(leaf, np.float64), np.asarray(ref, np.float64)
    name = jax.tree_util.keystr(path) or "(the array)"
    if a.shape != b.shape:
      worst_name = worst_name or f"{name} (shape {a.shape}, not the reference's {b.shape})"
      worst = float("inf")
      continue
    diff = float(np.max(np.abs(a - b))) if a.size else 0.0
    if leaf_atol is not None:
      if not np.allclose(a, b, rtol=rtol, atol=leaf_atol) and not worst_name:
        worst_name = (
          f"{name} (a leaf the order of the sums decides: compared within {leaf_atol:.3g}, "
          f"{ORDER_MARGIN} times its spread over {2 + ORDER_SHUFFLES} orders in the reference)"
        )
        worst = max(worst, diff)
      continue
    if not np.allclose(a, b, rtol=rtol, atol=atol) and not worst_name:
      worst_name = name
    worst = max(worst, diff)
  return worst_name, worst


def _sum_hint(ratio: float, trainer: Any) -> str:
  """A hint when `ratio` is the size of some mesh axis: a sum where a mean belongs."""
  sizes = {int(n) for n in trainer.mesh.shape.values() if n > 1} if trainer.mesh else set()
  sizes.add(trainer.mesh.size if trainer.mesh else 1)
  near = [n for n in sorted(sizes) if n > 1 and abs(ratio - n) < 1e-3 * n]
  return ": the size of a mesh axis, a sum where a mean belongs?" if near else ""


#: A leaf whose reference runs (rows in order, reversed, shuffled) differ by more
#: than its tolerance is compared within this many times their largest difference:
#: another order of the sums (the strategy's) lands about as far.
ORDER_MARGIN = 4

#: Shuffled orders of the rows the reference is trained on besides the reversed one,
#: to tell how far the order of the sums moves a leaf: one other order alone drew too
#: small a spread now and then (attention's key bias under Adam through a pipeline's
#: microbatches: 4.72e-4 against an allowance of 4.64e-4).
ORDER_SHUFFLES = 2


def _order_tolerances(spread: Any, atol: float, base_atol: float) -> Any:
  """Per leaf of `spread`, a tolerance where the order of the sums decides it, else None.

  Adam and other adaptive optimizers divide a gradient that is zero but for
  rounding (attention's key bias, a bias before BatchNorm) by its own size:
  the rounding becomes steps of about the learning rate, in directions the
  order of every sum decides. Two orders of the reference itself then differ
  beyond `base_atol` (the tolerance of an order-independent result) there, and
  nowhere else: such a leaf gets `atol + ORDER_MARGIN * spread`.
  """
  if spread is None:
    return None
  return jax.tree.map(lambda s: atol + ORDER_MARGIN * s if s > base_atol else None, spread)


def _loose_leaves(loose: Any, prefix: str) -> tuple[str, ...]:
  """The names of the leaves `_order_tolerances` loosened."""
  if loose is None:
    return ()
  return tuple(
    prefix + jax.tree_util.keystr(path)
    for path, tol in jax.tree_util.tree_leaves_with_path(loose, is_leaf=lambda x: x is None)
    if tol is not None
  )


def check_strategy(
  strategy: Strategy | str,
  model: hk.Transformed | hk.TransformedWithState | None = None,
  optimizers: Sequence[optax.GradientTransformation]
  | Mapping[str, optax.GradientTransformation]
  | None = None,
  *,
  steps: int = 5,
  batch: int = 64,
  features: int = 784,
  loss_fn: LossFn | None = None,
  batches: Sequence[Any] | None = None,
  model_inputs: Callable[[Any], Any] | None = None,
  rtol: float = 1e-5,
  atol: float = 1e-5,
  seed: int = 0,
  precision: Any = None,
  accumulate: int = 1,
) -> list[Report]:
  """Trains `strategy` beside plain single-device `jax.jit` and asserts they agree.

  For each optimizer (default: SGD, where a wrong gradient scale shows and
  everything is compared within `rtol`/`atol`, and Adam, whose params are
  compared within `ADAM_PARAM_ATOL` = lr / 10 because Adam amplifies rounding
  in near-zero gradients), both runs start from the same params (and model
  state and key) and see the same batches. After every step the strategy's
  replicas must be identical across devices; after the first step nothing
  may recompile; the per-step losses and `metrics["grad_norm"]` (the global
  norm of the batch's gradient), the final params (in the model's layout)
  and model state must match the reference within `rtol`/`atol`; and
  `trainer.apply` on the first batch's inputs must give what `model.apply`
  gives on `trainer.params(state)` (same structure and shapes, within
  `rtol`/`atol`). When a leaf of the params or model state differs beyond
  its tolerance, and the model draws no randomness, the reference is trained
  again, also on the batches with their rows reversed and shuffled (the same sums in
  another order): a leaf where those two differ beyond `atol` is one the
  order of the sums decides (adaptive optimizers turn the rounding of a
  gradient that is zero but for rounding, such as attention's key bias or a
  bias before BatchNorm, into learning-rate-sized steps), and is compared
  within its tolerance plus `ORDER_MARGIN` times that spread; the report
  names such leaves (`Report.order_sensitive_leaves`). A leaf with a real
  gradient has no such spread, so a strategy that drops or flips its
  gradient is still caught. The model state is checked only for a model that has one:
  the default model has none, so pass a stateful model to check a strategy
  that declares `supports_state`. A model whose collectives name one of the
  strategy's `model_axes` (`hk.BatchNorm(cross_replica_axis="data")` under
  `data_parallel`) runs in the reference with that axis bound at size 1.

  A model that draws randomness gets the same keys as the reference only
  where the layout computes on the whole batch at once (fsdp, tensor); under
  data parallelism each device folds in its index, so such a model passes
  only if its randomness does not change values (e.g. dropout at rate 0).

  Args:
    strategy: a `Strategy` instance or a registered name.
    model: an `hk.Transformed` or `hk.TransformedWithState` (default: the
      seed MLP, taking `[B, features]`).
    optimizers: the optimizers to try (default: `sgd(0.1)` and `adam(1e-3)`),
      a sequence (reported as "optimizer 0", ...) or a mapping name -> optimizer.
    steps: training steps per optimizer (with `batches`: one per batch).
    batch: the global batch size of the random batches.
    features: input features per example of the random batches.
    loss_fn: as for the trainer (default: softmax cross-entropy).
    batches: the batches to train on (default: `steps` random `(images,
      labels)` pairs of `batch` rows).
    model_inputs: as for the trainer (`batch -> model inputs`).
    rtol, atol: tolerances on losses, gradient norms, outputs and params.
    seed: for the params, the model's key and the random batches.
    precision: the trainer's mixed-precision policy; the reference runs the
      same jmp policy on one device. For bfloat16 pass `optimizers=[sgd]`
      and `rtol=atol=1e-3`: the strategies sum gradients in another order,
      and Adam turns that rounding into param steps as large as a dropped
      update's, which no tolerance separates (see README).
    accumulate: the trainer's gradient accumulation; the reference trains on
      the whole batch at once, which accumulation must reproduce.

  Returns:
    One `Report` per optimizer when everything holds.

  Raises:
    AssertionError: with a report of the first thing that differs.

  Example:
    >>> import parstrat, parstrat.testing
    >>> reports = parstrat.testing.check_strategy("data_parallel", steps=2, batch=16)
    >>> [r.optimizer for r in reports]
    ['sgd', 'adam']
  """
  if isinstance(strategy, str):
    strategy = registry.get(strategy)
  model = seed_mlp() if model is None else model
  named = (
    [("sgd", _SGD, atol), ("adam", _ADAM, max(atol, ADAM_PARAM_ATOL))]
    if optimizers is None
    else [(name, opt, atol) for name, opt in optimizers.items()]
    if isinstance(optimizers, Mapping)
    else [(f"optimizer {i}", opt, atol) for i, opt in enumerate(optimizers)]
  )
  if batches is None:
    images, labels = random_batches(steps, batch, features, seed=seed)
    batches = list(zip(images, labels, strict=True))
  steps = len(batches)
  inputs_of = (lambda b: b[0]) if model_inputs is None else model_inputs
  first_inputs = inputs_of(batches[0])
  sample = jax.tree.map(lambda x: x[:1], first_inputs)
  reports = []
  reference_model = as_stateful(
    precision_lib.with_policy(model, precision_lib.resolve_policy(precision))
  )
  try:
    jax.eval_shape(reference_model.init, jax.random.key(seed), sample)
  except NameError as e:  # (a collective over one of the strategy's `model_axes`, e.g.
    # sync BatchNorm's over "data", runs in the reference over that axis of size 1: one
    # device, the whole batch)
    if not is_unbound_axis(e):
      raise
    reference_model = bind_axes(reference_model, strategy.model_axes)
  reference_apply = jax.jit(reference_model.apply)  # compiled once for every optimizer
  for name, optimizer, param_atol in named:
    options = {"precision": precision} if precision is not None else {}
    if accumulate != 1:
      options["accumulate"] = accumulate
    if model_inputs is not None:
      options["model_inputs"] = model_inputs
    trainer = strategy(model, optimizer, loss_fn=loss_fn, **options)
    key = jax.random.key(seed)
    reference_params, reference_state = jax.jit(reference_model.init)(key, sample)
    label = f"{strategy!r} with {name}"
    try:
      # (the first batch fixes the batch's layout, and "auto" measures at its size)
      state = trainer.init(key, sample, sample_batch=batches[0])
    except AssertionError:
      raise
    except Exception as e:  # noqa: BLE001 - a strategy that cannot run fails the check
      raise AssertionError(f"{label} failed to train: {type(e).__name__}: {e}") from e
    train_reference = functools.partial(
      reference_train,
      reference_model,
      optimizer,
      batches,
      reference_params,
      loss_fn=trainer.loss_fn,
      model_inputs=model_inputs,
      model_state=reference_state,
      rng=key,
    )
    reference = train_reference()
    try:
      losses, grad_norms = [], []
      with _count_compiles() as compiles:
        for i in range(steps):
          if i == 1:
            compiles.clear()
          state, metrics = trainer.step(state, batches[i])
          losses.append(float(metrics["loss"]))
          grad_norms.append(float(metrics["grad_norm"]))
          try:
            checks.assert_replicas_equal(state)
          except AssertionError as e:
            raise AssertionError(f"{label}: after step {i + 1}: {e}") from None
        recompiles = len(compiles)
      params = trainer.params(state)
      model_state = state.model_state  # replicated
      apply_key = jax.random.key(seed + 1)
      outputs = trainer.apply(state, first_inputs, rng=apply_key)
      expected_outputs = reference_apply(params, model_state, apply_key, first_inputs)[0]
    except AssertionError:
      raise
    except Exception as e:  # noqa: BLE001 - a strategy that cannot run fails the check
      raise AssertionError(f"{label} failed to train: {type(e).__name__}: {e}") from e
    ref_losses = reference.losses
    loss_diff = np.abs(np.asarray(losses) - np.asarray(ref_losses))
    problems = []
    bad_steps = np.flatnonzero(~np.isclose(losses, ref_losses, rtol=rtol, atol=atol))
    if bad_steps.size:
      i = int(bad_steps[0])
      problems.append(
        f"loss differs from step {i + 1}: {losses[i]:.8g} vs reference {ref_losses[i]:.8g} "
        f"(ratio {losses[i] / ref_losses[i]:.6g})"
      )
    # Adam's params may drift by its tolerance, and the gradients with them.
    norm_rtol = rtol if param_atol == atol else max(rtol, 1e-4)
    bad_norms = np.flatnonzero(
      ~np.isclose(grad_norms, reference.grad_norms, rtol=norm_rtol, atol=atol)
    )
    if bad_norms.size:
      i = int(bad_norms[0])
      problems.append(
        f"metrics['grad_norm'] differs from step {i + 1}: {grad_norms[i]:.8g} vs the "
        f"reference's gradient norm {reference.grad_norms[i]:.8g} (ratio "
        f"{grad_norms[i] / reference.grad_norms[i]:.6g}"
        + _sum_hint(grad_norms[i] / reference.grad_norms[i], trainer)
        + ")"
      )
    strict = (
      _first_divergence(params, reference.params, rtol, param_atol)[0]
      or _first_divergence(model_state, reference.model_state, rtol, param_atol)[0]
    )
    if strict and not trainer.uses_rng:
      # Which leaves does the order of the sums decide? The reference again, also on
      # its rows reversed (not for a model that draws randomness: its masks would
      # fall on other rows). Only here: a passing check costs no second run.
      reference = train_reference(order_spread=True)
    loose = _order_tolerances(reference.param_spread, param_atol, atol)
    loose_state = _order_tolerances(reference.state_spread, param_atol, atol)
    leaf, param_diff = _first_divergence(params, reference.params, rtol, param_atol, loose)
    if leaf:
      problems.append(f"params diverge first at {leaf} (max abs diff {param_diff:.3g})")
    leaf, state_diff = _first_divergence(
      model_state, reference.model_state, rtol, param_atol, loose_state
    )
    if leaf:
      problems.append(f"model state diverges first at {leaf} (max abs diff {state_diff:.3g})")
    leaf, output_diff = _first_divergence(outputs, expected_outputs, rtol, atol)
    if leaf:
      problems.append(
        f"trainer.apply differs from model.apply on trainer.params at outputs{leaf} "
        f"(max abs diff {output_diff:.3g})"
      )
    if steps > 1 and recompiles:
      problems.append(f"{recompiles} compilation(s) after the first step (expected none)")
    if problems:
      raise AssertionError(f"{label} does not match single-device jit: " + "; ".join(problems))
    reports.append(
      Report(
        strategy=repr(strategy),
        optimizer=name,
        steps=steps,
        losses=tuple(losses),
        reference_losses=tuple(ref_losses),
        max_loss_diff=float(loss_diff.max()),
        max_param_diff=param_diff,
        compiles_after_first_step=recompiles,
        order_sensitive_leaves=_loose_leaves(loose, "params")
        + _loose_leaves(loose_state, "model_state"),
      )
    )
  return reports
