"""Dataset splits on the host: TFDS by default, or a folder of IDX files.

Images are uint8 [n, h, w, c], either loaded whole (numpy) or read on demand
(`on_demand=True`: capsjax.data.rows.ImageRows over TFDS's array_record files or over a
memory map of an uncompressed IDX file), so that a process of a multi-host run holds
only the rows it reads."""
import contextlib
import dataclasses
import logging
import os
import socket
import urllib.parse
from typing import Any, Optional

import numpy as np

from capsjax.data.datasets import DATASETS, dataset_info
from capsjax.data.idx import is_gzipped, map_idx, read_idx
from capsjax.data.rows import CHUNK_ROWS, ImageRows
from capsjax.errors import DataError

_IDX_NAMES = {
    'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte'),
    'test': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'),
}
_SPLITS = tuple(_IDX_NAMES)   # the names callers use; DatasetInfo.splits has TFDS's


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
  # TensorFlow (used by TFDS while preparing) prints start-up chatter; oneDNN's only
  # effect here would be on float rounding in ops TFDS does not use for MNIST.
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  try:
    with _quiet_absl():   # TFDS warns about an empty version folder it just looked into
      builder = tfds.builder(name, data_dir=tfds_data_dir or None, file_format='array_record')
      prepared = builder.is_prepared()
  except Exception as e:  # TFDS raises several types for unknown names and bad folders.
    raise DataError(f'TFDS has no dataset {name!r} ({type(e).__name__}: {str(e).splitlines()[0]})') from None
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


def load_dataset(name: str, split: str, data_dir: str = '', tfds_data_dir: str = '',
                 on_demand: bool = False) -> Dataset:
  """One split of dataset `name` (see capsjax.data.datasets): from the IDX files in
  `data_dir` if given, else through TFDS; checked against the dataset's image shape and
  class count. `on_demand`: images read when indexed (see the module docstring)."""
  info = dataset_info(name)
  if split not in _IDX_NAMES:
    raise DataError(f'unknown split {split!r}')
  if data_dir:
    if not info.idx_folder:
      idx_ones = ', '.join(n for n, i in DATASETS.items() if i.idx_folder)
      raise DataError(f'{name} is read through TFDS only (an IDX folder serves {idx_ones}); '
                      'drop --config.data_dir')
    dataset = load_idx_split(os.path.expanduser(data_dir), split, info.num_classes, on_demand)
  else:
    offline = ('--config.data_dir=DIR with the IDX files' if info.idx_folder else
               f'--config.tfds_data_dir=DIR holding a prepared {info.tfds_name}')
    dataset = load_tfds_split(info.tfds_name, info.splits[_SPLITS.index(split)], tfds_data_dir, offline,
                              info.image_keys, info.label_key, info.download_url, on_demand)
  if dataset.images.shape[1:] != info.image_shape:
    raise DataError(f'{split} images have shape {dataset.images.shape[1:]}; {name} has {info.image_shape}')
  return dataset
