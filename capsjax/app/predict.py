"""Classify image files with a trained CapsNet.

  python -m capsjax.app.predict [--workdir=W] [--member=K|all] [--json] [--reconstruct=DIR] FILE...

For each file: the class name and every class's activation (the routing's activations:
for Procedure 1, the capsule lengths). A dark digit on a light ground, for a model of
MNIST's light strokes on black, is inverted first, and a line on stderr says so; so is a
blank image (no pixel more than 16 of 255 levels from the others), whose class means nothing.
Without --workdir: the paper's MNIST CapsNet that ships with capsjax. --member=all: the
members of a seed ensemble (`mnist_seeds`, `mnist_final`) as the one classifier the run
reports, their class scores averaged (the summed scores' class) and each member's
reconstruction of that class averaged. A file of any size or
colour is converted as training converted the run's images (capsjax.data.images: grey or
RGB, resized to the run's size), then preprocessed as the run's test images; for an MNIST
model, a file that is not 28×28 (a photo of a digit) is laid out as MNIST's digits are
instead (its ink fitted into 20×20 and centred by mass: fit_like_mnist), and a line on
stderr says so. --json
prints one JSON object per line: {"file", "class", "class_index", "activations"}.
--reconstruct=DIR writes DIR/NAME.png (at least 112 px tall, whole-pixel blocks; NAME
with the folders that tell same-named files apart): the input | the decoder's reconstruction from the
predicted class's capsule. Each PNG says in a text chunk that capsjax-predict wrote it: a
later call replaces such a file, and refuses to replace any other.

From Python, `Predictor.from_workdir(W).predict(images)` does the same for arrays.
"""
import argparse
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from capsjax import console
from capsjax.app import cli
from capsjax.errors import CapsjaxError

PREDICT_BATCH = 64
BLANK_RANGE = 16   # an image whose pixels all lie within this many of 255 levels holds no ink
# The activation a predicted class reaches to be confident (a capsule's length is the
# probability that its entity is present, the paper's 0.5 for MultiMNIST's two digits).
CONFIDENT_ACTIVATION = 0.5
# MNIST's digits were fitted into 20×20 (ink of 128 and more spans 20 px at most in every
# test digit); a 28×28 image whose ink spans more fills the frame unlike them (an upscaled
# scan: the shipped model got 3 of 10 such digits right, every activation ≤ 0.32).
MNIST_INK_SPAN = 22


