"""The small CapsNet whose weights ship with the capsule explorer (`python -m capsjax.app.explorer`).

The paper's decoder (512-1024-784) and 16D digit capsules, with a narrower encoder
(conv1 128 channels, 8 primary capsule types) so that the exported float16 weights fit
in the package (≈ 4.9 MB; the paper's 8.2M parameters would be 16 MB). Three epochs
with the paper's loss and shifts; see docs/results.md for the command and its accuracy.
"""
from capsjax.experiments import mnist


def get_config():
  config = mnist.get_config()
  config.experiment = 'explorer'
  config.num_epochs = 3.0
  config.model.conv1_channels = 128
  config.model.primary_types = 8
  return config
