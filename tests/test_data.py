"""IDX reader (generated and malformed files), on-device shifts."""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capsjax.data import augment
from capsjax.data.idx import parse_idx, read_idx, write_idx
from capsjax.data.sources import load_dataset, load_idx_split
from capsjax.errors import DataError
from capsjax.experiments import mnist
from helpers import write_idx_split


@pytest.mark.parametrize('compress', [True, False])
def test_idx_round_trip(tmp_path, compress):
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (5, 28, 28), dtype=np.uint8)
  labels = rng.integers(0, 10, 5).astype(np.uint8)
  write_idx_split(tmp_path, 'train', images, labels, compress)
  dataset = load_idx_split(str(tmp_path), 'train')
  np.testing.assert_array_equal(dataset.images[..., 0], images)
  np.testing.assert_array_equal(dataset.labels, labels)
  assert dataset.images.shape == (5, 28, 28, 1) and dataset.labels.dtype == np.int32


def test_idx_reads_big_endian_types(tmp_path):
  values = np.arange(6, dtype=np.int32).reshape(2, 3) - 3
  write_idx(str(tmp_path / 'x.idx'), values)
  raw = (tmp_path / 'x.idx').read_bytes()
  assert raw[:4] == bytes([0, 0, 0x0C, 2]) and raw[4:8] == (2).to_bytes(4, 'big')
  np.testing.assert_array_equal(read_idx(str(tmp_path / 'x.idx')), values)


def test_real_mnist_files(mnist_dir):
  test = load_idx_split(mnist_dir, 'test')
  assert test.images.shape == (10000, 28, 28, 1)
  assert np.bincount(test.labels).tolist()[:3] == [980, 1135, 1032]


@pytest.mark.parametrize('raw,message', [
    (b'\x01\x00\x08\x01\x00\x00\x00\x01\x07', 'bad IDX magic'),
    (b'\x00\x00\x07\x01\x00\x00\x00\x01\x07', 'unknown IDX type'),
    (b'\x00\x00\x08\x02\x00\x00', 'truncated IDX header'),
    (b'\x00\x00\x08\x01\x00\x00\x00\x03\x07', r'declares shape \(3,\)'),
    (b'\x00\x00', 'too short'),
])
def test_malformed_idx_bytes(raw, message):
  with pytest.raises(DataError, match=message):
    parse_idx(raw, 'bad')


def test_corrupt_gzip_and_inconsistent_splits(tmp_path):
  (tmp_path / 'train-images-idx3-ubyte.gz').write_bytes(b'\x1f\x8b' + b'garbage' * 10)
  write_idx(str(tmp_path / 'train-labels-idx1-ubyte'), np.zeros(3, np.uint8))
  with pytest.raises(DataError, match='corrupt gzip'):
    load_idx_split(str(tmp_path), 'train')
  os.remove(tmp_path / 'train-images-idx3-ubyte.gz')
  write_idx(str(tmp_path / 'train-images-idx3-ubyte'), np.zeros((4, 28, 28), np.uint8))
  with pytest.raises(DataError, match='4 images but 3 labels'):
    load_idx_split(str(tmp_path), 'train')
  write_idx(str(tmp_path / 'train-labels-idx1-ubyte'), np.array([0, 1, 2, 12], np.uint8))
  with pytest.raises(DataError, match=r'labels must lie in \[0, 10\)'):
    load_idx_split(str(tmp_path), 'train')


def test_missing_folder_and_file(tmp_path):
  with pytest.raises(DataError, match='does not exist'):
    load_idx_split(str(tmp_path / 'nowhere'), 'test')
  with pytest.raises(DataError, match='no t10k-images-idx3-ubyte'):
    load_idx_split(str(tmp_path), 'test')


def test_wrong_image_size_is_rejected(tmp_path):
  write_idx_split(tmp_path, 'test', np.zeros((2, 32, 32), np.uint8), np.zeros(2, np.uint8))
  with pytest.raises(DataError, match=r'test images have shape \(32, 32, 1\); mnist has \(28, 28, 1\)'):
    load_dataset('mnist', 'test', str(tmp_path))


def test_tfds_is_the_default_source():
  # The TFDS path itself (download, prepare, read) is tested for real in test_tfds.py.
  config = mnist.get_config()
  assert config.data_dir == '' and config.dataset == 'mnist'


def test_shift_moves_content_with_zero_fill():
  image = jnp.zeros((6, 6, 1)).at[2, 3, 0].set(1.0).at[0, 0, 0].set(0.5)
  shifted = augment.shift_image(image, jnp.asarray(1), jnp.asarray(-2), 2)
  expected = np.zeros((6, 6, 1))
  expected[3, 1, 0] = 1.0  # (2+1, 3-2); the corner pixel left the frame
  np.testing.assert_array_equal(shifted, expected)


def test_random_shift_bounds_and_determinism():
  images = jnp.zeros((64, 28, 28, 1)).at[:, 14, 14, 0].set(1.0)
  key = jax.random.key(3)
  shifted = augment.random_shift(images, key, 2)
  np.testing.assert_array_equal(shifted, augment.random_shift(images, key, 2))
  positions = np.argwhere(np.asarray(shifted[..., 0]) == 1.0)
  assert len(positions) == 64  # each image keeps its one pixel
  offsets = positions[:, 1:] - 14
  assert offsets.min() == -2 and offsets.max() == 2
  assert len({tuple(o) for o in offsets}) > 10  # per-image, not one shift for the batch
  assert not np.array_equal(shifted, augment.random_shift(images, jax.random.key(4), 2))


@pytest.mark.parametrize('overrides,message', [
    (dict(num_train_examples=300), 'config.num_train_examples=300: the data has 200 training examples'),
    (dict(num_train_examples=190, validation_examples=20),
     'config.num_train_examples=190: the data has 180 training examples (after holding out 20 for validation)'),
    (dict(num_test_examples=51), 'config.num_test_examples=51: the data has 50 test examples'),
    (dict(task='multimnist', num_test_examples=50 * 1000 + 1, model_input=(36, 36, 1)),
     'config.num_test_examples=50001: the data has 50000 MultiMNIST test pairs'),
])
def test_counts_beyond_the_data_are_refused_never_clamped(tmp_path, overrides, message):
  from capsjax.assemble import splits  # pylint: disable=g-import-not-at-top
  from capsjax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  for split, count in (('train', 200), ('test', 50)):
    write_idx_split(str(tmp_path), split, rng.integers(0, 256, (count, 28, 28), dtype=np.uint8),
                 (np.arange(count) % 10).astype(np.uint8))
  config = mnist.get_config()
  config.data_dir, config.batch_size = str(tmp_path), 16
  config.model.input_shape = overrides.pop('model_input', (28, 28, 1))
  for key, value in overrides.items():
    config[key] = value
  if config.task == 'multimnist':
    config.multimnist = dict(examples_per_digit=1000, test_seed=1)
    config.max_shift = 0
  with pytest.raises(ConfigError, match=re.escape(message)):
    splits(config)
