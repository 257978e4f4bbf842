"""The tiny training shared by the data-parallel tests and their worker processes."""
from helpers import tiny_config


def tiny_sharded_config(data_dir):
  # Batch and test sizes divide by 8 devices and by 2 processes.
  config = tiny_config(data_dir, num_steps=6)
  config.batch_size = 32
  config.num_test_examples = 96
  config.eval_batch_size = 48
  config.checkpoint_every_steps = 2
  return config
