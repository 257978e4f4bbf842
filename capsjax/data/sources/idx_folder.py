"""The `idx_folder` source: LeCun's IDX files of an MNIST-family dataset in config.data_dir."""
import os

import numpy as np

from capsjax.data.datasets import DATASETS
from capsjax.data.idx import is_gzipped, map_idx, read_idx
from capsjax.data.rows import ImageRows
from capsjax.errors import DataError
from capsjax.data.sources.core import (  # the core this kind builds on
    IMAGE_FOLDER, Dataset, check_directory, Source, SourceInfo, _checked, _resized_dataset, register_source, with_image_size)

_IDX_NAMES = {
    'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte'),
    'test': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'),
}


def _find_idx_file(data_dir: str, stem: str) -> str:
  # LeCun's names, gzipped or not, and the variant with a dot before "idx".
  for name in (stem, stem + '.gz', stem.replace('-idx', '.idx'), stem.replace('-idx', '.idx') + '.gz'):
    path = os.path.join(data_dir, name)
    if os.path.isfile(path):
      return path
  raise DataError(f'no {stem}[.gz] in {data_dir}')


def load_idx_split(data_dir: str, split: str, num_classes: int = 10, on_demand: bool = False) -> Dataset:
  """One split from LeCun-format IDX files in `data_dir`. With `on_demand`, an uncompressed
  image file is memory-mapped and read by rows (ImageRows); a gzipped one is read whole."""
  check_directory(data_dir)
  image_stem, label_stem = _IDX_NAMES[split]
  image_path = _find_idx_file(data_dir, image_stem)
  label_path = _find_idx_file(data_dir, label_stem)
  map_images = on_demand and not is_gzipped(image_path)
  images, labels = (map_idx(image_path) if map_images else read_idx(image_path)), read_idx(label_path)
  if images.ndim != 3 or images.dtype != np.uint8:
    raise DataError(f'{image_path}: expected uint8 images [n, h, w], got {images.dtype} {images.shape}')
  if labels.ndim != 1:
    raise DataError(f'{label_path}: expected labels [n], got shape {labels.shape}')
  if len(images) != len(labels):
    raise DataError(f'{split} split: {len(images)} images but {len(labels)} labels')
  if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
    raise DataError(f'{label_path}: labels must lie in [0, {num_classes}), found {labels.min()}..{labels.max()}')
  images = images[..., None]
  if map_images:
    images = ImageRows(lambda ids, mapped=images: mapped[ids], images.shape[1:], num_rows=len(images))
  return Dataset(images, labels.astype(np.int32))


@register_source('idx_folder')
class IdxFolderSource(Source):
  """config.data_dir holding LeCun's IDX files of an MNIST-family dataset."""

  @classmethod
  def claims(cls, spec):
    return bool(spec.data_dir)

  def describe(self):
    described = DATASETS.get(self.spec.dataset)
    if described is None or not described.idx_folder:
      idx_ones = ', '.join(n for n, i in DATASETS.items() if i.idx_folder)
      raise DataError(f'{self.spec.dataset} is read through TFDS only (an IDX folder serves {idx_ones}; '
                      f'an image folder needs --config.dataset={IMAGE_FOLDER}); drop --config.data_dir')
    return with_image_size(SourceInfo(self.spec.dataset, described.image_shape, described.class_names,
                                 described.preprocessing), self.spec.image_size)

  def load(self, split, on_demand=False):
    info = self.describe()
    dataset = load_idx_split(os.path.expanduser(self.spec.data_dir), split, info.num_classes, on_demand)
    return _checked(_resized_dataset(dataset, self.spec.image_size), info, split)
