"""On-device preprocessing and augmentation: pure functions of (images, key), so a
training batch is a function of (seed, step) wherever it is built."""
import math
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

from capsjax.data import affine
from capsjax.keys import key, int_in, number_in, section_defaults

Array = jax.Array

KEYS = (
    # config.augment: training augmentation beyond the paper's shifts (all off: the paper's
    # recipe). rotation in degrees either way, scale as the largest fraction either way, shear
    # as the largest shear factor either way; an elastic distortion of elastic_alpha px smoothed
    # over elastic_sigma px (Simard, Steinkraus, Platt 2003 used 34 and 4 on MNIST).
    # augment: training augmentation beyond the shifts (all 0: the paper's recipe)
    key('augment.rotation', 0.0, number_in(0, 180), 'training images rotated by up to ± this many degrees'),
    key('augment.scale', 0.0, number_in(0, 1, high_open=True), 'training images scaled by a factor in '
        '[1 − scale, 1 + scale]'),
    key('augment.shear', 0.0, number_in(0, 1), 'training images sheared by a factor in [−shear, shear]'),
    key('augment.elastic_alpha', 0.0, number_in(0, math.inf), 'elastic distortion of training images: '
        'displacements of this many pixels (0: none)'),
    key('augment.elastic_sigma', 4.0, number_in(0, math.inf, low_open=True), 'elastic distortion: the Gaussian '
        'smoothing of the displacement field, in pixels'),
    # The augmentation of the strongest MNIST capsule results (Byerly, Kalganova, Dear 2020, "No
    # routing needed between capsules"; reused by Efficient-CapsNet), each a key of its own,
    # drawn as their code draws it (github.com/AdamByerly/BMCNNwHFCs, python/input/).
    key('augment.rotation_std', 0.0, number_in(0, 90), 'a random half of the training images rotated by an '
        'angle drawn from a normal of this std in degrees, clipped at ± 3 std (0: none; Byerly et al.: 10)'),
    key('augment.margin_shift', 0.0, number_in(0, 1), 'training images shifted by whole pixels, each axis by a '
        'half-normal share (std 0.33, below 1) of the free margin around their ink on a random side, times this '
        '(0: none; Byerly et al.: 1)'),
    key('augment.squish', 0, int_in(0, 16), 'training images squeezed horizontally by 1 … this many pixels, '
        'fewer more often (a half-normal share, std 0.33; 0: none; Byerly et al.: 7 of 28)'),
    key('augment.erase', 0, int_in(0, 16), 'one random square of this side in pixels set to 0 in each '
        'training image, away from the border (0: none; Byerly et al.: 4)'),
)
AUGMENT = section_defaults(KEYS, 'augment')


def shift_image(image: Array, dy: Array, dx: Array, max_shift: int) -> Array:
  """Translate one image [h, w, c] by (dy, dx) pixels with zero fill; |dy|, |dx| ≤ max_shift."""
  height, width, channels = image.shape
  padded = jnp.pad(image, ((max_shift, max_shift), (max_shift, max_shift), (0, 0)))
  # Moving the content down/right by d means reading the padded image from (m − d).
  return jax.lax.dynamic_slice(padded, (max_shift - dy, max_shift - dx, 0), (height, width, channels))


def random_shift(images: Array, key: Array, max_shift: int) -> Array:
  """Shift every image [batch, h, w, c] independently by up to ±max_shift px in each axis."""
  if max_shift == 0:
    return images
  shifts = jax.random.randint(key, (images.shape[0], 2), -max_shift, max_shift + 1)  # [batch, 2]
  return jax.vmap(shift_image, in_axes=(0, 0, 0, None))(images, shifts[:, 0], shifts[:, 1], max_shift)


# ----------------------------------------------------------------------------- crops, flips, jitter
# Every function maps a batch [batch, h, w, c] of floats in [0, 1] (or standardised) and,
# where random, one key to a batch; each image draws its own values.

def resize(images: Array, side: int) -> Array:
  """Bilinear, anti-aliased resize to side × side."""
  batch, _, _, channels = images.shape
  return jax.image.resize(images, (batch, side, side, channels), 'bilinear', antialias=True)


def center_crop(images: Array, side: int) -> Array:
  _, height, width, _ = images.shape
  top, left = (height - side) // 2, (width - side) // 2
  return images[:, top:top + side, left:left + side, :]


def random_crop(images: Array, key: Array, side: int) -> Array:
  """A side × side window at a uniformly random position per image."""
  batch, height, width, channels = images.shape
  tops = jax.random.randint(jax.random.fold_in(key, 0), (batch,), 0, height - side + 1)
  lefts = jax.random.randint(jax.random.fold_in(key, 1), (batch,), 0, width - side + 1)
  crop = lambda image, top, left: jax.lax.dynamic_slice(image, (top, left, 0), (side, side, channels))
  return jax.vmap(crop)(images, tops, lefts)


