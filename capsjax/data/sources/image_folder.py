"""The `image_folder` source: config.data_dir in tfds.ImageFolder's layout."""
import collections
import dataclasses
import functools
import os
import random
from typing import Dict, List, Tuple

import numpy as np

from capsjax import console
from capsjax.data import images as image_files
from capsjax.data.rows import ImageRows
from capsjax.errors import ConfigError, DataError
from capsjax.data.sources.core import (  # the core this kind builds on
    IMAGE_FOLDER, SPLITS, Dataset, check_directory, Source, SourceInfo, _checked, register_source)


@register_source('image_folder')
class ImageFolderSource(Source):
  """config.data_dir in tfds.ImageFolder's layout: DIR/SPLIT/CLASS/IMAGE with SPLIT train and
  test. As tfds.ImageFolder: class names are the sorted class folder names of every split,
  .png/.jpg/.jpeg files are read (others ignored), and each split's files are put in a
  fixed shuffled order (random.Random(split)), so that a validation split held out from
  the end of the training split draws on every class."""

  @classmethod
  def claims(cls, spec):
    return spec.dataset == IMAGE_FOLDER

  def _root(self) -> str:
    if not self.spec.data_dir:
      raise ConfigError(f'config.dataset={IMAGE_FOLDER} reads the folder in --config.data_dir=DIR '
                        '(DIR/train/CLASS/*.png and DIR/test/CLASS/*.png)')
    return os.path.abspath(os.path.expanduser(self.spec.data_dir))

  def describe(self):
    root = self._root()
    scan = scan_image_folder(root)
    if self.spec.image_size:
      height = width = self.spec.image_size
    elif len(scan.sizes) > 1:
      shown = ', '.join(f'{w}×{h}' for w, h in sorted(scan.sizes)[:3]) + (', …' if len(scan.sizes) > 3 else '')
      raise DataError(f'the images in {root} have {len(scan.sizes)} sizes ({shown}): pass '
                      '--config.image_size=N to resize them all to N×N')
    else:
      (width, height), = scan.sizes
    return SourceInfo(os.path.basename(root) or root, (height, width, scan.channels), scan.class_names,
                      background=self.spec.background)

  def load(self, split, on_demand=False):
    root = self._root()
    scan = scan_image_folder(root)
    info = self.describe()
    files = scan.files[split]
    paths = [path for path, _ in files]
    labels = np.array([scan.class_names.index(label) for _, label in files], np.int32)

    def read(ids: np.ndarray) -> np.ndarray:
      return np.stack([image_files.read_image(paths[i], info.image_shape, info.background) for i in ids])

    images = ImageRows(read, info.image_shape, num_rows=len(paths))
    if not on_demand:
      images = images.read_all(f'decoding {os.path.join(root, split)}')
    return _checked(Dataset(images, labels), info, split)


@dataclasses.dataclass(frozen=True)
class FolderScan:
  files: Dict[str, List[Tuple[str, str]]]   # split → [(path, class name)] in a fixed shuffled order
  class_names: Tuple[str, ...]
  sizes: frozenset                          # {(width, height)} over every image
  channels: int                             # 1 if every image is grey, else 3


LAYOUT = ('DIR/train/CLASS/*.png and DIR/test/CLASS/*.png (or .jpg; sub-folders of a class folder are read too), '
          'a folder per class in each')


def _check_classes(root: str, split: str, classes, train_classes) -> None:
  """A classifier needs two classes in each split, and a test class that training has: one
  class usually means DIR is a class folder, or the split holds one folder of images."""
  if len(classes) < 2:
    found = f'one class, {next(iter(classes))!r}' if classes else 'no class'
    raise DataError(f'{os.path.join(root, split)} holds {found} (a classifier needs at least two): the image '
                    f'folder layout is {LAYOUT}')
  unseen = sorted(classes - set(train_classes)) if split != 'train' else []
  if unseen:
    counts = ', '.join(f'{name!r}: {_count(root, split, name)} in {split}, {_count(root, "train", name)} in train'
                       for name in unseen[:5])
    raise DataError(f'{os.path.join(root, split)} has classes that {os.path.join(root, "train")} lacks '
                    f'(images found below each class folder: {counts}): the image folder layout is {LAYOUT}')


def _count(root: str, split: str, label: str) -> int:
  folder = os.path.join(root, split, label)
  return len(_images_below(folder)) if os.path.isdir(folder) else 0


def _images_below(class_dir: str) -> List[str]:
  """The images of a class folder and of every folder below it (a collection sorted into
  sub-folders, as torchvision's and Keras' folder readers take it), in a fixed order;
  hidden folders (.ipynb_checkpoints) left out."""
  found = []
  for folder, subfolders, names in os.walk(class_dir):
    subfolders[:] = sorted(name for name in subfolders if not name.startswith('.'))
    found.extend(os.path.join(folder, name) for name in sorted(names) if image_files.is_image_file(name))
  return found


@functools.lru_cache(maxsize=4)
def scan_image_folder(root: str) -> FolderScan:
  """The files, classes, sizes and colour of an image folder (headers only)."""
  check_directory(root)
  missing = [split for split in SPLITS if not os.path.isdir(os.path.join(root, split))]
  if missing:
    parent = os.path.dirname(os.path.normpath(root))
    inside = (os.path.basename(os.path.normpath(root)) in SPLITS
              and all(os.path.isdir(os.path.join(parent, split)) for split in SPLITS))
    raise DataError(f'{root} has no {" or ".join(missing)} folder: an image folder holds '
                    'train/CLASS/*.png and test/CLASS/*.png (or .jpg)'
                    + (f'; did you mean its parent, --config.data_dir={parent}?' if inside else ''))
  files, class_names = collections.defaultdict(list), set()
  sizes, channels = set(), 1
  for split in SPLITS:
    split_dir = os.path.join(root, split)
    for label in sorted(name for name in os.listdir(split_dir) if os.path.isdir(os.path.join(split_dir, name))):
      class_names.add(label)
      files[split].extend((path, label) for path in _images_below(os.path.join(split_dir, label)))
    if not files[split]:
      raise DataError(f'{split_dir} holds no .png or .jpg images in class folders (CLASS/IMAGE, or '
                      'CLASS/SUBFOLDER/…/IMAGE)')
    _check_classes(root, split, {label for _, label in files[split]}, {label for _, label in files.get('train', ())})
    random.Random(split).shuffle(files[split])   # tfds.ImageFolder's order
    for path, _ in console.progress(files[split], what=f'scanning {split_dir}', unit='images'):
      with image_files.open_image(path) as image:
        sizes.add(image_files.upright_size(image))
        channels = max(channels, image_files.channels_of(image.mode))
  return FolderScan(dict(files), tuple(sorted(class_names)), frozenset(sizes), channels)
