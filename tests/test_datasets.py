"""The paper's other datasets (section 7): on-device augmentation as pure functions, each
dataset through the real pipeline on TFDS mock data shaped like the real thing, a short
training per experiment that must beat chance, and the ensemble's summed-length vote."""
import importlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from capsjax import assemble, steps, train
from capsjax.data import augment
from capsjax.data import sources as mnist_data
from capsjax.data.sources import tfds_builders
from capsjax.data.datasets import Preprocessing, dataset_info
from capsjax.data.sources import Dataset
from capsjax.errors import DataError
from capsjax.models import build_model
from capsjax.objectives import top_k_correct
from capsjax.validation import problems_of
from helpers import SPEEDY_CONV, evaluators_off

# cifar10 trains as cifar10_ensemble's members do (the same config, vmapped): one run covers
# both; fashion_mnist is the mnist recipe and model on other 28×28 grey images (nothing of its own to train).
NEW_EXPERIMENTS = ('svhn', 'smallnorb', 'cifar10_ensemble')


def _batch(shape=(16, 12, 12, 3), seed=0):
  return jax.random.uniform(jax.random.key(seed), shape)


# ------------------------------------------------------------------------- augmentation

def test_random_crop_takes_a_window_of_each_image():
  images = jnp.arange(4 * 10 * 10 * 2, dtype=jnp.float32).reshape(4, 10, 10, 2)
  crops = np.asarray(augment.random_crop(images, jax.random.key(0), 6))
  assert crops.shape == (4, 6, 6, 2)
  for image, crop in zip(np.asarray(images), crops):
    top, left = np.argwhere(image[..., 0] == crop[0, 0, 0])[0]
    np.testing.assert_array_equal(crop, image[top:top + 6, left:left + 6])
  np.testing.assert_array_equal(augment.center_crop(images, 6), images[:, 2:8, 2:8])


def test_random_flip_mirrors_about_half_the_images():
  images = _batch((64, 5, 7, 1))
  flipped = np.asarray(augment.random_flip(images, jax.random.key(3)))
  mirrored = [np.array_equal(f, i[:, ::-1]) for f, i in zip(flipped, np.asarray(images))]
  unchanged = [np.array_equal(f, i) for f, i in zip(flipped, np.asarray(images))]
  assert all(m or u for m, u in zip(mirrored, unchanged)) and 16 < sum(mirrored) < 48


def test_brightness_and_contrast_jitter_invariants():
  images = _batch()
  brighter = np.asarray(augment.random_brightness(images, jax.random.key(1), 0.2)) - np.asarray(images)
  per_image = brighter.reshape(16, -1)
  np.testing.assert_allclose(per_image, per_image[:, :1].repeat(per_image.shape[1], 1), atol=1e-6)
  assert np.all(np.abs(per_image[:, 0]) <= 0.2)
  contrasted = np.asarray(augment.random_contrast(images, jax.random.key(2), 0.5, 1.5))
  means = np.asarray(images).mean(axis=(1, 2), keepdims=True)
  np.testing.assert_allclose(contrasted.mean(axis=(1, 2), keepdims=True), means, atol=1e-6)   # means kept
  before = (np.asarray(images) - means).reshape(16, -1)
  after = (contrasted - means).reshape(16, -1)
  factors = np.sum(before * after, 1) / np.sum(before * before, 1)          # least squares per image
  assert np.all((factors >= 0.5) & (factors <= 1.5))
  np.testing.assert_allclose(after, factors[:, None] * before, atol=1e-5)   # one factor per image


def test_standardize_and_its_floor():
  images = _batch()
  standard = np.asarray(augment.standardize(images)).reshape(16, -1)
  np.testing.assert_allclose(standard.mean(1), 0, atol=1e-5)
  np.testing.assert_allclose(standard.std(1), 1, atol=1e-4)
  np.testing.assert_array_equal(augment.standardize(jnp.full((1, 4, 4, 1), 0.3)), 0.0)   # constant: no NaN


def test_prepare_is_deterministic_per_key_and_centred_at_test():
  preprocessing = Preprocessing(resize=16, crop=12, flip=True, brightness=0.1, contrast=(0.5, 1.5),
                                standardize=True)
  stored = (np.asarray(_batch((8, 20, 20, 2))) * 255).astype(np.uint8)
  first, targets = augment.prepare(jnp.asarray(stored), preprocessing, jax.random.key(5), max_shift=1)
  again, _ = augment.prepare(jnp.asarray(stored), preprocessing, jax.random.key(5), max_shift=1)
  other, _ = augment.prepare(jnp.asarray(stored), preprocessing, jax.random.key(6), max_shift=1)
  assert first.shape == (8, 12, 12, 2) and first.dtype == jnp.float32
  np.testing.assert_array_equal(first, again)
  assert not np.allclose(first, other)
  assert 0.0 <= float(targets.min()) and float(targets.max()) <= 1.0
  test_inputs, test_targets = augment.prepare(jnp.asarray(stored), preprocessing)
  resized = augment.resize(jnp.asarray(stored, jnp.float32) / 255, 16)
  np.testing.assert_allclose(test_targets, resized[:, 2:14, 2:14], atol=1e-6)   # the central crop
  np.testing.assert_allclose(test_inputs, augment.standardize(resized[:, 2:14, 2:14]), atol=1e-5)


