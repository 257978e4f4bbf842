"""Image files and arrays to the uint8 arrays a run trains on: one conversion for training
(an image folder, a resized TFDS dataset) and for `capsjax.app.predict`, so that a file is
converted at prediction (and when opened in the explorer) exactly as training converted its kind.

Colour: a run's images are grey (1 channel) when every training image is grey, else RGB
(3 channels; palettes expanded). Transparency (an alpha channel: RGBA, LA, PA; or a
palette's or a colour key's tRNS entry) is composited onto the run's background,
`config.image_background` (white by default, or black): what a transparent pixel shows
is the background, never the colour stored under it. Size: resized with Pillow's bilinear
filter (antialiased when shrinking) to the run's [height, width] when it differs.
Orientation: as viewers show the image (its EXIF orientation applied: a phone's photo stored
on its side is read upright).
"""
import io
import os
import stat
import warnings
from typing import Tuple

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from capsjax.errors import DataError
from capsjax.keys import key, one_of

# What tfds.ImageFolder reads (other files in a class folder are ignored, as there).
IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png')
# Pillow modes without colour.
GREY_MODES = frozenset({'1', 'L', 'LA', 'I', 'I;16', 'I;16B', 'I;16L', 'I;16N', 'F'})
# What transparent pixels become (config.image_background), as a grey level.
BACKGROUNDS = {'white': 255, 'black': 0}
DEFAULT_BACKGROUND = 'white'
KEYS = (
    key('image_background', DEFAULT_BACKGROUND, one_of(tuple(BACKGROUNDS)), 'what the transparent pixels of image '
        "files (alpha, or a palette's transparent entry) are composited onto, in training, predict and the explorer"),
)
# Pillow modes with an alpha channel (premultiplied ones included).
ALPHA_MODES = frozenset({'RGBA', 'LA', 'PA', 'RGBa', 'La'})


def is_image_file(name: str) -> bool:
  return name.lower().endswith(IMAGE_EXTENSIONS)


def channels_of(mode: str) -> int:
  """1 for a grey Pillow mode, 3 for anything with colour."""
  return 1 if mode in GREY_MODES else 3


def open_image(path: str) -> Image.Image:
  """The image at `path`, header read (pixels decoded on first use); one DataError line if
  it is missing, not a regular file (a named pipe would block the read), not an image, or
  larger than Pillow decodes safely (a header claiming 10⁵ × 10⁵ pixels)."""
  try:
    mode = os.stat(path).st_mode
  except FileNotFoundError:
    raise DataError(f'{path}: no such file') from None
  except OSError as e:
    raise DataError(f'{path}: cannot read ({e.strerror or e})') from None
  if stat.S_ISDIR(mode):
    raise DataError(f'{path}: a directory, not an image file')
  if not stat.S_ISREG(mode):
    raise DataError(f'{path}: not a regular file (a pipe, socket or device), not an image file')
  return _opened(path, path)


def image_from_bytes(data: bytes, name: str = 'the file') -> Image.Image:
  """An image file's bytes (an upload) as `open_image` opens a path; one DataError line
  for bytes that are not an image or are too large to decode safely."""
  return _opened(io.BytesIO(data), name)


def _opened(source, name: str) -> Image.Image:
  try:
    with warnings.catch_warnings():   # large photos (above 89 MP) warn; twice that is refused below
      warnings.simplefilter('ignore', Image.DecompressionBombWarning)
      return Image.open(source)
  except Image.DecompressionBombError as e:
    raise DataError(f'{name}: too large to decode safely ({str(e).split(", could")[0]})') from None
  except FileNotFoundError:
    raise DataError(f'{name}: no such file') from None
  except IsADirectoryError:
    raise DataError(f'{name}: a directory, not an image file') from None
  except UnidentifiedImageError:
    raise DataError(f'{name}: not an image (Pillow reads PNG, JPEG and other image formats)') from None
  except OSError as e:
    raise DataError(f'{name}: cannot read ({e.strerror or e})') from None


def orientation(image: Image.Image) -> int:
  """The EXIF orientation a viewer turns the image by (1: as stored; 5–8: a quarter turn, as
  a phone's camera stores a photo held upright), read from the header without decoding the
  pixels (a PNG's eXIf chunk only where it precedes them)."""
  if image.format == 'PNG' and 'exif' not in image.info:
    return 1
  try:
    value = image.getexif().get(ExifTags.Base.Orientation, 1)
  except (OSError, ValueError, SyntaxError):   # a malformed EXIF block: the image as stored
    return 1
  return value if value in range(1, 9) else 1


def upright_size(image: Image.Image) -> Tuple[int, int]:
  """(width, height) of `image` as viewers show it (its EXIF orientation applied)."""
  return image.size[::-1] if orientation(image) >= 5 else image.size


