"""Train and evaluate an experiment: `python run.py --experiment=NAME --workdir=DIR`.

  --experiment=NAME      the config module experiments/NAME.py
  --workdir=DIR          checkpoints, metrics.jsonl and results.json (resumes from it)
  --config.KEY=VALUE     override any config field, e.g. --config.data_dir=../data/mnist
  --summary              print the model's parameter table and num_params=N, then exit
  --show_config          print every config key with its value (after overrides), then exit
  --help                 this text and the experiments; with --experiment=NAME, its config keys
"""
import importlib
import logging
import os
import pkgutil
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

ROOT = os.path.dirname(os.path.abspath(__file__))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import experiments  # pylint: disable=g-import-not-at-top

flags.DEFINE_string('experiment', None, 'Experiment name: a module in experiments/.')
flags.DEFINE_string('workdir', None, 'Directory for checkpoints, metrics and results.')
flags.DEFINE_bool('summary', False, 'Print the parameter table and exit.')
flags.DEFINE_bool('show_config', False, 'Print every config key with its value and exit.')
FLAGS = flags.FLAGS

# config.program → the function(config, workdir) that runs it (default 'train').
PROGRAMS = {
    'train': 'capsjax.train:train_and_evaluate',
    'ablation': 'capsjax.ablation:run',
    'affnist': 'capsjax.affnist:run',
    'sweep': 'capsjax.sweep:run',
}


def available_experiments():
  return sorted(m.name for m in pkgutil.iter_modules(experiments.__path__))


HELP_ARGS = ('--help', '-h', '--helpshort', '--helpfull', '-?')


def experiment_summary(name: str) -> str:
  """The first sentence of an experiment module's docstring."""
  doc = importlib.import_module(f'experiments.{name}').__doc__ or ''
  paragraph = ' '.join(doc.strip().split('\n\n')[0].split())
  sentence, dot, _ = paragraph.partition('. ')
  return sentence + ('.' if dot else '')


def config_lines(config, prefix: str = ''):
  """Every leaf of a config as 'key = value', in the experiment's order."""
  for key, value in config.items():
    if hasattr(value, 'items'):
      yield from config_lines(value, f'{prefix}{key}.')
    else:
      yield f'{prefix}{key} = {value!r}'


def print_help(name=None) -> None:
  print(__doc__.strip())
  if name is None:
    print('\nExperiments (--experiment=NAME):')
    names = available_experiments()
    width = max(map(len, names))
    for experiment in names:
      print(f'  {experiment.ljust(width)}  {experiment_summary(experiment)}')
    print('\n`python run.py --experiment=NAME --help` lists that experiment\'s config keys.')
    return
  config = load_experiment_config(name)
  print(f'\nExperiment {name}: {experiment_summary(name)}')
  print('\nConfig keys and defaults (override with --config.KEY=VALUE):')
  for line in config_lines(config):
    print(f'  {line}')


def _fail(message: str) -> None:
  print(f'error: {message}', file=sys.stderr)
  sys.exit(2)


def _experiment_from_argv(argv):
  """--experiment must be known before absl parses --config.KEY overrides."""
  for i, arg in enumerate(argv):
    if arg.startswith('--experiment='):
      return arg.split('=', 1)[1]
    if arg == '--experiment' and i + 1 < len(argv):
      return argv[i + 1]
  return None


def load_experiment_config(name: str):
  if name not in available_experiments():
    _fail(f'unknown experiment {name!r}; available: {", ".join(available_experiments())}')
  return importlib.import_module(f'experiments.{name}').get_config()


def print_summary(config) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp
  from capsjax.models import build_model

  model = build_model(config.model)
  dummy = jnp.zeros((1,) + tuple(config.model.input_shape), jnp.float32)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), dummy))['params']
  rows = [('/'.join(str(getattr(k, 'key', k)) for k in path), leaf.shape, leaf.size)
          for path, leaf in jax.tree_util.tree_leaves_with_path(shapes)]
  width = max(len(name) for name, _, _ in rows)
  print(f'{"parameter".ljust(width)}  {"shape":>22}  {"count":>10}')
  for name, shape, size in rows:
    print(f'{name.ljust(width)}  {str(tuple(shape)):>22}  {size:>10,}')
  total = sum(size for _, _, size in rows)
  print(f'{"total".ljust(width)}  {"":>22}  {total:>10,}')
  print(f'num_params={total}')


def main(argv):
  # JAX reports every accelerator plugin it did not find; that is noise on a CPU machine.
  logging.getLogger('jax._src.xla_bridge').setLevel(logging.WARNING)
  absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save step at INFO
  if len(argv) > 1:
    _fail(f'unexpected arguments: {" ".join(argv[1:])}')
  config = FLAGS.config
  if FLAGS.show_config:
    for line in config_lines(config):
      print(line)
    return
  from capsjax.errors import CapsjaxError  # pylint: disable=g-import-not-at-top
  from capsjax.validation import validate  # pylint: disable=g-import-not-at-top
  try:
    validate(config)   # before any data is read or anything compiled
  except CapsjaxError as e:
    _fail(str(e))
  if FLAGS.summary:
    print_summary(config)
    return
  if not FLAGS.workdir:
    _fail('--workdir is required to train')
  workdir = os.path.abspath(os.path.expanduser(FLAGS.workdir))
  program_name = config.get('program', 'train')
  if program_name not in PROGRAMS:
    _fail(f'unknown program {program_name!r}; available: {", ".join(sorted(PROGRAMS))}')
  module_name, function_name = PROGRAMS[program_name].split(':')
  program = getattr(importlib.import_module(module_name), function_name)
  from capsjax.sharding import initialize_distributed  # pylint: disable=g-import-not-at-top
  try:
    initialize_distributed(config)   # before any JAX computation
    program(config, workdir)
  except CapsjaxError as e:
    _fail(str(e))


def entry_point():
  name = _experiment_from_argv(sys.argv[1:])
  if any(arg in HELP_ARGS for arg in sys.argv[1:]):
    print_help(name)
    sys.exit(0)
  if name is None:
    _fail(f'--experiment=NAME is required; available: {", ".join(available_experiments())}')
  config = load_experiment_config(name)
  try:
    # Defining the flag already applies the --config.KEY=VALUE overrides in sys.argv.
    config_flags.DEFINE_config_dict('config', config, 'Experiment config.')
    remaining = FLAGS(sys.argv)
  except flags.Error as e:
    _fail(str(e).splitlines()[0])
  except (AttributeError, KeyError) as e:
    _fail(f'unknown config key in the overrides of experiment {name!r}: {e}')
  # The flags are parsed once, above: parsing again would apply each --config override a
  # second time (ml_collections then concatenates tuple values).
  app.run(main, argv=remaining)


if __name__ == '__main__':
  entry_point()
