"""Checkpoints with orbax: the whole training state, in the model's own layout.

Each checkpoint also gets a manifest (`parstrat_manifest.json`, written
atomically once orbax has finished) with the size and SHA-256 of every file, so
a damaged checkpoint is found before it is restored, and the newest intact one
is used instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import pathlib
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp

from parstrat._src import files
from parstrat._src import trees
from parstrat._src.messages import first_line
from parstrat._src.messages import stacklevel_outside
from parstrat._src.strategy import Trainer
from parstrat._src.strategy import TrainState

MANIFEST = "parstrat_manifest.json"


class CheckpointWarning(UserWarning):
  """A checkpoint was skipped (damaged or unreadable) or restored without a manifest."""


class CheckpointError(Exception):
  """No checkpoint could be restored (every one is damaged or unreadable), or one could not
  be saved (another run's checkpoints in the way, or the write itself failed)."""


class CheckpointDoesNotFit(ValueError):
  """The saved tree differs from the trainer's (raised before orbax reads an array).

  Another model, or (as its subclass `OptimizerDoesNotFit`) another optimizer.
  """


class OptimizerDoesNotFit(CheckpointDoesNotFit):
  """The saved params fit the trainer's model, its optimizer state does not.

  Another optimizer, or clipping or weight decay switched on or off, gives the
  optimizer state another layout: `Checkpointer.restore(trainer,
  fresh_optimizer=True)` restores the rest and starts the optimizer state anew.
  """


def _check_json(name: str, value: Any) -> None:
  """Refuses, naming it, the first part of `value` that JSON cannot hold as it is.

  Raises:
    TypeError: for a key that is not a str, int, float, bool or None, or a value
      that is not one of those or a list, tuple or dict of them (a NumPy scalar,
      say). (JSON writes number keys as strings and tuples as lists, as before.)
  """
  if isinstance(value, dict):
    for key, item in value.items():
      if key is not None and not isinstance(key, str | int | float | bool):
        raise TypeError(
          f"{name} has the key {key!r}: JSON keys are strings (numbers, bools and None "
          "are written as strings)."
        )
      _check_json(f"{name}[{key!r}]", item)
  elif isinstance(value, list | tuple):
    for i, item in enumerate(value):
      _check_json(f"{name}[{i}]", item)
  elif value is not None and not isinstance(value, str | int | float | bool):
    raise TypeError(
      f"{name} is a {type(value).__module__}.{type(value).__qualname__} ({value!r}), which "
      "a checkpoint's JSON cannot hold: pass a str, int, float, bool, None, list or dict "
      "(e.g. int(x) or x.tolist() for a NumPy value)."
    )


def _without_empty(tree: Any) -> Any:
  """`tree` with its zero-size leaves as None: orbax refuses to save an array of size 0
  ("Cannot save arrays with zero size"), and such a leaf holds nothing but its shape and
  dtype, which the restoring trainer has (see `_with_empty`)."""
  return jax.tree.map(lambda x: None if math.prod(x.shape) == 0 else x, tree)


def _with_empty(restored: Any, abstract: Any) -> Any:
  """The inverse of `_without_empty`: zeros of `abstract`'s shape, dtype and sharding
  where `restored` holds None for a zero-size leaf of `abstract`."""

  def fill(want: jax.ShapeDtypeStruct, got: Any) -> Any:
    if got is None and math.prod(want.shape) == 0:
      return jax.numpy.zeros(want.shape, want.dtype, device=want.sharding)
    return got

  return jax.tree.map(fill, abstract, restored)


def _keys_as_in(saved: Any, template: Any) -> Any:
  """`saved` (orbax's metadata tree: dicts and lists) with its dict keys as `template` has them.

  Orbax writes every dict key as text, so a model whose params hold a layer under
  an integer key (`{"blocks": {0: ..., 1: ...}}`, as an `nnx.List` of layers gives)
  reads back as `{"blocks": {"0": ..., "1": ...}}`. Where `template` has a key
  that is not text at the same place, and it reads as the saved one, the saved key
  becomes the template's; in a dict where `template` has integer keys, every
  saved key that reads as an integer becomes one (a saved layer the template
  lacks is then named as such, not met as a dict of mixed keys, which JAX
  cannot sort). Every other key is left as saved. (Orbax's restore itself goes
  by the template's tree, integer keys included.)

  Args:
    saved: the tree orbax's `item_metadata` gives.
    template: the tree the trainer restores into (any pytree).

  Returns:
    `saved`, its dicts with the keys renamed, its sequences as lists.

  Example:
    >>> _keys_as_in({"blocks": {"0": 1.0, "1": 2.0}}, {"blocks": {0: 0.0, 1: 0.0}})
    {'blocks': {0: 1.0, 1: 2.0}}
  """
  trie: dict = {}  # the template's keys, level by level
  # (An empty subtree counts: a layer whose optimizer state is all `optax.MaskedNode`s,
  # frozen by `optax.multi_transform`, has a key but no leaves.)
  is_empty = lambda x: not jax.tree.leaves(x)  # noqa: E731
  for path, _ in jax.tree_util.tree_leaves_with_path(template, is_leaf=is_empty):
    node = trie
    for entry in path:
      node = node.setdefault(trees.path_key(entry), {})

  def key_of(key: Any, node: dict) -> Any:
    if key in node or not isinstance(key, str):
      return key
    as_text = {str(k): k for k in node if not isinstance(k, str)}
    if key in as_text:
      return as_text[key]
    integers = any(isinstance(k, int) for k in node)
    return int(key) if integers and key.lstrip("-").isdigit() else key

  def rename(tree: Any, node: dict) -> Any:
    if isinstance(tree, dict):
      renamed = {key_of(k, node): v for k, v in tree.items()}
      return {k: rename(v, node.get(k, {})) for k, v in renamed.items()}
    if isinstance(tree, list | tuple):  # (orbax's metadata has no NamedTuples)
      return [rename(v, node.get(i, {})) for i, v in enumerate(tree)]
    return tree

  return rename(saved, trie)


class _ComparisonFailed(RuntimeError):
  """Comparing a verified checkpoint's tree with the trainer's raised: a fault in parstrat,
  raised as it is rather than taken for a damaged checkpoint (and skipped)."""


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

  Integrity: after orbax finishes, a manifest with the size and SHA-256 of
  every file of the checkpoint is written next to it (atomically). `restore`
  checks it first; a checkpoint whose files differ, or that orbax cannot read,
  is skipped with one `CheckpointWarning` line and the newest intact one is
  restored instead. Before orbax reads any array, the saved tree (orbax's own
  metadata: every leaf's shape) is compared with the trainer's, and a model
  that does not fit is a `CheckpointDoesNotFit` (a `ValueError`) naming the
  first leaf that differs.

  Args:
    directory: where the checkpoints live (created if missing).
    save_every: save when `step % save_every == 0` (and whenever `force=True`).
    keep: how many of the newest checkpoints to keep.
    clean_unfinished: delete the temporary folders of saves that never
      finished (a process killed during a save leaves one, as large as a
      checkpoint), before this object's first save. Only for the run that
      writes `directory`: a reader's would delete a running save's folder.
      `parstrat train` sets it.

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

  def __init__(
    self,
    directory: str | pathlib.Path,
    *,
    save_every: int = 1,
    keep: int = 3,
    clean_unfinished: bool = False,
  ):
    if save_every < 1 or keep < 1:
      raise ValueError(f"save_every and keep must be >= 1, got {save_every} and {keep}.")
    self.directory = pathlib.Path(directory).absolute()
    if self.directory.exists() and not self.directory.is_dir():
      raise ValueError(f"Checkpointer: {self.directory} is a file, not a directory.")
    self.save_every = save_every
    self._restored: int | None = None  # the step the run restored last went on from
    # (step, meta) of the checkpoint that holds this run's state as it was restored or
    # last written; a save of the same step and meta writes nothing.
    self._held: tuple[int, Any] | None = None
    self._written: set[int] = set()  # steps this object wrote since its last restore
    self._skipped: set[int] = set()  # steps `restore` found unreadable
    self._cast: list[str] = []  # the dtype changes of the last `_restore`
    self._manager = ocp.CheckpointManager(
      self.directory,
      item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
      options=ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        enable_async_checkpointing=False,
        create=True,
        cleanup_tmp_directories=clean_unfinished,
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
    """The steps of every complete checkpoint (intact or not: see `verify`)."""
    return list(self._manager.all_steps())

  def delete(self, step: int) -> None:
    """Removes checkpoint `step` (and its manifest)."""
    self._manager.delete(step)

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
      meta: JSON-able extras, e.g. the data position (checked before anything
        is written).
      step: the checkpoint's number (default: `state.step`, the updates applied).
      force: save even if `step` is not a multiple of `save_every`.

    Damaged checkpoints (see `verify`; one without a manifest is not taken
    for damaged unless `restore` could not read it) of later steps are deleted first: they
    are what `restore` skipped, and orbax, keeping the newest `keep` by step
    number, would otherwise delete the intact ones in their place.

    Checkpoints at `step` or later that remain are this object's run's when it
    restored a step at or before `step`, or wrote them all since: those beyond
    `step` are then the run abandoned at the restore, and are deleted with a
    `CheckpointWarning` naming them (none for steps `restore` found
    unreadable), and one at `step` is written again; but a save of the step and
    `meta` this object restored (without `fresh_optimizer`) or last wrote
    writes and deletes nothing. Any other checkpoint at `step` or later is
    another run's (but a damaged one at `step`, written again): saving would mix
    two runs in one directory, and raises before anything is deleted.

    Returns:
      Whether a checkpoint was written.

    Raises:
      TypeError: for a `meta` that is not a dict, or a part of it that JSON
        cannot hold, naming it.
      CheckpointError: for checkpoints at `step` or later of another run (see
        above), naming them, or a file where checkpoint `step` would go; nothing
        is written or deleted. Also when the write itself fails (a full disk, a
        directory gone), naming the cause and the newest checkpoint kept (the
        error it was raised from is chained).
    """
    if not isinstance(meta, dict):
      raise TypeError(f"meta must be a dict of JSON-able values, got {type(meta).__name__}.")
    _check_json("meta", meta)
    step = int(state.step) if step is None else int(step)
    if not force and step % self.save_every:
      return False
    target = self._step_dir(step)
    if os.path.lexists(target) and not target.is_dir():  # (orbax would replace it; a
      # dangling link too, `exists` being False for it)
      raise CheckpointError(
        f"{target} is a file, not a checkpoint: saving step {step} would replace it. "
        "Move it, or use another directory."
      )
    steps = self._manager.all_steps()
    # After `restore` fell back past damaged checkpoints, they are newer than the steps
    # trained again; orbax keeps the newest `keep` by step number, so left in place they
    # would push the intact ones out.
    damaged = [
      s
      for s in steps
      if s > step and (s in self._skipped or self.verify(s) not in (None, "has no manifest"))
    ]
    later = sorted(s for s in steps if s >= step and s not in damaged)
    if self._held == (step, meta) and step in later:
      return False  # (this state is that checkpoint; what lies beyond stays until a write)
    branch = self._restored is not None and self._restored <= step  # went on from a restore
    ours = branch or (bool(later) and set(later) <= self._written)
    rewritable = later == [step] and self.verify(step) not in (None, "has no manifest")
    if later and not ours and not rewritable:
      raise CheckpointError(
        f"{self.directory} already holds checkpoint(s) at step(s) "
        f"{', '.join(map(str, later))}, not of this run: saving step {step} would mix two "
        "runs. Restore one of them to go on from it, delete them, or use another directory."
      )
    abandoned = [  # the run that went on from the restored step (not steps written since)
      s for s in later if branch and s != self._restored and s not in self._skipped | self._written
    ]
    if abandoned:
      warnings.warn(
        f"saving step {step} after restoring step {self._restored}: deleted the "
        f"checkpoint(s) at step(s) {', '.join(map(str, abandoned))} in {self.directory}, "
        "of the run that went on from there",
        CheckpointWarning,
        stacklevel=stacklevel_outside(),
      )
    for old in [*damaged, *later]:  # (later: this run's beyond, or `step` written again)
      self._manager.delete(old)
    exported = _without_empty(trainer.export_state(state))
    try:
      saved = self._manager.save(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardSave(exported), meta=ocp.args.JsonSave(dict(meta))
        ),
        force=True,
      )
      if saved:
        self._manager.wait_until_finished()
        if jax.process_index() == 0:
          _write_manifest(self._step_dir(step))
    except Exception as e:  # noqa: BLE001 - the disk or file system failed (orbax's kinds)
      try:
        self._manager.reload()  # (what is on disk now, not orbax's list of before)
        newest = self.latest_step()
      except Exception:  # noqa: BLE001 - the directory itself is gone or unreadable
        newest = None
      kept = (
        "no checkpoint is kept"
        if newest is None
        else f"the newest kept is step {newest}"
        + (" (written, but not its manifest: it restores unverified)" * (newest == step))
      )
      raise CheckpointError(  # (the cause's whole line: tensorstore puts the OS error last)
        f"saving checkpoint step {step} in {self.directory} failed "
        f"({type(e).__name__}: {first_line(e, limit=1000)}); {kept}"
      ) from e
    if saved:
      self._held = (step, dict(meta))
      self._written.add(step)
      self._skipped.discard(step)
    return saved

  def metadata(self, step: int | None = None) -> dict[str, Any]:
    """The JSON `meta` saved with checkpoint `step` (default: the newest), read alone.

    Raises:
      FileNotFoundError: if there is no checkpoint.
      CheckpointError: if the metadata cannot be read.
    """
    step = self.latest_step() if step is None else int(step)
    if step is None:
      raise FileNotFoundError(f"No checkpoint in {self.directory}.")
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception as e:  # noqa: BLE001 - orbax raises many kinds
      raise CheckpointError(f"Checkpoint step {step} has unreadable metadata: {e}") from None
    return dict(restored["meta"])

  def _step_dir(self, step: int) -> pathlib.Path:
    return self.directory / str(step)

  def verify(self, step: int) -> str | None:
    """Checks checkpoint `step` against its manifest, without reading it with orbax.

    Returns:
      `None` when every file has the recorded size and SHA-256; otherwise what
      is wrong, in a few words (a missing manifest counts as wrong too: call
      `restore`, which accepts such a checkpoint with a warning).
    """
    folder = self._step_dir(step)
    try:
      manifest = json.loads((folder / MANIFEST).read_text())
      entries = manifest["files"]
    except FileNotFoundError:
      return "has no manifest"
    except (OSError, ValueError, KeyError, TypeError) as e:
      return f"has an unreadable manifest ({type(e).__name__})"
    for name, want in entries.items():
      path = folder / name
      if not path.is_file():
        return f"lacks {name}"
      if path.stat().st_size != want["bytes"]:
        return f"has {name} of {path.stat().st_size} bytes, {want['bytes']} were written"
      if _sha256(path) != want["sha256"]:
        return f"has {name} with a different checksum than was written"
    return None

  def restore(
    self, trainer: Trainer, step: int | None = None, *, fresh_optimizer: bool = False
  ) -> tuple[TrainState, dict]:
    """Restores the newest intact (or the given) checkpoint into `trainer`'s layout.

    `trainer` must have been `init`-ed (for its shapes and shardings); any
    strategy and mesh will do. Without `step`, checkpoints are tried newest
    first: one whose files do not match its manifest, or that orbax cannot
    read, is skipped, and one `CheckpointWarning` names the skipped steps,
    why, and the step restored instead. A checkpoint without a manifest (from
    an older parstrat, or a process killed between orbax's save and the
    manifest) is restored with a warning that it was not verified.

    Args:
      trainer: an `init`-ed trainer of the saved model.
      step: the checkpoint to restore (default: the newest intact one).
      fresh_optimizer: restore the params, model state, step and key, but not
        the optimizer state (orbax does not read it): it starts anew as
        `trainer.optimizer.init` of the restored params, so a run can go on
        with another optimizer, or with clipping or weight decay switched on
        or off, whose state has another layout. Its schedule (and Adam's bias
        correction) starts from step 0.

    Returns:
      `(state, meta)`: the state in `trainer`'s layout and the JSON `meta`.

    Raises:
      FileNotFoundError: if there is no checkpoint.
      CheckpointDoesNotFit: (a ValueError) if the saved state does not fit
        this trainer's model (named by the first leaf that differs; checked
        before reading any array), or, as `OptimizerDoesNotFit`, its
        optimizer state does not fit `trainer`'s (unless `fresh_optimizer`).
      CheckpointError: if no checkpoint can be restored (or the given `step`
        is damaged).
      RuntimeError: if comparing an intact checkpoint's tree with the trainer's
        raises: a fault in parstrat, not taken for a damaged checkpoint.
    """
    steps = sorted(self.all_steps(), reverse=True) if step is None else [int(step)]
    if not steps:
      raise FileNotFoundError(f"No checkpoint in {self.directory}.")
    # Shapes only: a zero state exported to its replicated form would hold one
    # more full copy of the state on every device while orbax restores another.
    template = jax.eval_shape(trainer._compiled_export, trainer._abstract_state)  # noqa: SLF001
    replicated = trainer._replicated  # noqa: SLF001
    abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), template
    )
    skipped = []
    for candidate in steps:
      problem = self.verify(candidate)
      unverified = problem == "has no manifest"
      if problem is None or unverified:
        try:
          with _quiet_orbax_callbacks_after_a_failed_read():
            restored = self._restore(candidate, template, abstract, fresh_optimizer)
        except (CheckpointDoesNotFit, _ComparisonFailed):
          raise
        except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many kinds
          first = first_line(e)
          problem, unverified = f"cannot be read ({type(e).__name__}: {first})", False
        else:
          notes = []
          if skipped:
            notes.append(
              f"skipped damaged checkpoint(s) in {self.directory}: "
              + "; ".join(f"step {s} {why}" for s, why in skipped)
              + f"; restored step {candidate}, the newest intact one"
            )
          if self._cast:
            more = f" and {len(self._cast) - 1} more leaves" if len(self._cast) > 1 else ""
            notes.append(
              f"checkpoint step {candidate} in {self.directory} holds other dtypes than this "
              f"trainer: restored with a cast, {self._cast[0]}{more}"
            )
          if unverified:
            notes.append(
              f"checkpoint step {candidate} in {self.directory} has no manifest (an older "
              "parstrat, or a save interrupted before it); restored it unverified"
            )
          for note in notes:
            warnings.warn(note, CheckpointWarning, stacklevel=stacklevel_outside())
          read = restored["state"]  # (without "opt_state" under fresh_optimizer)
          exported = dict(_with_empty(read, {k: abstract[k] for k in read}))
          if fresh_optimizer:
            exported["opt_state"] = None  # import_state starts it anew
          state = trainer.import_state(exported)
          self._restored = candidate
          self._held = None if fresh_optimizer else (candidate, dict(restored["meta"]))
          self._written = set()
          return state, dict(restored["meta"])
      skipped.append((candidate, problem))
      self._skipped.add(candidate)
    described = "; ".join(f"step {s} {why}" for s, why in skipped)
    raise CheckpointError(f"No intact checkpoint in {self.directory}: {described}.")

  def _check_fits(
    self, step: int, saved: Any, template: Any, abstract: Any, fresh_optimizer: bool
  ) -> tuple[Any, Any]:
    """Compares orbax's saved tree with `template`; notes the dtypes it casts (`_cast`).

    Returns:
      `(template, abstract)`, without the optimizer state under `fresh_optimizer`.

    Raises:
      CheckpointDoesNotFit, OptimizerDoesNotFit: naming the first leaf that differs.
    """
    saved_tree = _keys_as_in(saved, template)  # (integer keys were saved as text)
    # The params first: a different model is best named by its first layer.
    mismatch = trees.first_mismatch(
      {"params": saved_tree.get("params")}, {"params": template["params"]}
    )
    if mismatch is not None:
      raise CheckpointDoesNotFit(
        f"The checkpoint at step {step} does not fit this model: {mismatch}."
      )
    if fresh_optimizer:  # compared and read without the optimizer state
      saved_tree, template, abstract = (
        {k: v for k, v in tree.items() if k != "opt_state"}
        for tree in (saved_tree, template, abstract)
      )
    mismatch = trees.first_mismatch(saved_tree, template)
    # (orbax casts on restore: a precision change may be meant, but is said, once read)
    self._cast = trees.dtype_changes(saved_tree, template) if mismatch is None else []
    self._cast.sort(key=lambda change: not change.startswith("params"))  # (params first)
    if mismatch is not None:
      if mismatch.startswith("opt_state"):
        raise OptimizerDoesNotFit(
          f"The checkpoint at step {step} fits this model's params but not this trainer's "
          f"optimizer (another optimizer, clipping or weight decay?): {mismatch}."
        )
      raise CheckpointDoesNotFit(
        f"The checkpoint at step {step} fits this model's params but not this trainer's "
        f"training state: {mismatch}."
      )
    return template, abstract

  def _restore(self, step: int, template: Any, abstract: Any, fresh_optimizer: bool) -> dict:
    """Reads one checkpoint after checking its saved tree against `template`.

    With `fresh_optimizer`, the saved optimizer state is left unread (orbax's
    partial restore), whatever its layout.
    """
    saved = self._manager.item_metadata(step)["state"]
    if saved is None:
      raise OSError("orbax finds no saved state")
    # (zero-size leaves are saved as None: `_without_empty`)
    template, abstract = _without_empty(template), _without_empty(abstract)
    try:
      template, abstract = self._check_fits(step, saved.tree, template, abstract, fresh_optimizer)
    except CheckpointDoesNotFit:
      raise
    except Exception as e:  # noqa: BLE001 - parstrat's own code, on a verified tree
      raise _ComparisonFailed(
        f"Comparing the checkpoint at step {step} in {self.directory} with this trainer's "
        f"state failed, a fault in parstrat and not in the checkpoint, which is left as it "
        f"is: {type(e).__name__}: {first_line(e)}"
      ) from e
    if fresh_optimizer:  # the same files, read as a plain PyTree without opt_state
      with ocp.PyTreeCheckpointer() as reader:
        state = reader.restore(
          self._step_dir(step) / "state",
          args=ocp.args.PyTreeRestore(
            item=abstract,
            restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
            partial_restore=True,
          ),
        )
      return {"state": state, "meta": self.metadata(step)}
    try:
      return self._manager.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
        ),
      )
    except ValueError as e:
      # Every leaf fits, so the trees differ in a node without leaves: an optimizer
      # state with another chain (adam -> adamw adds an EmptyState).
      if "tree structures do not match" not in str(e):
        raise
      raise OptimizerDoesNotFit(
        f"The checkpoint at step {step} fits this model's params but not this trainer's "
        "optimizer: its optimizer state has another tree structure (another optimizer, "
        "clipping or weight decay?)."
      ) from None


@contextlib.contextmanager
def _quiet_orbax_callbacks_after_a_failed_read() -> Iterator[None]:
  """Drops the "Event loop is closed" errors orbax's reads leave when one fails.

  When a file of a checkpoint is missing, orbax's restore raises (and `restore`
  falls back to an older checkpoint), but the reads still in flight then fail
  one after another and call back into the event loop orbax has closed: each
  printed "Exception ignored in: None ... RuntimeError: Event loop is closed"
  to stderr, a dozen tracebacks for one handled error. After a failed read this
  waits until they have stopped for 0.2 s (they come within milliseconds; at
  most 2 s), dropping them. Any other unraisable error goes to the hook in
  place before.
  """
  previous = sys.unraisablehook
  last_dropped = [time.monotonic()]

  def hook(unraisable: Any) -> None:
    error = unraisable.exc_value
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
      last_dropped[0] = time.monotonic()
    else:
      previous(unraisable)

  sys.unraisablehook = hook
  try:
    yield
  except BaseException:
    failed = time.monotonic()
    last_dropped[0] = max(last_dropped[0], failed)
    deadline = failed + 2.0
    while time.monotonic() < min(deadline, last_dropped[0] + 0.2):
      time.sleep(0.01)
    raise
  finally:
    sys.unraisablehook = previous


def _sha256(path: pathlib.Path) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def _write_manifest(folder: pathlib.Path) -> None:
  """Records the size and SHA-256 of every file under `folder`, atomically."""
  entries = {}
  for path in sorted(folder.rglob("*")):
    if path.is_file() and path.name != MANIFEST:
      name = path.relative_to(folder).as_posix()
      entries[name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
  files.write_atomically(folder / MANIFEST, json.dumps({"format": 1, "files": entries}, indent=1))
