"""A hyper-parameter sweep in minutes on a CPU: learning rate, decay, batch size and shift
augmentation around a small CapsNet on 2 000 MNIST images (all 10 000 test images).

  python run.py --experiment=sweep_smoke --workdir=W --config.data_dir=../shared/data/mnist

For the paper-size model, start from `experiments/mnist.py` the same way (see BUILD.md).
"""
import ml_collections

from capsjax.experiments import mnist_smoke


def get_config():
  config = mnist_smoke.get_config()
  config.experiment = 'sweep_smoke'
  config.program = 'sweep'
  config.num_train_examples = 2000
  config.num_epochs = 0.0
  config.num_steps = 250
  config.batch_size = 32
  config.lr_decay_steps = 200
  config.log_every_steps = 50
  config.checkpoint_every_steps = 250
  config.evals.routing_probe.enabled = False
  config.sweep = ml_collections.ConfigDict(dict(variants=(
      'base:',
      'seed_1: seed=1',            # the same config, another seed: the noise level
      'seed_2: seed=2',
      'lr_3e-3: learning_rate=3e-3',
      'lr_3e-4: learning_rate=3e-4',
      'no_decay: lr_decay_rate=1.0',
      'fast_decay: lr_decay_steps=50',
      'batch_64: batch_size=64, num_steps=125',
      'no_shift: max_shift=0',
      'shift_3: max_shift=3',
  )))
  return config
