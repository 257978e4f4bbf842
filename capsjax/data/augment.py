"""On-device preprocessing and augmentation: pure functions of (images, key), so a
training batch is a function of (seed, step) wherever it is built."""
from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array


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


def standardize(images: Array) -> Array:
  """Per image: zero mean, unit variance, the deviation floored at 1/√pixels
  (tf.image.per_image_standardization)."""
  count = images[0].size
  mean = jnp.mean(images, axis=(1, 2, 3), keepdims=True)
  std = jnp.maximum(jnp.std(images, axis=(1, 2, 3), keepdims=True), 1.0 / jnp.sqrt(count))
  return (images - mean) / std


def prepare(images_uint8: Array, preprocessing, key: Optional[Array] = None, max_shift: int = 0):
  """A dataset's stored images → (model inputs, reconstruction targets in [0, 1]).

  `preprocessing` is a capsjax.data.datasets.Preprocessing. With `key` (training) the
  random steps run, a pure function of the key: crop, flip, brightness, contrast, shifts
  of up to `max_shift` px; without it (evaluation) the central crop only.
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
    images = random_shift(images, key, max_shift)   # the key itself: MNIST's stream is unchanged
  targets = jnp.clip(images, 0.0, 1.0)
  return (standardize(images) if preprocessing.standardize else images), targets
