"""Helpers shared by the test modules (no test module imports another)."""
import os

from capsjax.data.idx import write_idx
from capsjax.experiments import mnist


# The evaluators (capsjax.evaluators) compile their own programs at a run's first
# evaluation, seconds each: a test that does not assert on them turns them off.
EVALUATORS = ('routing_probe', 'routing_diagnostics', 'reconstructions')
EVALUATORS_OFF_FLAGS = tuple(f'--config.evals.{name}.enabled=False' for name in EVALUATORS)


def evaluators_off(config, keep=()):
  """Every evaluator but those in `keep` off in `config` (in place; returned)."""
  for name in EVALUATORS:
    if name not in keep:
      config.evals[name].enabled = False
  return config


# conv_impl where a test's model only has to run: the flag for a command's argument list too.
SPEEDY_CONV = 'space_to_depth'
SPEEDY_CONV_FLAG = f'--config.model.formulation.conv_impl={SPEEDY_CONV}'


def tiny_config(data_dir, **overrides):
  """A CapsNet small enough for a few CPU seconds per run."""
  config = mnist.get_config()
  config.data_dir = data_dir
  config.model.conv1_channels = 16
  config.model.primary_types = 4
  config.model.decoder_hidden = (32, 64)
  config.num_train_examples = 256
  config.num_test_examples = 100
  config.batch_size = 32
  config.num_steps = 6
  config.log_every_steps = 2
  config.log_every_seconds = 0.0   # the rows at the steps the tests name, on a loaded machine too
  # The strided convolution as a unit-stride one on pixel blocks (space_to_depth): at 28 px
  # and these widths its program compiles and trains faster than XLA's own or the patches
  # form (from 36 px on, XLA's own is faster, measured when the tests chose it); a
  # test of the CPU's 'auto' choice sets conv_impl itself, and the formulation tests cover
  # each form.
  config.model.formulation.conv_impl = SPEEDY_CONV
  config.eval_every_steps = 0
  config.eval_batch_size = 100
  config.checkpoint_every_steps = 2
  # The evaluators compile their own programs at the first evaluation (seconds each):
  # off here; the tests that assert on them turn them on (the diagnostics: test_train's real
  # MNIST run, test_diagnostics, the zoo's test; the routing probe: test_analyses; the
  # reconstruction images: test_images; their schedule: test_hooks).
  evaluators_off(config)
  for key, value in overrides.items():
    setattr(config, key, value)
  return config


def write_idx_split(folder, split, images, labels, compress=True):
  """MNIST's IDX file pair of `split` ('train' or 'test') in `folder`."""
  prefix = 'train' if split == 'train' else 't10k'
  suffix = '.gz' if compress else ''
  write_idx(os.path.join(folder, f'{prefix}-images-idx3-ubyte{suffix}'), images, compress)
  write_idx(os.path.join(folder, f'{prefix}-labels-idx1-ubyte{suffix}'), labels, compress)
