"""`images` with mnist_fast's recipe: your own images trained with the recipe that won the
budgeted search on held-out MNIST images (Adam at 3e-3 after a 100-step warm-up, at most a
quarter of a shorter run, cosine decay to 1e-5, small random rotations, scalings and shears
before the shifts).

  python run.py --experiment=images_fast --config.data_dir=DIR --workdir=W [--config.num_epochs=N]

The recipe was chosen on MNIST, not on your data: hold out images of your own
(--config.validation_examples=K) to see whether it helps there. Digits and other
orientation-bound classes may want --config.augment.rotation smaller.
"""
from capsjax.experiments import images
from capsjax.experiments import mnist_fast

# What mnist_fast changes in the paper's recipe (one place: mnist_fast.py).
RECIPE_KEYS = ('learning_rate', 'lr_schedule', 'lr_min', 'warmup_steps', 'warmup_max_fraction')
RECIPE_AUGMENTATION = ('rotation', 'scale', 'shear')


def get_config():
  config = images.get_config()
  fast = mnist_fast.get_config()
  config.experiment = 'images_fast'
  for key in RECIPE_KEYS:
    config[key] = fast[key]
  for key in RECIPE_AUGMENTATION:
    config.augment[key] = fast.augment[key]
  return config
