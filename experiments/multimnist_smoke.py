"""A reduced MultiMNIST CapsNet: a few minutes on 2 CPU cores, far above chance (1/45)."""
from capsjax.experiments import multimnist


def get_config():
  config = multimnist.get_config()
  config.experiment = 'multimnist_smoke'
  config.model.conv1_channels = 64
  config.model.primary_types = 16
  config.batch_size = 64
  config.num_steps = 600
  config.lr_decay_steps = 2000
  config.num_test_examples = 2000
  config.eval_every_steps = 0
  config.log_every_steps = 50
  config.checkpoint_every_steps = 300
  return config
