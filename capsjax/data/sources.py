"""Where a run's images come from: registered sources, each describing itself.

A source is chosen from the config's data keys (`DataSpec`: dataset, data_dir,
tfds_data_dir, image_size) by the first registered kind that claims them:
- `image_folder` (config.dataset='image_folder'): config.data_dir in tfds.ImageFolder's
  layout, DIR/train/CLASS/*.png|jpg and DIR/test/CLASS/…;
- `idx_folder`: a folder of LeCun IDX files (config.data_dir) for the MNIST family;
- `tfds`: the described datasets (capsjax.data.datasets) and any other TFDS
  image-classification builder by name (`kmnist`, `emnist/digits`, …), downloaded and
  prepared on first use.
Each describes itself (`SourceInfo`: image shape, classes and their names,
preprocessing) before any image is read, and loads a split as `Dataset`: uint8 images
[n, h, w, c], either whole (numpy) or read on demand (`on_demand=True`:
capsjax.data.rows.ImageRows over TFDS's array_record files, a memory map of an
uncompressed IDX file, or the image files), so that a process of a multi-host run holds
only the rows it reads. config.image_size resizes every image to N×N (capsjax.data.images,
the same conversion `capsjax.predict` applies to a file).
"""
import collections
import contextlib
import dataclasses
import functools
import logging
import os
import random
import re
import socket
import urllib.parse
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from capsjax.data import images as image_files
from capsjax.data.datasets import DATASETS, Preprocessing, model_input_shape
from capsjax.data.idx import is_gzipped, map_idx, read_idx
from capsjax.data.rows import CHUNK_ROWS, ImageRows
from capsjax.errors import ConfigError, DataError
from capsjax.registry import Registry

_IDX_NAMES = {
    'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte'),
    'test': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'),
}


@dataclasses.dataclass(frozen=True)
class Dataset:
  """images uint8 [n, h, w, c] (numpy, or ImageRows read on demand); labels int32 [n]."""
  images: Any
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


def load_idx_split(data_dir: str, split: str, num_classes: int = 10, on_demand: bool = False) -> Dataset:
  """One split from LeCun-format IDX files in `data_dir`. With `on_demand`, an uncompressed
  image file is memory-mapped and read by rows (ImageRows); a gzipped one is read whole."""
  if not os.path.isdir(data_dir):
    raise DataError(f'data directory {data_dir} does not exist')
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


@contextlib.contextmanager
def _quiet_absl():
  logger = logging.getLogger('absl')
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


def _check_download_reachable(builder, hint: str, timeout_s: float = 5.0, url: str = '') -> None:
  """Fails fast when the builder's download host cannot be reached.

  TFDS retries every URL ten times with back-off (about 200 s offline for MNIST) before
  it reports; a DNS lookup plus one TCP connect says the same within seconds. `url`
  (capsjax.data.datasets' download_url) stands in where the builder names none.
  """
  url = getattr(builder, 'URL', None) or url   # the MNIST family's download folder
  if not url:
    return
  parsed = urllib.parse.urlparse(url)
  port = parsed.port or (443 if parsed.scheme == 'https' else 80)
  try:
    socket.create_connection((parsed.hostname, port), timeout=timeout_s).close()
  except OSError as e:
    raise DataError(f'TFDS cannot download {builder.name} from {parsed.hostname} '
                    f'({type(e).__name__}: {e}); offline, pass {hint}') from None


@functools.lru_cache(maxsize=16)
def tfds_builder(name: str, tfds_data_dir: Optional[str] = None):
  """TFDS's builder `name` (array_record files in `tfds_data_dir`); nothing is downloaded."""
  _quiet_tensorflow()
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  try:
    with _quiet_absl():   # TFDS warns about an empty version folder it just looked into
      return tfds.builder(name, data_dir=tfds_data_dir or None, file_format='array_record')
  except Exception as e:  # TFDS raises several types for unknown names and bad folders.
    raise DataError(f'TFDS has no dataset {name!r} ({type(e).__name__}: {str(e).splitlines()[0]})') from None


