"""What the training loop sees of a dataset: host-side batch selection + on-device batches.

A pipeline splits each batch in two: `host_batch(step)` picks the examples on the host
(a tuple of small numpy arrays: images, labels and example indices for MNIST-like data,
example indices alone for MultiMNIST), and `device_batch(source, host_batch, key)` turns it into arrays inside the
jitted step (shifting, or generating the MultiMNIST overlays). `source` is a pytree of
device arrays that the step takes as an argument (never a baked-in constant).
Batches are dicts: images float32 [b, h, w, c], labels int32 [b] or [b, k], and for
MultiMNIST digits [b, k, h, w, c] (each label's own shifted digit).
"""
import concurrent.futures
import dataclasses
import functools
from typing import Any, Callable, Iterator, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from capsjax.data import affine, augment, multimnist
from capsjax.data.datasets import dataset_info
from capsjax.data.mnist import Dataset, load_dataset
from capsjax.data.rows import ImageRows
from capsjax.errors import ConfigError

HostBatch = Tuple[np.ndarray, ...]


@dataclasses.dataclass
class Pipeline:
  num_examples: int                 # examples in one epoch
  source: Any                       # device pytree passed to device_batch
  # training: (step, seed=config's, rows=all) → host arrays of those rows of the step's batch
  host_batch: Callable[..., HostBatch]
  # (batch size, rows=all) → (arrays, weights) of those rows of each padded batch
  eval_batches: Callable[..., Iterator[Tuple[HostBatch, np.ndarray]]]
  device_batch: Callable[..., dict]  # (source, host_batch, key or None) → batch dict


def preprocess(images_uint8: jax.Array) -> jax.Array:
  return images_uint8.astype(jnp.float32) / 255.0


def _batch_rows(num_examples: int, start: int, batch_size: int, rows: slice) -> Tuple[np.ndarray, np.ndarray]:
  """`rows` of the evaluation batch that starts at example `start`, padded to
  `batch_size` (one compilation): (example indices, 0 where padding; weights, 1 or 0)."""
  indices = start + np.arange(batch_size)[rows]
  valid = indices < num_examples
  return np.where(valid, indices, 0).astype(np.int32), valid.astype(np.float32)


@functools.lru_cache(maxsize=64)  # every step of an epoch reuses its permutation (per member seed)
def epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
  """The order of the training set in one epoch: a pure function of (seed, epoch)."""
  return np.random.default_rng([seed, epoch]).permutation(num_examples)


class ReadAhead:
  """A training `host_batch` that reads step + 1 in a background thread while the
  devices run step: images read on demand (decoded from TFDS's files) overlap the
  step. Returns exactly what `host_batch` returns, for any order of calls."""

  def __init__(self, host_batch: Callable[..., HostBatch]):
    self._host_batch = host_batch
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='read_ahead')
    self._pending = {}

  def __call__(self, step, run_seed=None, rows=slice(None)):
    key = (step, run_seed, rows.start, rows.stop, rows.step)   # slices are not hashable
    future = self._pending.pop(key, None)
    batch = future.result() if future is not None else self._host_batch(step, run_seed, rows)
    self._pending = {k: f for k, f in self._pending.items() if k[0] > step}   # ensembles: one per seed
    next_key = (step + 1,) + key[1:]
    if next_key not in self._pending:
      self._pending[next_key] = self._pool.submit(self._host_batch, step + 1, run_seed, rows)
    return batch


# ----------------------------------------------------------------------------- MNIST-like

