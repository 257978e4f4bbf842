"""`validate(config)`: every value checked before any data is read or anything compiled.

The library's own check: `train_and_evaluate` and `plan_run` run it first (`build_model`
checks its model section the same way), and the command runs the same one (a bad value from Python raises the ConfigError
whose line the command prints).

Each config key's rule is declared with the key, where the code that reads it lives
(capsjax.keys; `declared(config)` below lists them for a config: the run's keys, the
evaluators', and the model's and loss's of the family and objective the config names). A config that breaks
one raises ConfigError with one line: `config.KEY=VALUE: allowed ...`; a key no declaration
has, the command's `unknown config key 'KEY'`. Below the rules of
single keys, the rules across keys. Comparison models (`baseline.model`, `cnn.model`) are
checked as the run's model is. An experiment program's section (routing_zoo.*, sweep.*) is
checked once its module has registered it (capsjax.defaults.register_section: the program's
`KEYS`, `RULES` and `config_problems(config)`).
"""
import difflib
import os
import re
from typing import Iterator, List, Tuple

import ml_collections

from capsjax import assemble, defaults
from capsjax.errors import ConfigError, WorkdirError
from capsjax.evaluators import EVALUATORS, evaluator_keys
from capsjax.keys import Key, RegisteredTuple, check_values, int_at_least, lookup
from capsjax.layout import moved_key_hint
from capsjax.models import MODELS, model_keys, model_problems
from capsjax.objectives import OBJECTIVES, loss_keys
from capsjax.routing import ROUTINGS, routing_option_keys

# Sections holding a comparison model (their own `model` and `loss`, checked as the run's).
COMPARISON_MODELS = ('baseline', 'cnn')


def declared(config) -> Iterator[Tuple[str, Key]]:
  """(dotted key, its declaration) for every key `config` may hold: the run's, and for its
  model and loss (and a comparison model's, `baseline.model`, `cnn.loss`) those of the
  family and objective it names, with each routing's options under model.routing_options."""
  yield from defaults.run_keys(defaults.registered_sections()).items()
  for name in EVALUATORS:
    for key in evaluator_keys(name).values():
      yield f'evals.{name}.{key.name}', key
  for prefix in ('',) + tuple(f'{name}.' for name in COMPARISON_MODELS):
    found, model = lookup(config, prefix + 'model')
    if found and hasattr(model, 'keys'):
      family = model.get('name', 'capsnet')
      for key in model_keys(family if family in MODELS else 'capsnet').values():
        yield f'{prefix}model.{key.name}', key
      for routing in ROUTINGS.names():
        for key in routing_option_keys(routing).values():
          yield f'{prefix}model.routing_options.{routing}.{key.name}', key
    found, loss = lookup(config, prefix + 'loss')
    if found and hasattr(loss, 'keys'):
      objective = loss.get('name', 'capsnet')
      for key in loss_keys(objective if objective in OBJECTIVES else 'capsnet').values():
        yield f'{prefix}loss.{key.name}', key


def _check_loss(loss, model, prefix: str, problems: List[str]) -> None:
  name = loss.get('name')
  if name not in OBJECTIVES:
    problems.append(f'config.{prefix}name={name!r}: allowed one of {", ".join(OBJECTIVES.names())}')
    return
  before = len(problems)
  check_values(loss, loss_keys(name), problems, prefix)
  if len(problems) > before or model.get('name') not in MODELS:
    return
  objective, family = OBJECTIVES[name], MODELS[model.name]
  if model.name not in objective.families:
    trained_with = ' or '.join(repr(name) for name in family.objectives) or 'its own'
    problems.append(f'config.{prefix}name={loss.name!r}: a {model.name!r} model is trained with the '
                    f'{trained_with} loss')
  problems.extend(objective.check(loss, prefix))


def _check_evals(evals, problems: List[str]) -> None:
  """config.evals: a section per registered evaluator, each of its declared keys."""
  if not hasattr(evals, 'items'):
    problems.append(f'config.evals={evals!r}: allowed a dict: evaluator name → its section')
    return
  for name, section in evals.items():
    if name not in EVALUATORS:
      problems.append(f'config.evals.{name}: no evaluator {name!r} is registered (allowed: '
                      f'{", ".join(EVALUATORS.names())})')
      continue
    declared = evaluator_keys(name)
    unknown = [key for key in (section.keys() if hasattr(section, 'keys') else ()) if key not in declared]
    if unknown:
      problems.append(f'config.evals.{name}.{unknown[0]}: not a key of the {name!r} evaluator (its keys: '
                      f'{", ".join(declared)})')
    check_values(section, declared, problems, f'evals.{name}.')


def _across_problems(config) -> List[str]:
  """The lines of the rules across keys (each section's RULES: capsjax.keys.Across) that
  `config` breaks; a run-level key it lacks at its declared default, another as None."""
  declared = defaults.run_keys(defaults.registered_sections())
  problems = []
  for module in defaults.SECTIONS + defaults.registered_sections():
    for rule in getattr(module, 'RULES', ()):
      values = []
      for name in rule.keys:
        found, value = lookup(config, name)
        values.append(value if found else declared[name].default if name in declared else None)
      line = rule.problem(*values)
      if line:
        problems.append(line)
  return problems


