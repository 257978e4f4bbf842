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
from capsjax.data.datasets import DATASETS, Preprocessing
from capsjax.data.rows import ImageRows
from capsjax.data.sources import Dataset
from capsjax.keys import Across, Rule, is_int, key

KEYS = (
    # Checked against the image's side by capsjax.validation's rules across keys.
    key('max_shift', 2, Rule(lambda v: True, 'an integer in [0, a quarter of the image side]'),
        'training images shifted by up to ± this many pixels (zero padding)'),
)


def _max_shift_problem(max_shift, input_shape):
  side = min(tuple(input_shape or ())[:2] or (28,))
  limit = side // 4   # beyond a quarter of the side, shifts cut off much of a digit
  if is_int(max_shift) and 0 <= max_shift <= limit:
    return None
  return (f'config.max_shift={max_shift!r}: allowed an integer in [0, {limit}] (a quarter of the {side}-pixel '
          'image side)')


# The rule across these keys (capsjax.keys.Across), checked by validation.
RULES = (Across(('max_shift', 'model.input_shape'), _max_shift_problem),)

HostBatch = Tuple[np.ndarray, ...]


@dataclasses.dataclass
class Pipeline:
  num_examples: int                 # examples in one epoch
  source: Any                       # device pytree passed to device_batch
  # training: (step, seed=config's, rows=all) → host arrays of those rows of the step's batch
  host_batch: Callable[..., HostBatch]
  # (batch size, rows=all, padded size=batch size) → (arrays, weights) of those rows of
  # each batch, padded
  eval_batches: Callable[..., Iterator[Tuple[HostBatch, np.ndarray]]]
  device_batch: Callable[..., dict]  # (source, host_batch, key or None) → batch dict


def preprocess(images_uint8: jax.Array) -> jax.Array:
  return images_uint8.astype(jnp.float32) / 255.0


def _batch_rows(num_examples: int, start: int, batch_size: int, rows: slice,
                padded_size: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
  """`rows` of the evaluation batch of `batch_size` examples that starts at example
  `start`, padded to `padded_size` rows (default `batch_size`; more when the devices need
  a multiple of their count), the last batch too (one compilation): (example indices, 0
  where padding; weights, 1 or 0)."""
  offsets = np.arange(padded_size or batch_size)[rows]
  indices = start + offsets
  valid = (indices < num_examples) & (offsets < batch_size)
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

def described_preprocessing(dataset_name: str) -> Preprocessing:
  """The preprocessing of a described dataset (capsjax.data.datasets), else none: for
  callers that build a pipeline without a source (benchmarks, tests)."""
  described = DATASETS.get(dataset_name)
  return described.preprocessing if described else Preprocessing()


def dataset_pipeline(dataset: Dataset, training: bool, *, batch_size: int, seed: int = 0, max_shift: int = 0,
                     preprocessing: Preprocessing = Preprocessing(),
                     example_transform: Optional[Callable] = None, test_seed: int = 0,
                     augmentation: Optional[dict] = None) -> Pipeline:
  """Batches of a host dataset (uint8 on the host; converted on device), in the order of
  (`seed`, epoch). Without `example_transform`: `preprocessing` (the source's: crops,
  flips, jitter, standardisation) and training shifts of up to `max_shift` px, from the
  step's key in training. With it, `example_transform(image, key)` makes every image
  (expanded MNIST placement, affine test digits): in training from the step's key, in
  evaluation from (`test_seed`, example index), so the test set is fixed."""
  steps_per_epoch = len(dataset) // batch_size

  def host_batch(step, run_seed=None, rows=slice(None)):
    epoch, position = divmod(step, steps_per_epoch)
    order = epoch_permutation(seed if run_seed is None else run_seed, epoch, len(dataset))
    indices = order[position * batch_size:(position + 1) * batch_size][rows]
    return dataset.images[indices], dataset.labels[indices], indices.astype(np.int32)

  if isinstance(dataset.images, ImageRows):
    host_batch = ReadAhead(host_batch)

  def eval_batches(eval_batch_size, rows=slice(None), padded_size=None):
    for start in range(0, len(dataset), eval_batch_size):
      indices, weights = _batch_rows(len(dataset), start, eval_batch_size, rows, padded_size)
      images = np.zeros((len(indices),) + tuple(dataset.images.shape[1:]), np.uint8)
      images[weights > 0] = dataset.images[indices[weights > 0]]   # reads only these rows
      yield (images, dataset.labels[indices] * (weights > 0), indices), weights

  def device_batch(source, batch, key, augmentation_strengths=None):
    del source
    images, labels, indices = batch
    if example_transform is not None:
      images = preprocess(images)
      keys = jax.random.split(key, len(indices)) if training else affine.example_keys(test_seed, indices)
      return {'images': jax.vmap(example_transform)(images, keys), 'labels': labels}
    inputs, targets = augment.prepare(images, preprocessing, key if training else None,
                                      max_shift if training else 0, augmentation if training else None,
                                      augmentation_strengths)
    out = {'images': inputs, 'labels': labels}
    if preprocessing.standardize:   # the decoder draws the image, not its standardised form
      out['reconstruction_targets'] = targets
    return out

  return Pipeline(len(dataset), None, host_batch, eval_batches, device_batch)


# ----------------------------------------------------------------------------- MultiMNIST

def multimnist_pipeline(dataset: Dataset, seed: int, num_examples: int, *, batch_size: int,
                        examples_per_digit: int, num_classes: int = 10) -> Pipeline:
  """Overlaid pairs of `dataset`'s digits, generated on device from (`seed`, index): the
  first `num_examples` (0: all len(dataset) × examples_per_digit) for evaluation."""
  # Overlays are made on device from any two training digits: the whole split is needed.
  source = multimnist.make_source(np.asarray(dataset.images), dataset.labels, num_classes)
  total = len(dataset) * examples_per_digit
  num_examples = min(num_examples or total, total)

  def host_batch(step, run_seed=None, rows=slice(None)):
    # Training draws indices uniformly from the whole (virtual) 60M-example set; the
    # overlays themselves are always generated from the pipeline's own `seed`.
    order_seed = seed if run_seed is None else run_seed
    return (np.random.default_rng([order_seed, step]).integers(0, total, batch_size)[rows],)

  def eval_batches(eval_batch_size, rows=slice(None), padded_size=None):
    # Indices 0..n−1: with index mod N as the first digit, a subset of n ≤ N examples
    # still uses n different source digits.
    for start in range(0, num_examples, eval_batch_size):
      indices, weights = _batch_rows(num_examples, start, eval_batch_size, rows, padded_size)
      yield (indices,), weights

  def device_batch(source, batch, key):
    del key  # every random choice is a function of (seed, index)
    images, labels, digits = multimnist.generate(source, seed, batch[0])
    return {'images': images, 'labels': labels, 'digits': digits}

  return Pipeline(num_examples, source, host_batch, eval_batches, device_batch)


# ----------------------------------------------------------------------------- host memory

def images_on_demand(host_images: str = 'auto') -> bool:
  """config.host_images: 'memory' loads each split whole; 'rows' reads only the rows a
  process's batches use (capsjax.data.rows); 'auto' is 'rows' on several processes."""
  return host_images == 'rows' or (host_images == 'auto' and jax.process_count() > 1)
