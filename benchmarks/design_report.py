"""The package's shape, measured: where its lines are and where the config goes.

  python benchmarks/design_report.py [--data_dir=DIR]

1. Lines of `capsjax/`: the core (routing, losses, layers, models, ops, objectives, steps,
   data: the model and its training step), the rest of the library (capsjax/ outside
   app/), the application (capsjax/app/, the package's __init__ and __main__), and the
   share of the library that is not core.
2. The config's reach: a 4-step `mnist_smoke` run through `train_and_evaluate` with a
   profiler that notes every capsjax function entered with a ConfigDict among its
   arguments or captured variables (the config, a section of it, or a copy): the modules
   it reaches, in order, and how often the path returns to a module it had left.
"""
import argparse
import contextlib
import glob
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ('routing', 'losses', 'layers', 'models', 'ops', 'objectives', 'steps', 'data')


def line_counts() -> dict:
  counts = {'core': 0, 'library_rest': 0, 'application': 0}
  for path in glob.glob(os.path.join(ROOT, 'capsjax', '**', '*.py'), recursive=True):
    top = os.path.relpath(path, os.path.join(ROOT, 'capsjax')).split(os.sep)[0].removesuffix('.py')
    with open(path) as f:
      lines = len(f.readlines())
    part = ('application' if top in ('app', '__init__', '__main__') else 'core' if top in CORE else 'library_rest')
    counts[part] += lines
  counts['rest_share_of_library'] = counts['library_rest'] / (counts['core'] + counts['library_rest'])
  return counts


SUBPACKAGES = ('models', 'data', 'routing', 'app')
CHECKS = {('capsjax.validation', 'validate'), ('capsjax.models', 'model_problems')}


@contextlib.contextmanager
def config_probe():
  """While active (this thread), notes every capsjax function entered with a ConfigDict
  among its arguments or captured variables: yields the list of their modules in order
  (a module listed again only after another). A check (capsjax.validation.validate, and
  build_model's of its model section, models.model_problems) counts as its own module
  alone: it reads every key where the key's rule is declared, by design. A subpackage's
  modules (capsjax.models.*, capsjax.data.*) count as the subpackage, as the import chain
  of tests/test_design.py counts them."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  path = []
  checking = []   # the frame of validate while it runs

  def profile(frame, event, arg):
    del arg
    module = frame.f_globals.get('__name__', '')
    if module.count('.') > 1 and module.split('.')[1] in SUBPACKAGES:
      module = '.'.join(module.split('.')[:2])
    if checking:
      if event == 'return' and frame is checking[0]:
        checking.clear()
      return
    if event == 'call' and (module, frame.f_code.co_name) in CHECKS:
      checking.append(frame)
    if event == 'call' and module.startswith('capsjax.') and any(
        isinstance(value, ml_collections.ConfigDict) for value in frame.f_locals.values()):
      if not path or path[-1] != module:
        path.append(module)

  sys.setprofile(profile)
  try:
    yield path
  finally:
    sys.setprofile(None)


def returns(path: list) -> int:
  """How often `path` comes back to a module it had left."""
  return len(path) - len(dict.fromkeys(path))


def config_path(data_dir: str) -> list:
  from capsjax import train  # pylint: disable=g-import-not-at-top
  from capsjax.experiments import mnist_smoke  # pylint: disable=g-import-not-at-top
  config = mnist_smoke.get_config()
  config.data_dir = data_dir
  config.num_steps, config.num_train_examples, config.num_test_examples = 4, 256, 128
  for name in config.evals:
    config.evals[name].enabled = False
  with config_probe() as path:
    train.train_and_evaluate(config, tempfile.mkdtemp())
  return path


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--data_dir', default='', help='a folder of the MNIST IDX files (default: TFDS)')
  args = parser.parse_args()
  counts = line_counts()
  print(f"lines: core {counts['core']}, rest of the library {counts['library_rest']}, application "
        f"{counts['application']}; the rest is {100 * counts['rest_share_of_library']:.1f} % of the library")
  path = config_path(args.data_dir)
  reached = list(dict.fromkeys(path))
  print(f'the config reaches {len(reached)} modules: {", ".join(m.removeprefix("capsjax.") for m in reached)}')
  print(f'path ({returns(path)} returns to a module already left): '
        + ' → '.join(m.removeprefix('capsjax.') for m in path))
  return 0


if __name__ == '__main__':
  sys.exit(main())
