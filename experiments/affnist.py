"""Robustness to affine transformations (section 5.2): CapsNet and a CNN of similar size,
trained on expanded MNIST (digits placed at random on 40×40), both stopped at the same
expanded-MNIST test accuracy, then tested on affine-transformed MNIST test digits.

  python run.py --experiment=affnist --workdir=W --config.data_dir=../shared/data/mnist
  [--config.affnist.mat_dir=DIR]   # also test on the real affNIST test .mat files

Writes W/affnist.md, W/affnist.json and W/affine_examples.png; the two trainings run in
W/capsnet and W/cnn (each resumable).
"""
import ml_collections

from capsjax import defaults
from capsjax.experiments import ablation, mnist
from capsjax.app.programs import affnist as program   # declares affnist.*


def affnist_cnn_model() -> ml_collections.ConfigDict:
  """Section 5's baseline CNN (experiments/ablation.py), max-pooled, with the fully connected
  widths that give it about CapsNet's size on 40×40 (13,291,914 vs 13,475,648)."""
  model = ablation.mnist_baseline_model()
  model.update(pool=True, dense=(2560, 1024), input_shape=(40, 40, 1))
  return model


def get_config():
  config = mnist.get_config()
  config.experiment = 'affnist'
  config.program = 'affnist'
  config.task = 'expanded'           # training and expanded-MNIST test digits on a 40×40 canvas
  config.model.input_shape = (40, 40, 1)
  # The paper stops CapsNet at 99.23 % (and the CNN at 99.22 %) expanded-MNIST test accuracy.
  config.stop_at_test_accuracy = 0.9923
  config.num_epochs = 50.0
  config.affnist = defaults.section('affnist', program)
  config.cnn = ml_collections.ConfigDict(dict(model=affnist_cnn_model(), loss=dict(name='softmax_xent')))
  config.evals.routing_probe.enabled = False
  return config
