"""Reader for the IDX format of LeCun's MNIST files (gzipped or not), strict about its header.

Layout: two zero bytes, a type code, the number of dimensions n, then n big-endian uint32
sizes, then the data in C order (big-endian for multi-byte types).
"""
import gzip
import os
import zlib

import numpy as np

from capsjax.errors import DataError

_IDX_TYPES = {
    0x08: np.dtype('u1'), 0x09: np.dtype('i1'), 0x0B: np.dtype('>i2'),
    0x0C: np.dtype('>i4'), 0x0D: np.dtype('>f4'), 0x0E: np.dtype('>f8'),
}
_GZIP_MAGIC = b'\x1f\x8b'


def _read_bytes(path: str) -> bytes:
  try:
    with open(path, 'rb') as f:
      raw = f.read()
  except OSError as e:
    raise DataError(f'cannot read IDX file {path}: {e.strerror}') from None
  if raw[:2] == _GZIP_MAGIC:
    try:
      return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
      raise DataError(f'{path}: corrupt gzip stream ({e})') from None
  return raw


def _parse_header(raw: bytes, total_size: int, name: str):
  """(shape, dtype, header size) from the first bytes of an IDX file of `total_size` bytes."""
  if total_size < 4:
    raise DataError(f'{name}: too short for an IDX header ({total_size} bytes)')
  if raw[0] != 0 or raw[1] != 0:
    raise DataError(f'{name}: bad IDX magic number {raw[:4].hex()} (must start with 0000)')
  type_code, ndim = raw[2], raw[3]
  if type_code not in _IDX_TYPES:
    raise DataError(f'{name}: unknown IDX type code 0x{type_code:02x}')
  if ndim == 0:
    raise DataError(f'{name}: IDX file declares zero dimensions')
  header_size = 4 + 4 * ndim
  if total_size < header_size or len(raw) < header_size:
    raise DataError(f'{name}: truncated IDX header')
  shape = tuple(int.from_bytes(raw[4 + 4 * k: 8 + 4 * k], 'big') for k in range(ndim))
  dtype = _IDX_TYPES[type_code]
  expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  actual = total_size - header_size
  if actual != expected:
    raise DataError(f'{name}: IDX header declares shape {shape} ({expected} bytes of data) '
                    f'but the file holds {actual}')
  return shape, dtype, header_size


def parse_idx(raw: bytes, name: str = '<bytes>') -> np.ndarray:
  """Decode IDX bytes into an array, checking magic number and sizes."""
  shape, dtype, header_size = _parse_header(raw, len(raw), name)
  return np.frombuffer(raw, dtype=dtype, offset=header_size).reshape(shape).astype(dtype.newbyteorder('='))


def is_gzipped(path: str) -> bool:
  try:
    with open(path, 'rb') as f:
      return f.read(2) == _GZIP_MAGIC
  except OSError as e:
    raise DataError(f'cannot read IDX file {path}: {e.strerror}') from None


def map_idx(path: str) -> np.ndarray:
  """An uncompressed uint8 IDX file as a read-only memory map: rows are read from disk
  when indexed (a multi-host process touches only its own)."""
  name = os.path.basename(path)
  try:
    with open(path, 'rb') as f:
      header = f.read(4 + 4 * 255)
    total_size = os.path.getsize(path)
  except OSError as e:
    raise DataError(f'cannot read IDX file {path}: {e.strerror}') from None
  shape, dtype, header_size = _parse_header(header, total_size, name)
  if dtype != np.uint8 or total_size == header_size:
    return read_idx(path)   # multi-byte types need a byte-order conversion: read whole
  return np.memmap(path, dtype=np.uint8, mode='r', offset=header_size, shape=shape)


def read_idx(path: str) -> np.ndarray:
  return parse_idx(_read_bytes(path), os.path.basename(path))


def write_idx(path: str, array: np.ndarray, compress: bool = False) -> None:
  """Write an IDX file (used by the tests to make malformed and generated files)."""
  codes = {v.newbyteorder('='): k for k, v in _IDX_TYPES.items()}
  dtype = np.dtype(array.dtype).newbyteorder('=')
  if dtype not in codes:
    raise ValueError(f'no IDX type for {array.dtype}')
  code = codes[dtype]
  header = bytes([0, 0, code, array.ndim]) + b''.join(int(d).to_bytes(4, 'big') for d in array.shape)
  payload = header + np.ascontiguousarray(array).astype(_IDX_TYPES[code]).tobytes()
  opener = gzip.open if compress else open
  with opener(path, 'wb') as f:
    f.write(payload)


# The four MNIST files as TFDS's mnist builder downloads them, and from where.
MNIST_URL = 'https://storage.googleapis.com/cvdf-datasets/mnist/'
MNIST_FILES = ('train-images-idx3-ubyte.gz', 'train-labels-idx1-ubyte.gz', 't10k-images-idx3-ubyte.gz',
               't10k-labels-idx1-ubyte.gz')
MNIST_CACHE = os.path.join(os.path.expanduser('~'), '.cache', 'capsjax', 'mnist')


def find_mnist(candidates=()) -> str:
  """A folder of the MNIST IDX files for `config.data_dir`, found as the tests and the
  tutorials find it: $CAPSJAX_MNIST_DIR, else the first of `candidates` that exists, else
  ~/.cache/capsjax/mnist, downloaded there once. Offline without any: a DataError (one line).

  Example:
    >>> import os
    >>> from capsjax.data.idx import MNIST_FILES, find_mnist
    >>> sorted(set(MNIST_FILES) - set(os.listdir(find_mnist([mnist_dir]))))
    []
  """
  env = os.environ.get('CAPSJAX_MNIST_DIR')
  for folder in ([env] if env else []) + list(candidates):
    if os.path.isdir(folder):
      return folder
  import urllib.request  # pylint: disable=g-import-not-at-top
  os.makedirs(MNIST_CACHE, exist_ok=True)
  for name in MNIST_FILES:
    path = os.path.join(MNIST_CACHE, name)
    if os.path.isfile(path):
      continue
    try:
      with urllib.request.urlopen(MNIST_URL + name, timeout=60) as response:
        data = response.read()
    except OSError as e:
      raise DataError(f'MNIST IDX files are needed: set CAPSJAX_MNIST_DIR to a folder of them, or be online '
                      f'(downloading {MNIST_URL}{name} failed: {getattr(e, "reason", e)})') from None
    partial = f'{path}.{os.getpid()}.part'
    with open(partial, 'wb') as f:
      f.write(data)
    os.replace(partial, path)   # atomic: another process may download it too
  return MNIST_CACHE
