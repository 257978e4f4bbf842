"""`images` with mnist_smoke's reduced CapsNet and schedule: minutes on a CPU.

  python run.py --experiment=images_smoke --config.data_dir=DIR --workdir=W
"""
from capsjax.experiments import images
from capsjax.experiments import mnist_smoke


def get_config():
  config = images.get_config()
  smoke = mnist_smoke.get_config()
  config.experiment = 'images_smoke'
  for key in ('num_epochs', 'batch_size', 'lr_decay_steps', 'eval_every_steps', 'log_every_steps',
              'checkpoint_every_steps'):
    config[key] = smoke[key]
  config.model.conv1_channels = smoke.model.conv1_channels
  config.model.primary_types = smoke.model.primary_types
  return config