def dataset_pipeline(config, dataset: Dataset, training: bool,
                     example_transform: Optional[Callable] = None, seed: int = 0) -> Pipeline:
  """Batches of a host dataset (uint8 on the host; converted on device). Without
  `example_transform`: the dataset's preprocessing (capsjax.data.datasets; crops, flips,
  jitter, standardisation) and training shifts of up to config.max_shift px, from the
  step's key in training. With it, `example_transform(image, key)` makes every image
  (expanded MNIST placement, affine test digits): in training from the step's key, in
  evaluation from (`seed`, example index), so the test set is fixed."""
  batch_size = config.batch_size
  steps_per_epoch = len(dataset) // batch_size
  preprocessing = dataset_info(config.dataset).preprocessing

  def host_batch(step, run_seed=None, rows=slice(None)):
    epoch, position = divmod(step, steps_per_epoch)
    order = epoch_permutation(config.seed if run_seed is None else run_seed, epoch, len(dataset))
    indices = order[position * batch_size:(position + 1) * batch_size][rows]
    return dataset.images[indices], dataset.labels[indices], indices.astype(np.int32)

  if isinstance(dataset.images, ImageRows):
    host_batch = ReadAhead(host_batch)

  def eval_batches(eval_batch_size, rows=slice(None)):
    for start in range(0, len(dataset), eval_batch_size):
      indices, weights = _batch_rows(len(dataset), start, eval_batch_size, rows)
      images = np.zeros((len(indices),) + tuple(dataset.images.shape[1:]), np.uint8)
      images[weights > 0] = dataset.images[indices[weights > 0]]   # reads only these rows
      yield (images, dataset.labels[indices] * (weights > 0), indices), weights

  def device_batch(source, batch, key):
    del source
    images, labels, indices = batch
    if example_transform is not None:
      images = preprocess(images)
      keys = jax.random.split(key, len(indices)) if training else affine.example_keys(seed, indices)
      return {'images': jax.vmap(example_transform)(images, keys), 'labels': labels}
    inputs, targets = augment.prepare(images, preprocessing, key if training else None,
                                      config.max_shift if training else 0)
    out = {'images': inputs, 'labels': labels}
    if preprocessing.standardize:   # the decoder draws the image, not its standardised form
      out['reconstruction_targets'] = targets
    return out

  return Pipeline(len(dataset), None, host_batch, eval_batches, device_batch)


def affine_test_pipeline(config) -> Pipeline:
  """The MNIST test digits under random affine maps (config.affnist), fixed per index."""
  test = _load(config, 'test')
  if config.num_test_examples:
    test = test.take(config.num_test_examples)
  ranges = dict(config.affnist.ranges)
  transform = lambda image, key: affine.random_affine(image, key, ranges)[0]
  return dataset_pipeline(config, test, False, transform, config.affnist.test_seed)


# ----------------------------------------------------------------------------- MultiMNIST

def multimnist_pipeline(config, dataset: Dataset, seed: int, num_examples: int) -> Pipeline:
  # Overlays are made on device from any two training digits: the whole split is needed.
  source = multimnist.make_source(np.asarray(dataset.images), dataset.labels, dataset_info(config.dataset).num_classes)
  total = len(dataset) * config.multimnist.examples_per_digit
  num_examples = min(num_examples or total, total)

  def host_batch(step, run_seed=None, rows=slice(None)):
    # Training draws indices uniformly from the whole (virtual) 60M-example set; the
    # overlays themselves are always generated from the pipeline's own `seed`.
    order_seed = seed if run_seed is None else run_seed
    return (np.random.default_rng([order_seed, step]).integers(0, total, config.batch_size)[rows],)

  def eval_batches(eval_batch_size, rows=slice(None)):
    # Indices 0..n−1: with index mod N as the first digit, a subset of n ≤ N examples
    # still uses n different source digits.
    for start in range(0, num_examples, eval_batch_size):
      indices, weights = _batch_rows(num_examples, start, eval_batch_size, rows)
      yield (indices,), weights

  def device_batch(source, batch, key):
    del key  # every random choice is a function of (seed, index)
    images, labels, digits = multimnist.generate(source, seed, batch[0])
    return {'images': images, 'labels': labels, 'digits': digits}

  return Pipeline(num_examples, source, host_batch, eval_batches, device_batch)


# ----------------------------------------------------------------------------- entry point

