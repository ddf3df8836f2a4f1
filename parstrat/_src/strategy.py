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
import inspect
import re
import types
import warnings
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import ClassVar
from typing import NamedTuple

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
from parstrat._src import hlo_check
from parstrat._src import messages
from parstrat._src import optimizer_probe
from parstrat._src import optimizers as optimizers_lib
from parstrat._src import precision as precision_lib
from parstrat._src import trees

Params = Any  # a pytree in the model's own (Haiku) layout
#: `(outputs, labels) -> scalar` for `(inputs, labels)` batches, or
#: `(outputs, batch) -> scalar` when the strategy is called with `model_inputs`.
LossFn = Callable[[Any, Any], jax.Array]
#: A pytree of arrays whose leaves share their leading (batch) axis.
Batch = Any

#: XLA options every training step compiles with. On CPU, copy insertion's region
#: analysis lets a `lax.switch` branch hand back an operand it leaves unchanged
#: without copying it: the pipeline engine's gradient accumulators pass through
#: every tick that is not a backward pass (README, "Pipelines"; tested by
#: `test_ticks_that_leave_the_gradients_alone_do_not_copy_them`). The GPU and TPU
#: compilers do not read this CPU option.
STEP_COMPILER_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


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
    rng: the training key's raw data (`jax.random.key_data`, replicated). It
      never changes: step `t` draws from `jax.random.fold_in(key, t)`, so a
      restored state draws the same randomness as the run it came from.
    model_state: the Haiku state of an `hk.transform_with_state` model (e.g.
      BatchNorm's moving averages), replicated; `{}` for `hk.transform` models.
  """

  step: jax.Array
  params: Any
  opt_state: optax.OptState
  rng: jax.Array
  model_state: Any


@dataclasses.dataclass(frozen=True)
class Plan:
  """How one model is laid out and differentiated on a strategy's mesh.

  A `Plan` is built by `Strategy.make_plan` once the parameter shapes are known.
  Every function in it is pure and traceable.

  The `model` a plan gets from `make_plan` follows Haiku's stateful contract,
  `model.apply(params, model_state, rng, inputs) -> (outputs, model_state)`,
  whatever the user passed (an `hk.transform` model gets an empty state).
  `inputs` (the model's inputs) and `targets` (what the loss takes besides the
  outputs: the labels of an `(inputs, labels)` batch, else the whole batch) are
  pytrees whose leaves share the leading batch axis; `rng` is a PRNG key, also
  when the model draws no randomness (then unread: an adapter such as Flax's
  `rngs={"dropout": rng}` refuses None). The trainer derives the keys (one
  per device along the batch axes and per accumulation microstep) and averages
  the returned model state over the batch's pieces, so a plan only passes
  `rng` and `model_state` on to `model.apply`.

  Attributes:
    param_spec: `PartitionSpec` (or a pytree prefix of them) of the stored params.
    batch_spec: `PartitionSpec` of the batch's leading axis.
    to_stored: maps params in the model's layout to the stored layout.
    to_params: the inverse of `to_stored`.
    loss_and_grad: `(stored, inputs, targets, rng, model_state) -> (loss, grads,
      model_state)` for one device, run under `jax.shard_map` over the whole
      mesh. `stored`, `inputs` and `targets` are the device's blocks. It
      returns the global mean loss and the gradients of it (already reduced
      over every axis the batch is split on), shaped and sharded like
      `stored`, and the model state the model returned (this device's).
    forward: `(stored, inputs, rng, model_state) -> outputs` for one device,
      under `jax.shard_map`; the outputs (any pytree of batch-leading arrays)
      are split like the inputs.
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
    optimizer_view: for a plan whose stored layout is not the model's (a
      pipeline's flat stage rows): an object with `spec()` (a `PartitionSpec`
      per leaf of the model's params), `to_view(stored)` and `from_view(tree)`
      (traceable on global arrays under `jit`) that moves the stored params to
      the model's layout and back. The trainer runs an optimizer that does not
      act leaf by leaf (`optax.adamw(mask=...)`, `optax.multi_transform`) on
      that view, and keeps its state there. None (default): such optimizers
      are refused at `init`.
    branch_axes: for a plan whose devices run different `lax.switch` branches
      (pipeline stages) while XLA's partitioner adds collectives (a "model"
      axis): the mesh axes a collective inside a branch may span. The trainer
      then reads the compiled step before its first run and refuses it if a
      collective inside a branch spans other axes: only some of its devices
      would reach it, and the step would hang. None (default): no check.
  """

  param_spec: Any
  batch_spec: P
  to_stored: Callable[[Params], Any]
  to_params: Callable[[Any], Params]
  loss_and_grad: Callable[[Any, Any, Any, Any, Any], tuple[jax.Array, Any, Any]]
  forward: Callable[[Any, Any, Any, Any], Any]
  batch_multiple: int = 1
  description: str = ""
  check_vma: bool = True
  manual: bool = True
  reduce: Callable[[tuple[jax.Array, Any]], tuple[jax.Array, Any]] | None = None
  grad_spec: Any = None
  opt_spec: Any = None
  branch_axes: tuple[str, ...] | None = None
  optimizer_view: Any = None


def axis_field(cls: type, axis: str) -> str | None:
  """The dataclass field of `cls` that takes mesh `axis`'s size: `axis`, or `axis` + "s"."""
  from parstrat._src import registry  # noqa: PLC0415 (import cycle)

  fields = set(registry.options_of(cls)[0])
  return next((name for name in (axis, axis + "s") if name in fields), None)


def _check_plan(plan: Any, strategy: Any, mesh: Mesh) -> None:
  """Refuses what `make_plan` returned unless it is a `Plan` over `mesh`'s axes.

  Raises:
    TypeError: if it is not a `Plan`.
    ValueError: naming a spec's axis the mesh does not have, or a bad `batch_multiple`.
  """
  if not isinstance(plan, Plan):
    raise TypeError(f"{strategy!r}.make_plan returned {type(plan).__name__}, not a parstrat.Plan.")
  specs = {"batch_spec": plan.batch_spec}
  for field in ("param_spec", "grad_spec", "opt_spec"):
    specs[field] = getattr(plan, field)
  for field, tree in specs.items():
    for spec in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, P)):
      if not isinstance(spec, P):
        continue
      for entry in spec:
        for name in entry if isinstance(entry, tuple) else (entry,):
          if name not in (None, P.UNCONSTRAINED) and name not in mesh.axis_names:
            raise ValueError(
              f"{strategy!r}'s plan: its {field} {spec} names the axis {name!r}, which "
              f"the mesh does not have (its axes: {', '.join(map(repr, mesh.axis_names))})."
            )
  multiple = plan.batch_multiple
  if isinstance(multiple, bool) or not isinstance(multiple, (int, np.integer)) or multiple < 1:
    raise ValueError(
      f"{strategy!r}'s plan: batch_multiple must be a positive integer, got {multiple!r}."
    )


def model_loss(model: hk.TransformedWithState, loss_fn: LossFn) -> Callable[..., Any]:
  """`(params, inputs, targets, rng, model_state) -> (loss, model_state)` of one (micro)batch.

  The building block of a plan's `loss_and_grad`:
  `jax.value_and_grad(model_loss(model, loss_fn), has_aux=True)`.
  """

  def loss(params, inputs, targets, rng, model_state):
    outputs, model_state = model.apply(params, model_state, rng, inputs)
    return loss_fn(outputs, targets), model_state

  return loss


def outputs_fn(model: hk.TransformedWithState, model_state: Any = None) -> Callable[..., Any]:
  """`(params, inputs) -> outputs` of a stateful-contract `model`, for tracing analyses.

  The model gets `model_state` (default: an empty state; `ShapeDtypeStruct`
  leaves are taken as zeros) and a fixed key, so a model that draws randomness
  can still be traced (its layout analysis depends on neither's values).
  """
  state = jax.tree.map(
    lambda s: jnp.zeros(s.shape, s.dtype) if isinstance(s, jax.ShapeDtypeStruct) else s,
    {} if model_state is None else model_state,
  )

  def outputs(params, inputs):
    return model.apply(params, state, jax.random.key(0), inputs)[0]

  return outputs


def with_rng_argument(model: Any) -> Any:
  """`model` with an `apply` that takes an rng, as Haiku's does by default.

  `hk.without_apply_rng` drops the rng from `apply`: `(params, [state,] *inputs)`
  instead of `(params, [state,] rng, *inputs)`. A model whose `apply` signature
  names an `rng` is returned as it is; for any other, the first call passes the
  key and, if that raises a TypeError, calls again without it and keeps to
  that (re-raising the first error if the second call fails too). The result is
  of `model`'s type when that is Haiku's or a `SimpleNamespace`, else a
  `SimpleNamespace` (a class of the user's own need not take `init=`, `apply=`).
  """
  try:
    if "rng" in inspect.signature(model.apply).parameters:
      return model
  except (TypeError, ValueError):  # no signature to read: find out at the first call
    pass
  takes_rng: bool | None = None

  def apply(params, *args):
    nonlocal takes_rng
    *state, rng, inputs = args
    if takes_rng is False:
      return model.apply(params, *state, inputs)
    try:
      outputs = model.apply(params, *state, rng, inputs)
    except TypeError as with_rng:
      if takes_rng:
        raise
      try:
        outputs = model.apply(params, *state, inputs)
      except Exception:  # noqa: BLE001 - not an rng-less apply: the first error stands
        raise with_rng from None
      takes_rng = False
      return outputs
    takes_rng = True
    return outputs

  if isinstance(model, (hk.Transformed, hk.TransformedWithState, types.SimpleNamespace)):
    return type(model)(init=model.init, apply=apply)
  return types.SimpleNamespace(init=model.init, apply=apply)  # (a class of the user's own)


def bind_axes(model: Any, axes: Sequence[str]) -> Any:
  """`model` (same kind) whose `init` and `apply` run with `axes` bound, each of size 1.

  What runs outside the mesh (`init`, and tracing for shapes) then meets a
  model's collective over a mesh axis (`hk.BatchNorm(cross_replica_axis="data")`)
  as one device alone: `pmean` over one value is that value.
  """
  if not axes:
    return model
  axes = tuple(axes)
  return type(model)(init=_bound(model.init, axes), apply=_bound(model.apply, axes))