def _quiet_tensorflow() -> None:
  # TensorFlow (used by TFDS while preparing) prints start-up chatter; oneDNN's only
  # effect here would be on float rounding in ops TFDS does not use for MNIST.
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')


def load_tfds_split(name: str, split: str, tfds_data_dir: Optional[str] = None,
                    offline_hint: str = '--config.data_dir=DIR with the IDX files', image_keys=('image',),
                    label_key: str = 'label', download_url: str = '', on_demand: bool = False) -> Dataset:
  """One split through TFDS: downloaded and prepared on first use, then read back with
  `tfds.data_source` (array_record, random access, no TensorFlow at read time). The
  labels are read once without decoding any image; the images are decoded into one
  uint8 array (in chunks), or with `on_demand` only when rows are indexed.

  Preparation decodes the source files through `tf.io`, so it needs TensorFlow (the
  `tensorflow-cpu` dependency); later runs only read the prepared files.
  """
  _quiet_tensorflow()
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  builder = tfds_builder(name, tfds_data_dir or None)
  with _quiet_absl():
    prepared = builder.is_prepared()
  if not prepared:
    _check_download_reachable(builder, offline_hint, url=download_url)
    print(f'TFDS: downloading and preparing {name} in {builder.data_dir} (first use only)', flush=True)
    try:
      with _quiet_absl():   # e.g. "OpenCV is not installed … defaulting to PIL"
        builder.download_and_prepare()
    except Exception as e:  # network, checksum and TensorFlow errors all end here.
      first_line = str(e).splitlines()[0] if str(e) else ''
      raise DataError(f'TFDS could not prepare {name} ({type(e).__name__}: {first_line}); '
                      f'offline, pass {offline_hint}') from None
  try:
    source = builder.as_data_source(split=split)
    # The same records with the images left encoded: the labels cost no image decoding.
    undecoded = builder.as_data_source(split=split, decoders={key: tfds.decode.SkipDecoding()
                                                              for key in image_keys})
  except Exception as e:  # e.g. prepared earlier as TFRecord by another program.
    raise DataError(f'TFDS cannot read {name}:{split} from {builder.data_dir} '
                    f'({type(e).__name__}: {str(e).splitlines()[0]}); prepare it afresh in another '
                    '--config.tfds_data_dir') from None
  if not len(source):
    raise DataError(f'TFDS {name}:{split} is empty')
  labels = np.empty(len(source), np.int32)
  for start in range(0, len(labels), CHUNK_ROWS):   # bounded: the encoded images are large
    stop = min(start + CHUNK_ROWS, len(labels))
    labels[start:stop] = [int(example[label_key]) for example in undecoded.__getitems__(range(start, stop))]

  def read(ids: np.ndarray) -> np.ndarray:
    with _quiet_absl():   # "OpenCV is not installed … defaulting to PIL", once
      return np.stack([_stacked(example, image_keys) for example in source.__getitems__(ids.tolist())])

  images = ImageRows(read, read(np.zeros(1, np.int64)).shape[1:], num_rows=len(source))
  return Dataset(images if on_demand else np.asarray(images), labels)


def _stacked(example, image_keys) -> np.ndarray:
  """One example's images [h, w, c] with the features of `image_keys` stacked as channels."""
  parts = [np.asarray(example[key], np.uint8) for key in image_keys]
  return np.concatenate([p if p.ndim == 3 else p[..., None] for p in parts], axis=-1)


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


@dataclasses.dataclass(frozen=True)
class SourceInfo:
  """What a source says about itself: the images as the host holds them (after
  config.image_size), the classes, and how training and test inputs are made from them."""
  name: str
  image_shape: Tuple[int, int, int]   # [height, width, channels]
  class_names: Tuple[str, ...]
  preprocessing: Preprocessing = Preprocessing()

  @property
  def num_classes(self) -> int:
    return len(self.class_names)

  @property
  def input_shape(self) -> Tuple[int, int, int]:
    return model_input_shape(self.image_shape, self.preprocessing)


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
SOURCES = Registry('source', datasets=())