# ------------------------------------------------------------------------- TFDS mock data

@pytest.fixture
def offline_tfds(monkeypatch):
  """TFDS's mock data in place of download and preparation (random examples with the real
  features, shapes and dtypes); the reachability probe has nothing to reach."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from tensorflow_datasets.core.data_sources import base  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(tfds_builders, '_check_download_reachable', lambda *args, **kwargs: None)
  # The mock's batched read lacks an argument (TFDS 4.9): read the records one by one.
  monkeypatch.setattr(base.BaseDataSource, '__getitems__', lambda self, keys: [self[k] for k in keys])
  with tfds.testing.mock_data(num_examples=96):
    yield


@pytest.mark.parametrize('name', ['svhn', 'smallnorb', 'cifar10'])
def test_each_dataset_through_the_real_pipeline(name, offline_tfds):
  info = dataset_info(name)
  data = mnist_data.load_dataset(name, 'train')
  assert data.images.dtype == np.uint8 and data.images.shape == (96,) + info.image_shape
  assert data.labels.min() >= 0 and data.labels.max() < info.num_classes
  config = importlib.import_module(f'capsjax.experiments.{name}').get_config()
  config.batch_size, config.eval_batch_size = 32, 48
  assert tuple(config.model.input_shape) == info.input_shape
  train_pipe, test_pipe, _ = assemble.splits(config)
  host = train_pipe.host_batch(0)
  batch = train_pipe.device_batch(train_pipe.source, host, jax.random.key(0))
  again = train_pipe.device_batch(train_pipe.source, host, jax.random.key(0))
  assert batch['images'].shape == (32,) + info.input_shape and batch['images'].dtype == jnp.float32
  np.testing.assert_array_equal(batch['images'], again['images'])     # a function of the step's key
  (test_host, _), = list(test_pipe.eval_batches(48))[:1]
  test_batch = test_pipe.device_batch(test_pipe.source, test_host, None)
  if info.preprocessing.standardize:
    flat = np.asarray(batch['images']).reshape(32, -1)
    np.testing.assert_allclose(flat.mean(1), 0, atol=1e-4)
    targets = np.asarray(batch['reconstruction_targets'])
    assert targets.shape == batch['images'].shape and targets.min() >= 0 and targets.max() <= 1
    expected, _ = augment.prepare(jnp.asarray(test_host[0]), info.preprocessing)   # central crop
    np.testing.assert_allclose(test_batch['images'], expected, atol=1e-5)
  else:
    np.testing.assert_allclose(test_batch['images'], np.asarray(test_host[0], np.float32) / 255, atol=1e-7)


def test_tfds_only_datasets_refuse_an_idx_folder(tmp_path):
  with pytest.raises(DataError, match='through TFDS only.*mnist, fashion_mnist'):
    mnist_data.load_dataset('cifar10', 'train', str(tmp_path))


# ------------------------------------------------------------------------- short trainings

def learnable(digits: Dataset, info, count: int, offset: int) -> Dataset:
  """Real MNIST digits dressed as the dataset: scaled to fill its stored image, one colour
  per image in every channel, label = digit mod classes. Learnable like MNIST, and what
  the dataset's crops, flips and jitter do to it is what they do to real images."""
  height, width, channels = info.image_shape
  images = digits.images[offset:offset + count].astype(np.float32) / 255       # [n, 28, 28, 1]
  side = int(round(min(height, width) * 28 / 32))
  images = np.asarray(jax.image.resize(images, (count, side, side, 1), 'bilinear'))
  canvas = np.zeros((count, height, width, channels), np.float32)
  top, left = (height - side) // 2, (width - side) // 2
  tint = np.random.default_rng(offset).uniform(0.5, 1.0, (count, 1, 1, channels))
  canvas[:, top:top + side, left:left + side, :] = images * tint
  labels = digits.labels[offset:offset + count] % info.num_classes
  return Dataset((np.clip(canvas, 0, 1) * 255).astype(np.uint8), labels.astype(np.int32))


