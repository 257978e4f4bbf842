"""MultiMNIST (section 6): the same 3-layer CapsNet on 36×36 overlays of two digits.

Margin loss with two positive classes; the decoder reconstructs each digit from its own
(label-masked) capsule against that digit's own shifted image; the learning-rate decay
period is 10× the MNIST one (paper). Examples are generated on the fly from the 60M /
10M-example virtual sets (`capsjax/data/multimnist.py`).
"""
from capsjax import defaults
from capsjax.experiments import mnist


def get_config():
  config = mnist.get_config()
  config.experiment = 'multimnist'
  config.task = 'multimnist'
  config.multimnist = defaults.section('multimnist')   # 1000 pairs per digit, as the paper
  config.max_shift = 0              # the generator shifts each digit by up to ±4 px itself
  config.model.input_shape = (36, 36, 1)   # 11,361,808 parameters (paper: 11.36M)
  config.lr_decay_steps = 20000     # 10× MNIST's 2000
  config.num_steps = 300000         # 0.64 passes over the 60M training pairs
  config.num_test_examples = 10000  # 0 = the whole 10M-example test set
  config.eval_every_steps = 10000
  config.checkpoint_every_steps = 2000
  return config
