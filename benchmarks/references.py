"""The hand-written programs the benchmark measures parstrat against.

Each is the code a user would write today without parstrat, on the same model,
optimizer and global batch: single-device `jax.jit`, `jax.pmap`, `jit(shard_map)`
with one `pmean`, FSDP as `jit` on sharded params, and a `shard_map` + `ppermute`
GPipe loop. Each builder returns `(step, state, put)`: a jitted step that donates
its state, the placed initial state, and a function placing a batch.

`benchmarks/run.py` times them next to parstrat's strategies;
`tests/test_benchmark_references.py` compares their compiled programs with
parstrat's. Importing this module starts no backend and parses no arguments.
"""

from __future__ import annotations

import functools
import time

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import parstrat
from parstrat._src.strategy import STEP_COMPILER_OPTIONS

#: The XLA options the jitted references compile with: the same as parstrat's step, so
#: a ratio compares the programs, not the compiler settings. (`jax.pmap` takes none.)
REFERENCE_OPTIONS = dict(STEP_COMPILER_OPTIONS)


def median_step_time(step, state, batch, repeats):
  """`(median seconds, state)` of `repeats` calls `state = step(state, batch)`, after one more.

  For the benchmarks that time passes of their rows in turn (`exchange_overhead.py`,
  `optimizer_view.py`): the first call of each pass is not timed.
  """
  state = step(state, batch)
  jax.block_until_ready(state)
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    state = step(state, batch)
    jax.block_until_ready(state)
    samples.append(time.perf_counter() - start)
  return float(np.median(samples)), state


def mlp(widths):
  return hk.transform(lambda x: hk.nets.MLP(widths, activation=jax.nn.swish)(x))


def with_label_check(logits, labels):
  """The default loss and, as parstrat's step reports it, how many labels lie outside [0, C)."""
  outside = jnp.sum(((labels < 0) | (labels >= logits.shape[-1])).astype(jnp.float32))
  return parstrat.softmax_cross_entropy(logits, labels), outside


def loss_of(model):
  """`(params, x, y) -> (loss, labels outside [0, C))`: differentiate with `has_aux=True`."""

  def loss(params, x, y):
    return with_label_check(model.apply(params, None, x), y)

  return loss


def jit_reference(model, optimizer, params):
  loss = loss_of(model)

  @functools.partial(jax.jit, compiler_options=REFERENCE_OPTIONS)
  def step(carry, batch):
    params, opt_state = carry
    grads = jax.grad(loss, has_aux=True)(params, *batch)[0]
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  device = jax.devices()[0]
  state = jax.device_put((params, optimizer.init(params)), device)
  return step, state, lambda b: jax.device_put(b, device)


