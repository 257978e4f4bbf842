"""A split's images read on demand: what one process of a multi-host run holds.

With `config.host_images='rows'` (the default `'auto'` on several processes) a split is
not loaded: its images stay in TFDS's array_record files (or a memory-mapped IDX file)
and each process reads only the rows of each global batch it feeds to its devices
(`capsjax.sharding.process_rows`). Labels are small and are read once.
"""
from typing import Callable, Optional, Tuple

import numpy as np

from capsjax import console
from capsjax.keys import key, one_of

# config.host_images: 'memory' (each split whole), 'rows' (on demand), 'auto' (rows on
# several processes).
HOST_IMAGES = ('auto', 'memory', 'rows')
KEYS = (
    key('host_images', 'auto', one_of(HOST_IMAGES), "host memory: memory loads each split whole (uint8); rows "
        "reads only the rows of each batch this process feeds its devices (TFDS array_record or an uncompressed IDX "
        'file); auto: rows on several processes (multi-host)'),
)

# Rows read per call when a whole split is loaded: bounds the decoded examples held at
# once besides the uint8 array they are copied into.
CHUNK_ROWS = 4096


class ImageRows:
  """uint8 images [n, h, w, c] that reads only the rows asked for.

  Indexing with an integer array (or a list) reads those rows and returns a numpy
  array, as numpy would; a slice returns another ImageRows over those rows without
  reading anything. `np.asarray` reads every row (in chunks of CHUNK_ROWS).
  `rows_read` counts the rows read so far, views included.
  """

  def __init__(self, read: Callable[[np.ndarray], np.ndarray], row_shape: Tuple[int, ...],
               ids: Optional[np.ndarray] = None, num_rows: int = 0, _counter=None):
    self._read = read     # row ids (int64 [k]) → uint8 [k, *row_shape]
    self._row_shape = tuple(row_shape)
    self._ids = np.arange(num_rows, dtype=np.int64) if ids is None else ids
    self._counter = _counter if _counter is not None else [0]   # shared with views

  @property
  def shape(self) -> Tuple[int, ...]:
    return (len(self._ids),) + self._row_shape

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(np.uint8)

  @property
  def ndim(self) -> int:
    return 1 + len(self._row_shape)

  @property
  def rows_read(self) -> int:
    return self._counter[0]

  def __len__(self) -> int:
    return len(self._ids)

  def __getitem__(self, index):
    if isinstance(index, slice):
      return ImageRows(self._read, self._row_shape, self._ids[index], _counter=self._counter)
    ids = self._ids[np.asarray(index, dtype=np.int64)]
    if ids.ndim != 1:
      raise IndexError('ImageRows takes a slice or a 1-D array of row indices')
    self._counter[0] += len(ids)
    if not len(ids):
      return np.zeros((0,) + self._row_shape, np.uint8)
    images = np.asarray(self._read(ids), np.uint8)
    assert images.shape == (len(ids),) + self._row_shape, images.shape
    return images

  def __iter__(self):
    """Each image (uint8 [h, w, c]) in order, as iterating an array gives them; read
    CHUNK_ROWS at a time."""
    for start in range(0, len(self), CHUNK_ROWS):
      yield from self[np.arange(start, min(start + CHUNK_ROWS, len(self)))]

  def __array__(self, dtype=None, copy=None):
    del copy  # always a new array
    images = self.read_all()
    return images if dtype is None else images.astype(dtype)

  def read_all(self, what: Optional[str] = None) -> np.ndarray:
    """Every row, in chunks of CHUNK_ROWS; `what`: a progress bar of that name."""
    images = np.empty(self.shape, np.uint8)
    with console.progress(what=what or '', total=len(self), unit='images', disable=what is None) as bar:
      for start in range(0, len(self), CHUNK_ROWS):
        images[start:start + CHUNK_ROWS] = self[np.arange(start, min(start + CHUNK_ROWS, len(self)))]
        bar.update(min(CHUNK_ROWS, len(self) - start))
    return images