def random_flip(images: Array, key: Array) -> Array:
  """Left-right mirror of each image with probability 1/2."""
  flip = jax.random.bernoulli(key, 0.5, (images.shape[0], 1, 1, 1))
  return jnp.where(flip, images[:, :, ::-1, :], images)


def random_brightness(images: Array, key: Array, max_delta: float) -> Array:
  """Adds one uniform delta in [−max_delta, max_delta] per image (tf.image.random_brightness)."""
  delta = jax.random.uniform(key, (images.shape[0], 1, 1, 1), minval=-max_delta, maxval=max_delta)
  return images + delta


def random_contrast(images: Array, key: Array, lower: float, upper: float) -> Array:
  """Scales each channel's deviation from its mean by one factor in [lower, upper] per
  image (tf.image.random_contrast)."""
  factor = jax.random.uniform(key, (images.shape[0], 1, 1, 1), minval=lower, maxval=upper)
  mean = jnp.mean(images, axis=(1, 2), keepdims=True)        # [batch, 1, 1, channels]
  return (images - mean) * factor + mean


def affine_warp(image: Array, rotation_degrees: Array, factor: Array, shear: Array) -> Array:
  """One image [h, w, c] rotated by `rotation_degrees` (clockwise on screen: rows grow
  downwards), scaled by `factor` and sheared by `shear` about its centre (bilinear, zero
  fill; capsjax.data.affine.warp)."""
  matrix = affine.affine_matrix(jnp.deg2rad(rotation_degrees), shear, factor, factor)
  return affine.warp(image, matrix, jnp.zeros(2))


def random_affine(images: Array, key: Array, rotation: float, scale: float, shear: float) -> Array:
  """Each image [batch, h, w, c] rotated by up to ±`rotation` degrees, scaled by a factor in
  [1 − scale, 1 + scale] and sheared by a factor in [−shear, shear], drawn per image."""
  batch = images.shape[0]
  draw = lambda index, bound, centre=0.0: jax.random.uniform(
      jax.random.fold_in(key, index), (batch,), minval=centre - bound, maxval=centre + bound)
  return jax.vmap(affine_warp)(images, draw(0, rotation), draw(1, scale, 1.0), draw(2, shear))


def gaussian_smoothing_matrix(size: int, sigma: float) -> np.ndarray:
  """[size, size]: row i holds the normalised Gaussian weights of every position around i
  (zero beyond the edges), so that M @ field smooths a field along that axis."""
  offsets = np.arange(size)[:, None] - np.arange(size)[None, :]
  radius = int(np.ceil(3 * sigma))
  weights = np.exp(-0.5 * (offsets / sigma) ** 2) * (np.abs(offsets) <= radius)
  kernel_sum = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2).sum()
  return (weights / kernel_sum).astype(np.float32)


def displacement_fields(key: Array, shape, alpha: float, sigma: float) -> Array:
  """[batch, 2, h, w] (rows, columns) of `shape` = (batch, h, w): uniform noise in [−1, 1],
  smoothed along both axes by a Gaussian of `sigma` px, times `alpha` px."""
  batch, height, width = shape
  smooth_rows, smooth_cols = gaussian_smoothing_matrix(height, sigma), gaussian_smoothing_matrix(width, sigma)
  # Drawn as a vector and reshaped: the same numbers (each depends on the key and its
  # row-major index alone), and XLA:CPU compiles a rank-4 draw ~10x slower (docs/results.md).
  noise = jax.random.uniform(key, (batch * 2 * height * width,), minval=-1.0, maxval=1.0)
  noise = noise.reshape(batch, 2, height, width)                                    # [batch, 2, h, w]
  return alpha * jnp.einsum('hi,bdij,wj->bdhw', smooth_rows, noise, smooth_cols)


def elastic_distortion(images: Array, key: Array, alpha: float, sigma: float) -> Array:
  """Each image [batch, h, w, c] resampled (bilinear, zero fill) at its pixel positions plus
  a displacement field: uniform in [−1, 1] per pixel and axis, smoothed by a Gaussian of
  `sigma` px, times `alpha` px (Simard et al. 2003)."""
  batch, height, width, _ = images.shape
  fields = displacement_fields(key, (batch, height, width), alpha, sigma)           # [batch, 2, h, w]
  rows, cols = jnp.meshgrid(jnp.arange(height, dtype=jnp.float32), jnp.arange(width, dtype=jnp.float32),
                            indexing='ij')

  def one(image, field):
    sample = lambda channel: jax.scipy.ndimage.map_coordinates(
        channel, [rows + field[0], cols + field[1]], order=1, mode='constant', cval=0.0)
    return jax.vmap(sample, in_axes=-1, out_axes=-1)(image)                      # [h, w, c]
  return jax.vmap(one)(images, fields)


