"""The routing zoo at a size a 2-core CPU finishes within the hour and that separates the
algorithms: every registered routing of the zoo's list × 3 seeds (one vmapped program per
routing), small CapsNets (routing_zoo_smoke's sizes), 600 steps of 32 on the training
split less 5 000 held-out validation images, all 10 000 test images; selection on
validation only.

  python run.py --experiment=routing_zoo_cpu --workdir=W --config.data_dir=../shared/data/mnist
  python run.py --experiment=routing_zoo_cpu --workdir=W --config.dataset=fashion_mnist \\
      --config.data_dir=/usr/share/datasets/fashion-mnist

Results, command, machine and date: docs/results.md, "Routing algorithms side by side".
"""
from capsjax.experiments import routing_zoo_smoke


def get_config():
  config = routing_zoo_smoke.get_config()
  config.experiment = 'routing_zoo_cpu'
  config.routing_zoo.seeds = (0, 1, 2)
  config.num_train_examples = 0        # all of the training split but the validation images
  config.validation_examples = 5000
  config.num_test_examples = 0         # all of the test split
  config.num_steps = 600
  config.lr_decay_steps = 200
  config.log_every_steps = 50
  config.eval_every_steps = 200
  config.checkpoint_every_steps = 200
  config.routing_zoo.speed_rounds = 3
  return config
