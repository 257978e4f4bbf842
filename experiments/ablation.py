"""Table 1 of the paper: routing 1 vs 3 × reconstruction on/off × 3 seeds on MNIST, plus the
MNIST baseline CNN (section 5), each group trained as one vmapped program.

  python run.py --experiment=ablation --workdir=W --config.data_dir=../shared/data/mnist

Writes W/table1.md, W/table1.json and W/training_loss_routing.png; the 12 CapsNet members
train in W/capsnet, the 3 baseline seeds in W/baseline (each resumable).
"""
import ml_collections

from capsjax import models
from capsjax.experiments import mnist


def mnist_baseline_model() -> ml_collections.ConfigDict:
  """Section 5's baseline: 35,445,522 parameters (the paper: 35.4M)."""
  model = models.model_config('cnn')   # every key the family declares (its formulation too)
  model.update(conv_channels=(256, 256, 128), conv_kernels=(5, 5, 5), pool=False, dense=(328, 192),
               dropout_rate=0.5, num_classes=10, input_shape=(28, 28, 1))
  return model


def get_config():
  config = mnist.get_config()
  config.experiment = 'ablation'
  config.program = 'ablation'
  # Members: the product of these; the model's routing_iterations (3) bounds the traced count.
  config.ensemble = ml_collections.ConfigDict(dict(
      seeds=(0, 1, 2), routing_iterations=(1, 3), reconstruction_weights=(0.0, 0.0005)))
  config.baseline = ml_collections.ConfigDict(dict(
      enabled=True, model=mnist_baseline_model(), loss=dict(name='softmax_xent')))
  return config
