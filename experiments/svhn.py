"""SVHN (section 7 of the paper): the smaller CapsNet on the small training set, 4.3 % in the paper.

From the paper: TFDS `svhn_cropped`'s 73 257 training images only; conv1 with 64 channels,
16 primary capsule types of 6D, 8D class capsules. Ours, where the paper is silent:
±2 px shifts as for MNIST, the 512-1024 decoder reconstructing the 32×32×3 image
(0.0005 × summed squared error), Adam with MNIST's schedule, 50 epochs.
"""
from capsjax.experiments import mnist


def get_config():
  config = mnist.dataset_config('svhn')   # 32×32×3, 10 classes
  config.model.conv1_channels = 64
  config.model.primary_types = 16
  config.model.primary_dim = 6
  config.model.digit_dim = 8
  config.eval_every_steps = 572        # one epoch: 73 257 // 128
  config.checkpoint_every_steps = 572
  return config
