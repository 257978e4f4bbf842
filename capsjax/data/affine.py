"""Expanded MNIST (digits placed at random on a 40×40 canvas) and affNIST-style affine
test digits, generated on device from (seed, index); and a reader for real affNIST files.

Section 5.2 of the paper trains on "an MNIST digit placed randomly on a black background
of 40×40 pixels" and tests on affNIST. The affine test set here applies, to each MNIST
test digit centred on the 40×40 canvas, a random rotation, shear and independent x/y
scaling (ranges in the config, `AFFINE_RANGES` by default) followed by a random
translation that keeps the digit's ink inside the canvas.
"""
import os
from typing import Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from capsjax.errors import DataError

Array = jax.Array
CANVAS = 40

# Ranges of the random affine transformations (uniform in each). affNIST's page describes
# rotation, shear, independent vertical/horizontal scaling and translation; these bounds
# are the values quoted for it (rotation up to 20° either way, shear factor up to 0.2,
# scale 0.8–1.2), used as config defaults and reported with every result.
AFFINE_RANGES = {'rotation_degrees': 20.0, 'shear': 0.2, 'scale_min': 0.8, 'scale_max': 1.2}


def place(image: Array, top: Array, left: Array, canvas: int = CANVAS) -> Array:
  """A digit [h, w, c] pasted with its top-left corner at (top, left) on a zero canvas."""
  height, width, channels = image.shape
  background = jnp.zeros((canvas, canvas, channels), image.dtype)
  return jax.lax.dynamic_update_slice(background, image, (top, left, 0))


def random_place(image: Array, key: Array, canvas: int = CANVAS) -> Array:
  """Expanded MNIST: the digit at a uniformly random position on the canvas."""
  room = canvas - image.shape[0]
  top, left = jax.random.randint(key, (2,), 0, room + 1)
  return place(image, top, left, canvas)


def affine_matrix(rotation: Array, shear: Array, scale_x: Array, scale_y: Array) -> Array:
  """2×2 map in (x, y) coordinates: rotation · shear · scale (radians, shear factor)."""
  cos, sin = jnp.cos(rotation), jnp.sin(rotation)
  rotate = jnp.array([[cos, -sin], [sin, cos]])
  shear_matrix = jnp.array([[1.0, shear], [0.0, 1.0]])
  return rotate @ shear_matrix @ jnp.diag(jnp.stack([scale_x, scale_y]))


def warp(image: Array, matrix: Array, translation: Array) -> Array:
  """Output pixel p (x, y about the canvas centre) reads the input at A⁻¹(p − t), bilinear.

  image [h, w, c]; matrix [2, 2]; translation [2] as (x, y) pixels.
  """
  height, width, channels = image.shape
  centre = jnp.array([(width - 1) / 2.0, (height - 1) / 2.0])
  ys, xs = jnp.meshgrid(jnp.arange(height, dtype=jnp.float32), jnp.arange(width, dtype=jnp.float32),
                        indexing='ij')
  points = jnp.stack([xs.ravel(), ys.ravel()]) - centre[:, None] - translation[:, None]  # [2, h·w]
  # A⁻¹ in closed form (2×2): jnp.linalg.solve's LU and triangular-solve custom calls, batched
  # over images and members and run as two thunks at once, deadlocked XLA:CPU's thread pool
  # (jax 0.10.2, a 2-core machine: each waited on its own parallel map).
  (a, b), (c, d) = matrix[0], matrix[1]
  inverse = jnp.stack([jnp.stack([d, -b]), jnp.stack([-c, a])]) / (a * d - b * c)      # [2, 2]
  source = inverse @ points + centre[:, None]                                          # [2, h·w]
  sample = lambda channel: jax.scipy.ndimage.map_coordinates(
      channel, [source[1], source[0]], order=1, mode='constant', cval=0.0)
  warped = jax.vmap(sample, in_axes=-1, out_axes=-1)(image)                            # [h·w, c]
  return warped.reshape(height, width, channels)


def ink_box(image: Array, threshold: float = 0.0) -> Array:
  """(x_min, x_max, y_min, y_max) of the pixels above `threshold` (the whole image if none)."""
  ink = jnp.max(image, axis=-1) > threshold
  rows, cols = jnp.any(ink, axis=1), jnp.any(ink, axis=0)
  index_h, index_w = jnp.arange(image.shape[0]), jnp.arange(image.shape[1])
  y_min = jnp.min(jnp.where(rows, index_h, image.shape[0] - 1))
  y_max = jnp.max(jnp.where(rows, index_h, 0))
  x_min = jnp.min(jnp.where(cols, index_w, image.shape[1] - 1))
  x_max = jnp.max(jnp.where(cols, index_w, 0))
  return jnp.stack([x_min, x_max, y_min, y_max]).astype(jnp.float32)