def upright(image: Image.Image) -> Image.Image:
  """`image` as viewers show it: turned by its EXIF orientation (a phone photo of a digit,
  stored on its side, read upright), or `image` itself."""
  return image if orientation(image) == 1 else ImageOps.exif_transpose(image)


def has_transparency(image: Image.Image) -> bool:
  """Whether some pixels of `image` may be (partly) transparent."""
  return image.mode in ALPHA_MODES or 'transparency' in image.info


def flattened(image: Image.Image, background: str = DEFAULT_BACKGROUND) -> Image.Image:
  """`image` without transparency: RGBA (from any mode with alpha or a tRNS entry: no
  Pillow warning for palettes) composited onto `background`, as RGB; others unchanged."""
  if not has_transparency(image):
    return image
  if background not in BACKGROUNDS:
    raise DataError(f'image background {background!r}: allowed {", ".join(BACKGROUNDS)}')
  rgba = image.convert('RGBA')
  level = BACKGROUNDS[background]
  return Image.alpha_composite(Image.new('RGBA', rgba.size, (level, level, level, 255)), rgba).convert('RGB')


def to_array(image: Image.Image, shape: Tuple[int, int, int], name: str = 'image',
             background: str = DEFAULT_BACKGROUND) -> np.ndarray:
  """uint8 [height, width, channels] of `shape`: `image` upright (its EXIF orientation
  applied), its transparency composited onto `background` ('white' or 'black'), converted to
  grey or RGB and resized (bilinear) where its size differs."""
  height, width, channels = shape
  try:
    image = flattened(upright(image), background)
    if image.mode in ('I', 'I;16', 'I;16B', 'I;16L', 'I;16N', 'F') and channels == 1:
      # 16-bit or float grey: scaled to 0..255 by its own range, not clipped.
      values = np.asarray(image, np.float64)
      span = values.max() - values.min()
      image = Image.fromarray(np.uint8(np.round(255 * (values - values.min()) / (span or 1))))
    converted = image.convert('L' if channels == 1 else 'RGB')
    if converted.size != (width, height):
      converted = converted.resize((width, height), Image.BILINEAR)
    array = np.asarray(converted, np.uint8)
  except (OSError, ValueError) as e:   # a truncated or corrupt file fails when decoded
    raise DataError(f'{name}: cannot decode ({e})') from None
  return array[..., None] if channels == 1 else array


def read_image(path: str, shape: Tuple[int, int, int], background: str = DEFAULT_BACKGROUND) -> np.ndarray:
  """The image file at `path` as uint8 [height, width, channels] of `shape` (see to_array)."""
  with open_image(path) as image:
    return to_array(image, shape, path, background)


def resize_array(images: np.ndarray, size: int) -> np.ndarray:
  """uint8 [n, h, w, c] → [n, size, size, c], each image as `to_array` resizes it; c may be
  any count (stacked channels, e.g. smallNORB's stereo pair, are resized one by one)."""
  if images.shape[1:3] == (size, size):
    return images
  out = np.empty((len(images), size, size, images.shape[-1]), np.uint8)
  for i, image in enumerate(images):
    for c in range(images.shape[-1]):
      out[i, :, :, c] = to_array(Image.fromarray(image[:, :, c]), (size, size, 1))[..., 0]
  return out


# MNIST's own preparation (LeCun et al.): the digit fitted into a 20×20 box (aspect ratio
# kept, anti-aliased), then placed so that its centre of mass is the centre of 28×28.
MNIST_BOX, MNIST_SIZE = 20, 28
# A larger photo is shrunk to this long side first (its digit ends up 20 pixels tall).
WORKING_SIDE = 512
# The ground (paper, or black) under each pixel: the image closed (dark ink) or opened (light
# ink) over squares of this fraction of its long side. What is narrower (strokes) is ink; what
# is wider (uneven light, a vignette, a shadow's edge) is ground.
GROUND_WINDOW = 0.25
# Ink: pixels at least this fraction of the strongest ink's distance from the ground (paper
# grain, sensor noise and a notebook's ruled lines below it are the ground). Chosen on MNIST's
# training digits photographed (benchmarks/digit_photos.py --split=train; docs/results.md).
INK_FRACTION = 0.4
# Blots of less than this fraction of the largest one's ink are specks, not the digit.
SPECK_FRACTION = 0.1


def _ink(grey: np.ndarray) -> Tuple[np.ndarray, float, bool]:
  """(ink float32 [h, w] ≥ 0: how far each pixel lies from the ground under it, the frame's
  ground level, whether the ground is dark) of a grey uint8 [h, w]. The polarity is the
  frame's (its outer 1/14 on each side: median below 128, light strokes on black)."""
  import scipy.ndimage  # pylint: disable=g-import-not-at-top
  height, width = grey.shape
  edge_rows, edge_cols = max(1, round(height / 14)), max(1, round(width / 14))
  frame = np.ones(grey.shape, bool)
  frame[edge_rows:height - edge_rows, edge_cols:width - edge_cols] = False
  level = float(np.median(grey[frame]))
  dark_ground = level < 128
  window = max(3, round(GROUND_WINDOW * max(height, width)))
  values = grey.astype(np.float32)
  if dark_ground:   # light strokes: the opening removes them, leaving the ground
    return values - scipy.ndimage.grey_opening(values, size=(window, window)), level, dark_ground
  return scipy.ndimage.grey_closing(values, size=(window, window)) - values, level, dark_ground