# ----------------------------------------------------------------------------- Byerly et al.'s
# The augmentation of the strongest MNIST capsule results (Byerly, Kalganova, Dear 2020,
# "No routing needed between capsules"; reused by Efficient-CapsNet), each its own key,
# with the distributions of their code (github.com/AdamByerly/BMCNNwHFCs,
# python/input/input_pipeline_base.py and MNIST_input_pipeline.py): there every amount is
# min(|N(0, 0.33)|, 0.9999) of its range. Interpolation differs: bilinear here, OpenCV's
# and TensorFlow's Lanczos there.

def _half_normal_share(key: Array, shape) -> Array:
  """min(|N(0, 0.33)|, 0.9999): Byerly et al.'s share of a range (mean ≈ 0.26)."""
  return jnp.minimum(jnp.abs(0.33 * jax.random.normal(key, shape)), 0.9999)


def random_normal_rotation(images: Array, key: Array, std: float) -> Array:
  """A random half of the images [batch, h, w, c] rotated by an angle drawn from a normal
  of `std` degrees clipped at ±3 std (theirs: 30° × N(0, 0.33) clipped at ±0.9999); the
  other half unchanged."""
  batch = images.shape[0]
  rotate = jax.random.bernoulli(jax.random.fold_in(key, 0), 0.5, (batch,))
  angles = jnp.clip(std * jax.random.normal(jax.random.fold_in(key, 1), (batch,)), -3 * std, 3 * std)
  ones, zeros = jnp.ones(batch), jnp.zeros(batch)
  rotated = jax.vmap(affine_warp)(images, angles, ones, zeros)
  return jnp.where(rotate[:, None, None, None], rotated, images)


def ink_margins(image: Array, threshold: float = 0.0) -> Array:
  """(top, bottom, left, right): the empty rows and columns around the ink (pixels above
  `threshold`) of one image [h, w, c]; an image without ink has no margin."""
  height, width = image.shape[:2]
  x_min, x_max, y_min, y_max = affine.ink_box(image, threshold)
  margins = jnp.stack([y_min, height - 1 - y_max, x_min, width - 1 - x_max])
  return jnp.where(jnp.any(image > threshold), margins, 0)


def random_margin_shift(images: Array, key: Array, fraction: float) -> Array:
  """Each image [batch, h, w, c] shifted by a whole number of pixels in each axis, toward a
  random side, by a half-normal share of the free margin on that side of its ink times
  `fraction` (the ink stays inside): theirs with `fraction` 1, floor(share × (margin + 1))
  down or right, floor(−share × margin) up or left."""
  batch, height, width, _ = images.shape
  margins = jax.vmap(ink_margins)(images).astype(jnp.float32)        # [batch, 4]
  share = fraction * _half_normal_share(jax.random.fold_in(key, 0), (batch, 2))   # [batch, (rows, columns)]
  forward = jax.random.bernoulli(jax.random.fold_in(key, 1), 0.5, (batch, 2))
  shifts = jnp.where(forward, jnp.floor(share * (margins[:, jnp.array([1, 3])] + 1)),
                     jnp.floor(-share * margins[:, jnp.array([0, 2])])).astype(jnp.int32)   # [batch, 2]
  side = max(height, width)
  return jax.vmap(shift_image, in_axes=(0, 0, 0, None))(images, shifts[:, 0], shifts[:, 1], side)


def random_squish(images: Array, key: Array, most: int) -> Array:
  """Each image [batch, h, w, c] squeezed horizontally by floor(share × `most`) + 1 pixels,
  1 … `most` (a half-normal share: fewer more often), about its centre (bilinear, zero
  fill; theirs resizes the image narrower and pads it back, its offset ±1 px)."""
  batch, _, width, _ = images.shape
  most = jnp.asarray(most, jnp.int32)
  pixels = jnp.floor(_half_normal_share(key, (batch,)) * most.astype(jnp.float32)) + 1.0
  factors = jnp.where(most >= 1, (width - pixels) / width, 1.0)   # a traced 0 (a recipe member): unchanged

  def squish(image, factor):
    matrix = affine.affine_matrix(jnp.zeros(()), jnp.zeros(()), factor, jnp.ones(()))
    return affine.warp(image, matrix, jnp.zeros(2))
  return jax.vmap(squish)(images, factors)


