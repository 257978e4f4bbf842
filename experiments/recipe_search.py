"""The budgeted recipe search on a CPU: the paper's recipe against optimizers, schedules, a
moving average, clipping and augmentation, each one epoch on `mnist_smoke`'s small CapsNet,
chosen on the last 5 000 training images held out (the test error is reported, never used).

  python run.py --experiment=recipe_search --workdir=W --config.data_dir=DIR

One epoch of 55 000 images per variant (859 steps of 64), 4–5 minutes each on a 2-core
CPU (50 min in all, 2026-11-25); writes sweep.md. The winner is confirmed on the paper's model at two epochs
(the recipe issue; docs/results.md "Training in the time you have").
"""
import ml_collections

from capsjax.experiments import mnist_smoke

# The search's common ground for the new recipes: cosine decay to 1e-5 after a warm-up.
_COSINE = 'lr_schedule="cosine", lr_min=1e-5, warmup_steps=100'


def get_config():
  config = mnist_smoke.get_config()
  config.experiment = 'recipe_search'
  config.program = 'sweep'
  config.validation_examples = 5000
  config.num_train_examples = 0      # all 55 000 that are not held out
  config.num_epochs = 1.0
  config.eval_every_steps = 0        # at the end of each variant
  config.checkpoint_every_steps = 430
  config.log_every_steps = 100
  config.evals.routing_probe.enabled = False
  config.evals.routing_diagnostics.enabled = False
  config.sweep = ml_collections.ConfigDict(dict(variants=(
      'paper:',                                        # Adam 1e-3, ×0.96 every 200 steps, ±2 px shifts
      'paper_seed_1: seed=1',                          # the same, other seeds: the noise level
      'paper_seed_2: seed=2',
      'lr_3e-3: learning_rate=3e-3',
      f'cosine: {_COSINE}',
      f'cosine_3e-3: learning_rate=3e-3, {_COSINE}',
      f'adamw: optimizer="adamw", weight_decay=1e-4, learning_rate=3e-3, {_COSINE}',
      f'lion: optimizer="lion", weight_decay=1e-2, learning_rate=3e-4, {_COSINE}',
      f'clip: grad_clip_norm=1.0, learning_rate=3e-3, {_COSINE}',
      f'ema: ema_decay=0.99, learning_rate=3e-3, {_COSINE}',
      f'affine: augment.rotation=10.0, augment.scale=0.1, augment.shear=0.1, learning_rate=3e-3, {_COSINE}',
      f'elastic: augment.elastic_alpha=16.0, learning_rate=3e-3, {_COSINE}',
  )))
  return config
