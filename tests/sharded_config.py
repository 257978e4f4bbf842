"""The tiny training shared by the data-parallel tests and their worker processes."""
from helpers import tiny_config


def tiny_sharded_config(data_dir):
  # The training batch divides by 16 devices and by 2 processes; the evaluation batch
  # (500, the default) does not: it is padded to a multiple of the devices.
  config = tiny_config(data_dir, num_steps=6)
  config.batch_size = 32
  config.num_test_examples = 96
  config.eval_batch_size = 500
  config.checkpoint_every_steps = 2
  return config