def register_source(kind: str, datasets: Tuple[str, ...] = ()) -> Callable[[type], type]:
  """Class decorator: a Source subclass of kind `kind`; `datasets` are the
  config.dataset names it serves (besides those its `claims` accepts)."""
  def register(cls):
    cls.kind = kind
    return SOURCES.register(kind, datasets=tuple(datasets))(cls)
  return register


def _named_datasets() -> Tuple[str, ...]:
  return tuple(name for entry in SOURCES.entries() for name in entry.datasets)


def dataset_names_help() -> str:
  named = ''.join(f'{name}, ' for name in _named_datasets())
  return (f'one of {", ".join(DATASETS)}, {named}{IMAGE_FOLDER} (the folder in data_dir) or any TFDS '
          'image-classification dataset name (kmnist, emnist/digits, …)')


def is_dataset_name(name) -> bool:
  return isinstance(name, str) and (name in DATASETS or name == IMAGE_FOLDER or name in _named_datasets()
                                    or bool(_TFDS_NAME.match(name)))


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


@register_source('image_folder')
class ImageFolderSource(Source):
  """config.data_dir in tfds.ImageFolder's layout: DIR/SPLIT/CLASS/IMAGE with SPLIT train and
  test. As tfds.ImageFolder: class names are the sorted class folder names of every split,
  .png/.jpg/.jpeg files are read (others ignored), and each split's files are put in a
  fixed shuffled order (random.Random(split)), so that a validation split held out from
  the end of the training split draws on every class."""

  @classmethod
  def claims(cls, spec):
    return spec.dataset == IMAGE_FOLDER

  def _root(self) -> str:
    if not self.spec.data_dir:
      raise ConfigError(f'config.dataset={IMAGE_FOLDER} reads the folder in --config.data_dir=DIR '
                        '(DIR/train/CLASS/*.png and DIR/test/CLASS/*.png)')
    return os.path.abspath(os.path.expanduser(self.spec.data_dir))

  def describe(self):
    root = self._root()
    scan = scan_image_folder(root)
    if self.spec.image_size:
      height = width = self.spec.image_size
    elif len(scan.sizes) > 1:
      shown = ', '.join(f'{w}×{h}' for w, h in sorted(scan.sizes)[:3]) + (', …' if len(scan.sizes) > 3 else '')
      raise DataError(f'the images in {root} have {len(scan.sizes)} sizes ({shown}): pass '
                      '--config.image_size=N to resize them all to N×N')
    else:
      (width, height), = scan.sizes
    return SourceInfo(os.path.basename(root) or root, (height, width, scan.channels), scan.class_names)

  def load(self, split, on_demand=False):
    root = self._root()
    scan = scan_image_folder(root)
    info = self.describe()
    files = scan.files[split]
    paths = [path for path, _ in files]
    labels = np.array([scan.class_names.index(label) for _, label in files], np.int32)

    def read(ids: np.ndarray) -> np.ndarray:
      return np.stack([image_files.read_image(paths[i], info.image_shape) for i in ids])

    images = ImageRows(read, info.image_shape, num_rows=len(paths))
    return _checked(Dataset(images if on_demand else np.asarray(images), labels), info, split)


@dataclasses.dataclass(frozen=True)
class FolderScan:
  files: Dict[str, List[Tuple[str, str]]]   # split → [(path, class name)] in a fixed shuffled order
  class_names: Tuple[str, ...]
  sizes: frozenset                          # {(width, height)} over every image
  channels: int                             # 1 if every image is grey, else 3


