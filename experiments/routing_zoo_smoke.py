"""The routing zoo in minutes on a CPU: small CapsNets (ablation_smoke's sizes), 2 seeds per
routing, 200 steps of 32 on 4 000 MNIST training images (1 000 more held out for
validation), 2 000 test images."""
from capsjax.experiments import routing_zoo


def get_config():
  config = routing_zoo.get_config()
  config.experiment = 'routing_zoo_smoke'
  config.model.conv1_channels = 32
  config.model.primary_types = 8
  config.model.decoder_hidden = (256, 512)
  config.routing_zoo.seeds = (0, 1)
  config.num_train_examples = 4000
  config.validation_examples = 1000
  config.num_test_examples = 2000
  config.num_steps = 200
  config.batch_size = 32
  config.lr_decay_steps = 100
  config.log_every_steps = 25
  config.eval_every_steps = 50
  config.checkpoint_every_steps = 200
  return config