def random_affine(image: Array, key: Array, ranges: Dict[str, float], canvas: int = CANVAS):
  """The digit [28, 28, c] centred on the canvas, then rotated, sheared, scaled and
  translated at random so that its transformed ink box stays inside the canvas.

  Returns (image [canvas, canvas, c], parameters [6]: rotation°, shear, scale_x,
  scale_y, t_x, t_y).
  """
  offset = (canvas - image.shape[0]) // 2
  centred = place(image, offset, offset, canvas)
  keys = jax.random.split(key, 6)
  rotation = jax.random.uniform(keys[0], (), minval=-1.0, maxval=1.0) * ranges['rotation_degrees']
  shear = jax.random.uniform(keys[1], (), minval=-1.0, maxval=1.0) * ranges['shear']
  scale_x, scale_y = (jax.random.uniform(k, (), minval=ranges['scale_min'], maxval=ranges['scale_max'])
                      for k in keys[2:4])
  matrix = affine_matrix(jnp.deg2rad(rotation), shear, scale_x, scale_y)
  # Where the ink box's corners land (about the canvas centre) bounds the translation.
  centre = (canvas - 1) / 2.0
  x_min, x_max, y_min, y_max = ink_box(centred)
  corners = jnp.array([[x_min, x_min, x_max, x_max], [y_min, y_max, y_min, y_max]]) - centre
  moved = matrix @ corners                                                              # [2, 4]
  low = -centre - jnp.min(moved, axis=1)     # most negative shift keeping the box inside
  high = centre - jnp.max(moved, axis=1)
  high = jnp.maximum(high, low)              # a box larger than the canvas: no translation room
  translation = low + jax.random.uniform(keys[4], (2,)) * (high - low)
  warped = warp(centred, matrix, translation)
  return warped, jnp.stack([rotation, shear, scale_x, scale_y, translation[0], translation[1]])


def example_keys(seed: int, indices: Array) -> Array:
  """One key per example index: the same index always gives the same example."""
  return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(seed), indices)


# ----------------------------------------------------------------------------- real affNIST

def load_affnist_mat(path: str) -> Tuple[np.ndarray, np.ndarray]:
  """Images uint8 [n, 40, 40, 1] and labels int32 [n] from one affNIST `.mat` file.

  The files hold a struct `affNISTdata` whose `image` field is [1600, n] (one image per
  column, each 40 rows of 40 pixels) and whose `label_int` is [1, n] (or [n, 1]).
  """
  import scipy.io  # pylint: disable=g-import-not-at-top
  if not os.path.isfile(path):
    raise DataError(f'affNIST file {path} does not exist')
  try:
    contents = scipy.io.loadmat(path)
  except Exception as e:  # scipy raises several types for non-MAT files
    raise DataError(f'{path} is not a readable MATLAB file ({type(e).__name__}: {e})') from None
  if 'affNISTdata' not in contents:
    raise DataError(f'{path} has no affNISTdata struct (found {sorted(k for k in contents if not k.startswith("__"))})')
  data = contents['affNISTdata']
  names = data.dtype.names or ()
  if 'image' not in names or 'label_int' not in names:
    raise DataError(f'{path}: affNISTdata lacks image/label_int (fields: {names})')
  images = np.asarray(data['image'][0, 0])
  labels = np.asarray(data['label_int'][0, 0]).reshape(-1).astype(np.int32)
  if images.ndim != 2 or images.shape[0] != CANVAS * CANVAS or images.shape[1] != len(labels):
    raise DataError(f'{path}: expected image [1600, n] and n labels, got {images.shape} and {len(labels)}')
  images = images.T.reshape(-1, CANVAS, CANVAS)[..., None].astype(np.uint8)
  return images, labels


def load_affnist_dir(directory: str) -> Tuple[np.ndarray, np.ndarray]:
  """All `.mat` files of a folder (affNIST's test set comes as test.mat or 1.mat … 32.mat)."""
  if not os.path.isdir(directory):
    raise DataError(f'affNIST directory {directory} does not exist')
  names = sorted((n for n in os.listdir(directory) if n.endswith('.mat')),
                 key=lambda n: (len(n), n))
  if not names:
    raise DataError(f'no .mat files in {directory}')
  parts = [load_affnist_mat(os.path.join(directory, n)) for n in names]
  return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
