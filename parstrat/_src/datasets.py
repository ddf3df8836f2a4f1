"""MNIST: through tensorflow-datasets when it can be had, else the bundled real sample."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gzip
import hashlib
import importlib.resources
import socket
import urllib.parse
from collections.abc import Iterator

import numpy as np

from parstrat._src.messages import first_line

SAMPLE_IMAGES = "t10k-images-idx3-ubyte.gz"
SAMPLE_LABELS = "t10k-labels-idx1-ubyte.gz"
#: md5 of the decompressed sample images (from the sample's README).
SAMPLE_IMAGES_MD5 = "2646ac647ad5339dbf082846283269ea"
SAMPLE_TRAIN = 8_000
SAMPLE_EVAL = 2_000
NUM_PIXELS = 28 * 28
SOURCES = ("auto", "tfds", "sample")


@dataclasses.dataclass(frozen=True)
class Dataset:
  """Images as float32 `[N, 784]` in [0, 1], labels as int32 `[N]`."""

  train_images: np.ndarray
  train_labels: np.ndarray
  eval_images: np.ndarray
  eval_labels: np.ndarray
  source: str

  def __repr__(self) -> str:
    return f"Dataset({self.source}: {len(self.train_labels)} train, {len(self.eval_labels)} eval)"


def preprocess(images: np.ndarray) -> np.ndarray:
  """uint8 `[N, 28, 28(, 1)]` -> float32 `[N, 784]` scaled to [0, 1]."""
  images = np.asarray(images)
  return (images.reshape(images.shape[0], -1).astype(np.float32)) / 255.0


def _read_idx(raw: bytes) -> np.ndarray:
  """Parses an IDX file (the MNIST format): magic, dims, then uint8 data."""
  if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
    raise ValueError("Not an unsigned-byte IDX file.")
  ndim = raw[3]
  dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
  data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
  if data.size != int(np.prod(dims)):
    raise ValueError(f"IDX header says {dims} but holds {data.size} bytes.")
  return data.reshape(dims)


def sample_files() -> tuple[bytes, bytes]:
  """The bundled files, decompressed: (images IDX, labels IDX)."""
  root = importlib.resources.files("parstrat") / "data"
  images = gzip.decompress((root / SAMPLE_IMAGES).read_bytes())
  labels = gzip.decompress((root / SAMPLE_LABELS).read_bytes())
  return images, labels


def load_sample() -> Dataset:
  """The bundled official MNIST test set, split 8,000 train / 2,000 eval.

  Returns:
    A `Dataset` with `source="sample"`.

  Raises:
    ValueError: if the bundled files are damaged (md5 mismatch).
  """
  raw_images, raw_labels = sample_files()
  if hashlib.md5(raw_images).hexdigest() != SAMPLE_IMAGES_MD5:
    raise ValueError("The bundled MNIST sample is damaged (md5 mismatch); reinstall parstrat.")
  images = preprocess(_read_idx(raw_images))
  labels = _read_idx(raw_labels).astype(np.int32)
  return Dataset(
    images[:SAMPLE_TRAIN],
    labels[:SAMPLE_TRAIN],
    images[SAMPLE_TRAIN : SAMPLE_TRAIN + SAMPLE_EVAL],
    labels[SAMPLE_TRAIN : SAMPLE_TRAIN + SAMPLE_EVAL],
    source="sample",
  )


def _split_arrays(source) -> tuple[np.ndarray, np.ndarray]:
  records = [source[i] for i in range(len(source))]
  images = np.stack([np.asarray(r["image"]) for r in records])
  labels = np.asarray([r["label"] for r in records], np.int32)
  return preprocess(images), labels


def load_tfds(data_dir: str | None = None, *, download: bool = True) -> Dataset:
  """Full MNIST (60,000 train / 10,000 test) through `tfds.data_source`.

  Uses tensorflow-datasets' random-access data sources, which need no
  TensorFlow at read time.

  Args:
    data_dir: where tfds keeps its datasets (default: tfds's own).
    download: allow tfds to download and prepare the dataset.

  Returns:
    A `Dataset` with `source="tfds"`.
  """
  import tensorflow_datasets as tfds

  train = tfds.data_source("mnist", split="train", data_dir=data_dir, download=download)
  test = tfds.data_source("mnist", split="test", data_dir=data_dir, download=download)
  train_images, train_labels = _split_arrays(train)
  eval_images, eval_labels = _split_arrays(test)
  return Dataset(train_images, train_labels, eval_images, eval_labels, source="tfds")


def tfds_prepared(name: str, data_dir: str | None) -> bool:
  """Whether tfds has dataset `name` prepared in `data_dir` (False where it cannot tell)."""
  import tensorflow_datasets as tfds
  from absl import logging as absl_logging

  verbosity = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.ERROR)  # "no dataset_info.json" is expected here
  try:
    return tfds.builder(name, data_dir=data_dir).is_prepared()
  except Exception:  # noqa: BLE001 - any failure means "not usable"
    return False
  finally:
    absl_logging.set_verbosity(verbosity)


def _download_host() -> str | None:
  try:
    from tensorflow_datasets.image_classification import mnist
  except Exception:  # noqa: BLE001
    return None
  url = getattr(mnist, "_MNIST_URL", None)
  return urllib.parse.urlparse(url).hostname if url else None


#: A host any tfds download needs the network for (tfds's own GCS mirror): whether it
#: resolves tells an offline machine, where tfds would retry for minutes.
PROBE_HOST = "storage.googleapis.com"
#: How long a name lookup may take before the machine counts as offline (MNIST's too).
PROBE_TIMEOUT_S = 3.0


def network_answers() -> bool:
  """Whether `PROBE_HOST` resolves within `PROBE_TIMEOUT_S` (False: offline).

  Behind an HTTPS proxy (`HTTPS_PROXY`), where names may resolve only at the
  proxy, the network is taken to answer.
  """
  import os

  if any(os.environ.get(key) for key in ("HTTPS_PROXY", "https_proxy")):
    return True
  return _resolves(PROBE_HOST, timeout=PROBE_TIMEOUT_S)


def _resolves(host: str | None, timeout: float) -> bool:
  if not host:
    return False
  pool = concurrent.futures.ThreadPoolExecutor(1)
  future = pool.submit(socket.getaddrinfo, host, 443)
  try:
    future.result(timeout=timeout)
    return True
  except Exception:  # noqa: BLE001 - unresolvable or slow: offline
    return False
  finally:
    pool.shutdown(wait=False)  # a lookup that hangs must not hold the caller past `timeout`


def _tfds_or_one_line(data_dir: str | None) -> Dataset:
  """`source="tfds"`: MNIST through tfds, or a one-line `ValueError` saying why not."""
  if tfds_prepared("mnist", data_dir):
    return load_tfds(data_dir, download=False)
  host = _download_host()
  if not _resolves(host, timeout=PROBE_TIMEOUT_S):  # tfds would retry for minutes, then fail
    where = data_dir or "the default tfds data directory"
    raise ValueError(
      f"source 'tfds': MNIST is not prepared in {where} and "
      f"its download host {host} does not answer; use source 'sample' (the bundled 10,000 "
      "images) or 'auto'"
    )
  try:
    return load_tfds(data_dir)
  except Exception as e:  # noqa: BLE001 - tfds and its downloads raise many kinds
    raise ValueError(
      f"source 'tfds': the MNIST download failed ({type(e).__name__}: {first_line(e)})"
    ) from e


def load_mnist(source: str = "auto", *, data_dir: str | None = None, log=print) -> Dataset:
  """Loads MNIST from tensorflow-datasets, or the bundled sample.

  Args:
    source: "tfds" (download if needed; fail at once, in one line, when the
      dataset is not prepared and its download host does not answer), "sample" (the
      bundled 10,000 official test images, split 8,000 / 2,000) or "auto":
      tfds when the dataset is already prepared or its download host answers
      within 3 s, else the sample, saying so in one line.
    data_dir: tfds's data directory.
    log: where the one-line fallback notice goes.

  Returns:
    The `Dataset`.

  Raises:
    ValueError: for an unknown `source`, or `source="tfds"` when MNIST can be
      neither read nor downloaded.
  """
  if source not in SOURCES:
    raise ValueError(f"Unknown MNIST source {source!r}; choose one of {SOURCES}.")
  if source == "sample":
    return load_sample()
  if source == "tfds":
    return _tfds_or_one_line(data_dir)
  if tfds_prepared("mnist", data_dir):
    return load_tfds(data_dir, download=False)
  if _resolves(_download_host(), timeout=PROBE_TIMEOUT_S):
    try:
      return load_tfds(data_dir)
    except Exception as e:  # noqa: BLE001 - any download failure falls back
      log(
        f"MNIST download through tensorflow-datasets failed ({type(e).__name__}); "
        "using the bundled sample of 10,000 real MNIST images (8,000 train / 2,000 eval)."
      )
      return load_sample()
  log(
    "No network for tensorflow-datasets: using the bundled sample of 10,000 real "
    "MNIST images (8,000 train / 2,000 eval)."
  )
  return load_sample()


def batch_indices(
  num_examples: int, batch_size: int, *, seed: int, epoch: int, shuffle: bool = True
) -> Iterator[np.ndarray]:
  """Yields the example indices of each full global batch, in a deterministic order.

  The order depends only on the seed, the epoch and the global batch size, so
  it is the same for any device or process count; the last partial batch is
  dropped. A process can then load just its own rows of each batch.

  Raises:
    ValueError: if `batch_size` is not positive or exceeds the data.
  """
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
  if batch_size > num_examples:
    raise ValueError(f"batch_size={batch_size} exceeds the {num_examples} examples available.")
  order = np.random.default_rng([seed, epoch]).permutation(num_examples) if shuffle else None
  for start in range(0, num_examples - batch_size + 1, batch_size):
    if order is None:
      yield np.arange(start, start + batch_size)
    else:
      yield order[start : start + batch_size]


def batches(
  images: np.ndarray,
  labels: np.ndarray,
  batch_size: int,
  *,
  seed: int,
  epoch: int,
  shuffle: bool = True,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Yields full global batches `(images, labels)` in `batch_indices` order."""
  for index in batch_indices(len(labels), batch_size, seed=seed, epoch=epoch, shuffle=shuffle):
    yield images[index], labels[index]
