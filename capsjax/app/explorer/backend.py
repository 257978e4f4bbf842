"""The explorer's model side: test inputs, their digit capsules, and reconstructions of
tweaked capsules, all through the model's own `encode` / `decode`, jitted at start-up.

`Explorer` answers with plain Python values (lists, ints, floats) that the server sends
as JSON. Input problems raise `RequestError`, which the server turns into a 400.
"""
import io
import os
import threading
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from capsjax.app.predict import Predictor
from capsjax.app.trained import SHIPPED, TrainedModel
from capsjax.data import augment, images as image_files
from capsjax import assemble, console
from capsjax.errors import CapsjaxError, DataError
from capsjax.models import capsule_lengths
from capsjax.workdir import is_explorer_model
from capsjax.app.plots import draw_perturbations

SLIDER_RANGE = 0.25        # figure 4 of the paper: each dimension tweaked within ±0.25
WIDE_SLIDER_RANGE = 1.0
ENCODE_BATCH = 100
MNIST_BOX, MNIST_SIZE = image_files.MNIST_BOX, image_files.MNIST_SIZE


class RequestError(CapsjaxError):
  """A request the explorer cannot answer: the message goes back to the page."""


def mnist_preprocess(drawing: np.ndarray) -> np.ndarray:
  """A grey drawing uint8 [h, w] (white ink on black) → a 28×28 MNIST-style image in [0, 1]
  (capsjax.data.images.fit_like_mnist: as predict lays out a photo of a digit)."""
  drawing = np.asarray(drawing)
  if drawing.ndim != 2 or min(drawing.shape) < MNIST_BOX:
    raise RequestError(f'a drawing must be a 2-D grey image of at least {MNIST_BOX}×{MNIST_BOX} pixels, '
                       f'got shape {list(drawing.shape)}')
  if not drawing.any():
    raise RequestError('the drawing is empty: draw a digit first')
  return image_files.fit_like_mnist(np.clip(drawing, 0, 255).astype(np.uint8)).astype(np.float32) / 255.0


def to_pixels(images) -> np.ndarray:
  """Images in [0, 1] → uint8 0–255, as the page draws them."""
  return np.round(np.clip(np.asarray(images, np.float32), 0.0, 1.0) * 255.0).astype(np.uint8)


def _int(value, name: str, low: int, high: int) -> int:
  if isinstance(value, bool) or not isinstance(value, int):
    raise RequestError(f'{name} must be an integer, got {value!r}')
  if not low <= value < high:
    raise RequestError(f'{name} {value} is out of range [{low}, {high - 1}]')
  return value


