"""MultiMNIST (section 6.1), generated on the fly on device from (seed, index).

Example `index` of a split with N source digits takes the source digit `index mod N`
(its "variant" is `index div N`; the paper makes 1K variants per digit, so the training
set has 60M and the test set 10M examples). It is overlaid with a second digit of a
different class from the same split; each digit is shifted by up to ±4 px in each
direction inside a 36×36 canvas, and the sum is clipped at 1. Everything random about
an example is drawn from `fold_in(key(seed), index)`, so an index always gives the same
example and nothing is stored.

Exported for inspection by `capsjax-multimnist` (capsjax/app/multimnist.py).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from capsjax.data.augment import shift_image
from capsjax.errors import ArgumentError

Array = jax.Array
CANVAS = 36
MAX_SHIFT = 4


@dataclasses.dataclass(frozen=True)
class SourceDigits:
  """One split's digits on device, with per-class index tables for drawing partners.

  images: uint8 [n, 28, 28, 1]; labels: int32 [n]; by_class: indices sorted by class [n];
  class_start / class_count: int32 [classes] offsets into by_class.
  """
  images: Array
  labels: Array
  by_class: Array
  class_start: Array
  class_count: Array

  @property
  def size(self) -> int:
    return int(self.labels.shape[0])


jax.tree_util.register_dataclass(
    SourceDigits, data_fields=['images', 'labels', 'by_class', 'class_start', 'class_count'],
    meta_fields=[])


def make_source(images: np.ndarray, labels: np.ndarray, num_classes: int = 10) -> SourceDigits:
  counts = np.bincount(labels, minlength=num_classes)
  if np.count_nonzero(counts) < 2:
    raise ArgumentError('MultiMNIST needs digits of at least two classes')
  return SourceDigits(
      images=jnp.asarray(images), labels=jnp.asarray(labels, jnp.int32),
      by_class=jnp.asarray(np.argsort(labels, kind='stable'), jnp.int32),
      class_start=jnp.asarray(np.concatenate([[0], np.cumsum(counts)[:-1]]), jnp.int32),
      class_count=jnp.asarray(counts, jnp.int32))


def _place(digit: Array, shift: Array) -> Array:
  """A 28×28 digit centred in the 36×36 canvas, then moved by shift (dy, dx) ∈ [−4, 4]²."""
  margin = (CANVAS - digit.shape[0]) // 2
  canvas = jnp.pad(digit, ((margin, margin), (margin, margin), (0, 0)))
  return shift_image(canvas, shift[0], shift[1], MAX_SHIFT)


def generate_example(source: SourceDigits, seed: Array, index: Array):
  """(image [36, 36, 1] float32 in [0, 1], labels [2] int32, digits [2, 36, 36, 1])."""
  key = jax.random.fold_in(jax.random.key(seed), index)
  partner_class_key, partner_key, shift_key = jax.random.split(key, 3)
  first = index % source.size
  first_label = source.labels[first]
  num_classes = source.class_count.shape[0]
  # A different class, uniformly among the classes present in the split.
  present = (source.class_count > 0) & (jnp.arange(num_classes) != first_label)
  partner_label = jax.random.choice(partner_class_key, num_classes, p=present / jnp.sum(present))
  offset = jax.random.randint(partner_key, (), 0, source.class_count[partner_label])
  second = source.by_class[source.class_start[partner_label] + offset]
  shifts = jax.random.randint(shift_key, (2, 2), -MAX_SHIFT, MAX_SHIFT + 1)  # [digit, (dy, dx)]
  digits = jnp.stack([
      _place(source.images[first].astype(jnp.float32) / 255.0, shifts[0]),
      _place(source.images[second].astype(jnp.float32) / 255.0, shifts[1]),
  ])  # [2, 36, 36, 1]
  image = jnp.minimum(digits[0] + digits[1], 1.0)
  labels = jnp.stack([first_label, partner_label.astype(jnp.int32)])
  return image, labels, digits


@jax.jit
def generate(source: SourceDigits, seed: Array, indices: Array):
  """A batch: images [b, 36, 36, 1], labels [b, 2], digits [b, 2, 36, 36, 1]."""
  return jax.vmap(generate_example, in_axes=(None, None, 0))(source, seed, indices)


def bounding_box_overlap(digits: np.ndarray) -> np.ndarray:
  """Per pair: area(box1 ∩ box2) / area(smaller box) of the two digits' ink boxes."""
  overlaps = []
  for pair in np.asarray(digits)[..., 0] if np.asarray(digits).ndim == 5 else np.asarray(digits):
    boxes = []
    for digit in pair:
      rows, cols = np.nonzero(digit > 0)
      boxes.append((rows.min(), rows.max() + 1, cols.min(), cols.max() + 1))
    (r0, r1, c0, c1), (s0, s1, d0, d1) = boxes
    intersection = max(0, min(r1, s1) - max(r0, s0)) * max(0, min(c1, d1) - max(c0, d0))
    smaller = min((r1 - r0) * (c1 - c0), (s1 - s0) * (d1 - d0))
    overlaps.append(intersection / smaller)
  return np.asarray(overlaps)
