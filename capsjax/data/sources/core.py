"""The sources' core: Dataset, DataSpec, SourceInfo, the Source base class and its
registry, and the functions that open a source and load a split (the built-in kinds,
in their own modules, build on it; capsjax.data.sources re-exports it)."""
import dataclasses
import os
import re
from typing import Any, Callable, Tuple

import numpy as np

from capsjax.data import images as image_files
from capsjax.data.datasets import DATASETS, DescribesImages, Preprocessing
from capsjax.data.rows import ImageRows
from capsjax.errors import ArgumentError, ConfigError, DataError
from capsjax.keys import Rule, check_values, int_in, key, text
from capsjax.registry import Registry


@dataclasses.dataclass(frozen=True)
class Dataset:
  """images uint8 [n, h, w, c] (numpy, or ImageRows read on demand); labels int32 [n]."""
  images: Any
  labels: np.ndarray

  def __len__(self) -> int:
    return len(self.labels)

  def take(self, count: int) -> 'Dataset':
    return Dataset(self.images[:count], self.labels[:count])


# ----------------------------------------------------------------------------- sources

# config.dataset for an image folder (config.data_dir).
IMAGE_FOLDER = 'image_folder'
# What a TFDS builder's name looks like (name, optional /config and :version).
_TFDS_NAME = re.compile(r'^[a-z][a-z0-9_]*(/[a-z0-9_.\-]+)?(:[0-9.*]+)?$')
SPLITS = ('train', 'test')


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """Where a run's data comes from: the config's data keys and nothing else."""
  dataset: str
  data_dir: str = ''
  tfds_data_dir: str = ''
  image_size: int = 0            # > 0: every image resized to image_size × image_size
  background: str = image_files.DEFAULT_BACKGROUND   # what transparent pixels become (images.BACKGROUNDS)


@dataclasses.dataclass(frozen=True)
class SourceInfo(DescribesImages):
  """What a source says about itself: the images as the host holds them (after
  config.image_size), the classes, and how training and test inputs are made from them."""
  name: str
  image_shape: Tuple[int, int, int]   # [height, width, channels]
  class_names: Tuple[str, ...]
  preprocessing: Preprocessing = Preprocessing()
  background: str = image_files.DEFAULT_BACKGROUND   # transparency composited onto (capsjax.data.images)


class Source:
  """One kind of data source. `claims(spec)` says whether it reads `spec`; `describe()`
  is cheap (no image decoded beyond headers); `load(split)` reads a split."""

  def __init__(self, spec: DataSpec):
    self.spec = spec

  @classmethod
  def claims(cls, spec: DataSpec) -> bool:
    raise NotImplementedError

  def describe(self) -> SourceInfo:
    raise NotImplementedError

  def load(self, split: str, on_demand: bool = False) -> Dataset:
    raise NotImplementedError


# kind → Source subclass. Capability `datasets`: the config.dataset names the source
# serves by name (asked first, so a source registered outside the package is never
# shadowed by the built-in kinds); the others are asked in registration order.
SOURCES = Registry('source', datasets=(), doc="""The data sources by kind (`config.dataset` and
`config.data_dir` choose one; see capsjax.data.sources): each entry's value is a Source
class, and `datasets` the dataset names it serves by name. Add one with
`register_source`.

Example:
  >>> capsjax.SOURCES.names()
  ('image_folder', 'idx_folder', 'tfds')
""")


def register_source(kind: str, datasets: Tuple[str, ...] = ()) -> Callable[[type], type]:
  """Class decorator: a Source subclass of kind `kind`; `datasets` are the
  config.dataset names it serves (besides those its `claims` accepts). A Source says what
  it holds (`describe()` → SourceInfo: image shape [h, w, c], class names) and loads a
  split (`load(split)` → Dataset: uint8 images [n, h, w, c], int32 labels [n]). A config
  that imports the module then trains on it with `config.dataset = NAME`.

  Example:
    Two classes of synthetic images.

    >>> from capsjax.data.sources import Dataset, Source, SourceInfo
    >>> @capsjax.register_source('bright_or_dark', datasets=('bright_or_dark',))
    ... class BrightOrDark(Source):
    ...   def describe(self):
    ...     return SourceInfo('bright_or_dark', image_shape=(28, 28, 1), class_names=('dark', 'bright'))
    ...   def load(self, split, on_demand=False):
    ...     labels = np.arange(100, dtype=np.int32) % 2
    ...     images = np.broadcast_to(200 * labels[:, None, None, None], (100, 28, 28, 1))
    ...     return Dataset(images.astype(np.uint8), labels)
    >>> split = capsjax.load_dataset('bright_or_dark', 'train')
    >>> split.images.shape, split.labels[:4]
    ((100, 28, 28, 1), array([0, 1, 0, 1], dtype=int32))
    >>> capsjax.SOURCES.unregister('bright_or_dark')
  """
  if not isinstance(kind, str) or not kind:
    raise ArgumentError(f'register_source: the kind must be a non-empty string, got {kind!r}')
  if isinstance(datasets, str) or not all(isinstance(name, str) and name for name in datasets):
    raise ArgumentError(f'register_source: datasets takes a tuple of names, got {datasets!r}'
                        + (f' (one name: datasets=({datasets!r},))' if isinstance(datasets, str) else ''))

  def register(cls):
    if not (isinstance(cls, type) and issubclass(cls, Source)):
      raise ArgumentError(f'register_source({kind!r}) decorates a subclass of capsjax.data.sources.Source, got {cls!r}')
    cls.kind = kind
    return SOURCES.register(kind, datasets=tuple(datasets))(cls)
  return register


