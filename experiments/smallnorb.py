"""smallNORB (section 7 of the paper): the MNIST CapsNet on 5 categories, 2.7 % in the paper.

From the paper: the MNIST architecture; images resized 96→48, random 32×32 crops in
training and the central 32×32 at test. From the authors' code: the stereo pair as 2
channels, brightness (±63/255) and contrast (0.2–1.8) jitter, per-image standardisation
(see capsjax/data/datasets.py for where the order differs). Ours: reconstruction of the
32×32×2 crop in [0, 1] (theirs reconstructs the standardised image),
no extra shifts (the crops move the object), 100 epochs of TFDS `smallnorb`'s 24 300
training images.
"""
from capsjax.experiments import mnist


def get_config():
  config = mnist.dataset_config('smallnorb')   # 32×32×2 crops, 5 classes
  config.max_shift = 0
  config.num_epochs = 100.0
  config.eval_every_steps = 1890       # 10 epochs: 24 300 // 128 = 189 steps each
  config.checkpoint_every_steps = 1890
  return config
