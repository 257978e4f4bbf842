"""Fashion-MNIST with the paper's MNIST CapsNet and training (experiments/mnist.py).

TFDS `fashion_mnist` by default; offline, an IDX folder (Debian's dataset-fashion-mnist
installs one): --config.data_dir=/usr/share/datasets/fashion-mnist.
"""
from capsjax.experiments import mnist


def get_config():
  return mnist.dataset_config('fashion_mnist')
