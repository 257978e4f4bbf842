"""What helped: the paper's MNIST recipe against each choice of the authors' code, one at a
time and all together, and the recipe of the budgeted search (`mnist_fast`), 3 seeds each
(one vmapped program per variant), ranked on a held-out validation split (the last 10 000 training images), test error beside it.

  python run.py --experiment=recipes --workdir=W [--config.num_steps=100000]

Default length: 50 epochs per variant on 50 000 training images (19 500 steps of 128).
At the 24.7k images/s reported for one H100, 8 variants × 3 seeds are ≈ 45 min (an
estimate: not run yet, see docs/results.md); on a CPU, use the sweep_smoke scale.
"""
import ml_collections

from capsjax.experiments import mnist_seeds


def get_config():
  config = mnist_seeds.get_config()
  config.experiment = 'recipes'
  config.program = 'sweep'
  config.validation_examples = 10000
  config.num_epochs = 50.0
  config.eval_every_steps = 3910       # every 10 epochs of 50 000 images
  config.checkpoint_every_steps = 3910
  config.sweep = ml_collections.ConfigDict(dict(variants=(
      'paper:',
      'official_margin: loss.margin_reduction="official"',
      'official_init: model.init_scheme="official"',
      'digit_bias: model.routing_inputs=("bias",)',
      'primary_scale: model.primary_scale_by_types=True',
      'lr_floor: lr_min=1e-6',
      'official: loss.margin_reduction="official", model.init_scheme="official", model.routing_inputs=("bias",), '
      'model.primary_scale_by_types=True, lr_min=1e-6',
      # The recipe the budgeted search chose (experiments/mnist_fast.py).
      'fast: learning_rate=3e-3, lr_schedule="cosine", lr_min=1e-5, warmup_steps=100, warmup_max_fraction=0.25, '
      'augment.rotation=10.0, augment.scale=0.1, augment.shear=0.1',
  )))
  return config