def _sections_of(names) -> set:
  """Every section that holds one of the dotted key `names`, at any depth ('model.formulation.dtype' →
  'model', 'model.formulation')."""
  return {'.'.join(parts[:depth]) for parts in (name.split('.') for name in names) for depth in range(1, len(parts))}


def _undeclared_problems(config) -> List[str]:
  """A key no declaration has, one line each, as the command says it for an unknown
  override: from Python, `config.lerning_rate = 0.1` adds a key to the ConfigDict, which
  the run would never read. The model, loss and evaluator sections name theirs in their
  own checks; a section of a program not yet imported (its keys unregistered) is its own."""
  checked_apart = {'model', 'loss', 'evals'} | {f'{name}.{part}' for name in COMPARISON_MODELS for part in ('model', 'loss')}
  names = {name for name, _ in declared(config)}
  # Every section holding a declared key, at any depth. (A comparison model's own keys do
  # not make its section known: its program's keys do.)
  sections = _sections_of({name for name in names if not name.startswith(tuple(s + '.' for s in checked_apart))})
  problems = []

  def walk(section, prefix: str) -> None:
    for key in section.keys():
      dotted, value = prefix + key, section[key]
      if dotted in checked_apart:
        continue
      if dotted in sections and hasattr(value, 'keys'):
        walk(value, dotted + '.')
        continue
      if dotted in names or dotted in sections or (not prefix and hasattr(value, 'keys')):
        continue   # declared; or a section of a program not imported yet
      siblings = sorted({name[len(prefix):].split('.')[0] for name in names | sections if name.startswith(prefix)})
      match = difflib.get_close_matches(key, siblings, 1, 0.75)   # (ml_collections' rule for the command's hint)
      problems.append(f'unknown config key {dotted!r}' + (f" (did you mean '{prefix}{match[0]}'?)" if match else '')
                      + moved_key_hint(dotted))

  walk(config, '')
  return problems


def _none_section_problems(config) -> List[str]:
  """A section (a group of keys: model, loss, evals, augment, …) set to None, one line each:
  it once passed, and the run failed on it after the data was read."""
  names = {name for name, _ in declared(config)}
  sections = _sections_of(names) - names   # (a key that may itself be None is declared)
  sections |= {prefix + part for prefix in ('',) + tuple(f'{name}.' for name in COMPARISON_MODELS)
               for part in ('model', 'loss')}   # (declared() names their keys only when they are sections)
  problems = []
  for section in sorted(sections):
    found, value = lookup(config, section)
    if found and value is None:
      problems.append(f'config.{section}=None: allowed a section of its keys, not None')
  return problems


def problems_of(config) -> List[str]:
  """Every rule `config` breaks, one line each (empty when it is valid)."""
  problems: List[str] = _none_section_problems(config)
  if problems:
    return problems
  problems = _undeclared_problems(config)
  check_values(config, defaults.run_keys(defaults.registered_sections()), problems)
  found, evals = lookup(config, 'evals')
  if found:
    _check_evals(evals, problems)
  for prefix in ('',) + tuple(f'{name}.' for name in COMPARISON_MODELS):
    found, model = lookup(config, prefix + 'model')
    if found:
      if not prefix:   # a program training other routings checks their sections as its members'
        for module in defaults.registered_sections():
          model = getattr(module, 'model_as_checked', lambda config, model: model)(config, model)
      problems.extend(model_problems(model, prefix + 'model.'))
      found_loss, loss = lookup(config, prefix + 'loss')
      if found_loss:
        _check_loss(loss, model, prefix + 'loss.', problems)
  if problems:
    return problems
  problems.extend(_across_problems(config))   # the rules across keys, declared beside them
  found, recipes = lookup(config, 'ensemble.recipes')
  if found and recipes:
    problems.extend(_recipe_problems(config))
  elif config.get('ensemble'):
    problems.extend(_member_problems(config))
  for module in defaults.registered_sections():   # what only a program can check (its members)
    problems.extend(getattr(module, 'config_problems', lambda config: [])(config))
  return problems




def _recipe_problems(config) -> List[str]:
  """Each recipe of config.ensemble.recipes checked as the config it makes (one line per
  rule broken, naming the recipe); its routing iterations bounded by the shared model's."""
  try:
    listed = assemble.recipes(config)
  except ConfigError as e:
    return [str(e)]
  problems = []
  for name, recipe in listed:
    recipe.ensemble.recipes = ()
    problems += [f'config.ensemble.recipes {name!r}: ' + line.removeprefix('config.') for line in problems_of(recipe)]
  return problems or _member_problems(config)


def _member_problems(config) -> List[str]:
  """What only the ensemble as a whole can break: its members' routing iterations above the
  shared model's bound, or varied for a routing that does not iterate."""
  try:
    assemble.members(config)
  except ConfigError as e:
    return [str(e)]
  return []


