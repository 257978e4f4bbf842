"""MNIST-family datasets as host numpy arrays: TFDS by default, or a folder of IDX files."""
import dataclasses
import os
from typing import Optional

import numpy as np

from capsjax.data.idx import read_idx
from capsjax.errors import DataError

_IDX_NAMES = {
    'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte'),
    'test': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'),
}


@dataclasses.dataclass(frozen=True)
class Dataset:
  """images uint8 [n, h, w, c]; labels int32 [n]."""
  images: np.ndarray
  labels: np.ndarray

  def __len__(self) -> int:
    return len(self.labels)

  def take(self, count: int) -> 'Dataset':
    return Dataset(self.images[:count], self.labels[:count])


def _find_idx_file(data_dir: str, stem: str) -> str:
  # LeCun's names, gzipped or not, and the variant with a dot before "idx".
  for name in (stem, stem + '.gz', stem.replace('-idx', '.idx'), stem.replace('-idx', '.idx') + '.gz'):
    path = os.path.join(data_dir, name)
    if os.path.isfile(path):
      return path
  raise DataError(f'no {stem}[.gz] in {data_dir}')


def load_idx_split(data_dir: str, split: str, num_classes: int = 10) -> Dataset:
  """One split from LeCun-format IDX files in `data_dir`."""
  if not os.path.isdir(data_dir):
    raise DataError(f'data directory {data_dir} does not exist')
  image_stem, label_stem = _IDX_NAMES[split]
  image_path = _find_idx_file(data_dir, image_stem)
  label_path = _find_idx_file(data_dir, label_stem)
  images, labels = read_idx(image_path), read_idx(label_path)
  if images.ndim != 3 or images.dtype != np.uint8:
    raise DataError(f'{image_path}: expected uint8 images [n, h, w], got {images.dtype} {images.shape}')
  if labels.ndim != 1:
    raise DataError(f'{label_path}: expected labels [n], got shape {labels.shape}')
  if len(images) != len(labels):
    raise DataError(f'{split} split: {len(images)} images but {len(labels)} labels')
  if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
    raise DataError(f'{label_path}: labels must lie in [0, {num_classes}), found {labels.min()}..{labels.max()}')
  return Dataset(images[..., None], labels.astype(np.int32))


def load_tfds_split(name: str, split: str, tfds_data_dir: Optional[str] = None) -> Dataset:
  """One split through `tfds.data_source` (array_record; no TensorFlow needed)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  try:
    source = tfds.data_source(name, split=split, data_dir=tfds_data_dir or None)
  except Exception as e:  # TFDS raises many types for "not prepared / not downloadable".
    raise DataError(f'TFDS could not provide {name}:{split} ({type(e).__name__}: {e}); '
                    f'offline, pass --config.data_dir=DIR with the IDX files') from None
  examples = [source[i] for i in range(len(source))]
  if not examples:
    raise DataError(f'TFDS {name}:{split} is empty')
  images = np.stack([np.asarray(ex['image'], np.uint8) for ex in examples])
  labels = np.asarray([int(ex['label']) for ex in examples], np.int32)
  if images.ndim == 3:
    images = images[..., None]
  return Dataset(images, labels)


def load_dataset(config, split: str, image_shape=None) -> Dataset:
  """The split named by the config: IDX folder if `config.data_dir`, else TFDS.

  Images must have `image_shape` (default: the model's input shape).
  """
  if split not in _IDX_NAMES:
    raise DataError(f'unknown split {split!r}')
  if config.data_dir:
    dataset = load_idx_split(config.data_dir, split, config.model.num_classes)
  else:
    dataset = load_tfds_split(config.dataset, split, config.tfds_data_dir)
  expected = tuple(image_shape or config.model.input_shape)
  if dataset.images.shape[1:] != expected:
    raise DataError(f'{split} images have shape {dataset.images.shape[1:]}, the experiment expects {expected}')
  return dataset
