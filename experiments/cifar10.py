"""CIFAR-10 (section 7 of the paper): one CapsNet of the paper's 7-model ensemble.

From the paper: the MNIST architecture with 3 colour channels and 64 primary capsule
types, 3 routing iterations, 24×24 patches, and a "none-of-the-above" category in the
routing softmax (`model.routing_inputs=('leaky',)`). From the TensorFlow CIFAR-10 input pipeline the
authors' code follows: random 24×24 crops, horizontal flips, brightness/contrast jitter,
per-image standardisation; the central 24×24 at test. Reconstruction is off by default, as
in the authors' CIFAR runs (`--config.model.use_decoder=True` turns the 24×24×3 decoder
on, against the unstandardised crop). Ours: 100 epochs, MNIST's schedule.
"""
from capsjax.experiments import mnist


def get_config():
  config = mnist.dataset_config('cifar10')   # 24×24×3 crops, 10 classes
  config.model.primary_types = 64
  config.model.routing_inputs = ('leaky',)
  config.model.use_decoder = False
  config.max_shift = 0
  config.num_epochs = 100.0
  config.eval_every_steps = 3900       # 10 epochs of 50 000
  config.checkpoint_every_steps = 3900
  return config
