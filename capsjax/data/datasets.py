"""The datasets the paper's experiments use, described in one place: where each comes from
(TFDS name, splits, feature keys), what one stored image is, its classes, and how
training and test images are made from it (capsjax.data.augment, on device). Any other
TFDS image-classification dataset, or an image folder, describes itself
(capsjax.data.sources)."""
import dataclasses
from typing import Dict, Optional, Tuple

from capsjax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Preprocessing:
  """From a stored uint8 image to the model's input. Training: resize → random crop →
  random flip → brightness/contrast jitter (→ random shifts of config.max_shift px) →
  standardise; test: resize → central crop → standardise. Every field off by default."""
  resize: Optional[int] = None               # square side the stored image is resized to
  crop: Optional[int] = None                 # square side of the (random / central) crop
  flip: bool = False                         # random left-right flips in training
  brightness: float = 0.0                    # max |delta| added in training ([0, 1] scale)
  contrast: Optional[Tuple[float, float]] = None   # contrast factor range in training
  standardize: bool = False                  # per image: zero mean, unit variance


class DescribesImages:
  """What a description with `image_shape`, `class_names` and `preprocessing` says of the
  model it feeds (DatasetInfo, sources.SourceInfo)."""

  @property
  def num_classes(self) -> int:
    return len(self.class_names)

  @property
  def input_shape(self) -> Tuple[int, int, int]:
    return model_input_shape(self.image_shape, self.preprocessing)


@dataclasses.dataclass(frozen=True)
class DatasetInfo(DescribesImages):
  tfds_name: str                      # the TFDS builder (the default source)
  image_shape: Tuple[int, int, int]   # [height, width, channels] of one stored image
  class_names: Tuple[str, ...]
  idx_folder: bool                    # also readable from a folder of LeCun IDX files
  # TFDS features: the images stacked as channels (smallNORB's stereo pair), the label.
  image_keys: Tuple[str, ...] = ('image',)
  label_key: str = 'label'
  # Light strokes on a black ground (the MNIST family): an image of the opposite polarity
  # (a digit drawn in ink on paper) is inverted before a model of this data sees it
  # (capsjax.app.predict, saying so).
  light_on_dark: bool = False
  # Each image one digit laid out as MNIST's are (fitted into 20×20, centred by mass in 28×28):
  # a photo of another size is laid out so too before a model of this data sees it
  # (capsjax.data.images.fit_like_mnist, in capsjax.app.predict and the explorer).
  mnist_layout: bool = False
  splits: Tuple[str, str] = ('train', 'test')   # TFDS names of (training, test)
  preprocessing: Preprocessing = Preprocessing()
  source: str = ''                    # where the preprocessing choices come from
  # Where TFDS downloads from, when its builder does not say (the MNIST family's does):
  # probed before preparing, so that offline is one line within seconds.
  download_url: str = ''
  # (training, test) examples in the source's splits: what a plan (capsjax.app.plan) sizes the
  # data by without reading it.
  split_sizes: Tuple[int, int] = (0, 0)


def model_input_shape(image_shape: Tuple[int, int, int], preprocessing: Preprocessing) -> Tuple[int, int, int]:
  """The model's input for images of `image_shape`: the crop (or the resized image, or the
  image as it is)."""
  side = preprocessing.crop or preprocessing.resize
  height, width, channels = image_shape
  return (side, side, channels) if side else (height, width, channels)


DIGITS = tuple('0123456789')
# The names of TFDS's ClassLabel features.
FASHION = ('T-shirt/top', 'Trouser', 'Pullover', 'Dress', 'Coat', 'Sandal', 'Shirt', 'Sneaker', 'Bag',
           'Ankle boot')
CIFAR10 = ('airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship', 'truck')
SMALLNORB = ('four-legged animal', 'human figure', 'airplane', 'truck', 'car')

DATASETS: Dict[str, DatasetInfo] = {
    'mnist': DatasetInfo('mnist', (28, 28, 1), DIGITS, idx_folder=True, split_sizes=(60000, 10000), light_on_dark=True,
                          mnist_layout=True),
    # Same format; Debian's dataset-fashion-mnist installs the IDX files.
    'fashion_mnist': DatasetInfo('fashion_mnist', (28, 28, 1), FASHION, idx_folder=True, split_sizes=(60000, 10000),
                                 light_on_dark=True),
    # The small training set only (73 257 images; TFDS's `extra` split is not used).
    'svhn': DatasetInfo('svhn_cropped', (32, 32, 3), DIGITS, idx_folder=False,
                        source='paper section 7: the small training set; shifts as MNIST',
                        download_url='http://ufldl.stanford.edu/housenumbers/', split_sizes=(73257, 26032)),
    # The stereo pair as 2 channels; 5 categories.
    'smallnorb': DatasetInfo(
        'smallnorb', (96, 96, 2), SMALLNORB, idx_folder=False, image_keys=('image', 'image2'),
        label_key='label_category',
        preprocessing=Preprocessing(resize=48, crop=32, brightness=63 / 255, contrast=(0.2, 1.8),
                                    standardize=True),
        source='paper section 7: 96→48, random 32×32 crops, central crop at test; the authors\' '
               'code (research/capsules/input_data/norb/norb_input_record.py): the stereo pair, '
               'brightness ±63/255, contrast 0.2–1.8, per-image standardisation. Theirs jitters '
               'the 48×48 image before cropping, ours the crop (the same for brightness, which '
               'standardisation cancels; contrast uses the crop\'s channel means)',
        download_url='https://cs.nyu.edu/~ylclab/data/norb-v1.0-small/', split_sizes=(24300, 24300)),
    'cifar10': DatasetInfo(
        'cifar10', (32, 32, 3), CIFAR10, idx_folder=False,
        preprocessing=Preprocessing(crop=24, flip=True, brightness=63 / 255, contrast=(0.2, 1.8),
                                    standardize=True),
        source='paper section 7: 24×24 patches; flips, brightness ±63/255, contrast 0.2–1.8 and '
               'per-image standardisation as the TensorFlow CIFAR-10 input pipeline the '
               'authors\' code builds on',
        download_url='https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz', split_sizes=(50000, 10000)),
}


def dataset_info(name: str) -> DatasetInfo:
  """The description of one of the DATASETS (described_source in capsjax.data.sources
  covers the others)."""
  if name not in DATASETS:
    raise ConfigError(f'config.dataset={name!r} is not one of the described datasets {", ".join(DATASETS)}')
  return DATASETS[name]
