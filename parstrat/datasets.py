"""Data for training: MNIST (tensorflow-datasets, or the bundled offline sample) and batching.

`batches` and `batch_indices` give the deterministic order `parstrat train` uses
(and resumes from): it depends only on the seed, the epoch and the global batch
size, not on the device or process count.

Example:
  >>> from parstrat import datasets
  >>> data = datasets.load_mnist("sample")
  >>> data
  Dataset(sample: 8000 train, 2000 eval)
  >>> images, labels = next(datasets.batches(data.train_images, data.train_labels, 256,
  ...                                        seed=0, epoch=0))
  >>> images.shape, labels.shape
  ((256, 784), (256,))
"""

from parstrat._src.datasets import Dataset
from parstrat._src.datasets import batch_indices
from parstrat._src.datasets import batches
from parstrat._src.datasets import load_mnist
from parstrat._src.datasets import load_sample
from parstrat._src.datasets import load_tfds
from parstrat._src.datasets import preprocess

__all__ = [
  "Dataset",
  "batch_indices",
  "batches",
  "load_mnist",
  "load_sample",
  "load_tfds",
  "preprocess",
]