def pmap_reference(model, optimizer, params, n):
  loss = loss_of(model)

  @functools.partial(jax.pmap, axis_name="batch", donate_argnums=0)
  def step(carry, batch):
    params, opt_state = carry
    grads = lax.pmean(jax.grad(loss, has_aux=True)(params, *batch)[0], "batch")
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  devices = jax.devices()[:n]
  state = (params, optimizer.init(params))
  stacked = jax.tree.map(lambda x: np.broadcast_to(x, (n, *np.shape(x))), state)
  state = jax.pmap(lambda x: x, devices=devices)(stacked)

  def shard(batch):
    return jax.tree.map(lambda a: a.reshape(n, a.shape[0] // n, *a.shape[1:]), batch)

  return step, state, shard


def update_step(loss_and_grads, optimizer, metrics, **jit_options):
  """The jitted update every multi-device reference shares (state donated).

  With `metrics`, the step also returns what parstrat's step returns besides the
  state, the loss, the gradients' global norm, a finite flag and whether every label
  is a class id, carried as a third state element: a hand-written step that reports
  the same things. `loss_and_grads(params, batch)` returns `((loss, labels outside
  [0, C)), grads)`.
  """

  def step(carry, batch):
    params, opt_state = carry[:2]
    (loss, outside), grads = loss_and_grads(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    new = (optax.apply_updates(params, updates), opt_state)
    if not metrics:
      return new
    norm = optax.tree_utils.tree_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(norm)
    in_range = outside == 0
    return (*new, {"loss": loss, "grad_norm": norm, "finite": finite, "labels_in_range": in_range})

  return jax.jit(step, donate_argnums=0, compiler_options=REFERENCE_OPTIONS, **jit_options)


def no_metrics(sharding):
  """The initial metrics of a `metrics=True` reference's state, placed by `sharding`."""
  zero = jnp.zeros((), jnp.float32)
  true = jnp.bool_(True)
  metrics = {"loss": zero, "grad_norm": zero, "finite": true, "labels_in_range": true}
  return jax.device_put(metrics, sharding)


def shard_map_dp_reference(model, optimizer, params, n, metrics=False):
  """Data parallelism as a user writes it today: `jit(shard_map)` + one `pmean`."""
  mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
  loss = loss_of(model)

  def local(params, x, y):  # check_vma=False: the gradient is local, the pmean averages it
    return lax.pmean(jax.value_and_grad(loss, has_aux=True)(params, x, y), "data")

  grad_fn = jax.shard_map(
    local, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P(), check_vma=False
  )
  step = update_step(lambda params, batch: grad_fn(params, *batch), optimizer, metrics)
  replicated = NamedSharding(mesh, P())
  state = jax.device_put((params, optimizer.init(params)), replicated)
  state = (*state, no_metrics(replicated)) if metrics else state
  return step, state, lambda b: jax.device_put(b, NamedSharding(mesh, P("data")))


def fsdp_reference(model, optimizer, params, n, metrics=False, replicate_below=0):
  """FSDP as a user writes it today: `jit` on params sharded over "data", XLA's collectives.

  Each leaf is split along its largest dimension that n divides (else replicated),
  the optimizer state alike, the batch over "data"; the partitioner inserts the
  all-gathers and reduce-scatters. Leaves of fewer than `replicate_below` elements
  stay replicated (the layout of `FSDP(replicate_below=...)`).
  """
  mesh = jax.make_mesh(
    (n,), ("data",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,)
  )
  loss = loss_of(model)

  def sharding(leaf):
    dims = [d for d in np.argsort(np.shape(leaf))[::-1] if np.shape(leaf)[d] % n == 0]
    spec = [None] * np.ndim(leaf)
    if dims and np.size(leaf) >= replicate_below:
      spec[int(dims[0])] = "data"
    return NamedSharding(mesh, P(*spec))

  params = jax.device_put(params, jax.tree.map(sharding, params))
  opt_state = optimizer.init(params)
  state = jax.device_put((params, opt_state), jax.tree.map(sharding, (params, opt_state)))
  state = (*state, no_metrics(NamedSharding(mesh, P()))) if metrics else state
  step = update_step(
    lambda params, batch: jax.value_and_grad(loss, has_aux=True)(params, *batch),
    optimizer,
    metrics,
    out_shardings=jax.tree.map(lambda x: x.sharding, state),
  )
  return step, state, lambda b: jax.device_put(b, NamedSharding(mesh, P("data")))


def shard_map_gpipe_reference(
  width, stages, microbatches, optimizer, per_stage=1, metrics=False, remat=None, data=1
):
  """A hand-written GPipe: `per_stage` x (Linear(width)+swish) per stage, stacked weights.

  With `data` > 1, `data` such pipelines side by side on a ("data", "stage") mesh, the
  batch split over "data" (the counterpart of `Hybrid`): autodiff through `shard_map`
  sums the gradients of the params, replicated over "data", over that axis, once per step.

  Autodiff through the loop keeps every tick's residuals. With `remat` (a
  `jax.checkpoint_policies` name, e.g. "nothing_saveable" or "dots_saveable"), each
  tick's stage computation is wrapped in `jax.checkpoint` with that policy, as a user
  bounding a GPipe loop's activation memory writes it (praxis' and MaxText's pipelines
  remat their stages alike): the counterpart of parstrat's `activations=` policies.
  """
  # One loop: a "stage" mesh and a replicated batch, the program this reference always
  # compiled. (With a "data" axis, even of size 1, and no cast below, autodiff puts the
  # params' gradient psum over "data" in every tick of the backward loop, and XLA keeps
  # it as an all-reduce over singleton groups: a third slower here.)
  axes = ("stage",) if data == 1 else ("data", "stage")
  mesh = jax.make_mesh(
    (stages,) if data == 1 else (data, stages),
    axes,
    devices=jax.devices()[: data * stages],
    axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
  )
  batch_spec = P() if data == 1 else P("data")
  key = jax.random.key(0)
  w = jax.random.normal(key, (stages, per_stage, width, width)) / np.sqrt(width)
  b = jnp.zeros((stages, per_stage, width))
  params = (w, b)

  def pipeline_logits(params, x):
    if data > 1:  # each replica's own params: their gradient is summed over "data" once,
      # where this cast's transpose sits, not at each use inside the loop's backward
      params = lax.pcast(params, ("data",), to="varying")
    w, b = params  # this stage's [1, per_stage, width, width], [1, per_stage, width]
    stage = lax.axis_index("stage")
    M = microbatches
    xs = x.reshape(M, -1, width)

    def stage_fn(w, b, h):
      for k in range(per_stage):
        h = h @ w[0, k] + b[0, k]
        last = (stage == stages - 1) & (k == per_stage - 1)
        h = jnp.where(last, h, jax.nn.swish(h))
      return h

    if remat is not None:
      stage_fn = jax.checkpoint(stage_fn, policy=getattr(jax.checkpoint_policies, remat))

    def tick(carry, t):
      act, outs = carry
      h = stage_fn(w, b, jnp.where(stage == 0, xs[jnp.clip(t, 0, M - 1)], act))
      m = t - (stages - 1)
      outs = jnp.where(
        (stage == stages - 1) & (m >= 0), outs.at[jnp.clip(m, 0, M - 1)].set(h), outs
      )
      act = lax.ppermute(h, "stage", [(i, (i + 1) % stages) for i in range(stages)])
      return (act, outs), None

    init = (jnp.zeros_like(xs[0]), jnp.zeros_like(xs))
    init = lax.pcast(init, ("stage",), to="varying")
    (_, outs), _ = lax.scan(tick, init, jnp.arange(M + stages - 1))
    return lax.psum(jnp.where(stage == stages - 1, outs, 0.0), "stage").reshape(x.shape)

  logits = jax.shard_map(
    pipeline_logits, mesh=mesh, in_specs=(P("stage"), batch_spec), out_specs=batch_spec
  )
  stage_sharding = NamedSharding(mesh, P("stage"))
  params = jax.device_put(params, stage_sharding)
  opt_state = jax.tree.map(
    lambda x: jax.device_put(x, stage_sharding if x.ndim else NamedSharding(mesh, P())),
    optimizer.init(params),
  )

  def loss_and_grads(params, batch):
    x, y = batch
    return jax.value_and_grad(lambda p: with_label_check(logits(p, x), y), has_aux=True)(params)

  step = update_step(loss_and_grads, optimizer, metrics)
  replicated = NamedSharding(mesh, P())
  state = (params, opt_state, no_metrics(replicated)) if metrics else (params, opt_state)
  return step, state, lambda batch: jax.device_put(batch, NamedSharding(mesh, batch_spec))
