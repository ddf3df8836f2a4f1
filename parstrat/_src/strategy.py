"""The `Strategy` base class, the `Plan` it produces, and the `Trainer` engine.

A strategy answers three questions and nothing else:

1. Which mesh does it want?                      `Strategy.make_mesh`
2. How are params stored and the batch split?    `Plan.param_spec`, `Plan.batch_spec`,
                                                 `Plan.to_stored`, `Plan.to_params`
3. How does one device compute its gradients?    `Plan.loss_and_grad`, `Plan.forward`

The `Trainer` does the rest the same way for every strategy: it initialises and
places the state, runs the optimizer in the global (jit) view, validates batches,
and compiles one step program.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import ClassVar
from typing import NamedTuple

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from parstrat._src import checks
from parstrat._src import distributed
from parstrat._src import messages
from parstrat._src import optimizer_probe
from parstrat._src import precision as precision_lib
from parstrat._src import trees

Params = Any  # a pytree in the model's own (Haiku) layout
LossFn = Callable[[jax.Array, jax.Array], jax.Array]
Batch = tuple[Any, Any]


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """The default loss: mean softmax cross-entropy on integer labels.

  Args:
    logits: `[B, C]` float logits.
    labels: `[B]` integer class labels in `[0, C)`.

  Returns:
    The scalar mean loss over the batch.
  """
  return optax.losses.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class TrainState(NamedTuple):
  """Training state, as laid out on the strategy's mesh.

  Attributes:
    step: the number of optimizer updates applied so far (a replicated int32).
    params: the parameters in the strategy's storage layout (use
      `trainer.params(state)` for the model's own layout).
    opt_state: the optax state of `params`, sharded like them.
  """

  step: jax.Array
  params: Any
  opt_state: optax.OptState


@dataclasses.dataclass(frozen=True)
class Plan:
  """How one model is laid out and differentiated on a strategy's mesh.

  A `Plan` is built by `Strategy.make_plan` once the parameter shapes are known.
  Every function in it is pure and traceable.

  Attributes:
    param_spec: `PartitionSpec` (or a pytree prefix of them) of the stored params.
    batch_spec: `PartitionSpec` of the batch's leading axis.
    to_stored: maps params in the model's layout to the stored layout.
    to_params: the inverse of `to_stored`.
    loss_and_grad: `(stored, inputs, labels) -> (loss, grads)` for one device, run
      under `jax.shard_map` over the whole mesh. `stored`, `inputs` and `labels`
      are the device's blocks. It returns the global mean loss and the gradients
      of it (already reduced over every axis the batch is split on), shaped and
      sharded like `stored`.
    forward: `(stored, inputs) -> logits` for one device, under `jax.shard_map`;
      the logits are split like the inputs.
    batch_multiple: the per-device batch must be a multiple of this (e.g. the
      number of pipeline microbatches).
    description: a human-readable account of the layout (e.g. a stage table).
    check_vma: run `loss_and_grad` and `forward` under `jax.shard_map` with
      varying-manual-axes checking. Keep it on unless every reduction is
      explicit (with it on, the gradient of a replicated input comes back
      already summed over the mesh).
    manual: True (default): `loss_and_grad` and `forward` run per device under
      `jax.shard_map` and write their collectives. False: they run on global
      arrays under `jit`, laid out by `param_spec` and `batch_spec`, and XLA's
      SPMD partitioner inserts the collectives those shardings imply (how FSDP
      and tensor parallelism are expressed).
    reduce: optional `(loss, grads) -> (loss, grads)` run once per step after
      `loss_and_grad` (under the same `jax.shard_map`). A plan that sets it
      returns each device's *local* loss and gradients from `loss_and_grad` and
      averages them here, so gradient accumulation over k microsteps pays for
      one reduction instead of k. `None`: `loss_and_grad` already reduces.
    grad_spec: `PartitionSpec`s the gradients are laid out with before the
      optimizer runs (global plans only; default `param_spec`). ZeRO-2 shards
      them while the params stay replicated.
    opt_spec: `PartitionSpec`s of the optimizer state's parameter-shaped leaves
      (default `param_spec`). ZeRO-1 shards them while the params stay
      replicated.
  """

  param_spec: Any
  batch_spec: P
  to_stored: Callable[[Params], Any]
  to_params: Callable[[Any], Params]
  loss_and_grad: Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]]
  forward: Callable[[Any, jax.Array], jax.Array]
  batch_multiple: int = 1
  description: str = ""
  check_vma: bool = True
  manual: bool = True
  reduce: Callable[[tuple[jax.Array, Any]], tuple[jax.Array, Any]] | None = None
  grad_spec: Any = None
  opt_spec: Any = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strategy(abc.ABC):
  """A way to lay a model and its training step out over a device mesh.

  A subclass is a frozen dataclass of its options and implements two methods:

  * `make_mesh()`: the `jax.sharding.Mesh` it wants, with named axes.
  * `make_plan(model, loss_fn, mesh, sample_params, sample_inputs)`: a `Plan`
    saying how params are stored (and sharded), how the batch is split, and how
    one device computes the loss and the *averaged* gradients with collectives
    over the mesh's axis names.

  Calling a strategy with a Haiku model and an optax optimizer returns a
  `Trainer`; the trainer, not the strategy, holds anything model-specific.

  Attributes:
    devices: the devices to build the mesh from (default: `jax.devices()`).
    debug: check after every step that replicas of every replicated value are
      identical across devices (`parstrat.checks.assert_replicas_equal`).

  Example:
    >>> import haiku as hk, jax, optax, parstrat
    >>> model = hk.transform(lambda x: hk.nets.MLP([8, 10])(x))
    >>> trainer = parstrat.get("data_parallel", data=2)(model, optax.sgd(0.1))
    >>> state = trainer.init(jax.random.key(0), jax.numpy.zeros((1, 4)))
    >>> state.params["mlp/~/linear_0"]["w"].shape
    (4, 8)
  """

  devices: Sequence[jax.Device] | None = None
  debug: bool = False

  #: Names of the mesh axes this strategy uses, in order.
  axis_names: ClassVar[tuple[str, ...]] = ()

  @abc.abstractmethod
  def make_mesh(self) -> Mesh:
    """Returns the mesh this strategy runs on.

    Raises:
      ValueError: if the requested mesh does not fit the available devices.
    """

  @abc.abstractmethod
  def make_plan(
    self,
    model: hk.Transformed,
    loss_fn: LossFn,
    mesh: Mesh,
    sample_params: Params,
    sample_inputs: jax.ShapeDtypeStruct,
  ) -> Plan:
    """Returns the `Plan` for `model` on `mesh`.

    Args:
      model: the user's Haiku model (only `init` and `apply` are used).
      loss_fn: `(logits, labels) -> scalar` mean loss over examples.
      mesh: the mesh from `make_mesh`.
      sample_params: abstract params (`jax.ShapeDtypeStruct` leaves).
      sample_inputs: abstract inputs of one example batch (any batch size).
    """

  def __call__(
    self,
    model: hk.Transformed,
    optimizer: optax.GradientTransformation,
    *,
    loss_fn: LossFn | None = None,
    skip_nonfinite: bool = False,
    precision: Any = None,
    accumulate: int = 1,
  ) -> Trainer:
    """Wraps `model` and `optimizer` into a `Trainer` on this strategy's mesh.

    Args:
      model: an `hk.Transformed` (e.g. from `hk.transform`); `apply` is called
        with `rng=None`, so the model must not need randomness.
      optimizer: any `optax.GradientTransformation`.
      loss_fn: `(logits, labels) -> scalar`, a *mean* over examples (it is
        averaged over devices and microbatches). Default: softmax
        cross-entropy on integer labels.
      skip_nonfinite: when the loss, the gradient norm, or the updated params
        or optimizer state of a step hold a NaN or infinity, keep the previous
        params and optimizer state (and step count); `metrics["finite"]` says
        whether the update was applied.
      precision: mixed precision, applied with jmp around the model's `apply`:
        "mixed_bfloat16" computes in bfloat16 with params, optimizer state and
        loss in float32; also a jmp policy string or a `jmp.Policy`. Default:
        float32 throughout.
      accumulate: gradient accumulation: each `step` splits every device's
        batch block into `accumulate` equal microsteps run one after another,
        sums their gradients and applies one optimizer update, so activations
        are held for 1/`accumulate` of the batch at a time. The result is
        training on the whole batch (the loss must be a mean over examples).

    Returns:
      A `Trainer`.

    Raises:
      TypeError: if `model`, `optimizer` or `loss_fn` are of the wrong kind.
      ValueError: if the mesh does not fit the available devices, or
        `precision` or `accumulate` is invalid.
    """
    return Trainer(
      self,
      model,
      optimizer,
      loss_fn=loss_fn,
      skip_nonfinite=skip_nonfinite,
      precision=precision,
      accumulate=accumulate,
    )

  def resolve(self, trainer: Trainer, sample_inputs: jax.Array) -> Strategy:
    """The concrete strategy to run; `self` except for strategies that choose at `init`.

    `parstrat.Auto` overrides it to pick a strategy once the model's shapes
    are known; `Trainer.init` calls it (with the trainer's model, optimizer
    and options) before building the mesh.
    """
    del trainer, sample_inputs
    return self

  #: True for strategies (like "auto") whose mesh is only known after `resolve`.
  deferred: ClassVar[bool] = False

  #: How gradients cross the "data" axis, for "auto"'s cost model: (bytes each
  #: device moves per byte of gradients it holds, times (D-1)/D; collectives
  #: per step). An all-reduce: (2, 1). FSDP overrides it per ZeRO stage.
  gradient_traffic: ClassVar[tuple[float, int]] = (2.0, 1)

  @classmethod
  def candidates_for(
    cls, axis_sizes: dict[str, int], devices: Sequence[jax.Device] | None = None
  ) -> list[Strategy]:
    """This strategy's configurations on a mesh with `axis_sizes`, for "auto".

    The default builds one, passing each mesh axis's size to the dataclass
    field named like the axis (or the axis plus "s": axis "stage" -> `stages`),
    so a custom strategy takes part in "auto" by declaring its `axis_names`
    and such fields. It returns no candidate when a field is missing.

    Args:
      axis_sizes: a size for each of `axis_names`.
      devices: the devices the mesh is built from.

    Returns:
      The strategies to measure (possibly none).
    """
    fields = (
      {f.name for f in dataclasses.fields(cls) if f.init}
      if dataclasses.is_dataclass(cls)
      else set()
    )
    config = {}
    for axis, size in axis_sizes.items():
      name = next((n for n in (axis, axis + "s") if n in fields), None)
      if name is None:
        return []
      config[name] = size
    return [cls(devices=devices, **config)]

  def __repr__(self) -> str:
    shown = []
    for field in dataclasses.fields(self):
      if not field.init or not field.repr:
        continue
      value = getattr(self, field.name)
      if field.name == "devices" and value is not None:
        shown.append(f"devices=<{len(value)} devices>")
      elif value != field.default:
        shown.append(f"{field.name}={value!r}")
    return f"{type(self).__name__}({', '.join(shown)})"


def available_devices(devices: Sequence[jax.Device] | None) -> list[jax.Device]:
  """Returns `devices` as a list, or every device JAX sees."""
  return list(jax.devices() if devices is None else devices)


def build_mesh(
  axis_sizes: dict[str, int | None],
  devices: Sequence[jax.Device] | None,
) -> Mesh:
  """Builds a mesh with the named axes; at most one size may be `None` (fill).

  The axes are `AxisType.Auto`: parstrat writes every collective explicitly
  inside `jax.shard_map` and pins shardings on `jit`, and Auto axes keep
  mesh-typed arrays out of the user's own code (with Explicit axes, a plain
  `jax.jit(model.apply)` on returned params fails outside `jax.set_mesh`).

  Args:
    axis_sizes: mesh axis name -> size, in mesh order; one `None` takes all the
      remaining devices.
    devices: the devices to use (default: all).

  Returns:
    The mesh, over the first `prod(sizes)` devices.

  Raises:
    ValueError: if a size is not a positive integer, or more devices are asked
      for than exist, or the devices do not divide evenly.
  """
  devs = available_devices(devices)
  if not devs:
    raise ValueError(f"No devices to build the mesh {dict(axis_sizes)} from (devices=[]).")
  known = 1
  for name, size in axis_sizes.items():
    if size is None:
      continue
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
      raise ValueError(f"Mesh axis {name!r} needs a positive integer size, got {size!r}.")
    known *= int(size)
  fill = [name for name, size in axis_sizes.items() if size is None]
  sizes = dict(axis_sizes)
  if fill:
    if len(fill) > 1:
      raise ValueError(f"At most one mesh axis may be left to fill the devices, got {fill}.")
    if len(devs) % known:
      raise ValueError(
        f"{len(devs)} devices do not split evenly into axis {fill[0]!r} with the other "
        f"axes {dict((k, v) for k, v in axis_sizes.items() if v is not None)} (product {known})."
      )
    sizes[fill[0]] = len(devs) // known
  total = int(np.prod(list(sizes.values())))
  if total > len(devs):
    described = " x ".join(f"{name}={size}" for name, size in sizes.items())
    raise messages.TooFewDevicesError(described, total, len(devs), devs[0].platform)
  shape = tuple(int(s) for s in sizes.values())
  return jax.make_mesh(
    shape,
    tuple(sizes),
    devices=devs[:total],
    axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
  )


def _check_model(model: Any) -> None:
  if isinstance(model, hk.TransformedWithState):
    raise TypeError(
      "parstrat trains stateless models: got an hk.TransformedWithState "
      "(from hk.transform_with_state); use hk.transform."
    )
  if not (callable(getattr(model, "init", None)) and callable(getattr(model, "apply", None))):
    raise TypeError(
      f"The model must be an hk.Transformed (from hk.transform), got {type(model).__name__}."
    )


def _check_optimizer(optimizer: Any) -> None:
  if not (
    callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
  ):
    raise TypeError(
      "The optimizer must be an optax.GradientTransformation (e.g. optax.adam(1e-3)), "
      f"got {type(optimizer).__name__}."
    )


class Trainer:
  """A model and an optimizer laid out by a strategy: `init`, `step`, `apply`, `params`.

  Built by calling a `Strategy`. The compiled programs are built on first use
  and cached, so the second `step` does not retrace.

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp, optax, parstrat
    >>> model = hk.transform(lambda x: hk.nets.MLP([16, 10])(x))
    >>> trainer = parstrat.DataParallel(data=2)(model, optax.sgd(0.1))
    >>> images, labels = jnp.ones((8, 4)), jnp.zeros((8,), jnp.int32)
    >>> state = trainer.init(jax.random.key(0), images[:1])
    >>> state, metrics = trainer.step(state, (images, labels))
    >>> int(state.step), metrics["loss"].shape
    (1, ())
  """

  def __init__(
    self,
    strategy: Strategy,
    model: hk.Transformed,
    optimizer: optax.GradientTransformation,
    *,
    loss_fn: LossFn | None = None,
    skip_nonfinite: bool = False,
    precision: Any = None,
    accumulate: int = 1,
  ):
    _check_model(model)
    _check_optimizer(optimizer)
    if loss_fn is not None and not callable(loss_fn):
      raise TypeError(f"loss_fn must be callable (logits, labels) -> scalar, got {loss_fn!r}.")
    if isinstance(accumulate, bool) or not isinstance(accumulate, (int, np.integer)):
      raise TypeError(f"accumulate must be a positive integer, got {accumulate!r}.")
    if accumulate < 1:
      raise ValueError(f"accumulate must be a positive integer, got {accumulate!r}.")
    self.policy = precision_lib.resolve_policy(precision)
    self.precision = precision
    self.accumulate = int(accumulate)
    self.strategy = strategy
    self.model = model
    self.optimizer = optimizer
    self.loss_fn = softmax_cross_entropy if loss_fn is None else loss_fn
    self.uses_default_loss = self.loss_fn is softmax_cross_entropy
    self.skip_nonfinite = bool(skip_nonfinite)
    #: For "auto": the `parstrat.Choice` made at `init` (None otherwise).
    self.choice = None
    # What the plan sees: the user's model with the precision policy around `apply`.
    self._plan_model = precision_lib.with_policy(model, self.policy)
    # A deferred strategy ("auto") builds its mesh in `init`, once it has chosen.
    self.mesh: Mesh | None = None if strategy.deferred else strategy.make_mesh()
    self._plan: Plan | None = None
    self._input_shape: tuple[int, ...] | None = None

  def __repr__(self) -> str:
    mesh = "chosen at init" if self.mesh is None else dict(self.mesh.shape)
    extra = f", precision={self.precision!r}" if self.precision is not None else ""
    extra += f", accumulate={self.accumulate}" if self.accumulate != 1 else ""
    return f"Trainer({self.strategy!r}, mesh={mesh}{extra})"

  # ----------------------------------------------------------------- plan
  @property
  def plan(self) -> Plan:
    """The strategy's `Plan` for this model (available after `init`)."""
    if self._plan is None:
      raise RuntimeError("Call trainer.init(rng, sample_inputs) before using the trainer.")
    return self._plan

  def _shardings(self, spec_tree: Any) -> Any:
    return jax.tree.map(
      lambda spec: NamedSharding(self.mesh, spec),
      spec_tree,
      is_leaf=lambda x: isinstance(x, P),
    )

  @functools.cached_property
  def _replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  # ----------------------------------------------------------------- init
  def init(self, rng: jax.Array, sample_inputs: Any) -> TrainState:
    """Initialises params and optimizer state, placed on the mesh.

    Args:
      rng: a JAX PRNG key (`jax.random.key(seed)`).
      sample_inputs: example inputs `[B, ...]` of any batch size `B >= 1`; their
        per-example shape and dtype are what `step` and `apply` will accept.

    Returns:
      A `TrainState` whose arrays carry the strategy's shardings.

    Raises:
      TypeError, ValueError: for inputs that are not a float array with a batch
        axis, or a model that the strategy cannot lay out.
    """
    sample = self._check_sample(rng, sample_inputs)
    if self.strategy.deferred:  # e.g. "auto": choose now that the shapes are known
      chosen = self.strategy.resolve(self, sample)
      self.strategy, self.mesh = chosen, chosen.make_mesh()
    abstract_inputs = jax.ShapeDtypeStruct(sample.shape, sample.dtype)
    model = self._plan_model
    plan, layout = self._layout(rng, abstract_inputs)
    shardings = jax.tree.map(lambda x: x.sharding, layout)
    # `jax.jit(model.init)` is cached per model, so trainers of one model share
    # the (slow to compile) initialiser; the re-layout is a program of its own.
    if jax.process_count() == 1:
      params = jax.jit(model.init)(rng, sample)
    else:  # every process computes the same replicated params on the global mesh
      params = jax.jit(model.init, out_shardings=self._replicated)(rng, sample)
    stored = jax.jit(plan.to_stored, out_shardings=shardings.params)(params)
    opt_state = jax.jit(self.optimizer.init, out_shardings=shardings.opt_state)(stored)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
    state = TrainState(step=step, params=stored, opt_state=opt_state)
    self._commit(plan, sample.shape, state)
    return state

  def init_abstract(self, rng: jax.Array, sample_inputs: Any) -> TrainState:
    """Like `init`, but returns `jax.ShapeDtypeStruct`s carrying the shardings.

    Nothing is computed or allocated, so a model too big for the devices can
    still be laid out and its step lowered (`trainer.lower(state, batch)`) to
    read the compiled memory analysis; this is how "auto" measures candidates.
    """
    sample = self._check_sample(rng, sample_inputs)
    if self.strategy.deferred:
      raise ValueError("init_abstract needs a concrete strategy; call init for 'auto'.")
    plan, state = self._layout(rng, jax.ShapeDtypeStruct(sample.shape, sample.dtype))
    self._commit(plan, sample.shape, state)
    return state

  def _layout(self, rng, abstract_inputs) -> tuple[Plan, TrainState]:
    """The plan, and the state as `ShapeDtypeStruct`s with their shardings."""
    model = self._plan_model
    abstract_params = jax.eval_shape(model.init, rng, abstract_inputs)
    plan = self.strategy.make_plan(model, self.loss_fn, self.mesh, abstract_params, abstract_inputs)
    optimizer_probe.check_layout(self.optimizer, plan, abstract_params, self.strategy)
    param_shardings = self._shardings(plan.param_spec)
    stored = jax.eval_shape(plan.to_stored, abstract_params)
    opt_shardings = self._shardings(plan.param_spec if plan.opt_spec is None else plan.opt_spec)
    # Optimizer-state leaves that mirror a parameter get that parameter's
    # sharding; counters and other non-parameter leaves are replicated.
    abstract_opt = jax.eval_shape(self.optimizer.init, stored)
    opt_shardings = optax.tree_utils.tree_map_params(
      self.optimizer,
      lambda _, sharding: sharding,
      abstract_opt,
      jax.tree.broadcast(opt_shardings, stored),
      transform_non_params=lambda _: self._replicated,
    )
    with_sharding = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    state = TrainState(
      jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated),
      jax.tree.map(with_sharding, stored, jax.tree.broadcast(param_shardings, stored)),
      jax.tree.map(with_sharding, abstract_opt, opt_shardings),
    )
    return plan, state

  def _check_sample(self, rng: jax.Array, sample_inputs: Any):
    if not _is_prng_key(rng):
      raise TypeError(
        f"rng must be a JAX PRNG key (e.g. jax.random.key(0)), got {type(rng).__name__} {rng!r}."
      )
    sample = _as_array("sample_inputs", sample_inputs)
    if sample.ndim < 1 or sample.shape[0] < 1:
      raise ValueError(
        f"sample_inputs needs a leading batch axis of size >= 1, got shape {sample.shape}."
      )
    if not jnp.issubdtype(sample.dtype, jnp.floating):
      raise TypeError(f"sample_inputs must be floating point, got dtype {sample.dtype}.")
    return sample

  def _commit(self, plan: Plan, sample_shape, state: TrainState) -> None:
    """Adopts a new layout (only once everything is built: no half state on failure)."""
    self._plan = plan
    self._input_shape = tuple(sample_shape[1:])
    self._state_shardings = jax.tree.map(lambda x: x.sharding, state)
    self._abstract_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    self.__dict__.pop("_compiled_step", None)
    self.__dict__.pop("_compiled_apply", None)
    self.__dict__.pop("_compiled_params", None)
    self.__dict__.pop("_compiled_export", None)

  # ----------------------------------------------------------------- step
  @functools.cached_property
  def _compiled_step(self):
    plan = self.plan
    mesh = self.mesh
    param_spec = plan.param_spec
    accumulate = self.accumulate
    if plan.manual:

      def per_device(params, inputs, labels):
        split = lambda x: x.reshape(accumulate, -1, *x.shape[1:])  # noqa: E731
        loss, grads = accumulate_gradients(plan.loss_and_grad, params, split(inputs), split(labels))
        return (loss, grads) if plan.reduce is None else plan.reduce((loss, grads))

      grad_fn = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(param_spec, plan.batch_spec, plan.batch_spec),
        out_specs=(P(), param_spec),
        check_vma=plan.check_vma,
      )
    else:  # global arrays; XLA's partitioner adds the collectives the shardings imply
      grad_spec = param_spec if plan.grad_spec is None else plan.grad_spec
      grad_shardings = jax.tree.broadcast(self._shardings(grad_spec), self._abstract_state.params)
      ways = self._batch_split()
      micro_sharding = NamedSharding(mesh, P(None, *plan.batch_spec))

      def split(x):  # microstep j takes rows j of every device's block: no data moves
        x = x.reshape(ways, accumulate, -1, *x.shape[1:]).swapaxes(0, 1)
        x = x.reshape(accumulate, -1, *x.shape[3:])
        return jax.lax.with_sharding_constraint(x, micro_sharding)

      def grad_fn(params, inputs, labels):
        if accumulate == 1:
          loss, grads = plan.loss_and_grad(params, inputs, labels)
        else:
          loss, grads = accumulate_gradients(
            plan.loss_and_grad, params, split(inputs), split(labels)
          )
        return loss, jax.lax.with_sharding_constraint(grads, grad_shardings)

    optimizer = self.optimizer

    skip_nonfinite = self.skip_nonfinite

    def train_step(state: TrainState, inputs, labels):
      loss, grads = grad_fn(state.params, inputs, labels)
      updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      grad_norm = optax.tree_utils.tree_norm(grads)
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      new_state = TrainState(state.step + 1, params, opt_state)
      if skip_nonfinite:  # keep the old params and optimizer state for a bad batch
        # The new params and optimizer state are checked too (a finite gradient
        # still gives NaN params with an infinite learning rate). Only here: on
        # sharded params the check costs one more (scalar) collective.
        finite = finite & trees.all_finite((params, opt_state))
        new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
      metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite}
      if self.uses_default_loss:
        classes = self._num_classes(inputs)
        metrics["labels_in_range"] = jnp.all((labels >= 0) & (labels < classes))
      return new_state, metrics

    # Pinning the output shardings to the input's keeps the state a fixed
    # point, so the second step reuses the first step's program.
    return jax.jit(
      train_step,
      donate_argnums=0,
      out_shardings=(self._state_shardings, self._replicated),
    )

  def _batch_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, self.plan.batch_spec)

  def _batch_split(self) -> int:
    """How many ways the batch's leading axis is split across the mesh."""
    spec = self.plan.batch_spec
    axes = spec[0] if len(spec) else None
    if axes is None:
      return 1
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    return int(np.prod([self.mesh.shape[a] for a in axes]))

  def _check_inputs(self, inputs: Any, what: str, abstract: bool = False):
    self.plan  # noqa: B018 - raises a clear error before init
    x = _as_array(what, inputs, abstract)
    expected = self._input_shape
    if x.ndim != len(expected) + 1 or tuple(x.shape[1:]) != expected:
      raise ValueError(
        f"{what} must have shape [B, {', '.join(map(str, expected))}] like the sample "
        f"given to init, got {tuple(x.shape)}."
      )
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{what} must be floating point (e.g. float32), got dtype {x.dtype}.")
    self._check_batch_size(x.shape[0], what)
    return x

  def _check_batch_size(self, batch: int, what: str) -> None:
    split = self._batch_split()
    multiple = split * self.plan.batch_multiple * self.accumulate
    if batch < 1 or batch % multiple:
      raise ValueError(
        messages.batch_size_message(
          what, batch, str(self.plan.batch_spec), split, self.plan.batch_multiple,
          getattr(self.strategy, "microbatches", 0) is None, self.accumulate,
        )  # fmt: skip
      )

  def local_batch_rows(self, global_batch: int) -> slice:
    """The rows of each global batch that this process loads and passes to `step`.

    With one process that is every row. With several (multi-controller JAX),
    each process passes only its rows to `step` and `apply`, and the global
    batch is assembled with `jax.make_array_from_process_local_data`.
    """
    self._check_batch_size(global_batch, "the global batch")
    return distributed.local_rows(self._batch_sharding(), global_batch)

  def _to_global(self, value: Any) -> Any:
    if jax.process_count() == 1 or (
      isinstance(value, jax.Array) and not value.is_fully_addressable
    ):
      return value
    return jax.make_array_from_process_local_data(self._batch_sharding(), np.asarray(value))

  def _check_batch(self, batch: Any, abstract: bool = False) -> tuple[Any, Any]:
    """Validates `(images, labels)`; `abstract` also accepts `jax.ShapeDtypeStruct`s."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
      raise TypeError(f"A batch is a pair (images, labels), got {type(batch).__name__}.")
    self.plan  # noqa: B018 - raises a clear error before init
    to_global = (lambda v: v) if abstract else self._to_global
    x = self._check_inputs(to_global(batch[0]), "images", abstract)
    y = _as_array("labels", to_global(batch[1]), abstract)
    if y.ndim < 1 or y.shape[0] != x.shape[0]:
      raise ValueError(
        f"labels must have a leading axis of {x.shape[0]} (one per image), "
        f"got shape {tuple(y.shape)}."
      )
    if self.uses_default_loss:
      if y.ndim != 1:
        raise ValueError(f"labels must have shape [{x.shape[0]}], got {tuple(y.shape)}.")
      if not jnp.issubdtype(y.dtype, jnp.integer):
        raise TypeError(f"labels must be integer class ids, got dtype {y.dtype}.")
    return x, y

  def step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
    """Runs one training step: forward, backward, gradient averaging, update.

    One compiled program; `state` is donated (do not reuse it afterwards).

    Args:
      state: from `init` or a previous `step`.
      batch: `(images [B, ...] float, labels [B] int)`; `B` must split evenly
        over the strategy's batch axes (and microbatches).

    Returns:
      `(new_state, metrics)`, metrics `{"loss", "grad_norm", "finite"}` as device
      scalars (`finite` is False when the loss or the gradients hold a NaN or
      infinity, and with `skip_nonfinite=True` also the new params or optimizer
      state; then that update was not applied). With the default loss, also
      `"labels_in_range"`: every label is a class id in `[0, C)`, C the model's
      output width (out-of-range labels do not stop the step unless
      `debug=True`).

    Raises:
      TypeError, ValueError: for a malformed batch (checked before anything runs,
        so `state` stays usable), a state that was already donated to an
        earlier `step` or belongs to another trainer, or (with `debug=True`
        and the default loss) labels outside `[0, C)`.
    """
    self._check_state(state, "step")
    x, y = self._check_batch(batch)
    chex.assert_equal_shape_prefix([x, y], 1)
    sharding = self._batch_sharding()
    x, y = jax.device_put((x, y), sharding)
    if self.strategy.debug and self.uses_default_loss:
      self._check_label_range(x, y)
    state, metrics = self._compiled_step(state, x, y)
    if self.strategy.debug:
      checks.assert_replicas_equal(state)
    return state, metrics

  def lower(self, state: TrainState, batch: Batch) -> jax.stages.Lowered:
    """Lowers the training step for `batch`'s shapes, without running it.

    `trainer.lower(state, batch).compile().memory_analysis()` reports the
    compiled step's memory (e.g. `temp_size_in_bytes` for activations).

    `state` may come from `init_abstract` and `batch` may be a pair of
    `jax.ShapeDtypeStruct`s: then nothing is allocated, which is how a layout
    is measured for a model that may not fit.
    """
    abstract = isinstance(batch, (tuple, list)) and all(
      isinstance(b, jax.ShapeDtypeStruct) for b in batch
    )
    x, y = self._check_batch(batch, abstract)
    sharding = self._batch_sharding()
    if abstract:
      x, y = (jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=sharding) for b in (x, y))
    else:
      x, y = jax.device_put((x, y), sharding)
    return self._compiled_step.lower(state, x, y)

  # ----------------------------------------------------------------- apply
  @functools.cached_property
  def _compiled_apply(self):
    plan = self.plan
    if not plan.manual:
      return jax.jit(plan.forward, out_shardings=self._batch_sharding())
    fwd = jax.shard_map(
      plan.forward,
      mesh=self.mesh,
      in_specs=(plan.param_spec, plan.batch_spec),
      out_specs=plan.batch_spec,
      check_vma=plan.check_vma,
    )
    return jax.jit(fwd)

  def apply(self, state: TrainState, inputs: Any) -> jax.Array:
    """Returns the model's outputs on `inputs`, computed under the same layout.

    Args:
      state: a `TrainState` of this trainer.
      inputs: `[B, ...]` float inputs; `B` must split like a training batch.

    Returns:
      The logits, `[B, ...]`, split over the mesh like the inputs.
    """
    self.plan  # noqa: B018 - raises a clear error before init
    self._check_state(state, "apply")
    x = self._check_inputs(self._to_global(inputs), "inputs")
    x = jax.device_put(x, self._batch_sharding())
    return self._compiled_apply(state.params, x)

  # ----------------------------------------------------------------- guards
  def _check_state(self, state: Any, what: str) -> None:
    """Refuses a donated state, or one of another trainer, before JAX sees it.

    JAX 0.10 can crash the process (a segfault) on a deleted multi-device
    array, and a foreign tree fails deep inside `jit`; both are caught here.

    Raises:
      ValueError: naming the deleted or mismatched leaf.
    """
    self.plan  # noqa: B018 - raises a clear error before init
    leaves, treedef = jax.tree.flatten(state)
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
      if isinstance(leaf, jax.Array) and leaf.is_deleted():
        raise ValueError(
          f"{what}: this state was donated to an earlier trainer.step (its leaf "
          f"{trees.leaf_name(path)} is deleted); pass the state that step returned."
        )
    want_leaves, want_treedef = jax.tree.flatten(self._abstract_state)
    if treedef == want_treedef and all(
      np.shape(x) == w.shape for x, w in zip(leaves, want_leaves, strict=True)
    ):
      return
    detail = trees.first_mismatch(state, self._abstract_state) or (
      f"got a {type(state).__name__}, expected the TrainState its init or step returned"
    )
    raise ValueError(f"{what}: the state does not belong to this trainer: {detail}.")

  def _num_classes(self, inputs: Any) -> int:
    """The width C of the model's output for `inputs` (labels must lie in [0, C))."""
    params = jax.eval_shape(self.plan.to_params, self._abstract_state.params)
    inputs = jax.ShapeDtypeStruct(inputs.shape, inputs.dtype)
    outputs = jax.eval_shape(lambda p, x: self._plan_model.apply(p, None, x), params, inputs)
    return int(outputs.shape[-1])

  def _check_label_range(self, inputs: jax.Array, labels: jax.Array) -> None:
    """For `debug=True`: class ids outside [0, C) raise before the step runs."""
    classes = self._num_classes(inputs)
    low, high = (int(v) for v in _min_max(labels))
    if low < 0 or high >= classes:
      raise ValueError(
        f"labels must be class ids in [0, {classes}) for the default loss (the model has "
        f"{classes} outputs), got values from {low} to {high}."
      )

  # ----------------------------------------------------------------- layouts
  def export_state(self, state: TrainState) -> dict[str, Any]:
    """The state in the model's own layout, independent of the strategy.

    Returns `{"step", "params", "opt_state"}`: params as `trainer.params` gives
    them, and the optimizer state as `optimizer.init(params)` would lay it out.
    Another trainer of the same model and optimizer, under any strategy and
    mesh, resumes from it with `import_state`; checkpoints store this form.
    """
    self._check_state(state, "export_state")
    return self._compiled_export(state)

  @functools.cached_property
  def _compiled_export(self):
    plan = self.plan

    def export(state: TrainState):
      return {
        "step": state.step,
        "params": plan.to_params(state.params),
        "opt_state": _map_param_like(state.opt_state, state.params, plan.to_params),
      }

    return jax.jit(export, out_shardings=self._replicated)

  def import_state(self, exported: dict[str, Any]) -> TrainState:
    """Places a state from `export_state` (of any strategy) with this trainer's layout.

    Raises:
      ValueError: if its params do not match this trainer's model.
    """
    plan = self.plan
    params = exported["params"]
    expected = jax.eval_shape(plan.to_params, self._abstract_state.params)
    mismatch = trees.first_mismatch({"params": params}, {"params": expected})
    if mismatch is not None:
      raise ValueError(f"The saved params do not fit this model: {mismatch}.")

    def place(exported):
      stored = plan.to_stored(exported["params"])
      opt_state = _map_param_like(exported["opt_state"], exported["params"], plan.to_stored)
      return TrainState(jnp.asarray(exported["step"], jnp.int32), stored, opt_state)

    mesh_devices = set(self.mesh.devices.flat)

    def reachable(x):  # arrays on other devices (another trainer's mesh) go via the host
      if isinstance(x, jax.Array) and x.is_fully_addressable:
        if not x.sharding.device_set <= mesh_devices:
          return np.asarray(x)
      return x

    exported = jax.tree.map(reachable, exported)
    return jax.jit(place, out_shardings=self._state_shardings)(exported)

  # ----------------------------------------------------------------- params
  @functools.cached_property
  def _compiled_params(self):
    return jax.jit(self.plan.to_params, out_shardings=self._replicated)

  def params(self, state: TrainState) -> Params:
    """Returns the full params in the model's own Haiku layout (replicated).

    `model.apply(trainer.params(state), None, x)` works without parstrat.
    """
    self._check_state(state, "params")
    return self._compiled_params(state.params)


