"""What `parstrat train --dataset` reads: MNIST, any tfds dataset, or the user's function.

Every source becomes a `RunData`: global batches per epoch, passed to
`trainer.step` unchanged, and `(inputs, labels)` pairs for the eval accuracy.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any

import numpy as np

from parstrat._src import config
from parstrat._src import datasets
from parstrat._src.messages import first_line

#: The built-in dataset: MNIST with the bundled offline sample (`--source`).
MNIST = "mnist"


#: The order of MNIST, the sample and tfds batches (`datasets.batch_indices`), as
#: checkpoints record it; checkpoints written before `RunData.order` existed say it
#: for every dataset.
SHUFFLED = "shuffled per epoch by (seed, epoch)"


@dataclasses.dataclass(frozen=True)
class RunData:
  """A dataset as the training loop sees it.

  Attributes:
    description: one line for the start-up banner.
    train_epoch: epoch -> iterable of global batches (each passed to `trainer.step`).
    steps_per_epoch: batches per epoch, or None when the source has no length.
    eval_batches: () -> iterable of eval batches (any size), or None for no eval.
    example: one example of a batch (every leaf with leading axis 1).
    num_classes: the label count when known (the default MLP's output width).
    one_shot: the train data can be read once in all (a generator), not once
      per epoch (or per strategy of `--compare`).
    order: how the batches are ordered, as checkpoints record it.
  """

  description: str
  train_epoch: Callable[[int], Iterable[Any]]
  steps_per_epoch: int | None
  eval_batches: Callable[[], Iterable[Any]] | None
  example: Any
  num_classes: int | None = None
  one_shot: bool = False
  order: str = SHUFFLED

  @functools.cached_property
  def example_hash(self) -> str:
    """A hash of `example`'s shapes, dtypes and bytes (`"sha256 <16 hex digits>"`), once."""
    import hashlib

    import jax

    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(self.example):
      leaf = np.asarray(leaf)
      digest.update(f"{leaf.shape} {leaf.dtype}".encode())
      digest.update(np.ascontiguousarray(leaf).tobytes())
    return f"sha256 {digest.hexdigest()[:16]}"

  def sample_inputs(self, model_inputs: Callable[[Any], Any] | None = None) -> Any:
    """The model inputs of `example`, for `trainer.init`: `model_inputs(example)` when
    the trainer takes such a function, else the first of an `(inputs, labels)` pair."""
    return inputs_of(self.example) if model_inputs is None else model_inputs(self.example)


def inputs_of(batch: Any) -> Any:
  """The model's inputs in a batch: the first of a pair `(inputs, labels)`, else the batch."""
  return batch[0] if isinstance(batch, (tuple, list)) else batch


def _shown(value: Any) -> str:
  """`value` in a few words: its type, and its text when short."""
  text = repr(value)
  return f"{type(value).__name__} {text}" if len(text) <= 40 else type(value).__name__


def _first_example(batch: Any) -> Any:
  import jax

  return jax.tree.map(lambda x: np.asarray(x)[:1], batch)


def mnist(source: str, *, data_dir: str | None, batch_size: int, seed: int, log=print) -> RunData:
  """MNIST through `parstrat.datasets.load_mnist` (tfds, else the bundled sample).

  Raises:
    ValueError: if `batch_size` exceeds the training examples.
  """
  data = datasets.load_mnist(source, data_dir=data_dir, log=log)
  if batch_size > len(data.train_labels):
    raise ValueError(
      f"--batch-size {batch_size} exceeds the {len(data.train_labels)} training examples"
    )
  return RunData(
    description=repr(data),
    train_epoch=lambda epoch: datasets.batches(
      data.train_images, data.train_labels, batch_size, seed=seed, epoch=epoch
    ),
    steps_per_epoch=len(data.train_labels) // batch_size,
    eval_batches=lambda: [(data.eval_images, data.eval_labels)],
    example=(data.train_images[:1], data.train_labels[:1]),
    num_classes=10,
  )


def _tfds_pairs(records: list[dict], keys: tuple[str, str]) -> tuple[np.ndarray, np.ndarray]:
  """Stacks tfds records into `(inputs, labels)`; uint8 images become float32 in [0, 1]."""
  x = np.stack([np.asarray(r[keys[0]]) for r in records])
  if x.dtype == np.uint8:
    x = x.astype(np.float32) / 255.0
  y = np.asarray([r[keys[1]] for r in records])
  if np.issubdtype(y.dtype, np.integer):
    y = y.astype(np.int32)
  return x, y


def from_tfds(name: str, *, data_dir: str | None, batch_size: int, seed: int) -> RunData:
  """Any tfds dataset with supervised keys, read through `tfds.data_source` (no TensorFlow).

  Trains on split "train" in the deterministic order of `datasets.batch_indices`;
  evaluates on "test" (or "validation" when there is no test split).

  Raises:
    ValueError: if the dataset has no (input, label) keys or too few examples.
  """
  import tensorflow_datasets as tfds

  offline = False
  try:
    try:  # prepared already (or tfds's mock data): no network needed
      train = tfds.data_source(name, split="train", data_dir=data_dir, download=False)
    except tfds.core.registered.DatasetNotFoundError:
      raise
    except Exception:  # noqa: BLE001 - not prepared: tfds downloads it, if the network answers
      if datasets.tfds_prepared(name, data_dir):
        raise  # (prepared but unreadable: its own error, below)
      offline = not datasets.network_answers()
      if not offline:
        train = tfds.data_source(name, split="train", data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError as e:
    # Its message lists every dataset tfds knows (hundreds of lines): keep one close name.
    known = re.findall(r"^\s*-\s*(\S+)\s*$", str(e), flags=re.MULTILINE)
    raise ValueError(
      f"--dataset {name!r}: tensorflow-datasets has no such dataset"
      f"{config.did_you_mean(name, known)} (or give module:function)"
    ) from None
  except Exception as e:  # noqa: BLE001 - tfds raises many kinds; name it in one line
    raise ValueError(
      f"--dataset {name!r}: tfds cannot read it ({type(e).__name__}: {first_line(e)})"
    ) from e
  if offline:  # (tfds would retry its download for minutes, then fail)
    where = data_dir or "the default tfds data directory"
    raise ValueError(
      f"--dataset {name!r} is not prepared in {where}, and the network does not answer "
      f"({datasets.PROBE_HOST} unresolved in {datasets.PROBE_TIMEOUT_S:g} s) to download it: "
      "prepare it where there is one (--data-dir), or use --dataset mnist (its bundled "
      "sample) or a dataset function"
    )
  info = train.dataset_info
  keys = info.supervised_keys
  if not keys or len(keys) != 2 or not all(isinstance(k, str) for k in keys):
    raise ValueError(
      f"--dataset {name!r}: the dataset has no (input, label) supervised keys; "
      "write a dataset function (--dataset module:function) instead"
    )
  evaluation = None
  for split in ("test", "validation"):
    try:
      evaluation = tfds.data_source(name, split=split, data_dir=data_dir)
      break
    except Exception:  # noqa: BLE001, S112 - the split does not exist: try the next
      continue
  if batch_size > len(train):
    raise ValueError(f"--batch-size {batch_size} exceeds the {len(train)} training examples")
  label = info.features[keys[1]] if keys[1] in info.features else None
  classes = getattr(label, "num_classes", None)

  def train_epoch(epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for index in datasets.batch_indices(len(train), batch_size, seed=seed, epoch=epoch):
      yield _tfds_pairs([train[int(i)] for i in index], keys)

  def eval_batches() -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for start in range(0, len(evaluation), batch_size):
      stop = min(start + batch_size, len(evaluation))
      yield _tfds_pairs([evaluation[i] for i in range(start, stop)], keys)

  return RunData(
    description=f"tfds {name}: {len(train)} train, {len(evaluation) if evaluation else 0} eval",
    train_epoch=train_epoch,
    steps_per_epoch=len(train) // batch_size,
    eval_batches=eval_batches if evaluation is not None else None,
    example=_tfds_pairs([train[0]], keys),
    num_classes=classes,
  )


def from_function(spec: str, *, batch_size: int, seed: int) -> RunData:
  """The user's dataset function: `fn(batch_size=, seed=) -> (train, eval)`.

  The function gets those of `batch_size` and `seed` that it names. `train` is
  an iterable of global batches, iterated again each epoch (a list, or an
  object whose `__iter__` starts over), or a function epoch -> iterable; a
  one-shot iterator (a generator) is one pass. `eval` is an iterable of
  batches or None (a generator is read once, into a list, and evaluated on
  whole each time). Batches go to `trainer.step` unchanged.

  Raises:
    parstrat._src.config.ConfigError: if the function returns something else.
  """
  fn = config.load_object(spec, "--dataset")
  try:
    result = config.call_with_known(fn, batch_size=batch_size, seed=seed) if callable(fn) else fn
  except config.ConfigError as e:  # an argument besides batch_size and seed, say
    raise config.ConfigError(f"--dataset {spec!r}: {e}") from None
  if not (isinstance(result, (tuple, list)) and len(result) == 2):
    raise config.ConfigError(
      f"--dataset {spec!r} gave {type(result).__name__}; expected a pair (train, eval) of "
      "iterables of batches (eval may be None)"
    )
  train, evaluation = result
  if evaluation is not None and not isinstance(evaluation, Iterable):
    raise config.ConfigError(
      f"--dataset {spec!r}: eval must be an iterable of batches or None, got "
      f"{type(evaluation).__name__}"
    )
  if callable(train) and not isinstance(train, Iterable):
    epoch_source = train
  elif isinstance(train, Iterable):
    epoch_source = lambda epoch: train  # noqa: E731
  else:
    raise config.ConfigError(
      f"--dataset {spec!r}: train must be an iterable of batches, got {type(train).__name__}"
    )
  first_iter = iter(epoch_source(0))
  try:
    first = next(first_iter)
  except StopIteration:
    raise config.ConfigError(f"--dataset {spec!r}: the train data has no batches") from None
  import jax

  if not all(np.ndim(leaf) >= 1 for leaf in jax.tree.leaves(first)):
    raise config.ConfigError(
      f"--dataset {spec!r}: the first train batch is {_shown(first)}: train must yield "
      "batches (pytrees of arrays with a leading batch axis), e.g. a list of (inputs, "
      "labels) pairs, not the whole arrays"
    )
  one_shot = iter(train) is train if isinstance(train, Iterable) else False
  head = itertools.chain([first], first_iter) if one_shot else None

  def train_epoch(epoch: int) -> Iterable[Any]:
    if one_shot:
      return head  # one pass in all; later epochs find it exhausted
    return epoch_source(epoch)

  length = getattr(train, "__len__", None)
  if isinstance(evaluation, Iterable) and iter(evaluation) is evaluation:
    # A generator is read at every evaluation: kept, so each epoch (and each
    # strategy of --compare) evaluates on all of it, not the first alone.
    evaluation = list(evaluation)
  return RunData(
    description=f"{spec}",
    train_epoch=train_epoch,
    steps_per_epoch=length() if length is not None else None,
    eval_batches=(lambda: evaluation) if evaluation is not None else None,
    example=_first_example(first),
    one_shot=one_shot,
    order="as the dataset function gives it",
  )


def load(
  spec: str,
  *,
  source: str = "auto",
  data_dir: str | None = None,
  batch_size: int,
  seed: int,
  log=print,
) -> RunData:
  """`--dataset`: "mnist", a tfds name, or `module:function` / `file.py:function`."""
  if spec == MNIST:
    return mnist(source, data_dir=data_dir, batch_size=batch_size, seed=seed, log=log)
  if ":" in spec:
    return from_function(spec, batch_size=batch_size, seed=seed)
  if spec.endswith(".py"):  # (a file, not a tfds name)
    raise config.ConfigError(
      f"--dataset {spec!r}: name the function in the file that gives the data, '{spec}:function'"
    )
  return from_tfds(spec, data_dir=data_dir, batch_size=batch_size, seed=seed)


def _shapes(tree: Any) -> Any:
  """`tree` with each array (or `jax.ShapeDtypeStruct`) as `dtype[shape]` text."""
  import jax

  return jax.tree.map(lambda a: f"{a.dtype}{list(np.shape(a))}", tree)


def _unusable(batch: Any) -> str | None:
  """Why an eval batch gives no accuracy whatever the model's outputs, as what follows
  "eval batch N" (not an `(inputs, labels)` pair, labels that are not integer class
  ids, a scalar label), or None: the one rule `eval_accuracy` and the checks share."""
  if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
    what = f"an array {_shapes(batch)}" if hasattr(batch, "shape") else type(batch).__name__
    return f" is {what}, not an (inputs, labels) pair"
  labels = np.asarray(batch[1])
  if not np.issubdtype(labels.dtype, np.integer):
    return f"'s labels are {labels.dtype}, not integer class ids"
  if labels.ndim == 0:
    return "'s label is a scalar, not one per example"
  return None


def _fits(outputs_shape: tuple[int, ...], labels: np.ndarray) -> bool:
  """Whether outputs of `outputs_shape` give one class score vector per label."""
  return tuple(outputs_shape[:-1]) == labels.shape


def no_accuracy_reason(
  batches: Iterable[Any], abstract_outputs: Callable[[Any], Any], who: str
) -> str:
  """Why `eval_accuracy` gives no accuracy on `batches`: the first batch at fault and what
  is wrong with it. `abstract_outputs` maps inputs to the outputs' shapes, those of
  `who` (the model, or the eval model, named in the reason)."""
  for index, batch in enumerate(batches, 1):
    unusable = _unusable(batch)
    if unusable:
      return f"eval batch {index}{unusable}"
    labels = np.asarray(batch[1])
    try:
      outputs = abstract_outputs(batch[0])
    except Exception as e:  # noqa: BLE001 (a reason, not a failure: the run goes on)
      return f"{who} cannot run on eval batch {index}'s inputs ({type(e).__name__}: {e})"
    if not _fits(getattr(outputs, "shape", (None,)), labels):
      return (
        f"eval batch {index}'s labels {_shapes(labels)} do not match {who}'s outputs "
        f"{_shapes(outputs)} (for those labels: {[*labels.shape, 'classes']})"
      )
  return "no batch gave one"


def eval_label_outside(
  batches: Iterable[Any], outputs_rank: int, classes: int, who: str = "the model"
) -> str | None:
  """Names the first integer eval label outside `[0, classes)`, or None if there is none.

  Such a label can never be predicted, so `eval_accuracy` counts it as wrong.
  Batches that are not `(inputs, integer labels)` pairs, or whose labels do not have
  one axis fewer than the outputs (`outputs_rank` axes, the last `classes` wide, of
  `who`), are passed over: they give no accuracy at all, which the eval says.
  """
  for index, batch in enumerate(batches):
    if _unusable(batch):
      continue
    labels = np.asarray(batch[1])
    if not labels.size or labels.ndim != outputs_rank - 1:
      continue
    outside = labels[(labels < 0) | (labels >= classes)]
    if outside.size:
      return (
        f"eval batch {index + 1} has {outside.size} label(s) outside [0, {classes}), "
        f"{who}'s classes (first: {outside.flat[0]})"
      )
  return None


def eval_inputs_unlike(batches: Iterable[Any], sample: Any) -> str | None:
  """Names the first eval batch whose inputs `eval_accuracy` would give `trainer.apply`
  and `apply` would refuse, or None.

  `eval_accuracy` passes the inputs of `(inputs, integer labels)` pairs, up to the
  first batch that is not one; they must have the structure, per-example shapes
  and dtypes (as JAX sees them) of `sample`, the training inputs given to `init`:
  the check `apply` makes.

  Example:
    >>> train = np.zeros((1, 12), np.float32)
    >>> eval_inputs_unlike([(np.zeros((10, 5), np.float32), np.zeros(10, int))], train)
    'eval batch 1: inputs must have shape [B, 12] like the training inputs, got (10, 5).'
  """
  import jax

  from parstrat._src.strategy import _check_like  # (the one check: `apply`'s own)
  from parstrat._src.strategy import _per_example

  spec = _per_example(jax.tree.map(np.asarray, sample))
  for index, batch in enumerate(batches):
    if _unusable(batch):
      return None  # (eval_accuracy stops here: no accuracy at all)
    what = f"eval batch {index + 1}: inputs"
    try:
      inputs = jax.tree.map(np.asarray, batch[0])
      _check_like(what, inputs, spec, "the training inputs")
    except (TypeError, ValueError) as e:
      message = str(e)
      return message if message.startswith(what) else f"{what}: {message}"
  return None


def eval_accuracy(
  trainer, state, batches: Iterable[Any], batch_size: int, rows, rng=None
) -> float | None:
  """Top-1 accuracy over `(inputs, labels)` batches of any size, computed with `trainer.apply`.

  Every label counts once: with `[B]` labels it is the share of examples, with
  `[B, T]` labels (a sequence model) the share of tokens predicted right.
  Each batch is cut into pieces of `batch_size`. The last one, if shorter, is
  filled with the rows before it (counted once), or, in a batch smaller than a
  piece, with its own rows again: no made-up rows enter the model, whose
  outputs may depend on the whole piece (BatchNorm in training mode; zeros
  moved its statistics). With several processes, each passes its own `rows`
  and the outputs are gathered.

  A model that draws randomness (`hk.next_rng_key()`, as dropout does) is
  evaluated as it trains, with a key folded from `rng` (then required) for each piece.

  Returns:
    The accuracy, or None when the batches are not `(inputs, labels)` pairs
    whose integer labels match the outputs' leading shape.
  """
  import jax
  from jax.experimental import multihost_utils

  correct = total = pieces = 0
  for batch in batches:
    if _unusable(batch):
      return None
    inputs, labels = batch[0], np.asarray(batch[1])
    for start in range(0, len(labels), batch_size):
      y = labels[start : start + batch_size]
      n = len(y)
      begin = max(0, start + n - batch_size)  # the piece's first row: counted rows fill it

      def piece(x, begin=begin, end=start + n):
        x = np.asarray(x)[begin:end]
        return np.take(x, np.arange(batch_size) % len(x), axis=0)[rows]

      x = jax.tree.map(piece, inputs)
      if getattr(trainer, "uses_rng", False):  # dropout: a key of its own per piece
        if rng is None:
          raise ValueError(
            "eval_accuracy: the model draws randomness; pass rng=jax.random.key(...)"
          )
        outputs = trainer.apply(state, x, rng=jax.random.fold_in(rng, pieces))
      else:
        outputs = trainer.apply(state, x)
      pieces += 1
      outputs = np.asarray(multihost_utils.process_allgather(outputs, tiled=True))
      outputs = outputs[start - begin : start - begin + n]
      if not _fits(outputs.shape, y):
        return None
      correct += int(np.sum(outputs.argmax(-1) == y))
      total += y.size
  return correct / total if total else None
