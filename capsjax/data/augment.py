"""On-device augmentation: pure functions of (images, key)."""
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
