"""The routing zoo in minutes on a CPU: mnist_smoke's reduced CapsNet, 2 seeds per routing,
300 steps on 5 000 MNIST training images (1 000 more held out for validation), 2 000 test
images."""
from experiments import mnist_smoke
from experiments import routing_zoo


def get_config():
  config = routing_zoo.get_config()
  smoke = mnist_smoke.get_config()
  config.experiment = 'routing_zoo_smoke'
  config.model = smoke.model
  config.model.decoder_hidden = (256, 512)
  config.routing_zoo.seeds = (0, 1)
  config.num_train_examples = 5000
  config.validation_examples = 1000
  config.num_test_examples = 2000
  config.num_steps = 300
  config.batch_size = 64
  config.lr_decay_steps = 200
  config.log_every_steps = 25
  config.eval_every_steps = 100
  config.checkpoint_every_steps = 300
  return config