def images_on_demand(config) -> bool:
  """config.host_images: 'memory' loads each split whole; 'rows' reads only the rows a
  process's batches use (capsjax.data.rows); 'auto' is 'rows' on several processes."""
  mode = config.get('host_images', 'auto')
  return mode == 'rows' or (mode == 'auto' and jax.process_count() > 1)


def _load(config, split: str) -> Dataset:
  return load_dataset(config.dataset, split, config.data_dir, config.tfds_data_dir, images_on_demand(config))


def split_validation(config, train: Dataset) -> Tuple[Dataset, Optional[Dataset]]:
  """(training examples, held-out validation examples or None): the last
  config.validation_examples images of the training split are held out, as the authors'
  `--validate` holds out the last 10 000 (50k/10k)."""
  held_out = config.validation_examples
  if not held_out:
    return train, None
  if config.task == 'multimnist':
    raise ConfigError('config.validation_examples: a held-out validation split exists for '
                      "the 'classify' and 'expanded' tasks only")
  if held_out >= len(train):
    raise ConfigError(f'config.validation_examples={held_out}: allowed fewer than the {len(train)} '
                      'training examples')
  return (Dataset(train.images[:-held_out], train.labels[:-held_out]),
          Dataset(train.images[-held_out:], train.labels[-held_out:]))


def _at_most(config, key: str, available: int, what: str) -> int:
  """config[key], refused when the data has fewer (never silently clamped)."""
  if config[key] > available:
    raise ConfigError(f'config.{key}={config[key]}: the data has {available} {what}; allowed at most that')
  return config[key]


def make_pipelines(config) -> Tuple[Pipeline, Pipeline]:
  """(train, test) pipelines for config.task: 'classify' (the dataset's images as they
  are), 'expanded' (each digit placed at random on the model's larger canvas) or
  'multimnist' (two digits overlaid on the model's canvas). With
  config.validation_examples, training never sees the held-out images (make_splits
  returns them as a third pipeline)."""
  train, test, _ = make_splits(config)
  return train, test


def make_splits(config) -> Tuple[Pipeline, Pipeline, Optional[Pipeline]]:
  """(train, test, validation or None) pipelines; see make_pipelines."""
  task = config.task
  train, test = _load(config, 'train'), _load(config, 'test')
  model_input = dataset_info(config.dataset).input_shape
  if task == 'classify' and model_input != tuple(config.model.input_shape):
    raise ConfigError(f'{config.dataset} gives the model inputs of shape {model_input}; the model expects '
                      f'config.model.input_shape={tuple(config.model.input_shape)}')
  train, held_out = split_validation(config, train)
  if config.num_train_examples:
    train = train.take(_at_most(config, 'num_train_examples', len(train), 'training examples'
                                + (f' (after holding out {len(held_out)} for validation)' if held_out else '')))
  if task in ('classify', 'expanded'):
    if config.num_test_examples:
      test = test.take(_at_most(config, 'num_test_examples', len(test), 'test examples'))
    if len(train) < config.batch_size:
      raise ConfigError(f'batch_size {config.batch_size} exceeds the {len(train)} training examples')
    if task == 'classify':
      validation = dataset_pipeline(config, held_out, False) if held_out else None
      return dataset_pipeline(config, train, True), dataset_pipeline(config, test, False), validation
    canvas = config.model.input_shape[0]
    place = lambda image, key: affine.random_place(image, key, canvas)
    validation = (dataset_pipeline(config, held_out, False, place, config.expanded_test_seed + 1)
                  if held_out else None)
    return (dataset_pipeline(config, train, True, place),
            dataset_pipeline(config, test, False, place, config.expanded_test_seed), validation)
  if task == 'multimnist':
    if config.num_test_examples:
      _at_most(config, 'num_test_examples', len(test) * config.multimnist.examples_per_digit, 'MultiMNIST test pairs')
    return (multimnist_pipeline(config, train, config.seed, 0),
            multimnist_pipeline(config, test, config.multimnist.test_seed, config.num_test_examples), None)
  raise ConfigError(f"unknown task {task!r} (expected 'classify', 'expanded' or 'multimnist')")
