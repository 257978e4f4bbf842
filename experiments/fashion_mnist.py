"""Fashion-MNIST with the paper's MNIST CapsNet and training (experiments/mnist.py).

TFDS `fashion_mnist` by default; offline, an IDX folder (Debian's dataset-fashion-mnist
installs one): --config.data_dir=/usr/share/datasets/fashion-mnist.
"""
from experiments import mnist


def get_config():
  config = mnist.get_config()
  config.experiment = 'fashion_mnist'
  config.dataset = 'fashion_mnist'
  return config
