"""A conformance kit: does a strategy train exactly like plain single-device `jax.jit`?"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import chex
import haiku as hk
import jax
import numpy as np
import optax

from parstrat._src import checks
from parstrat._src import precision as precision_lib
from parstrat._src import registry
from parstrat._src.strategy import LossFn
from parstrat._src.strategy import Strategy
from parstrat._src.strategy import Trainer
from parstrat._src.strategy import softmax_cross_entropy

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
ADAM_LR = 1e-3
#: Adam divides by sqrt(v), so rounding differences in near-zero gradients can
#: move a parameter by up to the learning rate; its params are compared to
#: lr / 10. SGD, compared tightly, is where a wrong gradient scale shows.
ADAM_PARAM_ATOL = ADAM_LR / 10


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

  def __str__(self) -> str:
    return (
      f"{self.strategy} with {self.optimizer}: {self.steps} steps, loss diff "
      f"{self.max_loss_diff:.2e}, param diff {self.max_param_diff:.2e}, "
      f"{self.compiles_after_first_step} recompiles"
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


def reference_run(
  model: hk.Transformed,
  optimizer: optax.GradientTransformation,
  images: np.ndarray,
  labels: np.ndarray,
  params: Any,
  loss_fn: LossFn = softmax_cross_entropy,
) -> tuple[list[float], Any]:
  """Plain single-device `jax.jit` training: the oracle every strategy must match."""
  device = jax.devices()[0]
  params = jax.device_put(params, device)
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(model.apply(p, None, x), y))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for x, y in zip(images, labels, strict=True):
    params, opt_state, loss = step(params, opt_state, jax.device_put(x, device), y)
    losses.append(float(loss))
  return losses, params


def _first_divergence(params: Any, reference: Any, rtol: float, atol: float) -> tuple[str, float]:
  worst_name, worst = "", 0.0
  flat = jax.tree_util.tree_leaves_with_path(params)
  flat_ref = jax.tree.leaves(reference)
  for (path, leaf), ref in zip(flat, flat_ref, strict=True):
    a, b = np.asarray(leaf, np.float64), np.asarray(ref, np.float64)
    diff = float(np.max(np.abs(a - b))) if a.size else 0.0
    if not np.allclose(a, b, rtol=rtol, atol=atol) and not worst_name:
      worst_name = jax.tree_util.keystr(path)
    worst = max(worst, diff)
  return worst_name, worst


def _check_batch_split(trainer: Trainer, state, images: np.ndarray) -> None:
  logits = trainer.apply(state, images)
  expected = jax.sharding.NamedSharding(trainer.mesh, trainer.plan.batch_spec)
  if not logits.sharding.is_equivalent_to(expected, logits.ndim):
    raise AssertionError(
      f"The batch was not split as the plan says: outputs are laid out as "
      f"{logits.sharding}, the plan's batch_spec is {trainer.plan.batch_spec}."
    )


def check_strategy(
  strategy: Strategy | str,
  model: hk.Transformed | None = None,
  optimizers: Sequence[optax.GradientTransformation] | None = None,
  *,
  steps: int = 5,
  batch: int = 64,
  features: int = 784,
  loss_fn: LossFn | None = None,
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
  in near-zero gradients), both runs start from the same params and see the same deterministic
  batches. After every step the strategy's replicas must be identical across
  devices; after the first step nothing may recompile; the per-step losses and
  the final params (in the model's layout) must match the reference within
  `rtol`/`atol`; and the outputs of `trainer.apply` must be split over the
  mesh as the plan's `batch_spec` says.

  Args:
    strategy: a `Strategy` instance or a registered name.
    model: an `hk.Transformed` taking `[B, features]` (default: the seed MLP).
    optimizers: the optimizers to try (default: `sgd(0.1)` and `adam(1e-3)`).
    steps: training steps per optimizer.
    batch: the global batch size.
    features: input features per example.
    loss_fn: as for the trainer (default: softmax cross-entropy).
    rtol, atol: tolerances on losses and params.
    seed: for the params and the batches.
    precision: the trainer's mixed-precision policy; the reference runs the
      same jmp policy on one device (bfloat16 runs need looser tolerances:
      the strategies sum gradients in another order).
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
    [("sgd", optax.sgd(0.1), atol), ("adam", optax.adam(ADAM_LR), max(atol, ADAM_PARAM_ATOL))]
    if optimizers is None
    else [(f"optimizer {i}", opt, atol) for i, opt in enumerate(optimizers)]
  )
  images, labels = random_batches(steps, batch, features, seed=seed)
  reports = []
  reference_model = precision_lib.with_policy(model, precision_lib.resolve_policy(precision))
  for name, optimizer, param_atol in named:
    options = {"precision": precision} if precision is not None else {}
    if accumulate != 1:
      options["accumulate"] = accumulate
    trainer = strategy(model, optimizer, loss_fn=loss_fn, **options)
    key = jax.random.key(seed)
    reference_params = jax.jit(reference_model.init)(key, images[0][:1])
    ref_losses, ref_params = reference_run(
      reference_model, optimizer, images, labels, reference_params, trainer.loss_fn
    )
    label = f"{strategy!r} with {name}"
    try:
      state = trainer.init(key, images[0][:1])
      losses = []
      with _count_compiles() as compiles:
        for i in range(steps):
          if i == 1:
            compiles.clear()
          state, metrics = trainer.step(state, (images[i], labels[i]))
          losses.append(float(metrics["loss"]))
          try:
            checks.assert_replicas_equal(state)
          except AssertionError as e:
            raise AssertionError(f"{label}: after step {i + 1}: {e}") from None
        recompiles = len(compiles)
      params = trainer.params(state)
      _check_batch_split(trainer, state, images[0])
    except AssertionError:
      raise
    except Exception as e:  # noqa: BLE001 - a strategy that cannot run fails the check
      raise AssertionError(f"{label} failed to train: {type(e).__name__}: {e}") from e
    loss_diff = np.abs(np.asarray(losses) - np.asarray(ref_losses))
    problems = []
    bad_steps = np.flatnonzero(~np.isclose(losses, ref_losses, rtol=rtol, atol=atol))
    if bad_steps.size:
      i = int(bad_steps[0])
      problems.append(
        f"loss differs from step {i + 1}: {losses[i]:.8g} vs reference {ref_losses[i]:.8g} "
        f"(ratio {losses[i] / ref_losses[i]:.4g})"
      )
    leaf, param_diff = _first_divergence(params, ref_params, rtol, param_atol)
    if leaf:
      problems.append(f"params diverge first at {leaf} (max abs diff {param_diff:.3g})")
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
      )
    )
  return reports
