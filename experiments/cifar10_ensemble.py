"""CIFAR-10 as the paper reports it: 7 CapsNets (experiments/cifar10.py) trained as one vmapped
program; 10.6 % test error in the paper.

The ensemble predicts the class whose capsule lengths, summed over the 7 members, are
largest; results.json reports that error (`ensemble_test_error`) and each member's.
"""
import ml_collections

from capsjax.experiments import cifar10


def get_config():
  config = cifar10.get_config()
  config.experiment = 'cifar10_ensemble'
  config.ensemble = ml_collections.ConfigDict(dict(seeds=(0, 1, 2, 3, 4, 5, 6)))
  return config