@pytest.mark.parametrize('name', NEW_EXPERIMENTS)
def test_each_new_experiment_trains_beyond_chance(name, mnist_dir, monkeypatch, tmp_path):
  config = importlib.import_module(f'capsjax.experiments.{name}').get_config()
  assert problems_of(config) == []
  info = dataset_info(config.dataset)
  digits = mnist_data.load_idx_split(mnist_dir, 'train')
  monkeypatch.setattr(mnist_data.TfdsSource, 'load',
                      lambda self, split, on_demand=False: learnable(digits, info, 2048 if split == 'train' else 200,
                                                                     0 if split == 'train' else 50000))
  config.model.conv1_channels, config.model.primary_types = 16, 4
  config.model.decoder_hidden = (32, 64)
  config.model.formulation.conv_impl = SPEEDY_CONV
  config.batch_size, config.eval_batch_size, config.num_steps = 32, 100, 80
  config.lr_decay_steps, config.log_every_steps = 200, 40
  config.eval_every_steps, config.checkpoint_every_steps = 0, 80
  evaluators_off(config)   # asserted elsewhere (a suite-time trim)
  if config.ensemble:
    config.ensemble.seeds = (0, 1)
  results = train.train_and_evaluate(config, str(tmp_path / name))
  accuracies = 1 - np.atleast_1d(results['test_error'])
  clearly = min(3 / info.num_classes, 0.6)          # 3× chance (10 classes), 60 % (5 classes)
  assert np.all(accuracies > clearly), (name, accuracies)
  if config.ensemble:
    assert 1 - results['ensemble_test_error'] > clearly


# ------------------------------------------------------------------------- the ensemble's vote

def test_ensemble_predicts_the_largest_summed_length():
  lengths = jnp.array([[[0.9, 0.1, 0.0]], [[0.0, 0.5, 0.6]]])   # [members, batch, classes]
  # Member 0 says class 0, member 1 class 2; the summed lengths (0.9, 0.6, 0.6) say 0.
  assert top_k_correct(jnp.sum(lengths, 0), jnp.array([0]))[0].tolist() == [1.0]
  assert top_k_correct(lengths[1], jnp.array([0]))[0].tolist() == [0.0]


@pytest.mark.float32_matmuls
def test_ensemble_eval_step_sums_the_members_lengths(mnist_dir):
  from capsjax.experiments import cifar10  # pylint: disable=g-import-not-at-top
  config = cifar10.get_config()
  config.dataset, config.model.input_shape, config.model.num_classes = 'mnist', (28, 28, 1), 10
  config.model.conv1_channels, config.model.primary_types = 8, 2
  config.ensemble = ml_collections.ConfigDict(dict(seeds=(0, 1, 2)))
  model = build_model(**config.model)
  params = jax.jit(jax.vmap(lambda k: model.init(k, jnp.zeros((1, 28, 28, 1)))['params']))(
      jax.random.split(jax.random.key(0), 3))
  full = mnist_data.load_idx_split(mnist_dir, 'test')
  test = Dataset(full.images[:64], full.labels[:64])
  pipe = assemble.pipeline(config, test, False)
  knobs = {'seed': jnp.arange(3), 'routing_iterations': jnp.full(3, 3), 'reconstruction_weight': jnp.zeros(3)}
  eval_step = steps.make_eval_step(assemble.objective(config), model, pipe, ensemble=True)
  (host, weights), = list(pipe.eval_batches(64))
  sums = eval_step(params, None, host, weights, knobs)
  images = jnp.asarray(host[0], jnp.float32) / 255
  encode = jax.jit(lambda p: model.apply({'params': p}, images, method='encode'))   # compiled once
  lengths = np.stack([np.linalg.norm(encode(jax.tree.map(lambda x: x[m], params)), axis=-1) for m in range(3)])
  votes = np.argmax(lengths.sum(0), -1)
  assert float(sums['ensemble_correct']) == float(np.sum(votes == test.labels))
  np.testing.assert_array_equal(np.asarray(sums['correct']), (np.argmax(lengths, -1) == test.labels).sum(-1))


@pytest.mark.parametrize('name', ['svhn', 'smallnorb', 'cifar10'])
def test_offline_is_one_line_within_seconds(name, tmp_path, monkeypatch):
  import socket  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top

  def unreachable(address, timeout=None):
    raise OSError(f'no route to {address[0]}')
  monkeypatch.setattr(socket, 'create_connection', unreachable)   # offline, whatever this machine is
  start = time.monotonic()
  with pytest.raises(DataError, match=r'TFDS cannot download .* offline, pass a folder holding a prepared \S+ as '
                                         r'tfds_data_dir \(--config.tfds_data_dir=DIR\)$') as error:
    mnist_data.load_dataset(name, 'train', tfds_data_dir=str(tmp_path))
  assert time.monotonic() - start < 300 and '\n' not in str(error.value)   # no retries for minutes (a hang)
  assert dataset_info(name).download_url.split('/')[2] in str(error.value)