class Explorer:
  """A trained CapsNet with test inputs, answering the page's requests.

  images float32 [n, h, w, 1]; labels int [n] (MNIST-like) or [n, 2] (MultiMNIST).
  """

  def __init__(self, trained: TrainedModel, images: np.ndarray, labels: np.ndarray, show_progress: bool = False):
    trained.require_one_model('the explorer')   # its sliders move one model's capsule
    if not trained.has_decoder:
      raise CapsjaxError(f'{trained.source} holds no CapsNet with a decoder: nothing to explore')
    config, model, params, source = trained.config, trained.model, trained.params, trained.source
    self.trained, self.config, self.model, self.params, self.source = trained, config, model, params, source
    self.top_k = trained.task.labels_per_example   # labels (and predictions) per input
    self.multimnist = self.top_k > 1
    self.num_classes = int(config.model.num_classes)
    self.dim = int(config.model.digit_dim)
    self.input_shape = tuple(int(s) for s in config.model.input_shape)
    if self.input_shape[-1] not in (1, 3):
      raise CapsjaxError(f'{source} reads {self.input_shape[-1]}-channel images; the explorer draws grey or RGB')
    self.images = np.asarray(images, np.float32)
    self.labels = np.asarray(labels)
    # (capsules, the routing's activations: Procedure 1's are the capsule lengths)
    # The parameters are arguments of the compiled programs, not constants XLA would fold.
    encode = jax.jit(lambda params, x: model.apply({'params': params}, x, method='classify'))
    decode = jax.jit(lambda params, capsules, mask: model.apply({'params': params}, capsules, mask, method='decode'))
    self._encode = lambda x: encode(params, x)
    self._decode = lambda capsules, mask: decode(params, capsules, mask)
    self._figure_lock = threading.Lock()   # matplotlib is not thread-safe
    self.capsules, self.activations = self._encode_all(self.images, show_progress)   # [n, classes, dim], [n, classes]
    self.predictions = self._most_active(self.activations)                # [n, k]
    self.misclassified = [i for i, (label, predicted) in enumerate(zip(self.labels, self.predictions))
                          if set(np.atleast_1d(label).tolist()) != set(predicted.tolist())]
    if show_progress:
      console.say('compiling the decoder for the page…')
    for k in range(1, self.top_k + 1):   # compile every decode shape the page asks for now
      self.decode(np.zeros((k, self.dim), np.float32), list(range(k)))
    if self.can_open_files:   # and one input's (a drawing, a file): its first took 4.4 s compiled on demand
      self._encode(jnp.zeros((1,) + self.input_shape, jnp.float32))
    # An opened file is read as capsjax-predict reads it (polarity, blank): its Predictor's checks.
    self._files = Predictor(trained) if self.can_open_files else None

  # --------------------------------------------------------------------------- loading

  @classmethod
  def from_workdir(cls, workdir: str, member: Optional[int] = None, num_images: int = 1000,
                   data: Optional[dict] = None, show_progress: bool = False) -> 'Explorer':
    """The latest checkpoint of the run in `workdir`, with its first `num_images` test inputs
    (`data`: data_dir / tfds_data_dir on this machine, see load_trained); `show_progress`:
    say each stage on the console, with a bar for the encoding. A folder capsjax-export
    wrote is read as the shipped model is, with its own sample of test images."""
    trained = TrainedModel.from_workdir(workdir, member, data)
    if is_explorer_model(workdir):   # one model and its own sample of test images, as the shipped one
      return cls._with_sample(trained, workdir, show_progress, num_images)
    if show_progress:
      console.say(f'model: {trained.describe()}; reading up to {num_images} test inputs…')
    config = ml_collections.ConfigDict(trained.config.to_dict())
    config.num_test_examples = 0   # the whole test split, of which the first num_images are read
    config.host_images = 'rows'   # read and decode only those rows: not the training split, nor all the test split
    _, test = assemble.pipelines(config)
    images, labels, count = [], [], 0
    for host_batch, weights in test.eval_batches(min(ENCODE_BATCH, num_images)):
      batch = test.device_batch(test.source, host_batch, None)
      valid = weights > 0
      images.append(np.asarray(batch['images'])[valid])
      labels.append(np.asarray(batch['labels'])[valid])
      count += int(valid.sum())
      if count >= num_images:   # as many inputs as there are, up to num_images
        break
    return cls(trained, np.concatenate(images)[:num_images], np.concatenate(labels)[:num_images], show_progress)

  @classmethod
  def shipped(cls, show_progress: bool = False) -> 'Explorer':
    """The CapsNet that ships with the package (the paper's model, trained by
    experiments/mnist_official.py: docs/results.md, "The capsule explorer"), with its sample
    of MNIST test images."""
    return cls._with_sample(TrainedModel.shipped(), SHIPPED, show_progress)

  @classmethod
  def _with_sample(cls, trained: TrainedModel, directory: str, show_progress: bool = False,
                   num_images: Optional[int] = None) -> 'Explorer':
    """An exported model (`trained`, read from `directory`) with the test images capsjax-export
    wrote beside it (the first `num_images`)."""
    with np.load(os.path.join(directory, 'test_sample.npz')) as sample:   # preprocessed as the run's test images
      images = np.asarray(augment.prepare(jnp.asarray(sample['images'][:num_images]), trained.info.preprocessing)[0])
      labels = sample['labels'][:num_images]
    if show_progress:
      console.say(f'model: {trained.describe()}')
    return cls(trained, images, labels, show_progress)

  # --------------------------------------------------------------------------- requests

  def info(self) -> Dict[str, Any]:
    return {
        'mode': 'multimnist' if self.multimnist else 'mnist',
        'source': self.source,
        'model': self.trained.describe(),
        'experiment': self.config.experiment,
        'num_examples': len(self.labels),
        'num_classes': self.num_classes,
        'class_names': list(self.trained.info.class_names),
        # Digits (the page's wording): the classes are the ten digits, or a MultiMNIST run.
        'digits': self.multimnist or list(self.trained.info.class_names) == [str(d) for d in range(10)],
        'dim': self.dim,
        'image_shape': list(self.input_shape[:2]),
        'slider_range': SLIDER_RANGE,
        'wide_slider_range': WIDE_SLIDER_RANGE,
        'labels': self.labels.tolist(),
        'misclassified': self.misclassified,
        'can_draw': self.can_draw,
        'can_open_files': self.can_open_files,
    }

  def example(self, index) -> Dict[str, Any]:
    index = _int(index, 'index', 0, len(self.labels))
    answer = self._describe(self.images[index], self.capsules[index], self.activations[index],
                            self.predictions[index])
    answer.update(index=index, label=self.labels[index].tolist())
    return answer

  def encode_drawing(self, drawing: np.ndarray) -> Dict[str, Any]:
    if not self.can_draw:
      raise RequestError(f'drawing needs a 28×28 MNIST model; this one reads {list(self.input_shape)} inputs')
    image = mnist_preprocess(drawing)[..., None]
    capsules, activations = (np.asarray(x)[0] for x in self._encode(jnp.asarray(image[None])))
    return self._describe(image, capsules, activations, self._most_active(activations))

  def encode_file(self, data: bytes) -> Dict[str, Any]:
    """An image file's bytes (any size, grey or colour), converted as `capsjax.app.predict`
    converts a file for this run (Predictor.held: a photo laid out as MNIST's digits for an
    MNIST model; ink on paper inverted for a run of light strokes on black; then the run's
    test preprocessing), encoded: as /api/example,
    without a label, with 'fitted' (laid out as MNIST's digits), 'inverted' and 'blank' (no
    ink: its class means nothing) as predict's results say them."""
    if not self.can_open_files:
      raise RequestError(f'a {self.config.task} run reads two overlapping digits, not an image file')
    info = self.trained.info
    try:
      with image_files.image_from_bytes(data) as image:
        array = self._files.held(image, 'the file')   # uint8 [h, w, c]
        fitted = self._files.fits(image_files.upright_size(image))
    except DataError as e:
      raise RequestError(str(e)) from None
    held, inverted, blank = self._files.as_classified(array[None])              # [1, h, w, c] uint8
    inputs, _ = augment.prepare(jnp.asarray(held), info.preprocessing)           # [1, *input_shape]
    capsules, activations = (np.asarray(x)[0] for x in self._encode(inputs))
    answer = self._describe(np.asarray(inputs)[0], capsules, activations, self._most_active(activations))
    answer.update(fitted=fitted, inverted=bool(inverted[0]), blank=bool(blank[0]))
    return answer

  @property
  def can_open_files(self) -> bool:
    """Image files are converted as predict converts them: any single-object run reads them."""
    return self.trained.task.single_images

  @property
  def can_draw(self) -> bool:
    """Drawings are preprocessed as MNIST digits: only a 28×28 single-digit model reads them."""
    return not self.multimnist and self.input_shape == (MNIST_SIZE, MNIST_SIZE, 1)

  def decode(self, vectors, classes) -> np.ndarray:
    """Reconstructions float32 [k, h, w] (grey) or [k, h, w, 3] from capsule `vectors` [k, dim] of `classes` [k]:
    each decoded on its own, every other capsule masked out (the model's `decode`)."""
    vectors, classes = self._check_vectors(vectors, classes)
    capsules = np.zeros((len(classes), self.num_classes, self.dim), np.float32)  # [k, classes, dim]
    capsules[np.arange(len(classes)), classes] = vectors
    mask = jax.nn.one_hot(jnp.asarray(classes), self.num_classes)                # [k, classes]
    pixels = np.asarray(self._decode(jnp.asarray(capsules), mask))              # [k, h, w, c]
    return pixels[..., 0] if pixels.shape[-1] == 1 else pixels

  def reconstruct(self, vectors, classes) -> Dict[str, Any]:
    return {'pixels': [image.ravel().tolist() for image in to_pixels(self.decode(vectors, classes))]}

  def grid_png(self, vector, class_index) -> bytes:
    """Figure 4 for one capsule: each dimension (rows) tweaked by −0.25…+0.25 (columns)."""
    vectors, classes = self._check_vectors([vector], [class_index])
    buffer = io.BytesIO()
    with self._figure_lock:
      draw_perturbations(self.model, self.params, vectors[0], int(classes[0]), buffer)
    return buffer.getvalue()

  # --------------------------------------------------------------------------- helpers

  def _encode_all(self, images: np.ndarray, show_progress: bool = False):
    """(digit capsules [n, classes, dim], activations [n, classes]) in fixed-size batches
    (one compilation)."""
    batch = min(ENCODE_BATCH, len(images))
    capsules, activations = [], []
    with console.progress(what='encoding the test inputs', total=len(images), unit='images',
                      disable=not show_progress) as bar:
      for start in range(0, len(images), batch):
        chunk = images[start:start + batch]
        padded = np.concatenate([chunk, np.zeros((batch - len(chunk),) + chunk.shape[1:], chunk.dtype)])
        encoded, active = self._encode(jnp.asarray(padded))
        capsules.append(np.asarray(encoded)[:len(chunk)])
        activations.append(np.asarray(active)[:len(chunk)])
        bar.update(len(chunk))
    return np.concatenate(capsules), np.concatenate(activations)

  def _most_active(self, activations: np.ndarray) -> np.ndarray:
    """The top_k classes by activation, most active first: [..., classes] → [..., k]."""
    return np.argsort(-np.asarray(activations), axis=-1)[..., :self.top_k]

  def _describe(self, image: np.ndarray, capsules: np.ndarray, activations: np.ndarray,
                prediction: np.ndarray) -> Dict[str, Any]:
    return {
        # Row-major values: h·w grey, or h·w·3 interleaved RGB (the page tells them by length).
        'image': to_pixels(image[..., 0] if image.shape[-1] == 1 else image).ravel().tolist(),
        'lengths': np.asarray(capsule_lengths(jnp.asarray(capsules))).tolist(),
        'activations': np.asarray(activations).tolist(),   # the bars: the routing's activations
        'capsules': capsules.tolist(),
        'prediction': [int(c) for c in prediction],
    }

  def _check_vectors(self, vectors, classes):
    if not isinstance(vectors, (list, tuple, np.ndarray)) or not isinstance(classes, (list, tuple, np.ndarray)):
      raise RequestError('vectors and classes must be lists')
    if not 1 <= len(classes) <= self.top_k or len(vectors) != len(classes):
      raise RequestError(f'give 1 to {self.top_k} capsule vectors with one class each, '
                         f'got {len(vectors)} vectors and {len(classes)} classes')
    classes = np.array([_int(c, 'class', 0, self.num_classes) for c in classes])
    try:
      vectors = np.asarray(vectors, np.float64)
    except (TypeError, ValueError):
      raise RequestError(f'each capsule vector must be {self.dim} numbers') from None
    if vectors.shape != (len(classes), self.dim):
      raise RequestError(f'each capsule vector must be {self.dim} numbers, got shape {list(vectors.shape)}')
    if not np.all(np.isfinite(vectors)) or np.max(np.abs(vectors)) > 100:
      raise RequestError('capsule vector entries must be finite numbers within ±100')
    return vectors.astype(np.float32), classes