@functools.lru_cache(maxsize=4)
def scan_image_folder(root: str) -> FolderScan:
  """The files, classes, sizes and colour of an image folder (headers only)."""
  if not os.path.isdir(root):
    raise DataError(f'data directory {root} does not exist')
  missing = [split for split in SPLITS if not os.path.isdir(os.path.join(root, split))]
  if missing:
    raise DataError(f'{root} has no {" or ".join(missing)} folder: an image folder holds '
                    'train/CLASS/*.png and test/CLASS/*.png (or .jpg)')
  files, class_names = collections.defaultdict(list), set()
  sizes, channels = set(), 1
  for split in SPLITS:
    split_dir = os.path.join(root, split)
    for label in sorted(name for name in os.listdir(split_dir) if os.path.isdir(os.path.join(split_dir, name))):
      class_names.add(label)
      label_dir = os.path.join(split_dir, label)
      for name in sorted(os.listdir(label_dir)):
        if image_files.is_image_file(name):
          files[split].append((os.path.join(label_dir, name), label))
    if not files[split]:
      raise DataError(f'{split_dir} holds no .png or .jpg images in class folders (CLASS/IMAGE)')
    random.Random(split).shuffle(files[split])   # tfds.ImageFolder's order
    for path, _ in files[split]:
      with image_files.open_image(path) as image:
        sizes.add(image.size)
        channels = max(channels, image_files.channels_of(image.mode))
  return FolderScan(dict(files), tuple(sorted(class_names)), frozenset(sizes), channels)


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


@register_source('tfds')
class TfdsSource(Source):
  """A TFDS builder: one of the described datasets (capsjax.data.datasets: its splits,
  feature keys and preprocessing), or any other image-classification builder, described
  from its info (the image feature and the ClassLabel of its supervised keys)."""

  @classmethod
  def claims(cls, spec):
    return spec.dataset in DATASETS or bool(_TFDS_NAME.match(spec.dataset))

  def _reading(self):
    """(SourceInfo, TFDS name, TFDS split names, image keys, label key, download url, hint)."""
    spec = self.spec
    described = DATASETS.get(spec.dataset)
    if described is not None:
      hint = ('--config.data_dir=DIR with the IDX files' if described.idx_folder else
              f'--config.tfds_data_dir=DIR holding a prepared {described.tfds_name}')
      info = SourceInfo(spec.dataset, described.image_shape, described.class_names, described.preprocessing)
      return (with_image_size(info, spec.image_size), described.tfds_name, described.splits, described.image_keys,
              described.label_key, described.download_url, hint)
    builder = tfds_builder(spec.dataset, spec.tfds_data_dir or None)
    features = builder.info.features
    keys = builder.info.supervised_keys or ('image', 'label')
    image_key, label_key = (keys[0], keys[1]) if len(keys) >= 2 and isinstance(keys[0], str) else ('image', 'label')
    names = set(features.keys())
    image = features[image_key] if image_key in names else None
    label = features[label_key] if label_key in names else None
    if image is None or label is None or not hasattr(label, 'names') or len(getattr(image, 'shape', ())) != 3:
      raise DataError(f'TFDS {spec.dataset} is not an image-classification dataset (no image feature with a '
                      'class label among its supervised keys)')
    height, width, channels = image.shape
    if spec.image_size:
      height = width = spec.image_size
    elif height is None or width is None:
      raise DataError(f'TFDS {spec.dataset} has images of varying size: pass --config.image_size=N to resize '
                      'them all to N×N')
    info = SourceInfo(spec.dataset, (height, width, channels or 3), tuple(label.names))
    return (info, spec.dataset, SPLITS, (image_key,), label_key, '',
            f'--config.tfds_data_dir=DIR holding a prepared {spec.dataset}')

  def describe(self):
    return self._reading()[0]

  def load(self, split, on_demand=False):
    info, name, splits, image_keys, label_key, url, hint = self._reading()
    dataset = load_tfds_split(name, splits[SPLITS.index(split)], self.spec.tfds_data_dir, hint, image_keys,
                              label_key, url, on_demand)
    return _checked(_resized_dataset(dataset, self.spec.image_size), info, split)


def describe_source(spec: DataSpec) -> SourceInfo:
  return open_source(spec).describe()


def load_dataset(name: str, split: str, data_dir: str = '', tfds_data_dir: str = '',
                 on_demand: bool = False, image_size: int = 0) -> Dataset:
  """One split ('train' or 'test') of dataset `name` from its source (see the module
  docstring), checked against the source's description. `on_demand`: images read when
  indexed."""
  if split not in SPLITS:
    raise DataError(f'unknown split {split!r}')
  return open_source(DataSpec(name, data_dir, tfds_data_dir, image_size)).load(split, on_demand)
