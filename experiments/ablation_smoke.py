"""Table 1 in a few minutes on a CPU: small CapsNets and a narrowed baseline CNN on 2 000
MNIST training images, all 10 000 test images; same members as `ablation`."""
from capsjax.experiments import ablation


def get_config():
  config = ablation.get_config()
  config.experiment = 'ablation_smoke'
  config.num_train_examples = 2000
  config.num_steps = 150
  config.batch_size = 32
  config.lr_decay_steps = 100
  config.model.conv1_channels = 32
  config.model.primary_types = 8
  config.model.decoder_hidden = (256, 512)
  config.baseline.model.conv_channels = (32, 32, 16)
  config.log_every_steps = 25
  config.eval_every_steps = 0
  config.checkpoint_every_steps = 150
  return config
