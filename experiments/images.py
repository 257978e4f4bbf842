"""Your own images: the paper's MNIST recipe (capsjax/defaults.py) on an image folder, or
on any TFDS image-classification dataset; the CapsNet's input and classes come from the
data.

  python run.py --experiment=images --config.data_dir=DIR --workdir=W [--config.image_size=N]
  python run.py --experiment=images --config.dataset=kmnist --workdir=W

DIR holds train/CLASS/*.png|jpg and test/CLASS/… (tfds.ImageFolder's layout). Grey or RGB
comes from the images; images of mixed sizes need --config.image_size=N.

The model's stem, class-capsule transforms and decoder are chosen for the images' size
and the machine's memory (capsjax.sizing; the header says which and why): the paper's
at MNIST-like sizes; above 40 px a strided stem, transforms shared over positions and a
transposed-convolution decoder. --config.model.{stem,transforms,decoder}=… overrides.
"""
from capsjax import defaults


def get_config():
  config = defaults.base_config()
  config.experiment = 'images'
  config.dataset = 'image_folder'
  config.model.input_shape = ()   # the data's (after image_size)
  config.model.num_classes = 0    # the data's
  config.model.transforms = config.model.stem = config.model.decoder = 'auto'   # capsjax.sizing
  return config
