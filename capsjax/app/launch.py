"""Train and evaluate an experiment: `capsjax --experiment=NAME --workdir=DIR`.

The command line of `capsjax` (the installed command), `python -m capsjax` and, in a
checkout, `python run.py`; an experiment whose config names a program (ablation, affnist,
sweep, routing_zoo) runs that program:

  --experiment=NAME      the config module experiments/NAME.py (or --config=path/to/config.py)
  --workdir=DIR          checkpoints, metrics.jsonl and results.json (resumes from it)
  --config.KEY=VALUE     override any config field, e.g. --config.data_dir=../data/mnist
  --summary              print the model's parameter table and num_params=N, then exit
  --show_config          print every config key with its value (after overrides), then exit
  --help                 this text and the experiments; with --experiment=NAME, its config keys

The experiments are config files (experiments/NAME.py, each with get_config()) in a
folder the caller names: run.py hands its own experiments/ folder to `entry_point`; the
installed commands use the package `capsjax.experiments` (the repository's experiments/,
installed under capsjax's name by setup.cfg). The library never imports the experiments.
"""
import ast
import importlib.util
import keyword
import logging
import os
import re
import sys
from typing import List, Optional

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from capsjax.app import cli

flags.DEFINE_string('experiment', None, 'Experiment name: a module in experiments/.')
flags.DEFINE_string('workdir', None, 'Directory for checkpoints, metrics and results.')
flags.DEFINE_bool('summary', False, 'Print the parameter table and exit.')
flags.DEFINE_bool('show_config', False, 'Print every config key with its value and exit.')
FLAGS = flags.FLAGS

HELP_ARGS = ('--help', '-h', '--helpshort', '--helpfull', '-?')

_EXPERIMENTS_DIR = None   # set by entry_point


EXPERIMENTS_PACKAGE = 'capsjax.experiments'