def accumulate_gradients(
  loss_and_grad: Callable[[Any, Any, Any], tuple[jax.Array, Any]],
  params: Any,
  inputs: Any,
  labels: Any,
) -> tuple[jax.Array, Any]:
  """Mean loss and gradients over microsteps `inputs[j], labels[j]`, one at a time.

  The first microstep runs outside the loop and seeds the running sums, so the
  sums have exactly the type (shape, dtype, and under `shard_map` the
  device-varying axes) that `loss_and_grad` returns; a `lax.fori_loop` adds
  the others. Only one microstep's activations are alive at a time.

  Args:
    loss_and_grad: `(params, inputs, labels) -> (mean loss, grads)`.
    params: the params, passed to every microstep.
    inputs: `[k, ...]` microstep inputs.
    labels: `[k, ...]` microstep labels.

  Returns:
    `(loss, grads)` averaged over the k microsteps: the whole batch's mean loss
    and its gradient when every microstep has the same size.

  Example:
    >>> import jax, jax.numpy as jnp, parstrat
    >>> def loss_and_grad(w, x, y):
    ...   return jax.value_and_grad(lambda w: jnp.mean((x * w - y) ** 2))(w)
    >>> x, y = jnp.arange(8.0), jnp.ones(8)
    >>> loss, grad = parstrat.accumulate_gradients(
    ...     loss_and_grad, 1.0, x.reshape(4, 2), y.reshape(4, 2))
    >>> bool(jnp.allclose(grad, loss_and_grad(1.0, x, y)[1]))
    True
  """
  k = inputs.shape[0]
  first = loss_and_grad(params, inputs[0], labels[0])
  if k == 1:
    return first

  def body(j, total):  # reads microstep j in place: no copy of the batch
    x = jax.lax.dynamic_index_in_dim(inputs, j, keepdims=False)
    y = jax.lax.dynamic_index_in_dim(labels, j, keepdims=False)
    return jax.tree.map(jnp.add, total, loss_and_grad(params, x, y))

  total = jax.lax.fori_loop(1, k, body, first)
  return jax.tree.map(lambda x: x / k, total)


