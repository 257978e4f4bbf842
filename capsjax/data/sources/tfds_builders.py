"""The `tfds` source: the described datasets and any TFDS image-classification builder,
downloaded and prepared on first use, read from array_record files."""
import contextlib
import functools
import hashlib
import json
import logging
import os
import socket
import urllib.parse
from typing import Optional, Sequence

import numpy as np

from capsjax.data.datasets import DATASETS
from capsjax.data.rows import CHUNK_ROWS, ImageRows
from capsjax.errors import DataError
from capsjax.data.sources.core import (  # the core this kind builds on
    _TFDS_NAME, SPLITS, Dataset, Source, SourceInfo, _checked, _resized_dataset, register_source, with_image_size)


@contextlib.contextmanager
def _quiet_absl():
  logger = logging.getLogger('absl')
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


# What an offline error asks for, in the words of both callers: load_dataset's keyword and
# the commands' flag (a Python caller was once told only the flag).
IDX_HINT = "the IDX files' folder as data_dir (--config.data_dir=DIR)"


def tfds_hint(name: str) -> str:
  return f'a folder holding a prepared {name} as tfds_data_dir (--config.tfds_data_dir=DIR)'


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
                    offline_hint: str = IDX_HINT, image_keys=('image',),
                    label_key: str = 'label', download_url: str = '', on_demand: bool = False) -> Dataset:
  """One split through TFDS: downloaded and prepared on first use, then read back with
  `tfds.data_source` (array_record, random access, no TensorFlow at read time). A whole
  split is read in one pass (in chunks): each record's images decoded into one uint8 array
  and its label read. With `on_demand` the labels are read without decoding any image, and
  images only when rows are indexed. A whole split, once decoded, is kept beside the
  prepared files (`decoded_copy_path`) and later reads load that copy instead of decoding
  every image again.

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
  copy = None if on_demand else decoded_copy_path(builder, split, image_keys, label_key)
  if copy is not None:
    kept = _read_decoded_copy(copy, len(source))
    if kept is not None:
      return kept
  if not on_demand:
    dataset = _read_whole(source, image_keys, label_key)
    if copy is not None:
      _keep_decoded_copy(copy, dataset)
    return dataset
  labels = np.empty(len(source), np.int32)
  for start in range(0, len(labels), CHUNK_ROWS):   # bounded: the encoded images are large
    stop = min(start + CHUNK_ROWS, len(labels))
    labels[start:stop] = [int(example[label_key]) for example in undecoded.__getitems__(range(start, stop))]

  def read(ids: np.ndarray) -> np.ndarray:
    return _decoded_images(source, ids.tolist(), image_keys)[0]

  return Dataset(ImageRows(read, read(np.zeros(1, np.int64)).shape[1:], num_rows=len(source)), labels)


def _decoded_images(source, ids, image_keys):
  """(uint8 images [len(ids), h, w, c], the examples) of the records `ids` of `source`."""
  with _quiet_absl():   # "OpenCV is not installed … defaulting to PIL", once
    examples = source.__getitems__(ids)
    return np.stack([_stacked(example, image_keys) for example in examples]), examples


def _read_whole(source, image_keys, label_key: str) -> Dataset:
  """Every example of `source`, CHUNK_ROWS at a time, each record parsed once for its
  images and its label (a labels-only pass first parsed every record twice: MNIST's training
  split took 12.0-12.5 s, now 9.3-10.1 s; docs/results.md)."""
  images, labels = None, np.empty(len(source), np.int32)
  for start in range(0, len(source), CHUNK_ROWS):
    stop = min(start + CHUNK_ROWS, len(source))
    chunk, examples = _decoded_images(source, range(start, stop), image_keys)
    if images is None:
      images = np.empty((len(source),) + chunk.shape[1:], np.uint8)
    images[start:stop] = chunk
    labels[start:stop] = [int(example[label_key]) for example in examples]
  return Dataset(images, labels)


# The decoded copy of a split: `DECODED_COPY_PREFIX` + split + a digest of what it was
# decoded from (`decoded_copy_path`) + '.npz'. Decoding is per image in Python (TFDS's
# example parser and PIL), at every start of every run; the copy loads at disk speed
# (MNIST's training split: 21.3 s decoded, 0.044 s from the copy; AMD EPYC Zen 3, 2026-11-27).
DECODED_COPY_PREFIX = 'capsjax-decoded-'
# Changes when what a copy holds changes (its arrays' names, dtypes or layout).
DECODED_COPY_FORMAT = 1


def decoded_copy_path(builder, split: str, image_keys: Sequence[str], label_key: str) -> Optional[str]:
  """Where the decoded copy of `split` lives: in the prepared dataset's folder, named by a
  digest of the split's prepared files (names, sizes, modification times), the feature
  keys and the copy's format, so a dataset prepared again (or read with other keys) is
  decoded again. None where the files cannot be listed."""
  try:
    files = sorted(builder.info.splits[split].filepaths, key=str)
    stats = [(os.path.basename(str(path)), os.stat(path).st_size, os.stat(path).st_mtime_ns) for path in files]
  except Exception:  # pylint: disable=broad-except  (no such split or files: decode, keep nothing)
    return None
  if not stats:
    return None
  what = json.dumps([DECODED_COPY_FORMAT, split, list(image_keys), label_key, stats])
  digest = hashlib.sha256(what.encode()).hexdigest()[:16]
  return os.path.join(str(builder.data_dir), f'{DECODED_COPY_PREFIX}{_file_safe(split)}-{digest}.npz')


def _file_safe(split: str) -> str:
  return ''.join(c if c.isalnum() or c in '_.' else '_' for c in split)


def _read_decoded_copy(path: str, num_rows: int) -> Optional[Dataset]:
  """The copy at `path` if it is there, whole and of `num_rows` examples; else None (the
  split is then decoded again and the copy rewritten)."""
  try:
    with np.load(path, allow_pickle=False) as kept:
      images, labels = kept['images'], kept['labels']
  except Exception:  # pylint: disable=broad-except  (absent, truncated, not an npz: decode)
    return None
  if (len(images) != num_rows or len(labels) != num_rows or images.dtype != np.uint8 or images.ndim != 4
      or labels.dtype != np.int32):
    return None
  return Dataset(images, labels)


def _keep_decoded_copy(path: str, dataset: Dataset) -> None:
  """Writes the copy (to a temporary name, then renamed: a reader never sees half of one,
  and processes writing it at once each rename a whole one) and removes the split's older
  copies. Where the folder is not writable (a shared read-only TFDS folder, a full disk)
  nothing is kept and the run goes on: the next one decodes again."""
  temporary = f'{path}.{os.getpid()}.tmp'
  try:
    with open(temporary, 'wb') as f:
      np.savez(f, images=dataset.images, labels=dataset.labels)
    os.replace(temporary, path)
  except OSError:
    with contextlib.suppress(OSError):
      os.remove(temporary)
    return
  folder, name = os.path.split(path)
  split_prefix = name[:name.rindex('-') + 1]
  with contextlib.suppress(OSError):   # tidying only: a copy left behind is never read
    for other in os.listdir(folder):
      if other.startswith(split_prefix) and other.endswith('.npz') and other != name:
        os.remove(os.path.join(folder, other))


def _stacked(example, image_keys) -> np.ndarray:
  """One example's images [h, w, c] with the features of `image_keys` stacked as channels."""
  parts = [np.asarray(example[key], np.uint8) for key in image_keys]
  return np.concatenate([p if p.ndim == 3 else p[..., None] for p in parts], axis=-1)


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
      hint = IDX_HINT if described.idx_folder else tfds_hint(described.tfds_name)
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
    return (info, spec.dataset, SPLITS, (image_key,), label_key, '', tfds_hint(spec.dataset))

  def describe(self):
    return self._reading()[0]

  def load(self, split, on_demand=False):
    info, name, splits, image_keys, label_key, url, hint = self._reading()
    dataset = load_tfds_split(name, splits[SPLITS.index(split)], self.spec.tfds_data_dir, hint, image_keys,
                              label_key, url, on_demand)
    return _checked(_resized_dataset(dataset, self.spec.image_size), info, split)
