"""Checkpoints with orbax: the whole training state, in the model's own layout."""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

from parstrat._src.strategy import Trainer
from parstrat._src.strategy import TrainState


class Checkpointer:
  """Saves and restores training state every `save_every` steps, keeping the last `keep`.

  What is saved: the step, the params in the model's own Haiku layout, the
  optimizer state laid out as `optimizer.init(params)` would, the training key
  and the model's state (`trainer.export_state`), and a small JSON
  record (e.g. the data position and the seed). Because nothing in it depends
  on the strategy, a checkpoint written under one strategy and mesh restores
  under any other, and a user can read it with plain orbax. Orbax writes each
  checkpoint into a temporary directory and renames it when complete, so a
  process killed in the middle of a save leaves the previous checkpoint intact.

  Args:
    directory: where the checkpoints live (created if missing).
    save_every: save when `step % save_every == 0` (and whenever `force=True`).
    keep: how many of the newest checkpoints to keep.

  Example:
    >>> import tempfile, haiku as hk, jax, jax.numpy as jnp, optax, parstrat
    >>> from parstrat.checkpoint import Checkpointer
    >>> model = hk.transform(lambda x: hk.nets.MLP([4, 2])(x))
    >>> trainer = parstrat.DataParallel(data=2)(model, optax.sgd(0.1))
    >>> state = trainer.init(jax.random.key(0), jnp.zeros((1, 3)))
    >>> with Checkpointer(tempfile.mkdtemp(), save_every=1) as ckpt:
    ...   _ = ckpt.save(trainer, state, {"epoch": 0}, force=True)
    ...   restored, meta = ckpt.restore(trainer)
    >>> int(restored.step), meta
    (0, {'epoch': 0})
  """

  def __init__(self, directory: str | pathlib.Path, *, save_every: int = 1, keep: int = 3):
    if save_every < 1 or keep < 1:
      raise ValueError(f"save_every and keep must be >= 1, got {save_every} and {keep}.")
    self.directory = pathlib.Path(directory).absolute()
    self.save_every = save_every
    self._manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        enable_async_checkpointing=False,
        create=True,
      ),
    )

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()

  def close(self) -> None:
    self._manager.close()

  def latest_step(self) -> int | None:
    """The step of the newest complete checkpoint, or None."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(
    self,
    trainer: Trainer,
    state: TrainState,
    meta: dict[str, Any],
    *,
    step: int | None = None,
    force: bool = False,
  ) -> bool:
    """Saves `state` (and the JSON-able `meta`) if its step is due or `force`.

    Args:
      trainer: the trainer `state` belongs to.
      state: the state to save.
      meta: JSON-able extras, e.g. the data position.
      step: the checkpoint's number (default: `state.step`, the updates applied).
      force: save even if `step` is not a multiple of `save_every`.

    Returns:
      Whether a checkpoint was written.
    """
    step = int(state.step) if step is None else int(step)
    if not force and step % self.save_every:
      return False
    if step in self._manager.all_steps():
      return False
    exported = trainer.export_state(state)
    return self._manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(exported), meta=ocp.args.JsonSave(dict(meta))
      ),
      force=True,
    )

  def restore(self, trainer: Trainer, step: int | None = None) -> tuple[TrainState, dict]:
    """Restores the newest (or the given) checkpoint into `trainer`'s layout.

    `trainer` must have been `init`-ed (for its shapes and shardings); any
    strategy and mesh will do.

    Raises:
      FileNotFoundError: if there is no checkpoint.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"No checkpoint in {self.directory}.")
    template = trainer.export_state(_template_state(trainer))
    abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), template
    )
    restored = self._manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
      ),
    )
    return trainer.import_state(restored["state"]), dict(restored["meta"])


def _template_state(trainer: Trainer) -> TrainState:
  """A zero state with the trainer's shapes and shardings, to describe the restore."""
  shardings = trainer._state_shardings  # noqa: SLF001
  abstract = trainer._abstract_state  # noqa: SLF001
  return jax.tree.map(
    lambda a, s: jax.device_put(jax.numpy.zeros(a.shape, a.dtype), s), abstract, shardings
  )