@jax.jit
def _min_max(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  return jnp.min(x), jnp.max(x)


def _map_param_like(tree: Any, like: Any, fn: Callable[[Any], Any]) -> Any:
  """Applies `fn` to every subtree of `tree` shaped like `like` (e.g. Adam's mu, nu)."""
  like_structure = jax.tree.structure(like)
  like_shapes = [np.shape(x) for x in jax.tree.leaves(like)]

  def is_param_like(node) -> bool:
    if node is None:
      return False
    return (
      jax.tree.structure(node) == like_structure
      and [np.shape(x) for x in jax.tree.leaves(node)] == like_shapes
    )

  return jax.tree.map(
    lambda node: fn(node) if is_param_like(node) else node, tree, is_leaf=is_param_like
  )


def _is_prng_key(rng: Any) -> bool:
  if not isinstance(rng, jax.Array):
    return False
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    return rng.shape == ()
  return rng.dtype == jnp.uint32 and rng.shape == (2,)  # a legacy jax.random.PRNGKey


def _as_array(what: str, value: Any, abstract: bool = False):
  if abstract and isinstance(value, jax.ShapeDtypeStruct):
    return value
  if isinstance(value, (jax.Array, np.ndarray)):
    return value
  if isinstance(value, (str, bytes)):
    raise TypeError(f"{what} must be a jax or numpy array, got {type(value).__name__}.")
  if isinstance(value, (list, tuple, int, float)) or np.isscalar(value):
    try:
      return np.asarray(value)
    except Exception as e:  # noqa: BLE001
      raise TypeError(f"{what} must be an array, got {type(value).__name__}: {e}") from None
  raise TypeError(f"{what} must be a jax or numpy array, got {type(value).__name__}.")
