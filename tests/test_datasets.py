import numpy as np
import pytest
import tensorflow_datasets as tfds

from parstrat._src import datasets


@pytest.fixture(scope="module")
def sample():
  return datasets.load_sample()


def test_sample_matches_its_readme(sample):
  images, labels = datasets.sample_files()
  import hashlib

  assert hashlib.md5(images).hexdigest() == "2646ac647ad5339dbf082846283269ea"
  all_labels = np.concatenate([sample.train_labels, sample.eval_labels])
  assert np.bincount(all_labels, minlength=10).tolist() == [
    980,
    1135,
    1032,
    1010,
    982,
    892,
    958,
    1028,
    974,
    1009,
  ]
  assert all_labels[:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]
  all_images = np.concatenate([sample.train_images, sample.eval_images])
  assert all_images.mean() * 255 == pytest.approx(33.79, abs=0.01)


def test_sample_is_split_and_preprocessed(sample):
  assert sample.source == "sample"
  assert sample.train_images.shape == (8000, 784) and sample.eval_images.shape == (2000, 784)
  assert sample.train_images.dtype == np.float32 and sample.train_labels.dtype == np.int32
  assert 0.0 <= sample.train_images.min() and sample.train_images.max() <= 1.0


def test_tfds_path_with_mock_data():
  with tfds.testing.mock_data(num_examples=24):
    data = datasets.load_tfds()
  assert data.source == "tfds"
  assert data.train_images.shape == (24, 784) and data.eval_images.shape == (24, 784)
  assert data.train_images.dtype == np.float32
  assert 0.0 <= data.train_images.min() and data.train_images.max() <= 1.0
  assert data.train_labels.dtype == np.int32 and set(data.train_labels) <= set(range(10))


def test_a_tfds_dataset_not_prepared_offline_is_one_line_at_once(monkeypatch, tmp_path):
  # `--dataset fashion_mnist` offline retried its download for minutes (as MNIST did
  # before its own check), leaving half-downloaded files behind.
  from parstrat._src import run_data

  asked = []
  monkeypatch.setattr(datasets, "_resolves", lambda host, timeout: asked.append(host) or False)
  with pytest.raises(ValueError) as e:
    run_data.from_tfds("fashion_mnist", data_dir=str(tmp_path), batch_size=4, seed=0)
  assert str(e.value) == (
    f"--dataset 'fashion_mnist' is not prepared in {tmp_path}, and the network does not "
    "answer (storage.googleapis.com unresolved in 3 s) to download it: prepare it where "
    "there is one (--data-dir), or use --dataset mnist (its bundled sample) or a dataset "
    "function"
  )
  assert asked == ["storage.googleapis.com"]
  assert not list(tmp_path.rglob("*.tmp.*")) and not list(tmp_path.rglob("incomplete*"))
  with tfds.testing.mock_data(num_examples=8):  # prepared (here: mocked): no network asked
    data = run_data.from_tfds("fashion_mnist", data_dir=str(tmp_path), batch_size=4, seed=0)
  assert asked == ["storage.googleapis.com"] and data.steps_per_epoch == 2
  # Prepared but unreadable (another file format, say): its own error, not "offline".
  monkeypatch.setattr(datasets, "tfds_prepared", lambda name, data_dir: True)
  with pytest.raises(ValueError, match=r"^--dataset 'fashion_mnist': tfds cannot read it \("):
    run_data.from_tfds("fashion_mnist", data_dir=str(tmp_path), batch_size=4, seed=0)
  assert asked == ["storage.googleapis.com"]
  # Behind an HTTPS proxy names may resolve only there: the network is not asked.
  monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
  assert datasets.network_answers() and asked == ["storage.googleapis.com"]


def test_auto_falls_back_to_the_sample_in_one_line(monkeypatch, tmp_path):
  monkeypatch.setattr(datasets, "_resolves", lambda host, timeout: False)
  lines = []
  data = datasets.load_mnist("auto", data_dir=str(tmp_path), log=lines.append)
  assert data.source == "sample"
  assert len(lines) == 1 and "bundled sample of 10,000 real MNIST images" in lines[0]


def test_auto_falls_back_when_the_download_fails(monkeypatch, tmp_path):
  monkeypatch.setattr(datasets, "_resolves", lambda host, timeout: True)

  def fail(*args, **kwargs):
    raise ConnectionError("no route")

  monkeypatch.setattr(datasets, "load_tfds", fail)
  lines = []
  assert datasets.load_mnist("auto", data_dir=str(tmp_path), log=lines.append).source == "sample"
  assert "download through tensorflow-datasets failed (ConnectionError)" in lines[0]


def test_source_tfds_offline_fails_at_once_in_one_line(monkeypatch, tmp_path):
  # tfds retried its download for minutes, then raised a traceback.
  import time

  from parstrat._src import cli

  monkeypatch.setattr(datasets, "_download_host", lambda: "storage.parstrat.invalid")
  start = time.monotonic()
  message = f"MNIST is not prepared in {tmp_path} and its download host storage.parstrat.invalid"
  with pytest.raises(ValueError, match=message + " does not answer; use source 'sample'"):
    datasets.load_mnist("tfds", data_dir=str(tmp_path))
  assert time.monotonic() - start < 30  # the 3 s lookup, not tfds's retries

  def fail(*args, **kwargs):
    raise ConnectionError("no route\nmore lines")

  monkeypatch.setattr(datasets, "_resolves", lambda host, timeout: True)
  monkeypatch.setattr(datasets, "load_tfds", fail)
  with pytest.raises(ValueError, match=r"the MNIST download failed \(ConnectionError: no route\)$"):
    datasets.load_mnist("tfds", data_dir=str(tmp_path))
  args = ["train", "--source", "tfds", "--data-dir", str(tmp_path), "--steps", "1"]
  assert cli.main(args) == 2


def test_an_unknown_tfds_name_is_one_line_with_a_suggestion(capsys):
  # tfds's own message lists every dataset it knows: hundreds of lines.
  from parstrat._src import cli

  assert cli.main(["train", "--dataset", "fashion_mnistt", "--steps", "1"]) == 2
  err = capsys.readouterr().err.strip()
  assert err == (
    "parstrat train: error: --dataset 'fashion_mnistt': tensorflow-datasets has no such "
    "dataset; did you mean 'fashion_mnist'? (or give module:function)"
  )


def test_unknown_source():
  with pytest.raises(ValueError, match="Unknown MNIST source 'mnist2'"):
    datasets.load_mnist("mnist2")


def test_batches_are_deterministic_and_independent_of_devices(sample):
  first = list(datasets.batches(sample.train_images, sample.train_labels, 1000, seed=1, epoch=0))
  again = list(datasets.batches(sample.train_images, sample.train_labels, 1000, seed=1, epoch=0))
  other = list(datasets.batches(sample.train_images, sample.train_labels, 1000, seed=1, epoch=1))
  assert len(first) == 8
  for (x1, y1), (x2, y2) in zip(first, again, strict=True):
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
  assert not np.array_equal(first[0][1], other[0][1])
  with pytest.raises(ValueError, match="batch_size=9000 exceeds the 8000 examples"):
    next(datasets.batches(sample.train_images, sample.train_labels, 9000, seed=0, epoch=0))
  with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
    next(datasets.batches(sample.train_images, sample.train_labels, 0, seed=0, epoch=0))
