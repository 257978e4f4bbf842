"""The paper's MNIST setup (section 5): 3-layer CapsNet, 3 routing iterations, ±2 px shifts.

Optimiser: Adam at 1e-3 with exponential decay ×0.96 every 2000 steps, batch 128, as in
the authors' released code; the values live in capsjax/defaults.py, the base of every
experiment (see BUILD.md).
"""
from capsjax import defaults

get_model_config = defaults.capsnet_config
dataset_config = defaults.dataset_config


def get_config():
  return defaults.base_config()