def _without_specks(ink: np.ndarray) -> np.ndarray:
  """`ink` [h, w] without the connected blots (8-connected) of less than SPECK_FRACTION of
  the largest one's ink: dust and grain on a page would widen the digit's box."""
  import scipy.ndimage  # pylint: disable=g-import-not-at-top
  labels, count = scipy.ndimage.label(ink > 0, structure=np.ones((3, 3)))
  if count < 2:
    return ink
  masses = scipy.ndimage.sum(ink, labels, index=np.arange(1, count + 1))   # [count]
  kept = np.concatenate([[False], masses >= SPECK_FRACTION * masses.max()])   # [count + 1]: 0 is the ground
  return np.where(kept[labels], ink, 0.0)


def _centred(ink: np.ndarray) -> np.ndarray:
  """float32 [28, 28]: the box of `ink` [h, w] (some of it > 0) fitted into 20×20 (aspect
  ratio kept, Lanczos), placed so that its centre of mass is the centre."""
  rows, cols = np.nonzero(ink)
  ink = ink[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
  scale = MNIST_BOX / max(ink.shape)
  box_height, box_width = (max(1, round(side * scale)) for side in ink.shape)
  boxed = np.clip(np.asarray(Image.fromarray(ink, 'F').resize((box_width, box_height), Image.LANCZOS)), 0, 255)
  mass = boxed.sum()
  middle = (MNIST_SIZE - 1) / 2
  top = int(np.clip(round(middle - (boxed.sum(axis=1) @ np.arange(box_height)) / mass), 0, MNIST_SIZE - box_height))
  left = int(np.clip(round(middle - (boxed.sum(axis=0) @ np.arange(box_width)) / mass), 0, MNIST_SIZE - box_width))
  canvas = np.zeros((MNIST_SIZE, MNIST_SIZE), np.float32)
  canvas[top:top + box_height, left:left + box_width] = boxed
  return canvas


def fit_like_mnist(grey: np.ndarray) -> np.ndarray:
  """A grey image uint8 [h, w] of one digit (a photo, a scan, a drawing: any size, either
  polarity) → uint8 [28, 28] laid out as MNIST's digits are, in the image's own polarity.
  A photo larger than WORKING_SIDE is shrunk to it first. Ink is how far a pixel lies from
  the ground under it (`_ink`: uneven light and shadows are ground), stretched so that the
  strongest is 255; what lies below INK_FRACTION of that is ground, and specks (blots of
  under SPECK_FRACTION of the largest blot's ink) are left out; the ink's box is fitted into
  20×20 (aspect ratio kept, Lanczos) and placed so that its centre of mass is the image's
  centre. An image without ink (every pixel within 1 level of the ground) is returned as a
  plain 28×28 of its frame's level."""
  grey = np.asarray(grey)
  if grey.ndim != 2 or grey.dtype != np.uint8 or not grey.size:
    raise DataError(f'fit_like_mnist takes a grey uint8 image [h, w], got {grey.dtype} {list(grey.shape)}')
  if max(grey.shape) > WORKING_SIDE:
    scale = WORKING_SIDE / max(grey.shape)
    shrunk = Image.fromarray(grey).resize((max(1, round(grey.shape[1] * scale)), max(1, round(grey.shape[0] * scale))),
                                          Image.LANCZOS)
    grey = np.asarray(shrunk)
  ink, level, dark_ground = _ink(grey)
  strongest = float(ink.max())
  if strongest <= 1.0:   # no ink: the ground, as it is
    return np.full((MNIST_SIZE, MNIST_SIZE), round(level), np.uint8)
  ink = _without_specks(np.where(ink >= INK_FRACTION * strongest, ink * (255.0 / strongest), 0.0))
  fitted = np.uint8(np.round(_centred(ink)))
  return fitted if dark_ground else 255 - fitted


def side_by_side(image_uint8: np.ndarray, reconstruction: np.ndarray) -> np.ndarray:
  """uint8 [h, 2w + 2, c]: an input | a 2-pixel grey gap | its reconstruction (in [0, 1])."""
  rebuilt = np.uint8(np.round(np.clip(reconstruction, 0.0, 1.0) * 255)).reshape(image_uint8.shape)
  gap = np.full(image_uint8.shape[:1] + (2,) + image_uint8.shape[2:], 128, np.uint8)
  return np.concatenate([image_uint8, gap, rebuilt], axis=1)
