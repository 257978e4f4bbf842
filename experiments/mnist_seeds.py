"""The paper's MNIST recipe (experiments/mnist.py) over 3 seeds as one vmapped program, for
mean ± std as in Table 1; compare with experiments/mnist_official.py.

  python run.py --experiment=mnist_seeds --workdir=W [--config.validation_examples=10000]
"""
import ml_collections

from capsjax.experiments import mnist


def get_config():
  config = mnist.get_config()
  config.experiment = 'mnist_seeds'
  config.ensemble = ml_collections.ConfigDict(dict(seeds=(0, 1, 2)))
  return config