def split_name_lists(config) -> None:
  """Tuple-of-names keys given on the command line as one comma-separated word
  (`--config.routing_zoo.routings=dynamic,self_routing`, which the flag parser reads as a
  one-element tuple) become the tuple of those names, in place: run keys and model keys
  (`--config.model.routing_inputs=bias,leaky`) alike."""
  for key, declared_key in list(declared(config)):
    if not isinstance(declared_key.rule, RegisteredTuple):
      continue
    parent, _, leaf = key.rpartition('.')
    holder = config
    for part in filter(None, parent.split('.')):
      holder = holder.get(part) if holder is not None else None
    value = holder.get(leaf) if holder is not None else None
    if isinstance(value, (tuple, list)) and any(isinstance(v, str) and ',' in v for v in value):
      holder[leaf] = tuple(name.strip() for v in value for name in str(v).split(',') if name.strip())


def validate(config) -> None:
  """Raises ConfigError naming the first invalid key, its value and what is allowed: the
  line the command prints. `train_and_evaluate` and `plan_run` run it first; an
  experiment program's section is checked once the program is imported.

  Example:
    >>> config = capsjax.base_config()
    >>> capsjax.validate(config)            # the paper's setup: nothing to say
    >>> config.batch_size, config.model.routing = 0, 'dynamical'
    >>> capsjax.validate(config)
    Traceback (most recent call last):
    ...
    capsjax.errors.ConfigError: config.batch_size=0: allowed an integer >= 1 (and 1 more problem(s))
  """
  if not isinstance(config, ml_collections.ConfigDict):   # (a dict once failed deep inside, unnamed)
    raise ConfigError(f'a config is an ml_collections.ConfigDict (capsjax.base_config(), or an experiment\'s '
                      f'get_config()), got {type(config).__name__}')
  _check_complete(config)
  problems = problems_of(config)
  if problems:
    more = f' (and {len(problems) - 1} more problem(s))' if len(problems) > 1 else ''
    raise ConfigError(problems[0] + more)


def _check_complete(config: ml_collections.ConfigDict) -> None:
  """A run's config has every top-level key of base_config (a section alone, `config.model`,
  passed every key it has and then failed inside as a KeyError)."""
  required = {key.name.split('.')[0] for key in defaults.run_keys().values() if key.in_base}
  required |= {'evals', 'loss', 'model'}   # the sections base_config fills from their registries
  missing = sorted(required - set(config.keys()))
  if not missing:
    return
  base = defaults.base_config()
  section = next((name for name in sorted(base) if isinstance(base[name], ml_collections.ConfigDict)
                  and name in missing and set(config.keys()) <= set(base[name].keys()) | {'formulation'}), None)
  shown = ', '.join(missing[:4]) + (f' and {len(missing) - 4} more' if len(missing) > 4 else '')
  raise ConfigError(f"a run's config lacks {shown}" + (
      f': this is config.{section}, one section; give the whole config' if section else '') +
      " (capsjax.base_config(), or an experiment's get_config(), has every key)")


def check_training_call(config, workdir, stop_at_step) -> str:
  """train_and_evaluate's arguments as the command checks them (its --workdir is required):
  validate(config), a workdir that names a folder (an empty one once trained into the
  current folder), stop_at_step by config.stop_at_step's rule. Returns the workdir, a str."""
  validate(config)
  if not isinstance(workdir, (str, os.PathLike)) or not os.fspath(workdir).strip():
    raise WorkdirError(f'a workdir is required to train: a folder path, got {workdir!r}')
  check_local_workdir(os.fspath(workdir))
  if stop_at_step is not None and not int_at_least(0)(stop_at_step):
    raise ConfigError(f'stop_at_step={stop_at_step!r}: allowed {int_at_least(0)} (0 or None: the run\'s own end)')
  return os.fspath(workdir)


def check_local_workdir(workdir: str) -> None:
  """WorkdirError for a URL (gs://bucket/run, s3://…): a workdir is written with local file
  operations and a file lock, which would make a folder named `gs:` on every host."""
  if re.match(r'^[A-Za-z][A-Za-z0-9+.-]*://', workdir):
    raise WorkdirError(f'workdir {workdir!r}: a bucket is not a workdir (runs write files and lock them); mount it '
                       '(gcsfuse --implicit-dirs BUCKET /mnt/BUCKET) and give the mounted path. gcsfuse has no '
                       'file locks: start one training per workdir')


# ----------------------------------------------------------------------------- key help
# `run.py --experiment=NAME --help`: each key's help line and allowed values, from its
# declaration (capsjax.keys), for the family and objective the config names.

def _declaration(key: str, config=None):
  config = defaults.base_config() if config is None else config
  return dict(declared(config)).get(key)


def allowed(key: str, config=None) -> str:
  """What config.KEY allows (dotted key) in `config` (default: the base config), or ''."""
  declared = _declaration(key, config)
  return str(declared.rule) if declared is not None and declared.rule is not None else ''


def key_help(key: str, config=None) -> str:
  """'help [allowed]' of config.KEY (dotted) in `config` (default: the base config), for
  --help; '' when undeclared."""
  declared = _declaration(key, config)
  if declared is None:
    return ''
  rule = str(declared.rule) if declared.rule is not None else ''
  return f'{declared.help} [{rule}]' if declared.help and rule else declared.help