def _bound(fn: Callable, axes: tuple[str, ...]) -> Callable:
  inner = fn
  for name in axes:  # (out_axes 0: outputs may depend on the axis, e.g. axis_index)
    inner = jax.vmap(inner, in_axes=None, out_axes=0, axis_size=1, axis_name=name)

  @functools.wraps(fn)
  def bound(*args, **kwargs):
    outputs = inner(*args, **kwargs)
    for _ in axes:
      outputs = jax.tree.map(lambda x: x[0], outputs)
    return outputs

  return bound


def _shardings_by_path(opt_state: Any, params: Any, shardings: Any, replicated: Any) -> Any:
  """Optimizer-state shardings: a leaf whose path ends with a param's, and of its shape,
  gets that param's sharding (with a leading axis more: that sharding after an unsplit
  axis); any other leaf is replicated. (Only a layout: a wrong
  match costs memory, never a number.)"""
  by_path = {
    tuple(path): (param.shape, sharding)
    for (path, param), sharding in zip(
      jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(shardings), strict=True
    )
  }
  lengths = sorted({len(path) for path in by_path}, reverse=True)

  def leaf(path, x):
    for n in lengths:
      shape, sharding = by_path.get(tuple(path[len(path) - n :]), (None, None))
      if n <= len(path) and shape is not None:
        found = _state_leaf_sharding(x.shape, shape, sharding)
        if found is not None:
          return found
    return replicated

  return jax.tree_util.tree_map_with_path(leaf, opt_state)


def _state_leaf_sharding(
  shape: tuple[int, ...], param_shape: tuple[int, ...], sharding: NamedSharding
) -> NamedSharding | None:
  """An optimizer-state leaf's sharding from its param's: the same for a leaf of the
  param's shape (Adam's moments), the same after an unsplit axis for a stack of them
  (lbfgs's last updates, `[memory, *shape]`), None (replicated) for any other."""
  if tuple(shape) == tuple(param_shape):
    return sharding
  if tuple(shape[1:]) == tuple(param_shape):
    return NamedSharding(sharding.mesh, P(None, *sharding.spec))
  return None


def is_unbound_axis(error: NameError) -> bool:
  """Whether `error` is JAX's "unbound axis name": a collective over an axis not in scope."""
  return "unbound axis name" in str(error)


def unbound_axis_message(strategy: Strategy, error: NameError) -> str:
  from parstrat._src import registry  # noqa: PLC0415 - the registry imports strategies

  where = [
    f"{name} ({', '.join(repr(a) for a in cls.model_axes)})"
    for name in registry.available()
    if (cls := registry.lookup(name)).model_axes
  ]
  found = re.search(r"unbound axis name: ([^\s.]+)", str(error))
  axis = repr(found.group(1)) if found else "an axis name"
  return (
    f"{strategy!r} cannot train a model whose collectives name {axis} (e.g. "
    "hk.BatchNorm(cross_replica_axis=...)): it does not run the model per device over "
    "such an axis. Strategies that do, and the mesh axis the model may name: "
    f"{', '.join(where) or 'none registered'}."
  )


def as_stateful(model: Any) -> hk.TransformedWithState:
  """`model` under Haiku's stateful contract (an `hk.transform` model gets an empty state).

  Its `apply` takes an rng, also where `hk.without_apply_rng` removed it.
  """
  model = with_rng_argument(model)
  if isinstance(model, hk.TransformedWithState):
    return model

  def init(rng, inputs):
    return model.init(rng, inputs), {}

  def apply(params, model_state, rng, inputs):
    return model.apply(params, rng, inputs), model_state

  return hk.TransformedWithState(init=init, apply=apply)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strategy(abc.ABC):
  """A way to lay a model and its training step out over a device mesh.

  A subclass is a frozen dataclass of its options and implements two methods:

  * `make_mesh()`: the `jax.sharding.Mesh` it wants, with named axes.
  * `make_plan(model, loss_fn, mesh, sample_params, sample_inputs)`: a `Plan`
    saying how params are stored (and sharded), how the batch is split, and how
    one device computes the loss and the *averaged* gradients with collectives
    over the mesh's axis names.

  A strategy that can pass a PRNG key to the model (dropout) sets
  `supports_rng = True`; one whose plan keeps a model state correct sets
  `supports_state = True`. Otherwise the trainer refuses such models at `init`
  with a message naming the strategy. One whose plan runs the model per device
  over mesh axes (under `jax.shard_map`) names them in `model_axes`: the model's
  own collectives may then name them (sync BatchNorm over "data").

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

  #: Whether its plan trains models that call `hk.next_rng_key()` (e.g. dropout).
  supports_rng: ClassVar[bool] = False

  #: Whether its plan trains `hk.transform_with_state` models (e.g. BatchNorm).
  supports_state: ClassVar[bool] = False

  #: Mesh axes over which its plan runs the model per device (under
  #: `jax.shard_map`), so that the model's own collectives may name them:
  #: `hk.BatchNorm(cross_replica_axis="data")` under `data_parallel`.
  model_axes: ClassVar[tuple[str, ...]] = ()

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
      model: the user's Haiku model under the stateful contract,
        `apply(params, model_state, rng, inputs) -> (outputs, model_state)`
        (only `init` and `apply` are used).
      loss_fn: `(outputs, targets) -> scalar` mean loss over examples.
      mesh: the mesh from `make_mesh`.
      sample_params: abstract params (`jax.ShapeDtypeStruct` leaves).
      sample_inputs: abstract model inputs of one example batch (any batch
        size): a pytree of `jax.ShapeDtypeStruct`s sharing the leading axis.
    """

  def __call__(
    self,
    model: hk.Transformed | hk.TransformedWithState,
    optimizer: optax.GradientTransformation,
    *,
    loss_fn: LossFn | None = None,
    model_inputs: Callable[[Batch], Any] | None = None,
    skip_nonfinite: bool = False,
    precision: Any = None,
    accumulate: int = 1,
  ) -> Trainer:
    """Wraps `model` and `optimizer` into a `Trainer` on this strategy's mesh.

    Batches: without `model_inputs`, a batch is a pair `(inputs, labels)`, the
    model gets `inputs` and the loss `loss_fn(outputs, labels)`. With
    `model_inputs`, a batch is any pytree (e.g. `{"tokens": ..., "targets":
    ...}`), the model gets `model_inputs(batch)` and the loss
    `loss_fn(outputs, batch)`. Either way every leaf of the batch (and of the
    inputs) shares the leading batch axis, which the strategy splits.

    Args:
      model: an `hk.Transformed` or `hk.TransformedWithState` (its state, e.g.
        BatchNorm's, is kept in `TrainState.model_state`; strategies with
        `supports_state`). A model that calls `hk.next_rng_key()` gets a key
        per step (strategies with `supports_rng`).
      optimizer: any `optax.GradientTransformation`.
      loss_fn: `(outputs, labels) -> scalar`, or `(outputs, batch) -> scalar`
        with `model_inputs`; a *mean* over examples (it is averaged over
        devices and microbatches). Default: softmax cross-entropy on integer
        labels (for `(inputs, labels)` batches only).
      model_inputs: `batch -> inputs`, run inside the compiled step on the
        global batch; every leaf it returns must keep the batch axis (e.g.
        `lambda batch: batch["tokens"]`). None: batches are `(inputs, labels)`.
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
      TypeError: if `model`, `optimizer`, `loss_fn` or `model_inputs` are of
        the wrong kind, or `model_inputs` is given without a `loss_fn`.
      ValueError: if the mesh does not fit the available devices, or
        `precision` or `accumulate` is invalid.
    """
    return Trainer(
      self,
      model,
      optimizer,
      loss_fn=loss_fn,
      model_inputs=model_inputs,
      skip_nonfinite=skip_nonfinite,
      precision=precision,
      accumulate=accumulate,
    )

  def resolve(self, trainer: Trainer, sample_inputs: Any) -> Strategy:
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
    config = {}
    for axis, size in axis_sizes.items():
      name = axis_field(cls, axis)
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
  if not (callable(getattr(model, "init", None)) and callable(getattr(model, "apply", None))):
    raise TypeError(
      "The model must be an hk.Transformed or hk.TransformedWithState (from hk.transform or "
      f"hk.transform_with_state), got {type(model).__name__}."
    )


def _check_optimizer(optimizer: Any) -> None:
  if not (
    callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
  ):
    raise TypeError(
      "The optimizer must be an optax.GradientTransformation (e.g. optax.adam(1e-3)), "
      f"got {type(optimizer).__name__}."
    )


def _made_mesh(strategy: Strategy) -> Mesh:
  """`strategy.make_mesh()`, checked to be a `jax.sharding.Mesh`.

  Raises:
    TypeError: naming the strategy and what its `make_mesh` returned.
  """
  mesh = strategy.make_mesh()
  if not isinstance(mesh, Mesh):
    raise TypeError(
      f"{strategy!r}.make_mesh returned {type(mesh).__name__}, not a jax.sharding.Mesh "
      "(a missing `return`?)."
    )
  return mesh


def _check_grad_shapes(grads: Any, params: Any, what: str) -> None:
  """Raises `ValueError` for a gradient of another shape than its param (JAX would
  broadcast it into the update without a word); the structures are alike."""
  for (path, grad), param in zip(
    jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(params), strict=True
  ):
    if np.shape(grad) != np.shape(param):
      raise ValueError(
        f"{what} returned grads{jax.tree_util.keystr(path)} of shape {np.shape(grad)}; "
        f"this device holds that param with shape {np.shape(param)}."
      )