def _corner_range(size: int, side: Array):
  """Where an erased square's corner may lie: `side` … size − side − 2 (theirs: 4 … 22 of 28,
  the square away from the border), or anywhere it fits where that range is empty."""
  low, high = side, size - side - 1   # randint's high is exclusive
  inside = high > low
  return jnp.where(inside, low, 0), jnp.where(inside, high, size - side + 1)


def random_erase(images: Array, key: Array, side: int) -> Array:
  """One side × side square of each image [batch, h, w, c] set to 0 at a uniform position
  away from the border (`_corner_range`)."""
  batch, height, width, _ = images.shape
  side = jnp.asarray(side, jnp.int32)
  tops = jax.random.randint(jax.random.fold_in(key, 0), (batch, 1, 1), *_corner_range(height, side))
  lefts = jax.random.randint(jax.random.fold_in(key, 1), (batch, 1, 1), *_corner_range(width, side))
  rows, columns = jnp.arange(height)[None, :, None], jnp.arange(width)[None, None, :]
  inside = (rows >= tops) & (rows < tops + side) & (columns >= lefts) & (columns < lefts + side)   # [batch, h, w]
  return jnp.where(inside[..., None], 0.0, images)


def augment(images: Array, key: Array, options: Dict[str, Any], strengths: Optional[Dict[str, Any]] = None) -> Array:
  """`options` (config.augment) applied to a training batch: Byerly et al.'s normal
  rotation and squish, the affine part, the elastic part, the shift within the ink's
  margin, then the erased square; a part whose size is 0 is skipped. `strengths`: traced
  sizes of a recipe member (capsjax.ensembles) used in place of `options`' in the parts
  `options` runs (a member's 0 leaves its images as they are, up to interpolation)."""
  value = options if strengths is None else {**options, **strengths}
  if options.get('rotation_std'):
    images = random_normal_rotation(images, jax.random.fold_in(key, 2), value['rotation_std'])
  if options.get('squish'):
    images = random_squish(images, jax.random.fold_in(key, 3), value['squish'])
  if options.get('rotation') or options.get('scale') or options.get('shear'):
    images = random_affine(images, jax.random.fold_in(key, 0), value.get('rotation', 0.0),
                           value.get('scale', 0.0), value.get('shear', 0.0))
  if options.get('elastic_alpha'):
    images = elastic_distortion(images, jax.random.fold_in(key, 1), value['elastic_alpha'],
                                options.get('elastic_sigma', AUGMENT['elastic_sigma']))
  if options.get('margin_shift'):
    images = random_margin_shift(images, jax.random.fold_in(key, 4), value['margin_shift'])
  if options.get('erase'):
    images = random_erase(images, jax.random.fold_in(key, 5), value['erase'])
  return images


def standardize(images: Array) -> Array:
  """Per image: zero mean, unit variance, the deviation floored at 1/√pixels
  (tf.image.per_image_standardization)."""
  count = images[0].size
  mean = jnp.mean(images, axis=(1, 2, 3), keepdims=True)
  std = jnp.maximum(jnp.std(images, axis=(1, 2, 3), keepdims=True), 1.0 / jnp.sqrt(count))
  return (images - mean) / std


def prepare(images_uint8: Array, preprocessing, key: Optional[Array] = None, max_shift: int = 0,
            augmentation: Optional[Dict[str, Any]] = None, strengths: Optional[Dict[str, Any]] = None):
  """A dataset's stored images → (model inputs, reconstruction targets in [0, 1]).

  `preprocessing` is a capsjax.data.datasets.Preprocessing. With `key` (training) the
  random steps run, a pure function of the key: crop, flip, brightness, contrast,
  `augmentation` (config.augment: affine, elastic), shifts of up to `max_shift` px; without
  it (evaluation) the central crop only. The reconstruction target is the augmented image.
  """
  images = images_uint8.astype(jnp.float32) / 255.0
  if preprocessing.resize:
    images = resize(images, preprocessing.resize)
  if preprocessing.crop:
    images = (center_crop(images, preprocessing.crop) if key is None
              else random_crop(images, jax.random.fold_in(key, 1), preprocessing.crop))
  if key is not None:
    if preprocessing.flip:
      images = random_flip(images, jax.random.fold_in(key, 2))
    if preprocessing.brightness:
      images = random_brightness(images, jax.random.fold_in(key, 3), preprocessing.brightness)
    if preprocessing.contrast:
      images = random_contrast(images, jax.random.fold_in(key, 4), *preprocessing.contrast)
    if augmentation:
      images = augment(images, jax.random.fold_in(key, 5), augmentation, strengths)
    images = random_shift(images, key, max_shift)   # the key itself: MNIST's stream is unchanged
  targets = jnp.clip(images, 0.0, 1.0)
  return (standardize(images) if preprocessing.standardize else images), targets
