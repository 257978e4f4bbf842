"""`affnist` in minutes on a CPU: small models of similar size (2.64M and 2.85M
parameters), 10 000 training digits, stopped at 93 % on 2 000 expanded-MNIST test digits
(or after 800 steps), tested on 2 000 affine digits."""
from capsjax.experiments import affnist


def get_config():
  config = affnist.get_config()
  config.experiment = 'affnist_smoke'
  config.num_train_examples = 10000
  config.num_test_examples = 2000
  config.num_steps = 800
  config.batch_size = 64
  config.lr_decay_steps = 400
  config.stop_at_test_accuracy = 0.93
  config.eval_every_steps = 50
  config.log_every_steps = 50
  config.checkpoint_every_steps = 50
  config.model.conv1_channels = 32
  config.model.primary_types = 8
  config.model.decoder_hidden = (256, 512)
  config.cnn.model.conv_channels = (64, 64, 32)
  config.cnn.model.dense = (2048, 512)
  return config