def _checked_loss_and_grad(loss_and_grad: Callable[..., Any], local: bool) -> Callable[..., Any]:
  """`loss_and_grad` with its results checked where it is traced (a plan of one's own).

  `local`: the plan has a `reduce`, so the gradients are each device's own,
  and may have other shapes until `reduce` (a reduce-scatter) gives them the
  params' (checked there, `_check_grad_shapes`).

  Raises (when traced):
    TypeError: for other than `(loss, grads, model_state)`, gradients of
      another structure than the params (naming a leaf only one has), or a
      model state of another structure.
    ValueError: for a loss that is not a scalar, or (unless `local`) a
      gradient of another shape than its param.
  """

  def run(params, inputs, targets, key, model_state):
    out = loss_and_grad(params, inputs, targets, key, model_state)
    what = "Plan.loss_and_grad"
    if not isinstance(out, (tuple, list)) or len(out) != 3:
      count = f"{len(out)} values" if isinstance(out, (tuple, list)) else type(out).__name__
      raise TypeError(f"{what} must return (loss, grads, model_state), got {count}.")
    loss, grads, new_state = out
    if np.shape(loss) != ():
      raise ValueError(
        f"{what} must return a scalar loss (this device's, or the mean), got shape "
        f"{tuple(np.shape(loss))}."
      )
    given = dict(jax.tree_util.tree_leaves_with_path(params))
    got = dict(jax.tree_util.tree_leaves_with_path(grads))
    if jax.tree.structure(grads) != jax.tree.structure(params):
      lacking = [jax.tree_util.keystr(k) for k in given if k not in got]
      extra = [jax.tree_util.keystr(k) for k in got if k not in given]
      detail = (f"no gradient for {lacking[0]}" if lacking else "") or (
        f"a gradient for {extra[0]}, which is no param" if extra else "another tree structure"
      )
      raise TypeError(f"{what} returned gradients unlike the params: {detail}.")
    if not local:
      _check_grad_shapes(grads, params, what)
    if jax.tree.structure(new_state) != jax.tree.structure(model_state):
      raise TypeError(
        f"{what} returned a model state of another structure than the one it was given."
      )
    return out

  return run


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
    model: hk.Transformed | hk.TransformedWithState,
    optimizer: optax.GradientTransformation,
    *,
    loss_fn: LossFn | None = None,
    model_inputs: Callable[[Batch], Any] | None = None,
    skip_nonfinite: bool = False,
    precision: Any = None,
    accumulate: int = 1,
  ):
    _check_model(model)
    _check_optimizer(optimizer)
    if loss_fn is not None and not callable(loss_fn):
      raise TypeError(f"loss_fn must be callable (outputs, labels) -> scalar, got {loss_fn!r}.")
    if model_inputs is not None and not callable(model_inputs):
      raise TypeError(f"model_inputs must be callable batch -> inputs, got {model_inputs!r}.")
    if model_inputs is not None and loss_fn is None:
      raise TypeError(
        "With model_inputs, the loss gets (outputs, batch): pass a loss_fn(outputs, batch) "
        "-> scalar (the default loss takes (logits, labels) of an (inputs, labels) pair)."
      )
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
    # The label metric and checks are for the default loss on (inputs, labels).
    self.uses_default_loss = self.loss_fn is softmax_cross_entropy and model_inputs is None
    #: `batch -> model inputs`, or None for `(inputs, labels)` batches.
    self.model_inputs = model_inputs
    self.skip_nonfinite = bool(skip_nonfinite)
    #: For "auto": the `parstrat.Choice` made at `init` (None otherwise).
    self.choice = None
    #: Whether the model calls `hk.next_rng_key()` (known after `init`).
    self.uses_rng = False
    # The user's model with the precision policy around `apply` (same kind as `model`),
    # and what the plan sees: that model under Haiku's stateful contract.
    self._policy_model = precision_lib.with_policy(with_rng_argument(model), self.policy)
    self._plan_model = as_stateful(self._policy_model)
    self._host_axes: tuple[str, ...] = ()  # mesh axes the model names (set by `init`)
    self._host_models: dict[tuple, Any] = {}
    # A deferred strategy ("auto") builds its mesh in `init`, once it has chosen.
    self.mesh: Mesh | None = None if strategy.deferred else _made_mesh(strategy)
    self._plan: Plan | None = None
    self._input_spec: Any = None  # per-example ShapeDtypeStructs of the model inputs
    self._batch_spec: Any = None  # ... of a batch, from `sample_batch` or the first step
    self._processes_agree = False  # every process's first `step` passed rows alike
    self._loss_mean_checked = False  # `_warn_unless_loss_is_a_mean` ran on a first batch
    #: The `sample_batch` given to `init`, as `jax.ShapeDtypeStruct`s (or None).
    self.sample_batch: Any = None
    self._branches_checked: set[tuple[str, int]] = set()
    self._rng_impl = None

  def __repr__(self) -> str:
    mesh = "chosen at init" if self.mesh is None else dict(self.mesh.shape)
    extra = f", precision={self.precision!r}" if self.precision is not None else ""
    extra += f", accumulate={self.accumulate}" if self.accumulate != 1 else ""
    return f"Trainer({self.strategy!r}, mesh={mesh}{extra})"

  # ----------------------------------------------------------------- batches
  def _inputs_of(self, batch: Batch) -> Any:
    return batch[0] if self.model_inputs is None else self.model_inputs(batch)

  def _targets_of(self, batch: Batch) -> Any:
    return batch[1] if self.model_inputs is None else batch

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
  def init(self, rng: jax.Array, sample_inputs: Any, *, sample_batch: Batch = None) -> TrainState:
    """Initialises params, optimizer state and model state, placed on the mesh.

    Args:
      rng: a JAX PRNG key (`jax.random.key(seed)`): it initialises the params,
        and `jax.random.fold_in(rng, 1)` becomes the training key
        (`TrainState.rng`).
      sample_inputs: example model inputs, any pytree of arrays (float or
        integer) sharing a leading batch axis of any size `B >= 1`; the
        per-example shape and dtype of every leaf are what `apply` (and the
        model inputs of every batch) must match.
      sample_batch: optional example batch (any batch size): fixes the
        structure, per-example shapes and dtypes every `step` batch must
        have. Default: the first batch given to `step` (or `lower`) fixes them.
        ("auto" also measures its candidates at its batch size where it is
        larger than `sample_inputs`'.)

    Returns:
      A `TrainState` whose arrays carry the strategy's shardings.

    Raises:
      TypeError, ValueError: for inputs that are not arrays with a shared batch
        axis, or a model that the strategy cannot lay out (e.g. one that draws
        randomness or keeps state under a strategy that does not support it).
    """
    sample = self._check_sample(rng, sample_inputs)
    if sample_batch is not None:
      sample_batch = self._as_batch(sample_batch, abstract=True)
      self.sample_batch = _abstract(sample_batch)
    if self.strategy.deferred:  # e.g. "auto": choose now that the shapes are known
      chosen = self.strategy.resolve(self, sample)
      self.strategy, self.mesh = chosen, _made_mesh(chosen)
    plan, layout, uses_rng = self._layout(rng, _abstract(sample))
    shardings = jax.tree.map(lambda x: x.sharding, layout)
    # `jax.jit(model.init)` is cached per model, so trainers of one model share
    # the (slow to compile) initialiser; the re-layout is a program of its own.
    init_fn = self._host_model(self._policy_model).init
    if jax.process_count() == 1:
      initialised = jax.jit(init_fn)(rng, sample)
    else:  # every process computes the same replicated params on the global mesh
      initialised = jax.jit(init_fn, out_shardings=self._replicated)(rng, sample)
    stateful = isinstance(self._policy_model, hk.TransformedWithState)
    params, model_state = initialised if stateful else (initialised, {})
    stored = jax.jit(plan.to_stored, out_shardings=shardings.params)(params)
    opt_state = jax.jit(
      lambda stored: optimizers_lib.init(self.optimizer, self._optimizer_params(plan, stored)),
      out_shardings=shardings.opt_state,
    )(stored)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
    train_rng = jax.device_put(_training_key_data(rng), shardings.rng)
    model_state = jax.device_put(model_state, shardings.model_state)
    state = TrainState(step, stored, opt_state, train_rng, model_state)
    self._commit(plan, sample, state, uses_rng, rng, sample_batch)
    return state

  def init_abstract(
    self, rng: jax.Array, sample_inputs: Any, *, sample_batch: Batch = None
  ) -> TrainState:
    """Like `init`, but returns `jax.ShapeDtypeStruct`s carrying the shardings.

    Nothing is computed or allocated on the devices, so a model too big for
    them can still be laid out and its step lowered (`trainer.lower(state,
    batch)`) to read the compiled memory analysis; this is how "auto" measures
    candidates. (For a plan that does not store the model's own layout, e.g.
    a pipeline, the optimizer-layout probe still runs, on the host's CPU with
    full-size values: see `optimizer_probe.check_layout`.)
    """
    sample = self._check_sample(rng, sample_inputs)
    if sample_batch is not None:
      sample_batch = self._as_batch(sample_batch, abstract=True)
    if self.strategy.deferred:
      raise ValueError("init_abstract needs a concrete strategy; call init for 'auto'.")
    plan, state, uses_rng = self._layout(rng, _abstract(sample))
    self._commit(plan, sample, state, uses_rng, rng, sample_batch)
    return state

  @staticmethod
  def _optimizer_params(plan: Plan, stored: Any) -> Any:
    """The params as the optimizer sees them: stored, or the plan's view of them."""
    return stored if plan.optimizer_view is None else plan.optimizer_view.to_view(stored)

  def _host_model(self, model: Any) -> Any:
    """`model` as traced outside the mesh (see `_layout`): its axes bound if it needs them.

    The same object each time for one model, so that `jax.jit`'s cache holds.
    """
    if not self._host_axes:
      return model
    key = (id(model), self._host_axes)  # (the trainer holds the model: no id reuse)
    if key not in self._host_models:
      self._host_models[key] = bind_axes(model, self._host_axes)
    return self._host_models[key]

  def _layout(self, rng, abstract_inputs) -> tuple[Plan, TrainState, bool]:
    """The plan, the state as `ShapeDtypeStruct`s with their shardings, and rng use."""
    model = self._plan_model
    # Traced here outside the mesh: a model whose collectives (in `init` or `apply`)
    # name the strategy's `model_axes` (a sync BatchNorm's "data") is traced, from here
    # on, with them bound at size 1. Only such a model: bound functions are new ones,
    # which `jax.jit` compiles again.

    def trace(axes):
      host = bind_axes(model, axes)
      params, model_state = jax.eval_shape(host.init, rng, abstract_inputs)
      return params, model_state, _reads_rng(host, params, model_state, abstract_inputs)

    try:
      axes, (abstract_params, abstract_model_state, uses_rng) = (), trace(())
    except NameError as e:
      if not is_unbound_axis(e):  # (a collective in the model, over an axis not in scope)
        raise
      try:
        axes = tuple(self.strategy.model_axes)
        abstract_params, abstract_model_state, uses_rng = trace(axes)
      except NameError:
        raise ValueError(unbound_axis_message(self.strategy, e)) from None
    self._host_axes = axes  # (the same model, so the same axes as any layout before)
    strategy = self.strategy
    if uses_rng and not strategy.supports_rng:
      raise ValueError(
        f"{strategy!r} cannot train a model that calls hk.next_rng_key() (e.g. dropout): "
        "its layout does not pass a PRNG key to the model. Use data_parallel, fsdp or tensor."
      )
    if jax.tree.leaves(abstract_model_state) and not strategy.supports_state:
      raise ValueError(
        f"{strategy!r} cannot train a model with state (hk.transform_with_state, e.g. "
        f"BatchNorm; state {sorted(abstract_model_state)}): its layout does not keep the "
        "state. Use data_parallel or fsdp."
      )
    _check_params_differentiable(abstract_params)
    plan = strategy.make_plan(model, self.loss_fn, self.mesh, abstract_params, abstract_inputs)
    _check_plan(plan, strategy, self.mesh)
    if not optimizer_probe.needs_model_layout(self.optimizer, plan, abstract_params, strategy):
      plan = dataclasses.replace(plan, optimizer_view=None)  # (None: on the stored layout)
    param_shardings = self._shardings(plan.param_spec)
    stored = jax.eval_shape(plan.to_stored, abstract_params)
    if plan.optimizer_view is None:
      opt_params = stored
      opt_shardings = self._shardings(plan.param_spec if plan.opt_spec is None else plan.opt_spec)
    else:  # the optimizer runs on the model's layout, each leaf sharded as the view says
      opt_params = abstract_params
      opt_shardings = self._shardings(plan.optimizer_view.spec())
    # Optimizer-state leaves that mirror a parameter (Adam's moments), or stack
    # copies of it (lbfgs), get that parameter's sharding. Counters and other
    # non-parameter leaves are replicated, and so are per-parameter leaves of
    # another shape (adafactor's factored moments). `multi_transform`'s masked-out
    # leaves (`optax.MaskedNode`) stay.
    abstract_opt = jax.eval_shape(
      functools.partial(optimizers_lib.init, self.optimizer), opt_params
    )

    def param_leaf_sharding(leaf, sharding, param):
      if isinstance(leaf, optax.MaskedNode):
        return leaf
      return _state_leaf_sharding(leaf.shape, param.shape, sharding) or self._replicated

    try:
      opt_shardings = optax.tree_utils.tree_map_params(
        self.optimizer,
        param_leaf_sharding,
        abstract_opt,
        jax.tree.broadcast(opt_shardings, opt_params),
        opt_params,
        transform_non_params=lambda _: self._replicated,
        is_leaf=lambda x: isinstance(x, optax.MaskedNode),
      )
    except (TypeError, AttributeError, KeyError, IndexError):  # optax runs `init` on a
      # stand-in for the params, which a function of the params (multi_transform's
      # labels by `hk.data_structures.map`, lbfgs's line search reading the first
      # leaf's dtype) cannot read: matched by path instead.
      opt_shardings = _shardings_by_path(
        abstract_opt, opt_params, jax.tree.broadcast(opt_shardings, opt_params), self._replicated
      )
    with_sharding = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    replicated = lambda x: with_sharding(x, self._replicated)  # noqa: E731
    state = TrainState(
      jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated),
      jax.tree.map(with_sharding, stored, jax.tree.broadcast(param_shardings, stored)),
      jax.tree.map(with_sharding, abstract_opt, opt_shardings),
      replicated(jax.eval_shape(_training_key_data, rng)),
      jax.tree.map(replicated, abstract_model_state),
    )
    return plan, state, uses_rng

  def _check_sample(self, rng: jax.Array, sample_inputs: Any):
    if not _is_prng_key(rng):
      raise TypeError(
        f"rng must be a JAX PRNG key (e.g. jax.random.key(0)), got {type(rng).__name__} {rng!r}."
      )
    sample = _arrays("sample_inputs", sample_inputs)
    rows = _batch_size("sample_inputs", sample)
    if rows < 1:
      shapes = [tuple(x.shape) for x in jax.tree.leaves(sample)]
      raise ValueError(
        f"sample_inputs needs a leading batch axis of size >= 1, got shape "
        f"{shapes[0] if len(shapes) == 1 else shapes}."
      )
    return sample

  def _commit(self, plan, sample, state, uses_rng, rng, sample_batch) -> None:
    """Adopts a new layout (only once everything is built: no half state on failure)."""
    if sample_batch is not None:  # checked against the new layout before anything changes
      self._check_first_batch(sample_batch, _per_example(sample), (plan, _abstract(state)))
    self._plan = plan
    self.uses_rng = uses_rng
    self._rng_impl = _key_impl(rng)
    self._input_spec = _per_example(sample)
    self._batch_spec = None if sample_batch is None else _per_example(sample_batch)
    self._processes_agree = False
    self._loss_mean_checked = False
    self._batch_source = "the sample_batch given to init"
    self._state_shardings = jax.tree.map(lambda x: x.sharding, state)
    self._abstract_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    self.__dict__.pop("_compiled_step", None)
    self.__dict__.pop("_abstract_leaves", None)
    self._branches_checked = set()  # (program, batch size) pairs read: none for a new layout
    self.__dict__.pop("_compiled_apply", None)
    self.__dict__.pop("_compiled_params", None)
    self.__dict__.pop("_compiled_export", None)

  # ----------------------------------------------------------------- step
  def _key(self, rng_data: jax.Array, index: jax.Array | None) -> jax.Array:
    key = jax.random.wrap_key_data(rng_data, impl=self._rng_impl)
    return key if index is None else jax.random.fold_in(key, index)

  def _batch_axes(self) -> tuple[str, ...]:
    spec = self.plan.batch_spec
    axes = spec[0] if len(spec) else None
    if axes is None:
      return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)

  def _device_key(self, key):
    """Inside the map: `key` folded with this device's index along the batch axes."""
    axes = self._batch_axes()
    if key is None or not axes:
      return key
    index = 0
    for axis in axes:
      index = index * self.mesh.shape[axis] + jax.lax.axis_index(axis)
    return jax.random.fold_in(key, index)

  @functools.cached_property
  def _compiled_step(self):
    plan = self.plan
    mesh = self.mesh
    loss_and_grad = _checked_loss_and_grad(plan.loss_and_grad, local=plan.reduce is not None)
    param_spec = plan.param_spec
    accumulate = self.accumulate
    axes = self._batch_axes()

    def microsteps(loss_and_grad, params, model_state, key, inputs, targets, split):
      """(loss, grads, model_state) averaged over `accumulate` microsteps."""
      keys = None
      if key is not None and accumulate > 1:
        keys = jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(accumulate))
      elif key is not None:
        keys = key[None]  # one microstep: the key itself

      def run(params, inputs, targets, key):
        return loss_and_grad(params, inputs, targets, key, model_state)

      return accumulate_gradients(
        run, params, jax.tree.map(split, inputs), jax.tree.map(split, targets), keys
      )

    if plan.manual:

      def per_device(params, model_state, key, inputs, targets):
        if plan.check_vma and axes:  # each device's own new state, averaged below
          model_state = jax.lax.pcast(model_state, axes, to="varying")
        split = lambda x: x.reshape(accumulate, -1, *x.shape[1:])  # noqa: E731
        loss, grads, model_state = microsteps(
          loss_and_grad, params, model_state, self._device_key(key), inputs, targets, split
        )
        if plan.reduce is not None:
          loss, grads = plan.reduce((loss, grads))
          _check_grad_shapes(grads, params, "Plan.reduce")
        model_state = _mean_over(model_state, axes, mesh)
        if not norm_inside:
          return loss, grads, model_state
        return loss, grads, model_state, trees.replicated_norm(grads, mesh.axis_names)

      # Gradients replicated over the whole mesh (after the reduction): each
      # device takes the norm of its 1/N of them, instead of all of it.
      norm_inside = plan.reduce is not None and all(
        spec == P() for spec in jax.tree.leaves(param_spec, is_leaf=lambda x: isinstance(x, P))
      )
      grad_fn = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(param_spec, P(), P(), plan.batch_spec, plan.batch_spec),
        out_specs=(P(), param_spec, P()) + ((P(),) if norm_inside else ()),
        check_vma=plan.check_vma,
      )
    else:  # global arrays; XLA's partitioner adds the collectives the shardings imply
      norm_inside = False  # the partitioner takes the norm where the gradients lie
      grad_spec = param_spec if plan.grad_spec is None else plan.grad_spec
      grad_shardings = jax.tree.broadcast(self._shardings(grad_spec), self._abstract_state.params)
      ways = self._batch_split()
      micro_sharding = NamedSharding(mesh, P(None, *plan.batch_spec))

      def split(x):  # microstep j takes rows j of every device's block: no data moves
        x = x.reshape(ways, accumulate, -1, *x.shape[1:]).swapaxes(0, 1)
        x = x.reshape(accumulate, -1, *x.shape[3:])
        return jax.lax.with_sharding_constraint(x, micro_sharding)

      def grad_fn(params, model_state, key, inputs, targets):
        if accumulate == 1:
          loss, grads, model_state = loss_and_grad(params, inputs, targets, key, model_state)
        else:
          loss, grads, model_state = microsteps(
            loss_and_grad, params, model_state, key, inputs, targets, split
          )
        return loss, jax.lax.with_sharding_constraint(grads, grad_shardings), model_state

    optimizer = self.optimizer
    view = plan.optimizer_view

    def optimizer_update(grads, opt_state, params, loss, value_fn):
      # On global arrays, outside every map: a `lax.cond` in the optimizer
      # (`apply_if_finite`, `MultiSteps`) has one predicate for all devices, so
      # the collectives XLA puts in its branches are reached by all (the branch
      # check must not take it for a pipeline stage's `lax.switch`). A line
      # search's `lax.while_loop` likewise: its condition reads the global loss.
      with jax.named_scope(hlo_check.UNIFORM_SCOPE):
        return optimizers_lib.update(optimizer, grads, opt_state, params, loss, value_fn)

    skip_nonfinite = self.skip_nonfinite
    uses_default_loss = self.uses_default_loss
    uses_rng = self.uses_rng
    inputs_of, targets_of = self._inputs_of, self._targets_of

    def train_step(state: TrainState, batch):
      # (a model that reads no key still gets one: an adapter such as Flax's
      # `apply(v, x, rngs={'dropout': rng})` refuses None, and the key is unused)
      key = self._key(state.rng, state.step if uses_rng else None)
      args = (state.params, state.model_state, key, inputs_of(batch), targets_of(batch))
      if norm_inside:
        loss, grads, model_state, grad_norm = grad_fn(*args)
      else:
        loss, grads, model_state = grad_fn(*args)
        grad_norm = optax.tree_utils.tree_norm(grads)

      def loss_and_grad_at(opt_params):  # for line searches: the same program at other params
        stored = opt_params if view is None else view.from_view(opt_params)
        loss, grads = grad_fn(stored, *args[1:])[:2]
        return loss, grads if view is None else view.to_view(grads)

      value_fn = optimizers_lib.loss_function(loss_and_grad_at)
      if view is None:
        updates, opt_state = optimizer_update(grads, state.opt_state, state.params, loss, value_fn)
      else:  # an optimizer that does not act leaf by leaf, on the model's layout
        grads_view, params_view = view.to_view(grads), view.to_view(state.params)
        updates, opt_state = optimizer_update(
          grads_view, state.opt_state, params_view, loss, value_fn
        )
        updates = view.from_view(updates)
      params = optax.apply_updates(state.params, updates)
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      new_state = TrainState(state.step + 1, params, opt_state, state.rng, model_state)
      if skip_nonfinite:  # keep the old params and optimizer state for a bad batch
        # The new params and optimizer state are checked too (a finite gradient
        # still gives NaN params with an infinite learning rate). Only here: on
        # sharded params the check costs one more (scalar) collective.
        finite = finite & trees.all_finite((params, opt_state))
        new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
      metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite}
      if uses_default_loss:  # (inputs, labels) pairs
        classes = self._num_classes(batch[0])
        labels = batch[1]
        # A count (a sum, like the gradients' reduction) rather than jnp.all, so
        # XLA can fold its reduction over the batch axes into the gradients' one.
        outside = jnp.sum(((labels < 0) | (labels >= classes)).astype(jnp.float32))
        metrics["labels_in_range"] = outside == 0
      return new_state, metrics

    # Pinning the output shardings to the input's keeps the state a fixed
    # point, so the second step reuses the first step's program.
    return jax.jit(
      train_step,
      donate_argnums=0,
      out_shardings=(self._state_shardings, self._replicated),
      compiler_options=dict(STEP_COMPILER_OPTIONS),
    )

  def _batch_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, self.plan.batch_spec)

  def _batch_split(self) -> int:
    """How many ways the batch's leading axis is split across the mesh."""
    return int(np.prod([self.mesh.shape[a] for a in self._batch_axes()]))

  def _check_batch_size(self, batch: int, what: str, accumulate: int | None = None) -> None:
    accumulate = self.accumulate if accumulate is None else accumulate
    split = self._batch_split()
    multiple = split * self.plan.batch_multiple * accumulate
    if batch < 1 or batch % multiple:
      raise messages.BatchSizeError(
        messages.batch_size_message(
          what,
          batch,
          str(self.plan.batch_spec),
          split,
          self.plan.batch_multiple,
          messages.microbatches_default(self.strategy),
          accumulate,
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
    if jax.process_count() == 1:
      return value

    def leaf(x):
      if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x
      return jax.make_array_from_process_local_data(self._batch_sharding(), np.asarray(x))

    return jax.tree.map(leaf, value)

  def _check_first_batch(self, batch: Batch, input_spec: Any, layout: tuple | None = None) -> None:
    """Checks a first batch (or `sample_batch`): its model inputs and labels, or the loss.

    `layout` is `(plan, abstract state)` of a layout not yet adopted (default:
    the trainer's own).
    """
    if self.model_inputs is None:
      what = "batch[0] (the model inputs)"
    else:
      what = "model_inputs(batch)"
    try:
      inputs = jax.eval_shape(self._inputs_of, _abstract(batch))
    except Exception as e:  # noqa: BLE001 - the user's function, reported with its cause
      raise TypeError(f"model_inputs(batch) failed on the batch: {type(e).__name__}: {e}") from e
    _check_like(what, inputs, input_spec, "the sample_inputs given to init")
    rows = _batch_size("batch", batch)
    _check_rows(what, inputs, rows)
    if self.model_inputs is None and self.uses_default_loss:
      y = batch[1]
      if not isinstance(y, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        raise TypeError(f"labels must be one integer array, got {type(y).__name__}.")
      if y.ndim != 1:
        raise ValueError(f"labels must have shape [{rows}], got {tuple(y.shape)}.")
      if not jnp.issubdtype(y.dtype, jnp.integer):
        raise TypeError(f"labels must be integer class ids, got dtype {y.dtype}.")
    if not self.uses_default_loss:
      plan, state = layout or (self.plan, self._abstract_state)
      self._check_loss_is_scalar(plan, state, inputs, batch)

  def _check_loss_is_scalar(self, plan: Plan, state: Any, inputs: Any, batch: Batch) -> None:
    """A `loss_fn` must return one number: a `[B]` loss fails deep in `grad` otherwise."""
    params = jax.eval_shape(plan.to_params, state.params)
    targets = batch[1] if self.model_inputs is None else batch
    try:
      loss, _ = jax.eval_shape(
        model_loss(self._host_model(self._plan_model), self.loss_fn),
        params,
        inputs,
        _abstract(targets),
        jax.random.key(0),
        state.model_state,
      )
    except Exception:  # noqa: BLE001 - the step reports the loss's own error, with its cause
      return
    shape = getattr(loss, "shape", None)
    if shape != ():
      what = f"shape {tuple(shape)}" if shape is not None else type(loss).__name__
      raise ValueError(
        f"loss_fn must return a scalar (e.g. the mean over the batch), got {what}; "
        "reduce it, e.g. `.mean()`."
      )

  def _loss_parts(self) -> int:
    """The parts of a batch whose losses the step averages: the devices the batch is split
    over and the microbatches, where each computes its own loss (`manual` plans), times
    the accumulation microsteps. 1 where the loss is computed on the whole batch."""
    per_device = self._batch_split() * self.plan.batch_multiple if self.plan.manual else 1
    return per_device * self.accumulate

  def _warn_unless_loss_is_a_mean(self, batch: Batch) -> None:
    """Warns when `loss_fn` is not a mean over examples and the step averages parts' losses.

    On the first rows of the first batch (at most 8, an even number), with random
    outputs of the model's shapes, the loss of the rows is compared with the mean of the
    losses of their two halves: equal (within float32 rounding) for a mean over
    examples; not for a mean over a count that differs between the halves (a masked
    mean) or a loss across examples, which then trains otherwise than on one device.
    Passed over (no word) with the default loss, a loss on the whole batch, several
    processes, fewer than 2 rows, outputs that do not lead with the batch, or a loss that
    fails or is not finite on these values: it is a hint, not a proof.
    """
    parts = self._loss_parts()
    if self.uses_default_loss or parts == 1 or jax.process_count() > 1:
      return
    rows = min(8, _batch_size("batch", batch)) // 2 * 2
    if rows < 2:
      return
    try:
      head = jax.tree.map(lambda x: np.asarray(x[:rows]), batch)
      shapes = self._abstract_outputs(self._inputs_of(head))
      noise = np.random.default_rng(0)
      # (at least float32: a loss of bfloat16 outputs (a jmp policy's output=bfloat16)
      # rounds its value to ~3 digits, beyond any tolerance that tells a masked mean)
      outputs = jax.tree.map(
        lambda o: (
          noise.normal(size=o.shape).astype(np.promote_types(o.dtype, np.float32))
          if jnp.issubdtype(o.dtype, jnp.floating)
          else np.zeros(o.shape, o.dtype)
        ),
        shapes,
      )
      if any(np.shape(x)[:1] != (rows,) for x in jax.tree.leaves(outputs)):
        return
      half = lambda tree, k: jax.tree.map(lambda x: x[k * rows // 2 : (k + 1) * rows // 2], tree)  # noqa: E731
      targets = self._targets_of(head)
      values = [self.loss_fn(outputs, targets)]
      values += [self.loss_fn(half(outputs, k), half(targets, k)) for k in (0, 1)]
      whole, *halves = map(float, values)
      # (within the rounding of the loss's own dtype: one that computes in bfloat16)
      kind = jnp.result_type(*values)
      eps = float(jnp.finfo(kind).eps) if jnp.issubdtype(kind, jnp.floating) else 0.0
    except Exception:  # noqa: BLE001 - a hint only: the step reports the loss's own errors
      return
    mean = (halves[0] + halves[1]) / 2
    rtol = max(1e-4, 4 * eps)
    if np.isfinite([whole, mean]).all() and not np.isclose(whole, mean, rtol=rtol, atol=1e-6):
      warnings.warn(
        f"loss_fn is not a mean over examples: on the first batch's first {rows} rows (with "
        f"random outputs) it gives {whole:.6g}, and the mean of its values on their two "
        f"halves is {mean:.6g}. {self.strategy!r} averages the losses of {parts} parts of "
        "each batch (devices, microbatches, accumulation steps), so it trains otherwise "
        "than on one device: a masked mean over its own count, `(l * mask).sum() / "
        "mask.sum()`, weights the parts alike, not the tokens. Divide by a count "
        "proportional to the rows instead, e.g. `(l * mask).sum() / mask.size` (see "
        "README, 'loss_fn must be a mean over examples').",
        LossNotAMeanWarning,
        stacklevel=3,
      )

  def _as_batch(self, batch: Any, abstract: bool = False) -> Any:
    """`batch` with array leaves (a pair, without `model_inputs`)."""
    if self.model_inputs is None and (not isinstance(batch, (tuple, list)) or len(batch) != 2):
      raise TypeError(
        f"A batch is a pair (inputs, labels), got {type(batch).__name__}"
        + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        + "; for other batches pass model_inputs= (batch -> model inputs) and a "
        "loss_fn(outputs, batch) when calling the strategy."
      )
    return _arrays("batch", tuple(batch) if isinstance(batch, list) else batch, abstract)

  def _check_batch(self, batch: Any, abstract: bool = False) -> Any:
    """Validates a batch; `abstract` also accepts `jax.ShapeDtypeStruct` leaves."""
    self.plan  # noqa: B018 - raises a clear error before init
    batch = self._as_batch(batch, abstract)
    if not abstract:
      batch = self._to_global(batch)
    rows = _batch_size("batch", batch)
    if self._batch_spec is None:
      self._check_first_batch(batch, self._input_spec)
      spec = _per_example(batch)
    else:
      spec = self._batch_spec
      _check_like("batch", batch, spec, self._batch_source)
    self._check_batch_size(rows, "the batch")
    if self._batch_spec is None:  # the first batch fixes what the others look like
      self._batch_spec, self._batch_source = spec, "the first batch"
    return batch

  def step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
    """Runs one training step: forward, backward, gradient averaging, update.

    One compiled program; `state` is donated (do not reuse it afterwards).

    Args:
      state: from `init` or a previous `step`.
      batch: `(inputs, labels)` (e.g. images `[B, ...]` and int labels `[B]`),
        or with `model_inputs` any pytree of arrays; every leaf shares the
        leading axis `B`, which must split evenly over the strategy's batch
        axes (and microbatches and `accumulate`). Every batch must have the
        structure, per-example shapes and dtypes of the first one (or of
        `sample_batch`); errors name the leaf (e.g. `batch['tokens']`).

    Returns:
      `(new_state, metrics)`, metrics `{"loss", "grad_norm", "finite"}` as device
      scalars (`grad_norm` is the global norm of the gradients averaged over
      the batch; `finite` is False when the loss or the gradients hold a NaN or
      infinity, and with `skip_nonfinite=True` also the new params or optimizer
      state; then that update was not applied). With the default loss, also
      `"labels_in_range"`: every label is a class id in `[0, C)`, C the model's
      output width (out-of-range labels do not stop the step unless
      `debug=True`).

    Raises:
      TypeError, ValueError: for a malformed batch (checked before anything runs,
        so `state` stays usable), a state that was already donated to an
        earlier `step` or belongs to another trainer, or (with `debug=True`
        and the default loss) labels outside `[0, C)`. With several processes,
        the first `step` checks (one collective) that every process passed
        rows of the same shapes and dtypes, naming those that differ.

    Warns:
      LossNotAMeanWarning: at the first step, where the step averages the losses of
        parts of the batch and `loss_fn` is seen not to be a mean over examples
        (see `_warn_unless_loss_is_a_mean`).
    """
    self._check_state(state, "step")
    if not self._processes_agree and jax.process_count() > 1:
      # Each process passes its own rows; processes that pass different shapes
      # would assemble different global batches and compile different programs.
      # Once per layout, at its first step: every process runs it at the same point.
      distributed.check_same_everywhere(
        "batches (each process's rows, see local_batch_rows)",
        {
          "batch" + jax.tree_util.keystr(path): f"{np.shape(x)} {np.result_type(x)}"
          for path, x in jax.tree_util.tree_leaves_with_path(self._as_batch(batch))
        },
      )
      self._processes_agree = True
    batch = self._placed(self._check_batch(batch))
    if not self._loss_mean_checked:
      self._loss_mean_checked = True
      self._warn_unless_loss_is_a_mean(batch)
    if self.strategy.debug and self.uses_default_loss:
      self._check_label_range(*batch)
    self._check_branches(self._compiled_step, (state, batch), "step")
    state, metrics = self._compiled_step(state, batch)
    if self.strategy.debug:
      checks.assert_replicas_equal(state)
    return state, metrics

  def _placed(self, batch: Any) -> Any:
    """`batch` laid out with the batch sharding (a batch already there is passed as is)."""
    sharding = self._batch_sharding()
    leaves = jax.tree.leaves(batch)
    if all(isinstance(x, jax.Array) and x.sharding == sharding for x in leaves):
      return batch
    return jax.device_put(batch, sharding)

  def _check_branches(self, compiled: Any, args: tuple, what: str) -> None:
    """Refuses a program with collectives some devices would never reach, before it runs.

    Only for plans with `branch_axes`, once per program and batch size (the
    last argument is the batch). Compiling here costs nothing extra: the
    first run finds the executable in JAX's compilation cache.

    Raises:
      ValueError: naming the first collective inside a per-stage branch
        that spans devices outside `plan.branch_axes`.
    """
    key = (what, jax.tree.leaves(args[-1])[0].shape[0])
    if self.plan.branch_axes is None or key in self._branches_checked:
      return
    with hlo_check.scopes_in_op_names():  # (the run reuses this lowering)
      text = compiled.lower(*args).compile().as_text()
    problems = hlo_check.branch_problems(text, self.mesh, vary=self.plan.branch_axes)
    if problems:
      more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
      raise ValueError(
        f"{self.strategy!r} compiled a {what} that would hang: XLA put collectives inside "
        f"per-stage branches, which only some of their devices run: {problems[0]}{more}. "
        "Nothing ran and the state is unchanged. Try activations='recompute' (the default) "
        "or without a mixed-precision policy, or model=1."
      )
    self._branches_checked.add(key)

  def lower(self, state: TrainState, batch: Batch) -> jax.stages.Lowered:
    """Lowers the training step for `batch`'s shapes, without running it.

    `trainer.lower(state, batch).compile().memory_analysis()` reports the
    compiled step's memory (e.g. `temp_size_in_bytes` for activations).

    `state` may come from `init_abstract` and `batch` may hold
    `jax.ShapeDtypeStruct`s: then nothing is allocated, which is how a layout
    is measured for a model that may not fit.
    """
    leaves = jax.tree.leaves(batch)
    abstract = bool(leaves) and all(isinstance(b, jax.ShapeDtypeStruct) for b in leaves)
    batch = self._check_batch(batch, abstract)
    sharding = self._batch_sharding()
    if abstract:
      batch = jax.tree.map(
        lambda b: jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=sharding), batch
      )
    else:
      batch = jax.device_put(batch, sharding)
    # (JAX reuses a lowering for the run and for `_check_branches`, which reads its scopes.)
    with hlo_check.scopes_in_op_names():
      return self._compiled_step.lower(state, batch)

  # ----------------------------------------------------------------- apply
  @functools.cached_property
  def _compiled_apply(self):
    plan = self.plan

    def forward(params, model_state, key, inputs):
      return plan.forward(params, inputs, key, model_state)

    if not plan.manual:
      batch, whole = self._batch_sharding(), self._replicated

      def split_like_the_inputs(params, model_state, key, inputs):
        rows = _batch_size("inputs", inputs)
        # Outputs whose first axis is the batch are split like it; others (a
        # scalar, a time-major [T, B, ...]) come back whole.
        return jax.tree.map(
          lambda y: jax.lax.with_sharding_constraint(
            y, batch if y.ndim and y.shape[0] == rows else whole
          ),
          forward(params, model_state, key, inputs),
        )

      return jax.jit(split_like_the_inputs)

    def per_device(params, model_state, key, inputs):
      return forward(params, model_state, self._device_key(key), inputs)

    fwd = jax.shard_map(
      per_device,
      mesh=self.mesh,
      in_specs=(plan.param_spec, P(), P(), plan.batch_spec),
      out_specs=plan.batch_spec,
      check_vma=plan.check_vma,
    )
    return jax.jit(fwd)

  def apply(self, state: TrainState, inputs: Any, *, rng: jax.Array | None = None) -> Any:
    """Returns the model's outputs on `inputs`, computed under the same layout.

    A stateful model reads `state.model_state` (the state it returns is
    dropped). A model that calls `hk.next_rng_key()` needs `rng`; strategies
    that split the batch over devices fold each device's index into it, as
    in `step`.

    Args:
      state: a `TrainState` of this trainer.
      inputs: model inputs shaped like the `sample_inputs` given to `init`,
        with any batch size that splits over the strategy's batch axes (and
        pipeline microbatches; `accumulate` plays no part).
      rng: a PRNG key for models that draw randomness (ignored otherwise).

    Returns:
      The outputs (any pytree), those with the batch as their first axis split
      over the mesh like the inputs. Where `apply` runs on the whole batch
      (`fsdp`, `tensor`), others (a scalar, a time-major
      `[T, B, ...]`) come back whole.

    Raises:
      TypeError, ValueError: for inputs unlike the sample, or a missing `rng`.
      ValueError: where `apply` runs per device (`data_parallel`), for an output
        without the batch as its first axis, naming it.
    """
    self.plan  # noqa: B018 - raises a clear error before init
    self._check_state(state, "apply")
    inputs = self._to_global(_arrays("inputs", inputs))
    _check_like("inputs", inputs, self._input_spec, "the sample_inputs given to init")
    rows = _batch_size("inputs", inputs)
    try:
      self._check_batch_size(rows, "inputs", accumulate=1)
    except messages.BatchSizeError as e:
      if rows < 1:
        raise
      raise messages.BatchSizeError(
        f"{e} Pad the inputs, or run the model on one device without the layout: "
        "model.apply(trainer.params(state), ...)."
      ) from None
    if self.uses_rng:
      if rng is None:
        raise ValueError(
          "This model calls hk.next_rng_key(): pass apply(state, inputs, rng=jax.random.key(...))."
        )
      if not _is_prng_key(rng):
        raise TypeError(f"rng must be a JAX PRNG key, got {type(rng).__name__} {rng!r}.")
      key = rng if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(rng)
    else:
      key = self._key(state.rng, None)  # (unread: see train_step)
    if self.plan.manual:
      self._check_outputs_split(inputs)
    inputs = jax.device_put(inputs, self._batch_sharding())
    args = (state.params, state.model_state, key, inputs)
    self._check_branches(self._compiled_apply, args, "forward pass")
    return self._compiled_apply(*args)

  # ----------------------------------------------------------------- guards
  @functools.cached_property
  def _abstract_leaves(self) -> tuple[list[Any], Any]:
    return jax.tree.flatten(self._abstract_state)

  @functools.cached_property
  def _mesh_devices(self) -> set:
    return set(self.mesh.devices.flat)

  def _check_state(self, state: Any, what: str) -> None:
    """Refuses a donated state, or one of another trainer, before JAX sees it.

    JAX 0.10 can crash the process (a segfault) on a deleted multi-device
    array, and a foreign tree fails deep inside `jit`; both are caught here.

    Raises:
      ValueError: naming the deleted or mismatched leaf.
    """
    self.plan  # noqa: B018 - raises a clear error before init
    leaves, treedef = jax.tree.flatten(state)
    # (Arrays only: under `jax.eval_shape(trainer.export_state, state)` the leaves are
    # tracers, which are neither deleted nor on other devices.)
    concrete = lambda x: isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)  # noqa: E731
    if any(concrete(leaf) and leaf.is_deleted() for leaf in leaves):
      path = next(  # the slow walk with names only for the message
        path
        for path, leaf in jax.tree_util.tree_leaves_with_path(state)
        if concrete(leaf) and leaf.is_deleted()
      )
      raise ValueError(
        f"{what}: this state was donated to an earlier trainer.step (its leaf "
        f"{trees.leaf_name(path)} is deleted); pass the state that step returned."
      )
    want_leaves, want_treedef = self._abstract_leaves
    if treedef == want_treedef and all(
      np.shape(x) == w.shape for x, w in zip(leaves, want_leaves, strict=True)
    ):
      mesh_devices = self._mesh_devices
      stray = next(
        (
          x for x in leaves if concrete(x) and x.committed and x.sharding.device_set != mesh_devices
        ),
        None,
      )
      if stray is None:
        return
      ids = lambda devices: sorted(d.id for d in devices)  # noqa: E731
      raise ValueError(
        f"{what}: the state does not belong to this trainer: its arrays are on devices "
        f"{ids(stray.sharding.device_set)}, this trainer's mesh on {ids(mesh_devices)} "
        "(another trainer's state moves with trainer.import_state(other.export_state(state)))."
      )
    detail = trees.first_mismatch(state, self._abstract_state) or (
      f"got a {type(state).__name__}, expected the TrainState its init or step returned"
    )
    raise ValueError(f"{what}: the state does not belong to this trainer: {detail}.")

  def _abstract_outputs(self, inputs: Any) -> Any:
    """The model's outputs for `inputs` (arrays or shapes), as shapes: nothing runs."""
    params = jax.eval_shape(self.plan.to_params, self._abstract_state.params)
    outputs, _ = jax.eval_shape(
      lambda p, s, x: self._host_model(self._plan_model).apply(p, s, jax.random.key(0), x),
      params,
      self._abstract_state.model_state,
      _abstract(inputs),
    )
    return outputs

  def _num_classes(self, inputs: Any) -> int:
    """The width C of the model's output for `inputs` (labels must lie in [0, C))."""
    return int(self._abstract_outputs(inputs).shape[-1])

  @functools.cached_property
  def _outputs_split(self) -> set:
    """The input shapes whose outputs `_check_outputs_split` has passed."""
    return set()

  def _check_outputs_split(self, inputs: Any) -> None:
    """Refuses, naming it, an output that a per-device `apply` could not put together.

    Each device computes the outputs of its own rows, and they are joined along
    the first axis: that axis must be the batch's, in every output. It is where
    the first axis follows the rows, for the whole batch and for one device's
    share (a time-major `[T, B, ...]` whose T happens to equal one of them is
    caught by the other).

    Raises:
      ValueError: naming the first output leaf that has no leading batch axis.
    """
    rows, split = _batch_size("inputs", inputs), self._batch_split()
    shapes = tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(inputs))
    if split == 1 or shapes in self._outputs_split:  # (traced once per input shapes)
      return
    for count in (rows, rows // split):
      outputs = self._abstract_outputs(
        jax.tree.map(lambda x, n=count: jax.ShapeDtypeStruct((n, *x.shape[1:]), x.dtype), inputs)
      )
      for path, y in jax.tree_util.tree_leaves_with_path(outputs):
        if not y.shape or y.shape[0] != count:
          raise ValueError(
            f"apply: {self.strategy!r} computes the outputs per device, each of its own "
            f"rows, and joins them along the first axis, but on {count} rows output"
            f"{jax.tree_util.keystr(path)} has shape {tuple(y.shape)}, not a leading batch "
            f"axis of {count}. Use model.apply(trainer.params(state), ...) for such outputs "
            "(a scalar, a time-major [T, B, ...]), or a strategy whose apply runs on the "
            "whole batch (fsdp, tensor)."
          )
    self._outputs_split.add(shapes)

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

    Returns `{"step", "params", "opt_state", "rng", "model_state"}`: params as
    `trainer.params` gives them, the optimizer state as
    `optimizer.init(params)` would lay it out, the training key's raw data
    and the model's state. Another trainer of the same model and optimizer,
    under any strategy and mesh, resumes from it with `import_state`;
    checkpoints store this form.
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
        "opt_state": state.opt_state
        if plan.optimizer_view is not None  # (kept in the model's layout already)
        else trees.map_param_like(state.opt_state, state.params, plan.to_params),
        "rng": state.rng,
        "model_state": state.model_state,
      }

    return jax.jit(export, out_shardings=self._replicated)

  def import_state(self, exported: dict[str, Any]) -> TrainState:
    """Places a state from `export_state` (of any strategy) with this trainer's layout.

    Without `"opt_state"` (or with `None` there), the optimizer state starts
    anew: this trainer's `optimizer.init` of the imported params, as `init`
    lays it out (e.g. to continue a run with another optimizer; its
    learning-rate schedule, and Adam's bias correction, start from step 0).

    Raises:
      ValueError: if its params, rng, model state or optimizer state do not
        match this trainer's (the optimizer state of another optimizer, or of
        clipping or weight decay switched on or off, is named as such).
    """
    plan = self.plan
    params = exported["params"]
    expected = jax.eval_shape(plan.to_params, self._abstract_state.params)
    mismatch = trees.first_mismatch({"params": params}, {"params": expected})
    if mismatch is not None:
      raise ValueError(f"The saved params do not fit this model: {mismatch}.")
    mismatch = trees.first_mismatch(
      {"rng": exported.get("rng"), "model_state": exported.get("model_state")},
      {"rng": self._abstract_state.rng, "model_state": self._abstract_state.model_state},
    )
    if mismatch is not None:
      raise ValueError(f"The saved state does not fit this model: {mismatch}.")

    fresh = exported.get("opt_state") is None
    if not fresh:
      self._check_opt_state(exported["opt_state"], expected)

    def place(exported):
      stored = plan.to_stored(exported["params"])
      if fresh:
        opt_state = optimizers_lib.init(self.optimizer, self._optimizer_params(plan, stored))
      elif plan.optimizer_view is not None:  # kept in the model's layout
        opt_state = exported["opt_state"]
      else:
        opt_state = trees.map_param_like(exported["opt_state"], exported["params"], plan.to_stored)
      return TrainState(
        jnp.asarray(exported["step"], jnp.int32),
        stored,
        opt_state,
        jnp.asarray(exported["rng"], self._abstract_state.rng.dtype),
        exported["model_state"],
      )

    mesh_devices = set(self.mesh.devices.flat)

    def reachable(x):  # arrays on other devices (another trainer's mesh) go via the host
      # (`jit` takes committed arguments on its own devices only: on a subset of
      # them, say 2 of a 4-device mesh, it refuses them too)
      if isinstance(x, jax.Array) and x.is_fully_addressable and x.committed:
        if x.sharding.device_set != mesh_devices:
          if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # (a noise transform's)
            data = np.asarray(jax.random.key_data(x))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
          return np.asarray(x)
      return x

    exported = jax.tree.map(reachable, exported)
    return jax.jit(place, out_shardings=self._state_shardings)(exported)

  def _check_opt_state(self, opt_state: Any, params: Any) -> None:
    """Raises ValueError, naming the difference, for another optimizer's state."""
    expected = jax.eval_shape(self.optimizer.init, params)
    problem = trees.first_mismatch({"opt_state": opt_state}, {"opt_state": expected})
    if problem is None and jax.tree.structure(opt_state) != jax.tree.structure(expected):

      def outline(tree):  # e.g. (ScaleByAdamState, EmptyState): a chain's states
        if isinstance(tree, (tuple, list)) and not hasattr(tree, "_fields"):
          parts = ", ".join(type(part).__name__ for part in tree)
          return f"[{parts}]" if isinstance(tree, list) else f"({parts})"
        return type(tree).__name__

      if _plain_containers(opt_state) and not _plain_containers(expected):
        raise ValueError(
          "The saved optimizer state has this trainer's leaves in plain dicts and lists "
          f"({outline(opt_state)}, expected {outline(expected)}), as orbax reads a "
          "checkpoint without a target tree: restore it with parstrat.checkpoint."
          "Checkpointer, or give orbax the target jax.eval_shape(trainer.export_state, state)."
        )
      problem = (
        f"its leaves fit but its tree does not: {outline(opt_state)}, expected {outline(expected)}"
      )
    if problem is not None:
      raise ValueError(
        "The saved optimizer state does not fit this trainer's optimizer (another optimizer, "
        f'clipping or weight decay?): {problem}. Import the state without its "opt_state" '
        "(or with None there) to start the optimizer anew from the saved params."
      )

  # ----------------------------------------------------------------- params
  @functools.cached_property
  def _compiled_params(self):
    return jax.jit(self.plan.to_params, out_shardings=self._replicated)

  def params(self, state: TrainState) -> Params:
    """Returns the full params in the model's own Haiku layout (replicated).

    `model.apply(trainer.params(state), None, x)` works without parstrat (for an
    `hk.transform_with_state` model, `model.apply(trainer.params(state),
    state.model_state, rng, x)`).
    """
    self._check_state(state, "params")
    return self._compiled_params(state.params)


def _plain_containers(tree: Any) -> bool:
  """Whether `tree` is built of dicts, lists, tuples and None only (no NamedTuple)."""
  if tree is None:
    return True
  if isinstance(tree, dict):
    return all(_plain_containers(v) for v in tree.values())
  if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
    return all(_plain_containers(v) for v in tree)
  return jax.tree_util.treedef_is_leaf(jax.tree.structure(tree))  # (an array, a shape)


def accumulate_gradients(
  loss_and_grad: Callable[..., Any],
  params: Any,
  *microbatches: Any,
) -> Any:
  """The mean of `loss_and_grad(params, *microbatches[j])` over microsteps j, one at a time.

  The first microstep runs outside the loop and seeds the running sums, so the
  sums have exactly the type (shape, dtype, and under `shard_map` the
  device-varying axes) that `loss_and_grad` returns; a `lax.fori_loop` adds
  the others. Only one microstep's activations are alive at a time.

  Args:
    loss_and_grad: `(params, *microbatch) -> pytree`, e.g. `(mean loss, grads)`.
    params: the params, passed to every microstep.
    *microbatches: pytrees whose leaves have a leading microstep axis `[k, ...]`
      (e.g. inputs and labels; None for an argument that is None in every
      microstep).

  Returns:
    Every leaf of `loss_and_grad`'s result averaged over the k microsteps, in
    its own dtype (integer leaves: the floor of the mean; bool leaves: True
    where every microstep's is): the whole batch's mean loss and
    its gradient when every microstep has the same size.

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
  k = jax.tree.leaves(microbatches)[0].shape[0]

  def microstep(j):
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, j, keepdims=False), microbatches)

  first = loss_and_grad(params, *jax.tree.map(lambda x: x[0], microbatches))
  if k == 1:
    return first

  def body(j, total):  # reads microstep j in place: no copy of the batch
    return jax.tree.map(jnp.add, total, _summable(loss_and_grad(params, *microstep(j))))

  total = jax.lax.fori_loop(1, k, body, _summable(first))
  return jax.tree.map(lambda x, like: _mean_of_sum(x, k, like.dtype), total, first)


def _summable(tree: Any) -> Any:
  """Bools and integers narrower than 32 bits as int32 (uint32), so that sums count.

  (`jnp.add` of bools is `or`, and 8 devices' int8 100s would overflow.)
  """

  def wide(x):
    if x.dtype == jnp.bool_:
      return x.astype(jnp.int32)
    if jnp.issubdtype(x.dtype, jnp.integer) and x.dtype.itemsize < 4:
      return x.astype(jnp.uint32 if jnp.issubdtype(x.dtype, jnp.unsignedinteger) else jnp.int32)
    return x

  return jax.tree.map(wide, tree)


def _mean_of_sum(total: jax.Array, count: int, dtype) -> jax.Array:
  """`total / count` in `dtype`: for integers the floor, for bools whether all were True."""
  mean = total / count if jnp.issubdtype(total.dtype, jnp.inexact) else total // count
  return mean.astype(dtype)


def _mean_over(tree: Any, axes: tuple[str, ...], mesh: Mesh) -> Any:
  """Inside the map: the mean over mesh `axes` of every leaf, in the leaf's dtype.

  Integers get the floor of the mean, and bools (summed as int32 by `psum`) that
  floor cast back: True where every device's is.
  """
  if not axes:
    return tree
  count = int(np.prod([mesh.shape[a] for a in axes]))
  return jax.tree.map(
    lambda x: _mean_of_sum(jax.lax.psum(_summable(x), axes), count, x.dtype), tree
  )


def _training_key_data(rng: jax.Array) -> jax.Array:
  """The raw data of the training key `fold_in(rng, 1)` stored in `TrainState.rng`."""
  return jax.random.key_data(jax.random.fold_in(rng, 1))


def _key_impl(rng: jax.Array):
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    return jax.random.key_impl(rng)
  return None  # a legacy raw key: JAX's default implementation


def _check_params_differentiable(params: Any) -> None:
  """Refuses params with a leaf that is not a float: gradients cannot be taken of it.

  Raises:
    TypeError: naming the first such leaf and its dtype (it failed at the first step,
      inside `jax.grad`, naming neither).
  """
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      raise TypeError(
        f"params{jax.tree_util.keystr(path)} has dtype {leaf.dtype}: the params must all be "
        "floats, to take their gradients. A random key or counter (Flax nnx's `Rngs` held "
        "by a module, as `nnx.Dropout(rate, rngs=rngs)` holds one) belongs outside them: "
        "give `init` only the parameters (`nnx.split(module, nnx.Param, ...)`), or pass "
        "the key per call; keep other integer arrays in the model's state or as constants."
      )


def _reads_rng(model, params, model_state, inputs) -> bool:
  """Whether the model's `apply` reads its rng (calls `hk.next_rng_key()`), found by tracing.

  Haiku's lifted transforms (`hk.remat`, `hk.layer_stack`, `hk.dynamic_unroll`)
  hand the key into their inner computation whether or not it draws from it.
  So a key that reaches an equation counts as read if the outputs depend on it
  (the jaxpr's dead-code elimination, JAX's internal `dce_jaxpr`, says which
  inputs they use), or if `apply` fails without a key: a model that calls
  `hk.next_rng_key()` and drops the value (dropout at rate 0) still needs one.
  """
  key = jax.random.key(0)
  jaxpr = jax.make_jaxpr(lambda p, s, k, x: model.apply(p, s, k, x))(
    params, model_state, key, inputs
  ).jaxpr
  n = len(jax.tree.leaves(params)) + len(jax.tree.leaves(model_state))
  key_var = jaxpr.invars[n]
  if not any(key_var in eqn.invars for eqn in jaxpr.eqns) and key_var not in jaxpr.outvars:
    return False
  try:
    from jax._src.interpreters import partial_eval  # noqa: PLC0415 - internal, optional

    _, used = partial_eval.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
  except (ImportError, AttributeError, TypeError, ValueError):
    return True  # cannot tell: the key reaches an equation
  if used[n]:
    return True
  try:
    jax.eval_shape(lambda p, s, x: model.apply(p, s, None, x), params, model_state, inputs)
  except Exception:  # noqa: BLE001 - Haiku's MissingRNGError, or any failure without a key
    return True
  return False


@jax.jit
def _min_max(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  return jnp.min(x), jnp.max(x)


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


def _arrays(what: str, tree: Any, abstract: bool = False) -> Any:
  """`tree` with every leaf an array; errors name the leaf, e.g. `batch['tokens']`."""
  if isinstance(tree, list) and not any(isinstance(x, (jax.Array, np.ndarray)) for x in tree):
    tree = _as_array(what, tree)  # nested lists of numbers: one array
  tree = jax.tree_util.tree_map_with_path(
    lambda path, leaf: _as_array(what + jax.tree_util.keystr(path), leaf, abstract), tree
  )
  if not jax.tree.leaves(tree):
    raise TypeError(f"{what} must hold at least one array, got {tree!r}.")
  return tree


class LossNotAMeanWarning(UserWarning):
  """`loss_fn` gave another value on a batch than the mean of its values on its halves,
  under a strategy that averages the losses of parts of each batch."""


def _batch_size(what: str, tree: Any) -> int:
  """The leading axis every leaf of `tree` shares."""
  rows = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    name = what + jax.tree_util.keystr(path)
    if not leaf.shape:
      raise ValueError(f"{name} needs a leading batch axis, got a scalar of dtype {leaf.dtype}.")
    rows[name] = leaf.shape[0]
  if len(set(rows.values())) > 1:
    listed = ", ".join(f"{name}: {n}" for name, n in rows.items())
    raise ValueError(f"The leaves of {what} must share their leading (batch) axis, got {listed}.")
  return next(iter(rows.values()))


def _check_rows(what: str, tree: Any, rows: int) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not leaf.shape or leaf.shape[0] != rows:
      raise ValueError(
        f"{what}{jax.tree_util.keystr(path)} must keep the batch's leading axis of {rows}, "
        f"got shape {tuple(leaf.shape)}."
      )


def _abstract(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _per_example(tree: Any) -> Any:
  """Every leaf's per-example shape and dtype (the batch axis dropped; dtypes as JAX sees
  them, so a NumPy float64 is float32 unless 64-bit mode is on)."""
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(tuple(x.shape[1:]), jax.dtypes.canonicalize_dtype(x.dtype)),
    tree,
  )


def _check_like(what: str, tree: Any, spec: Any, source: str) -> None:
  """`tree`'s leaves must have `spec`'s structure, per-example shapes and dtypes."""
  if jax.tree.structure(tree) != jax.tree.structure(spec):
    raise TypeError(
      f"{what} must have the structure of {source}, {jax.tree.structure(spec)}; got "
      f"{jax.tree.structure(tree)}."
    )
  for (path, leaf), want in zip(
    jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(spec), strict=True
  ):
    name = what + jax.tree_util.keystr(path)
    if leaf.ndim != len(want.shape) + 1 or tuple(leaf.shape[1:]) != tuple(want.shape):
      raise ValueError(
        f"{name} must have shape [B, {', '.join(map(str, want.shape))}] like {source}, "
        f"got {tuple(leaf.shape)}."
      )
    if jax.dtypes.canonicalize_dtype(leaf.dtype) != jnp.dtype(want.dtype):
      raise TypeError(f"{name} must have dtype {want.dtype} like {source}, got dtype {leaf.dtype}.")