class Predictor:
  """A trained CapsNet (or baseline CNN, capsjax.app.trained.TrainedModel) and how its run
  converted images: `predict(images)` takes arrays (uint8 [n, *the run's image shape],
  or images of any size, grey or colour, converted as the run converted its own) and
  `read_files(paths)` image files; `python -m capsjax.app.predict` is its command line.

  Example:
    `mnist_dir` as in load_dataset's example.

    >>> predictor = capsjax.Predictor.shipped()   # or Predictor.from_workdir(workdir)
    >>> test = capsjax.load_dataset('mnist', 'test', data_dir=mnist_dir)
    >>> results = predictor.predict(test.images[:4])   # uint8 [4, 28, 28, 1]
    >>> [r['class'] for r in results], sorted(results[0])
    (['7', '2', '1', '0'], ['activations', 'blank', 'class', 'class_index', 'confident', 'fitted', 'input', 'inverted', 'reconstruction', 'unlike_training'])
    >>> [r['class'] for r in predictor.predict(255 - test.images[:2])], results[0]['inverted']   # ink on paper
    (['7', '2'], False)
    >>> results[0]['reconstruction'].shape
    (28, 28, 1)
  """

  def __init__(self, trained):
    import jax  # pylint: disable=g-import-not-at-top
    from capsjax.app.trained import TrainedModel  # pylint: disable=g-import-not-at-top
    trained = TrainedModel.of(trained)   # a workdir, or load_trained's (config, model, params), too
    if not trained.task.single_images:
      raise CapsjaxError(f'{trained.source} holds a {trained.config.task} run: predict classifies one '
                         'object per image')
    self.trained = trained
    self.model, self.params, self.source = trained.model, trained.params, trained.source
    self.info = trained.info
    self.class_names = self.info.class_names
    self.capsules = trained.family.capsules
    self.has_decoder = trained.has_decoder
    self.probabilities = trained.objective.probabilities   # class scores → what is shown
    from capsjax.data.datasets import DATASETS  # pylint: disable=g-import-not-at-top
    described = DATASETS.get(trained.config.get('dataset'))
    # Light strokes on black (MNIST): an ink-on-paper image is inverted first (predict says so).
    self.light_on_dark = bool(described and described.light_on_dark and self.info.image_shape[-1] == 1)
    # One digit fitted into 20×20 and centred (MNIST): so is a photo of another size (`held`).
    self.mnist_layout = bool(described and described.mnist_layout and tuple(self.info.image_shape) == (28, 28, 1))
    self._scores = jax.jit(self._scores_and_reconstructions)
    self._classes = jax.jit(lambda params, images: jax.numpy.argmax(
        self._scores_and_reconstructions(params, images, reconstruct=False)[0], -1))

  @classmethod
  def from_workdir(cls, workdir: str, member: Union[int, str, None] = None) -> 'Predictor':
    """The run in `workdir`: of an ensemble, member `member`, or with member='all' every
    member of a seed ensemble summed as the one classifier the run reports
    (TrainedModel.summed_seeds). By default a seed ensemble's summed members (what the run
    reports), another ensemble's last member."""
    from capsjax.app.trained import TrainedModel, is_seed_ensemble  # pylint: disable=g-import-not-at-top
    if member is None and is_seed_ensemble(workdir):
      member = 'all'
    if isinstance(member, str):
      if member != 'all':   # (TrainedModel's refusal would not name 'all')
        raise CapsjaxError(f"member={member!r}: allowed an integer >= 0 (a member of the ensemble), 'all' (a seed "
                           "ensemble's members summed) or None (the last)")
      return cls(TrainedModel.summed_seeds(workdir))
    return cls(TrainedModel.from_workdir(workdir, member))

  @classmethod
  def shipped(cls) -> 'Predictor':
    from capsjax.app.trained import TrainedModel  # pylint: disable=g-import-not-at-top
    return cls(TrainedModel.shipped())

  # --------------------------------------------------------------------------- conversion

  def convert(self, image: np.ndarray, name: str = 'image') -> np.ndarray:
    """One image array (integers in [0, 255], floats in [0, 1] or booleans, True white, as
    a 1-bit PNG reads; [h, w], [h, w, 1|3|4]) as the run held its images: uint8 of the
    run's shape (`held`: a photo of a digit laid out as MNIST's for an MNIST model). Values
    outside that range are refused: clipping them (floats of 0–255) once turned a grey image
    into black and white without a word."""
    from PIL import Image  # pylint: disable=g-import-not-at-top
    if isinstance(image, (str, bytes, os.PathLike)):
      raise CapsjaxError(f'{name}: a file name ({image!r}), not an image array; files: predict(read_files([path, …]))')
    array = np.asarray(image)
    if array.dtype == bool:   # a mask (once refused as not numeric): as Pillow reads a 1-bit image
      array = array.astype(np.uint8) * 255
    if array.dtype != np.uint8:
      if not np.issubdtype(array.dtype, np.number) or not np.all(np.isfinite(array)):
        raise CapsjaxError(f'{name}: expected a numeric image array with finite values')
      integers = np.issubdtype(array.dtype, np.integer)
      top = 255 if integers else 1.0
      if array.size and (array.min() < 0 or array.max() > top):
        raise CapsjaxError(f'{name}: {"integer" if integers else "float"} pixel values must be in [0, {top:g}], '
                           f'got [{array.min():g}, {array.max():g}]'
                           + ('' if integers else ' (floats of 0–255: divide by 255, or pass uint8)'))
      array = array.astype(np.uint8) if integers else np.uint8(np.round(array * 255))
    if array.ndim == 3 and array.shape[-1] == 1:
      array = array[..., 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (3, 4)):
      raise CapsjaxError(f'{name}: expected an image [h, w] or [h, w, 1|3|4], got shape {list(np.shape(image))}')
    return self.held(Image.fromarray(array), name)

  def fits(self, size: Tuple[int, int]) -> bool:
    """Whether an image of `size` (width, height) is laid out as MNIST's digits (`held`)."""
    return self.mnist_layout and tuple(size) != tuple(self.info.image_shape[1::-1])

  def held(self, image, name: str = 'image') -> np.ndarray:
    """A Pillow image as the run held its images: uint8 of the run's shape
    (capsjax.data.images.to_array); for an MNIST model, an image of another size (a photo of a
    digit, which stretched to 28×28 is often misread: docs/results.md) laid out as MNIST's
    digits are instead (capsjax.data.images.fit_like_mnist)."""
    from capsjax.data.images import fit_like_mnist, to_array, upright_size  # pylint: disable=g-import-not-at-top
    width, height = upright_size(image)
    if self.fits((width, height)):
      grey = to_array(image, (height, width, 1), name, self.info.background)   # [h, w, 1]
      return fit_like_mnist(grey[..., 0])[..., None]
    return to_array(image, self.info.image_shape, name, self.info.background)

  def read_files(self, paths: Sequence[str]) -> np.ndarray:
    """The files as the run held its images (`held`): uint8 [n, *shape] (one error line for
    a missing file or one that is not an image)."""
    from capsjax.data.images import open_image  # pylint: disable=g-import-not-at-top
    if isinstance(paths, (str, bytes, os.PathLike)):
      raise CapsjaxError(f'read_files takes a list of paths, got one path: read_files([{paths!r}])')
    if not paths:
      return np.zeros((0,) + tuple(self.info.image_shape), np.uint8)
    held = []
    for path in paths:
      with open_image(path) as image:
        held.append(self.held(image, path))
    return np.stack(held)

  # --------------------------------------------------------------------------- prediction

  def _model_scores(self, params, inputs):
    """(class scores [batch, classes]: a CapsNet's activations, a CNN's logits; the class
    capsules [batch, classes, dim] or None) of one model."""
    if not self.capsules:
      return self.model.apply({'params': params}, inputs)['logits'], None
    capsules, activations = self.model.apply({'params': params}, inputs, method='classify')
    return activations, capsules

  def _scores_and_reconstructions(self, params, images_uint8, reconstruct: bool = True):
    import jax  # pylint: disable=g-import-not-at-top
    from capsjax.data import augment  # pylint: disable=g-import-not-at-top
    from capsjax.models import longest_capsule_mask  # pylint: disable=g-import-not-at-top
    inputs, _ = augment.prepare(images_uint8, self.info.preprocessing)
    over_members = lambda f, *axes: jax.vmap(f, in_axes=(0,) + axes) if self.trained.summed else f
    # A seed ensemble's scores averaged over its members: the class of the run's summed
    # classifier (steps.make_eval_step's ensemble_correct), shown on one member's scale.
    scores, capsules = over_members(self._model_scores, None)(params, inputs)   # [(members,) batch, classes]
    if self.trained.summed:
      scores = scores.mean(0)
    activations = scores if self.capsules else self.probabilities(scores)
    if capsules is None or not (self.has_decoder and reconstruct):
      return activations, None
    # Each member reconstructs the (summed) predicted class from its own capsule; averaged.
    decode = lambda member_params, member_capsules, mask: self.model.apply(
        {'params': member_params}, member_capsules, mask, method='decode')
    reconstructions = over_members(decode, 0, None)(params, capsules, longest_capsule_mask(activations))
    return activations, reconstructions.mean(0) if self.trained.summed else reconstructions

  def classify(self, images_uint8: np.ndarray, what: Optional[str] = None) -> np.ndarray:
    """The class index of each image of a uint8 batch of the run's shape (no
    reconstructions): what a test error is counted from. `what`: a progress bar of that name."""
    # (shape and dtype without reading: on-demand rows, capsjax.data.rows.ImageRows, have both)
    shape = tuple(np.shape(images_uint8))
    dtype = images_uint8.dtype if hasattr(images_uint8, 'dtype') else np.asarray(images_uint8).dtype
    if shape[1:] != tuple(self.info.image_shape) or dtype != np.uint8:
      raise CapsjaxError(f'classify takes uint8 images [n, {", ".join(map(str, self.info.image_shape))}] (the '
                         f"run's shape; predict converts others), got {shape} {dtype}")
    classes = []
    with console.progress(what=what or '', total=len(images_uint8), unit='images', disable=what is None) as bar:
      for chunk, padded in _padded_batches(images_uint8):
        classes.append(np.asarray(self._classes(self.params, padded))[:len(chunk)])
        bar.update(len(chunk))
    return np.concatenate(classes) if classes else np.zeros((0,), np.int64)

  def opposite_polarity(self, images_uint8: np.ndarray) -> np.ndarray:
    """Per image of the run's shape: whether it is dark on light where the run's images are
    light strokes on black (its frame, the outer 2 pixels, at least 3/4 light: paper, not
    noise); always False for a run of other images."""
    if not self.light_on_dark:
      return np.zeros(len(images_uint8), bool)
    frame = np.ones(images_uint8.shape[1:3], bool)
    frame[2:-2, 2:-2] = False
    return (images_uint8[:, frame].reshape(len(images_uint8), -1) > 127).mean(-1) >= 0.75

  def as_classified(self, images_uint8: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the images as they are classified, inverted, blank) of uint8 images of the run's
    shape [n, h, w, c]: those of the opposite polarity (`opposite_polarity`) inverted, and
    per image whether it was (inverted) and whether it holds no ink (`blank`). What predict
    and the explorer's opened files both do."""
    inverted, blank = self.opposite_polarity(images_uint8), self.blank(images_uint8)
    if inverted.any():
      images_uint8 = np.where(inverted[:, None, None, None], 255 - images_uint8, images_uint8)
    return images_uint8, inverted, blank

  @staticmethod
  def blank(images_uint8: np.ndarray) -> np.ndarray:
    """Per image: whether all its pixels lie within BLANK_RANGE levels of each other (a
    blank page or an empty frame: any class it is given means nothing)."""
    images_uint8 = np.asarray(images_uint8)
    flat = images_uint8.reshape(len(images_uint8), math.prod(images_uint8.shape[1:])).astype(np.int16)   # (-1: not for 0)
    return flat.max(-1) - flat.min(-1) <= BLANK_RANGE

  def unlike_training_layout(self, images_uint8: np.ndarray) -> np.ndarray:
    """Per image as classified (light on dark): for an MNIST model, whether its ink spans
    more than MNIST_INK_SPAN pixels (a frame-filling digit); False for other models."""
    if not self.mnist_layout or not len(images_uint8):
      return np.zeros(len(images_uint8), bool)
    ink = np.asarray(images_uint8)[..., 0] >= 128                         # [n, 28, 28]
    def span(present):                                                   # [n, side] → [n]
      first, last = np.argmax(present, -1), present.shape[-1] - np.argmax(present[:, ::-1], -1)
      return np.where(present.any(-1), last - first, 0)
    return np.maximum(span(ink.any(-1)), span(ink.any(-2))) > MNIST_INK_SPAN

  def predict(self, images, names: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    """For each image (an array, or a stacked batch of the run's shape): {'class',
    'class_index', 'activations' {name: value}, 'input' uint8, 'reconstruction' float
    [0, 1] or None, 'inverted', 'blank'}. CapsNet activations are its routing's (Procedure 1:
    the capsule lengths); a CNN's are its softmax (or sigmoid) outputs. An image of the
    opposite polarity to the run's (a dark digit on white for an MNIST model:
    opposite_polarity) is inverted first, and 'inverted' says so; 'blank': the image holds
    no ink (`blank`), so its class means nothing; 'confident': the predicted class's activation
    reaches CONFIDENT_ACTIVATION; 'unlike_training': an MNIST model's 28×28 image whose ink
    fills the frame (`unlike_training_layout`); 'fitted': an MNIST model's image of another
    size than 28×28, laid out as MNIST's digits are (`held`)."""
    if images is None or isinstance(images, (str, bytes, os.PathLike)):
      raise CapsjaxError(f'predict takes images (arrays, or a batch [n, h, w, c]), got {images!r}; files: '
                         'predict(read_files([path, …]))')
    if isinstance(images, np.ndarray) and images.ndim == 3 and images.shape[-1] in (1, 3, 4):
      # (iterated, its rows would be read as 1-pixel-wide images, each classified)
      raise CapsjaxError(f'predict takes a list of images or a batch [n, h, w, c]; one image of shape '
                         f'{list(images.shape)} is predict([image])')
    if names is not None and len(names) != len(images):
      raise CapsjaxError(f'predict: {len(names)} names for {len(images)} images')
    if (hasattr(images, 'shape') and hasattr(images, 'dtype') and len(images.shape) == 4
        and images.dtype == np.uint8 and tuple(images.shape[1:]) == tuple(self.info.image_shape)):
      held = np.asarray(images)   # an array, or on-demand rows (capsjax.data.rows.ImageRows) read here
      fitted = np.zeros(len(held), bool)
    elif not len(images):
      return []
    else:
      fitted = [self.fits(np.shape(image)[1::-1]) for image in images]
      held = np.stack([self.convert(image, (names or [None] * len(images))[i] or f'image {i}')
                       for i, image in enumerate(images)])
    held, inverted, blank = self.as_classified(held)
    unlike = self.unlike_training_layout(held) & ~np.asarray(fitted, bool)
    results = []
    for chunk, padded in _padded_batches(held):
      scores, reconstructions = self._scores(self.params, padded)
      scores = np.asarray(scores)[:len(chunk)]
      if not np.all(np.isfinite(scores)):
        raise CapsjaxError(self._non_finite(np.flatnonzero(~np.all(np.isfinite(scores), -1)) + len(results), names))
      reconstructions = None if reconstructions is None else np.asarray(reconstructions)[:len(chunk)]
      for i, row in enumerate(scores):
        index = int(np.argmax(row))
        results.append({'class': self.class_names[index], 'class_index': index,
                        'activations': {name: float(v) for name, v in zip(self.class_names, row)},
                        'input': chunk[i], 'reconstruction': None if reconstructions is None else reconstructions[i],
                        'inverted': bool(inverted[len(results)]), 'blank': bool(blank[len(results)]),
                        'fitted': bool(fitted[len(results)]), 'confident': bool(row[index] >= CONFIDENT_ACTIVATION),
                        'unlike_training': bool(unlike[len(results)])})
    return results

  def _non_finite(self, indices, names) -> str:
    """Why images `indices` got NaN or infinite class scores (a NaN capsule once read as
    length 0: "every class absent", exit 0): the parameters that hold non-finite values
    (a diverged run), else the model's arithmetic on these images."""
    import jax  # pylint: disable=g-import-not-at-top
    which = ', '.join((names[i] if names is not None else f'image {i}') for i in indices[:3])
    which += f' and {len(indices) - 3} more' if len(indices) > 3 else ''
    bad = [jax.tree_util.keystr(path, simple=True, separator='/')
           for path, leaf in jax.tree_util.tree_flatten_with_path(self.params)[0]
           if not np.all(np.isfinite(np.asarray(leaf, np.float32)))]
    cause = (f'{self.source} holds non-finite parameters ({", ".join(bad[:3])}{" …" if len(bad) > 3 else ""}): '
             'its training diverged' if bad
             else 'the model overflowed on them')
    return f'NaN or infinite class scores for {which}: {cause}'


def _padded_batches(images):
  """(chunk, chunk zero-padded to PREDICT_BATCH) over uint8 images: one compiled batch
  shape for any count (on-demand rows are read here, a chunk at a time)."""
  for start in range(0, len(images), PREDICT_BATCH):
    chunk = np.asarray(images[start:start + PREDICT_BATCH])
    yield chunk, np.concatenate([chunk, np.zeros((PREDICT_BATCH - len(chunk),) + chunk.shape[1:], np.uint8)])


# Reconstruction PNGs are scaled up (nearest neighbour, whole pixels) to at least this height.
MIN_PNG_HEIGHT = 112
# The PNG text chunk that marks a file as a reconstruction this command wrote (and may replace).
WRITTEN_BY = ('Software', 'capsjax-predict --reconstruct')


def written_by_predict(path: str) -> bool:
  """Whether `path` is a PNG that capsjax-predict --reconstruct wrote (its text chunk says so)."""
  from PIL import Image, UnidentifiedImageError  # pylint: disable=g-import-not-at-top
  try:
    with Image.open(path) as image:
      return image.format == 'PNG' and image.info.get(WRITTEN_BY[0]) == WRITTEN_BY[1]
  except (OSError, UnidentifiedImageError):
    return False


def _png_names(paths: Sequence[str]) -> List[str]:
  """A distinct NAME.png per file that says which input it is: the file's name, with as
  many of its folders as tell apart files of the same name (a/x.png, b/x.png →
  a_x.png, b_x.png); the same file given twice gets -2."""
  parts = [[p for p in os.path.normpath(os.path.abspath(path)).split(os.sep) if p] for path in paths]
  stems = [os.path.splitext(p[-1])[0] or 'image' for p in parts]
  key = lambda i, depth: tuple(parts[i][len(parts[i]) - 1 - depth:-1]) + (stems[i],)   # depth folders + stem
  names = []
  for index, components in enumerate(parts):
    depth = 0
    while depth < len(components) - 1 and any(
        key(other, depth) == key(index, depth) for other in range(len(parts)) if parts[other] != components):
      depth += 1
    names.append('_'.join(key(index, depth)))
  seen: Dict[str, int] = {}
  unique = []
  for name in names:
    seen[name] = seen.get(name, 0) + 1
    unique.append(f'{name}.png' if seen[name] == 1 else f'{name}-{seen[name]}.png')
  return unique


def enlarged(pixels: np.ndarray, min_height: int = MIN_PNG_HEIGHT) -> np.ndarray:
  """uint8 [h, w(, c)] scaled up by a whole factor (nearest neighbour: every pixel a block)
  to at least `min_height` rows."""
  factor = max(1, -(-min_height // pixels.shape[0]))
  return np.repeat(np.repeat(pixels, factor, axis=0), factor, axis=1)


def member_or_all(text: str):
  """--member: an ensemble member's index, or 'all' (a seed ensemble's members summed)."""
  if text == 'all':
    return text
  try:
    return cli.member(text)
  except argparse.ArgumentTypeError as error:
    raise argparse.ArgumentTypeError(f"{error} (a member's index, or all)") from None


member_or_all.__name__ = "integer >= 0 or 'all'"


@cli.main_wrapper
def main(argv=None):
  parser = cli.ArgumentParser(prog='capsjax-predict', description=__doc__.splitlines()[0])
  parser.add_argument('files', nargs='+', metavar='FILE', help='image files (PNG, JPEG, …)')
  parser.add_argument('--workdir', type=cli.existing_workdir, default=None,
                      help='a trained run (default: the model shipped with capsjax)')
  parser.add_argument('--member', type=member_or_all, default=None,
                      help='ensemble member of an ensemble run; all: the members of a seed ensemble summed, '
                           'the classifier the run reports (the default for a seed ensemble; for another '
                           'ensemble, the last member)')
  parser.add_argument('--json', action='store_true', help='one JSON object per line')
  parser.add_argument('--reconstruct', metavar='DIR', default=None,
                      help='write DIR/NAME.png: input | reconstruction')
  args = parser.parse_args(argv)
  from PIL import Image, PngImagePlugin  # pylint: disable=g-import-not-at-top
  from capsjax.data.images import open_image, side_by_side, upright_size  # pylint: disable=g-import-not-at-top
  sizes = []
  for path in args.files:   # every file checked before the model loads
    with open_image(path) as image:
      sizes.append(upright_size(image))
  if args.workdir is None and args.member is not None:
    cli.fail('capsjax-predict: --member needs --workdir (the shipped model is a single run)')
  if args.reconstruct and os.path.exists(args.reconstruct) and not os.path.isdir(args.reconstruct):
    cli.fail(f'capsjax-predict: --reconstruct={args.reconstruct} is a file, not a folder')
  if args.reconstruct:   # `capsjax-predict x.png --reconstruct=.` wrote ./x.png over its input
    inputs = {os.path.realpath(path): path for path in args.files}
    for png in _png_names(args.files):
      written = os.path.join(args.reconstruct, png)
      if os.path.realpath(written) in inputs:
        cli.fail(f'capsjax-predict: --reconstruct={args.reconstruct} would write {written} over the input file '
                 f'{inputs[os.path.realpath(written)]}: give another folder')
      if os.path.lexists(written) and not written_by_predict(written):   # a file of the user's
        cli.fail(f'capsjax-predict: --reconstruct={args.reconstruct} would replace {written}, which '
                 'capsjax-predict did not write: give another folder, or move that file')
  predictor = Predictor.shipped() if args.workdir is None else Predictor.from_workdir(args.workdir, args.member)
  print(f'model: {predictor.trained.describe()}', file=sys.stderr, flush=True)   # stdout: the predictions
  if args.reconstruct and not predictor.has_decoder:
    cli.fail(f'capsjax-predict: --reconstruct: {predictor.source} has no decoder')
  results = predictor.predict(predictor.read_files(args.files))
  if args.reconstruct:
    try:
      os.makedirs(args.reconstruct, exist_ok=True)
    except OSError as error:   # (the bare OSError named no flag)
      cli.fail(f'capsjax-predict: --reconstruct={args.reconstruct}: cannot make the folder '
               f'({error.strerror or error})')
  width = max(len(name) for name in predictor.class_names)
  for path, png, result, size in zip(args.files, _png_names(args.files), results, sizes):
    # On stderr (stdout stays the predictions), one line a file.
    laid_out = (f"{size[0]}×{size[1]}, laid out as MNIST's digits are (its ink fitted into 20×20 and centred by mass "
                'in 28×28)') if predictor.fits(size) else ''
    if result['blank']:
      print(f'{path}: a blank image (every pixel within {BLANK_RANGE} of 255 levels of the others): its class '
            'below means nothing', file=sys.stderr, flush=True)
    elif result['inverted']:
      print(f'{path}: dark on a light ground, where {predictor.source}\'s images are light strokes on black: '
            f'{laid_out + " and " if laid_out else ""}inverted before classifying', file=sys.stderr, flush=True)
    elif laid_out:
      print(f'{path}: {laid_out} before classifying', file=sys.stderr, flush=True)
    if result['unlike_training'] and not result['blank']:
      print(f"{path}: its ink fills the 28×28 frame, where MNIST's digits lie in a 20×20 box centred in it: crop "
            'the digit with a margin, or give a larger photo (laid out as MNIST\'s digits are)', file=sys.stderr,
            flush=True)
    if not result['confident'] and not result['blank']:
      print(f'{path}: no class is confident (the strongest, {result["class"]}, has {max(result["activations"].values()):.2f}'
            f' < {CONFIDENT_ACTIVATION}): the image may be unlike the training images', file=sys.stderr, flush=True)
    if args.json:
      print(json.dumps({'file': path, 'class': result['class'], 'class_index': result['class_index'],
                        'activations': result['activations']}), flush=True)
    else:
      ranked = sorted(result['activations'].items(), key=lambda item: -item[1])
      print(f'{path}: {result["class"]}  (' + ', '.join(f'{name:>{width}} {value:.3f}' for name, value in ranked)
            + ')', flush=True)
    if args.reconstruct:
      pair = enlarged(side_by_side(result['input'], result['reconstruction']))
      written = os.path.join(args.reconstruct, png)
      marked = PngImagePlugin.PngInfo()
      marked.add_text(*WRITTEN_BY)
      Image.fromarray(pair[..., 0] if pair.shape[-1] == 1 else pair).save(written, format='PNG', pnginfo=marked)
      # (On stderr with --json: stdout stays one JSON object per line.)
      print(f'wrote {written}: {path} | its reconstruction, {pair.shape[1]}×{pair.shape[0]} px',
            file=sys.stderr if args.json else sys.stdout, flush=True)
  return 0


if __name__ == '__main__':
  cli.run_program(main)
