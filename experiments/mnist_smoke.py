"""A reduced CapsNet on a few thousand MNIST images: ≥ 95 % test accuracy in minutes on a CPU."""
from capsjax.experiments import mnist


def get_config():
  config = mnist.get_config()
  config.experiment = 'mnist_smoke'
  config.num_train_examples = 5000
  config.num_epochs = 6.0
  config.batch_size = 64
  config.lr_decay_steps = 200
  config.model.conv1_channels = 64
  config.model.primary_types = 16
  config.eval_every_steps = 0     # only at the end
  config.log_every_steps = 20
  config.checkpoint_every_steps = 200
  return config