def installed_experiments_dir() -> str:
  """The folder of the installed experiments package (found, not imported)."""
  spec = importlib.util.find_spec(EXPERIMENTS_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    cli.fail(f'no {EXPERIMENTS_PACKAGE} package: install capsjax with pip (pip install -e . in a checkout)')
  return list(spec.submodule_search_locations)[0]


def available_experiments():
  return sorted(name[:-3] for name in os.listdir(_EXPERIMENTS_DIR)
                if name.endswith('.py') and not name.startswith('_'))


def experiment_path(name: str) -> str:
  return os.path.join(_EXPERIMENTS_DIR, f'{name}.py')


def experiment_summary(name: str) -> str:
  """The first sentence of an experiment file's docstring (read, not run)."""
  with open(experiment_path(name)) as f:
    doc = ast.get_docstring(ast.parse(f.read())) or ''
  paragraph = ' '.join(doc.strip().split('\n\n')[0].split())
  sentence, dot, _ = paragraph.partition('. ')
  return sentence + ('.' if dot else '')


def load_config_file(path: str, module_name: str):
  """A config file's get_config(), loaded from the file as config_flags loads it (its own
  imports run: a user's routing or source registers here)."""
  spec = importlib.util.spec_from_file_location(module_name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def load_experiment(name: str):
  """experiments/NAME.py's get_config()."""
  return load_config_file(experiment_path(name), f'{EXPERIMENTS_PACKAGE}.{name}')


def config_file_argument(argv) -> Optional[str]:
  """The path of --config=PATH (or --config PATH) among the arguments, if any."""
  for index, arg in enumerate(argv[1:], 1):
    if arg.startswith('--config='):
      return arg.split('=', 1)[1]
    if arg == '--config' and index + 1 < len(argv):
      return argv[index + 1]
  return None


def config_lines(config, prefix: str = ''):
  """Every leaf of a config as 'key = value'."""
  for key, value in config.items():
    if hasattr(value, 'items'):
      yield from config_lines(value, f'{prefix}{key}.')
    else:
      yield f'{prefix}{key} = {value!r}'


def print_help(name=None, config_path=None, doc: Optional[str] = None) -> None:
  print((doc or __doc__).strip())
  if name is None and config_path:
    if not os.path.isfile(config_path):
      cli.fail(f'--config={config_path}: no such file')
    print_keys(load_config_file(config_path, 'capsjax_user_config'), f'Config file {config_path}')
    return
  if name is None:
    print('\nExperiments (--experiment=NAME):')
    names = available_experiments()
    width = max(map(len, names))
    for experiment in names:
      print(f'  {experiment.ljust(width)}  {experiment_summary(experiment)}')
    print("\n`capsjax --experiment=NAME --help` (or python run.py …) lists that experiment's config keys.")
    return
  print_keys(load_experiment(name), f'Experiment {name}: {experiment_summary(name)}')


def print_keys(config, title: str) -> None:
  """Every key of `config` with its value, meaning and allowed values (the registries'
  names as they are now: a routing registered by the config file is listed)."""
  from capsjax.validation import key_help  # pylint: disable=g-import-not-at-top
  registered_programs()   # their sections' keys are listed with the run's
  print(f'\n{title}')
  print('\nConfig keys, defaults, what each does [allowed values] (override with --config.KEY=VALUE):')
  for line in config_lines(config):
    print(f'  {line}  — {key_help(line.split(" = ")[0], config)}')


def print_summary(config) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp
  from capsjax import assemble

  if 'input_shape' in config.model and not tuple(config.model.input_shape) or config.model.get('num_classes') == 0:
    config = assemble.resolve_data(config)   # a data-shaped experiment: the data's headers say the shape
  config, chosen = assemble.choose_model(config)
  if chosen:
    print(chosen)
  model = assemble.model(config)
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
  members = assemble.members(config)
  if members:   # one program trains them all; num_params stays per model
    print(f'ensemble: {len(members)} models × {total:,} = {len(members) * total:,} parameters')
  print(f'num_params={total}')


def override_problem(message: str) -> str:
  """absl's error for a --config.KEY=VALUE it could not parse, in the project's words:
  `config.KEY='VALUE': allowed …`; other flag errors as absl says them (first line)."""
  first = message.splitlines()[0]
  parsed = re.match(r"flag --config\.([\w.]+)=(.*?): (invalid literal for|could not convert)", first)
  if parsed:
    from capsjax.validation import allowed  # pylint: disable=g-import-not-at-top
    registered_programs()   # their sections' keys
    key, value = parsed.group(1), parsed.group(2)
    what = allowed(key) or 'a value of the type of its default'
    return f'config.{key}={value!r}: allowed {what}'
  return first


def unknown_key_problem(error: Exception, argv=(), experiment: Optional[str] = None) -> str:
  """ml_collections' KeyError for an unknown override as one line, with its suggestion
  (the key as the override spells it, found among `argv`)."""
  while error.args and isinstance(error.args[0], BaseException):   # AttributeError(KeyError(…))
    error = error.args[0]
  text = str(error.args[0] if error.args else error)
  key = re.match(r"""^['"]?([^'"\n]+)""", text)
  suggestion = re.search(r'Did you mean "([^"]+)"', text)
  name = key.group(1) if key else text
  spelt = [arg[len('--config.'):].split('=')[0] for arg in argv if arg.startswith('--config.')]
  dotted = next((path for path in spelt if path.split('.')[-1] == name or f'.{name}.' in f'.{path}.'), name)
  prefix = dotted[:dotted.index(name)] if name in dotted else ''
  from capsjax.layout import moved_key, moved_key_hint  # pylint: disable=g-import-not-at-top
  having = [] if suggestion or moved_key(dotted) else _experiments_with(dotted)
  return (f'unknown config key {dotted!r}'
          + (f" (did you mean '{prefix}{suggestion.group(1)}'?)" if suggestion else '')
          + moved_key_hint(dotted)
          + (_routing_options_hint(argv, experiment) if 'routing_options.' in dotted else '')
          + (f' in experiment {experiment!r}; experiments with it: {", ".join(having)}'
             if having and experiment else ''))


def _experiments_with(dotted: str) -> List[str]:
  """The experiments whose config has the key `dotted` (a section: not None there)."""
  having = []
  for other in available_experiments():
    try:
      value = load_experiment(other)
      for part in dotted.split('.'):
        value = value[part]
    except Exception:  # pylint: disable=broad-except
      continue
    if value is not None:
      having.append(other)
  return having


def _routing_options_hint(argv, experiment: Optional[str]) -> str:
  """'; routing 'em' takes the options …': the routing the command line (or the
  experiment) chooses, and what it takes."""
  # pylint: disable=g-import-not-at-top
  from capsjax.routing import ROUTINGS, routing_option_defaults
  given = [arg.split('=', 1)[1] for arg in argv if arg.startswith('--config.model.routing=')]
  name = given[-1] if given else None
  if name is None and experiment in available_experiments():
    spec = importlib.util.spec_from_file_location('_experiment_for_hint', experiment_path(experiment))
    module = importlib.util.module_from_spec(spec)
    try:
      spec.loader.exec_module(module)
      name = module.get_config().model.routing
    except Exception:  # pylint: disable=broad-except
      return ''
  if name not in ROUTINGS:
    return ''
  own = routing_option_defaults(name)
  return f"; routing {name!r} takes " + (
      f'the options {", ".join(f"model.routing_options.{name}.{option}" for option in own)}' if own else 'no options')


def malformed_key_problem(argv, name: Optional[str]) -> Optional[str]:
  """One line for an override whose key path is not made of Python names
  (`--config.batch-size=1`, `--config.lambda=1`: ml_collections would end in a traceback),
  with the key it likely means (hyphens as underscores) where the experiment has that one;
  or for a key given twice (ml_collections would join two tuples into one)."""
  for arg in argv[1:]:
    if not arg.startswith('--config.'):
      continue
    dotted = arg[len('--config.'):].split('=', 1)[0]
    if (re.fullmatch(r'[A-Za-z_]\w*(\.[A-Za-z_]\w*)*', dotted, flags=re.ASCII)
        and not any(keyword.iskeyword(part) for part in dotted.split('.'))):
      continue
    guess = '.'.join(re.sub(r'\W', '_', part, flags=re.ASCII) for part in dotted.split('.'))
    return f'unknown config key {dotted!r}' + (f" (did you mean '{guess}'?)" if _has_key(argv, name, guess) else '')
  given = [arg[len('--config.'):].split('=', 1)[0] for arg in argv[1:] if arg.startswith('--config.')]
  repeated = next((dotted for index, dotted in enumerate(given) if dotted in given[:index]), None)
  if repeated:
    return f'--config.{repeated} is given twice: give it once'
  return None


def _has_key(argv, name: Optional[str], dotted: str) -> bool:
  """Whether the experiment's (or --config file's) config has the key `dotted`."""
  try:
    path = config_file_argument(argv)
    value = load_config_file(path, 'capsjax_user_config') if path else load_experiment(name) if name else None
    for part in dotted.split('.'):
      value = value[part]
    return True
  except Exception:  # pylint: disable=broad-except
    return False


def missing_section_problem(section: str, argv, name: Optional[str]) -> str:
  """One line for an override inside a section that the experiment leaves None (such as
  --config.ensemble.seeds on `mnist`): which experiments have the section."""
  spelt = next((arg.split('=')[0] for arg in argv if arg.startswith(f'--config.{section}.')), f'--config.{section}')
  having = _experiments_with(section)
  return (f'{spelt}: experiment {name!r} has no {section!r} section (config.{section} is None there); '
          + (f'experiments with one: {", ".join(having)}' if having else 'no experiment has one'))


def parse_flags(argv, doc: Optional[str] = None):
  """absl parses --experiment first (known flags only); experiments/NAME.py then becomes
  the default of the ml_collections config-file flag --config, whose --config.KEY=VALUE
  overrides absl applies exactly once. Returns the arguments absl did not consume."""
  try:
    FLAGS(argv, known_only=True)
  except flags.Error as e:
    cli.fail(str(e).splitlines()[0])
  name = FLAGS.experiment
  if any(arg in HELP_ARGS for arg in argv[1:]):
    try:
      print_help(name if name in available_experiments() else None, config_file_argument(argv), doc)
      sys.stdout.flush()
    except BrokenPipeError:   # `run.py --help | head`
      os._exit(0)
    sys.exit(0)
  if name is not None and name not in available_experiments():
    cli.fail(f'unknown experiment {name!r}; available: {", ".join(available_experiments())}')
  FLAGS.unparse_flags()
  malformed = malformed_key_problem(argv, name)
  if malformed:
    cli.fail(malformed)
  try:
    config_flags.DEFINE_config_file('config', default=experiment_path(name) if name else None,
                                    help_string='Experiment config file.', sys_argv=argv)
    remaining = FLAGS(argv)
  except flags.Error as e:
    cli.fail(override_problem(str(e)))
  except (AttributeError, KeyError) as e:
    cli.fail(unknown_key_problem(e, argv, name))
  except ValueError as e:   # ml_collections: an override below a section that is None here
    section = re.search(r'field "([\w.]+)" is None', str(e))
    if not section:
      raise
    cli.fail(missing_section_problem(section.group(1), argv, name))
  if FLAGS.config is None:
    cli.fail(f'--experiment=NAME is required; available: {", ".join(available_experiments())}')
  return remaining


def quiet_logs() -> None:
  """JAX reports every accelerator plugin it did not find (noise on a CPU machine); orbax
  logs every save step at INFO."""
  logging.getLogger('jax._src.xla_bridge').setLevel(logging.WARNING)
  absl_logging.set_verbosity(absl_logging.WARNING)


@cli.main_wrapper
def main(argv):
  quiet_logs()
  if len(argv) > 1:
    cli.fail(f'unexpected arguments: {" ".join(argv[1:])}')
  config = FLAGS.config
  if FLAGS.show_config:
    try:
      for line in config_lines(config):
        print(line)
      sys.stdout.flush()
    except BrokenPipeError:   # `run.py --show_config | head`
      os._exit(0)
    return 0
  from capsjax.validation import check_local_workdir, split_name_lists, validate  # pylint: disable=g-import-not-at-top
  registered_programs()   # the built-in programs' sections are checked with the run's keys
  split_name_lists(config)   # --config.routing_zoo.routings=dynamic,self_routing
  validate(config)   # before any data is read or anything compiled
  cli.check_xla_flags()   # before JAX starts a backend: XLA would end the process its own way
  if FLAGS.summary:
    print_summary(config)
    return 0
  if not FLAGS.workdir:
    cli.fail('--workdir is required to train')
  check_local_workdir(FLAGS.workdir)   # before abspath would make gs://b/x a folder named gs:
  program = registered_programs().get(config.program)   # a registered name (validation)
  from capsjax.app.distributed import check_backend, initialize_distributed  # pylint: disable=g-import-not-at-top
  initialize_distributed(config.distributed, config.coordinator_address,   # before any JAX computation
                         config.num_processes, config.process_id, config.distributed_timeout_s,
                         config.local_devices)
  check_backend()
  program(config, os.path.abspath(os.path.expanduser(FLAGS.workdir)))   # RunStopped: exit 75
  return 0


def registered_programs():
  """capsjax.app.programs.PROGRAMS with the built-in programs registered."""
  # pylint: disable=g-import-not-at-top
  from capsjax.app.programs import PROGRAMS, ablation, affnist, routing_zoo, sweep
  del ablation, affnist, routing_zoo, sweep   # each module registers its program
  return PROGRAMS


def set_experiments_dir(experiments_dir: Optional[str] = None) -> None:
  """Where --experiment=NAME is found: `experiments_dir`, else the installed package's."""
  global _EXPERIMENTS_DIR
  _EXPERIMENTS_DIR = experiments_dir or installed_experiments_dir()


def entry_point(experiments_dir: Optional[str] = None):
  """The main of the `capsjax` command, `python -m capsjax` and run.py (which hands its
  experiments/ folder). Without `experiments_dir`, the installed package's folder."""
  set_experiments_dir(experiments_dir)
  argv = list(sys.argv)
  if argv[1:] == ['--version']:   # (before anything heavy is imported)
    from capsjax import __version__  # pylint: disable=g-import-not-at-top
    print(f'capsjax {__version__}')
    sys.exit(0)
  cli.as_program()
  remaining = parse_flags(argv)
  app.run(main, argv=remaining)