def _named_datasets() -> Tuple[str, ...]:
  return tuple(name for entry in SOURCES.entries() for name in entry.datasets)


def check_directory(path: str, what: str = 'data directory') -> None:
  """DataError naming what is wrong with a folder the config names (missing, or a file)."""
  if os.path.isdir(path):
    return
  if os.path.exists(path):
    raise DataError(f'{what} {path} is a file, not a directory')
  raise DataError(f'{what} {path} does not exist')


def dataset_names_help() -> str:
  named = ''.join(f'{name}, ' for name in _named_datasets())
  return (f'one of {", ".join(DATASETS)}, {named}{IMAGE_FOLDER} (the folder in data_dir) or any TFDS '
          'image-classification dataset name (kmnist, emnist/digits, …)')


def is_dataset_name(name) -> bool:
  return isinstance(name, str) and (name in DATASETS or name == IMAGE_FOLDER or name in _named_datasets()
                                    or bool(_TFDS_NAME.match(name)))


KEYS = (
    key('dataset', 'mnist', Rule(is_dataset_name, dataset_names_help), 'where the images come from: a TFDS name '
        '(TFDS downloads and prepares it on first use), or image_folder (the folder in data_dir)'),
    key('data_dir', '', text('a folder, or empty'), 'a folder read instead of TFDS: IDX files (MNIST family, '
        'offline), or with dataset=image_folder DIR/train/CLASS/*.png|jpg and DIR/test/CLASS/…; does not bind the workdir'),
    key('tfds_data_dir', '', text('a folder, or empty'), "TFDS's data folder (default ~/tensorflow_datasets); does "
        'not bind the workdir'),
    key('image_size', 0, int_in(0, 4096), '> 0: every image resized to N×N (needed for images of mixed sizes); 0: '
        'as stored'),
    key('class_names', (), Rule(lambda v: isinstance(v, (tuple, list)) and all(isinstance(x, str) and x for x in v),
                                'a tuple of class names (empty: from the data)'),
        'the class names written into results, figures and predictions; () = from the data (filled in when the '
        'run starts)'),
)


def open_source(spec: DataSpec) -> Source:
  """The source that serves spec.dataset by name, else the first registered kind that
  claims `spec`."""
  for entry in SOURCES.entries():
    if spec.dataset in entry.datasets:
      return entry.value(spec)
  for entry in SOURCES.entries():
    if not entry.datasets and entry.value.claims(spec):
      return entry.value(spec)
  raise ConfigError(f'config.dataset={spec.dataset!r}: allowed {dataset_names_help()}')


def with_image_size(info: SourceInfo, image_size: int) -> SourceInfo:
  if not image_size:
    return info
  return dataclasses.replace(info, image_shape=(image_size, image_size, info.image_shape[2]))


def _resized_dataset(dataset: Dataset, image_size: int) -> Dataset:
  """`dataset` with every image resized to image_size × image_size (when read, for
  images read on demand)."""
  if not image_size or tuple(dataset.images.shape[1:3]) == (image_size, image_size):
    return dataset
  images = dataset.images
  if isinstance(images, ImageRows):
    channels = images.shape[-1]
    resized = ImageRows(lambda ids, rows=images: image_files.resize_array(rows[ids], image_size),
                        (image_size, image_size, channels), num_rows=len(images))
    return Dataset(resized, dataset.labels)
  return Dataset(image_files.resize_array(np.asarray(images), image_size), dataset.labels)


def _checked(dataset: Dataset, info: SourceInfo, split: str) -> Dataset:
  if tuple(dataset.images.shape[1:]) != info.image_shape:
    raise DataError(f'{split} images have shape {tuple(dataset.images.shape[1:])}; {info.name} has '
                    f'{info.image_shape}')
  return dataset


def describe_source(spec: DataSpec) -> SourceInfo:
  return open_source(spec).describe()


def load_dataset(name: str, split: str, data_dir: str = '', tfds_data_dir: str = '',
                 on_demand: bool = False, image_size: int = 0) -> Dataset:
  """One split ('train' or 'test') of dataset `name` from its source (see the module
  docstring), checked against the source's description. `on_demand`: images read when
  indexed. Returns a Dataset: images uint8 [n, h, w, c], labels int32 [n].

  Example:
    `mnist_dir`: a folder of the MNIST IDX files; without it TFDS downloads MNIST.

    >>> test = capsjax.load_dataset('mnist', 'test', data_dir=mnist_dir)
    >>> test.images.shape, test.images.dtype, test.labels[:4]
    ((10000, 28, 28, 1), dtype('uint8'), array([7, 2, 1, 0], dtype=int32))
  """
  if split not in SPLITS:
    raise DataError(f'unknown split {split!r}: allowed {", ".join(SPLITS)}')
  # The arguments by the rules of the config keys they stand for (the command's words); a
  # pathlib folder is its path.
  data_dir, tfds_data_dir = (os.fspath(d) if isinstance(d, os.PathLike) else d for d in (data_dir, tfds_data_dir))
  arguments = {'dataset': name, 'data_dir': data_dir, 'tfds_data_dir': tfds_data_dir, 'image_size': image_size}
  problems = []
  check_values(arguments, {k.name: k for k in KEYS if k.name in arguments}, problems)
  if problems:
    raise ConfigError(problems[0])
  if not isinstance(on_demand, bool):   # ('no' is true: every image read on demand)
    raise ArgumentError(f'load_dataset: on_demand={on_demand!r}: allowed True or False')
  return open_source(DataSpec(name, data_dir, tfds_data_dir, image_size)).load(split, on_demand)

