"""`validate(config)`: every value checked before any data is read or anything compiled.

Each config key's rule is declared with the key, where the code that reads it lives
(capsjax.keys; `declared(config)` below lists them for a config: the run's keys, the
evaluators', and the model's and loss's of the family and objective the config names). A config that breaks
one raises ConfigError with one line: `config.KEY=VALUE: allowed ...`. Below the rules of
single keys, the rules across keys. Comparison models (`baseline.model`, `cnn.model`) are
checked as the run's model is.
"""
from typing import Dict, Iterator, List, Tuple

import ml_collections

from capsjax import assemble, defaults
from capsjax.app.programs import ablation, affnist, routing_zoo, sweep
from capsjax.errors import ConfigError
from capsjax.evaluators import EVALUATORS, evaluator_keys
from capsjax.formulations import conv_inputs_problem
from capsjax.keys import Key, RegisteredTuple
from capsjax.models import MODELS, model_keys
from capsjax.objectives import OBJECTIVES, loss_keys
from capsjax.routing import ROUTINGS, routing_option_defaults, routing_option_keys
from capsjax.layout import moved_key_hint

# The modules declaring experiment sections (baseline.*, affnist.*, routing_zoo.*, sweep.*):
# imported here, their rules and help lines are checked and shown with the base config's.
SECTION_OWNERS = (ablation, affnist, routing_zoo, sweep)
# Sections holding a comparison model (their own `model` and `loss`, checked as the run's).
COMPARISON_MODELS = ('baseline', 'cnn')


def declared(config) -> Iterator[Tuple[str, Key]]:
  """(dotted key, its declaration) for every key `config` may hold: the run's, and for its
  model and loss (and a comparison model's, `baseline.model`, `cnn.loss`) those of the
  family and objective it names, with each routing's options under model.routing_options."""
  yield from defaults.run_keys(SECTION_OWNERS).items()
  for name in EVALUATORS:
    for key in evaluator_keys(name).values():
      yield f'evals.{name}.{key.name}', key
  for prefix in ('',) + tuple(f'{name}.' for name in COMPARISON_MODELS):
    found, model = _get(config, prefix + 'model')
    if found and hasattr(model, 'keys'):
      family = model.get('name', 'capsnet')
      for key in model_keys(family if family in MODELS else 'capsnet').values():
        yield f'{prefix}model.{key.name}', key
      for routing in ROUTINGS.names():
        for key in routing_option_keys(routing).values():
          yield f'{prefix}model.routing_options.{routing}.{key.name}', key
    found, loss = _get(config, prefix + 'loss')
    if found and hasattr(loss, 'keys'):
      objective = loss.get('name', 'capsnet')
      for key in loss_keys(objective if objective in OBJECTIVES else 'capsnet').values():
        yield f'{prefix}loss.{key.name}', key


def _get(config, dotted: str):
  """(True, value) for an existing dotted key, else (False, None)."""
  node = config
  for part in dotted.split('.'):
    if node is None or not hasattr(node, 'keys') or part not in node.keys():
      return False, None
    node = node[part]
  return True, node


def _value(config, dotted: str):
  """`config`'s value of the run-level key `dotted`, or its declared default where a partial
  config lacks it (the default is read from the declaration, never repeated here)."""
  found, value = _get(config, dotted)
  return value if found else defaults.run_keys(SECTION_OWNERS)[dotted].default


def _check_keys(config, declared: Dict[str, Key], problems: List[str], prefix: str = '') -> None:
  """Each declared key's value by its rule; None passes only a key whose default is None
  (a section left out, a value chosen later): elsewhere the code would read None as a number."""
  for dotted, key in declared.items():
    found, value = _get(config, dotted)
    if value is None and key.default is None:
      continue
    if found and key.rule is not None and not key.rule(value):
      problems.append(f'config.{prefix}{dotted}={value!r}: allowed {key.rule}')


def _check_model(model, prefix: str, problems: List[str]) -> None:
  before = len(problems)
  family = model.get('name')
  if family not in MODELS:
    problems.append(f'config.{prefix}name={family!r}: allowed one of {", ".join(MODELS.names())}')
    return
  declared = model_keys(family)
  names = dict.fromkeys(name.split('.')[0] for name in declared)   # its keys and sections
  unknown = [key for key in model.keys() if key not in names]
  if unknown:
    problems.append(f'config.{prefix}{unknown[0]}: not a key of the {family!r} model (its keys: '
                    f'{", ".join(names)})' + moved_key_hint(prefix + unknown[0]))
  for section in (name for name in names if name not in declared):
    found, value = _get(model, section)
    keys_of = [name[len(section) + 1:] for name in declared if name.startswith(section + '.')]
    if found and not hasattr(value, 'keys'):
      problems.append(f'config.{prefix}{section}={value!r}: allowed a section of {", ".join(keys_of)}')
    elif found and any(key not in keys_of for key in value.keys()):
      other = next(key for key in value.keys() if key not in keys_of)
      problems.append(f'config.{prefix}{section}.{other}: not a key of model.{section} (its keys: '
                      f'{", ".join(keys_of)})')
  _check_keys(model, declared, problems, prefix)
  if 'routing_options' in declared:
    for routing in ROUTINGS.names():   # each routing's section by its own options' rules
      _check_keys(model, {f'routing_options.{routing}.{option}': key
                          for option, key in routing_option_keys(routing).items()}, problems, prefix)
  if len(problems) > before:
    return   # the family's own cross-field checks need valid fields
  (has_impl, impl), (has_inputs, inputs) = (_get(model, f'formulation.{key}') for key in ('conv_impl', 'conv_inputs'))
  inputs_problem = conv_inputs_problem(impl, inputs) if has_impl and has_inputs else None
  if inputs_problem:
    problems.append(f'config.{prefix}formulation.conv_inputs={inputs!r}: {inputs_problem}')
  problems.extend(MODELS[family].check(model, prefix))


def _check_loss(loss, model, prefix: str, problems: List[str]) -> None:
  name = loss.get('name')
  if name not in OBJECTIVES:
    problems.append(f'config.{prefix}name={name!r}: allowed one of {", ".join(OBJECTIVES.names())}')
    return
  before = len(problems)
  _check_keys(loss, loss_keys(name), problems, prefix)
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
    _check_keys(section, declared, problems, f'evals.{name}.')


def _across_problems(config) -> List[str]:
  """The lines of the rules across keys (each section's RULES: capsjax.keys.Across) that
  `config` breaks; a run-level key it lacks at its declared default, another as None."""
  declared = defaults.run_keys(SECTION_OWNERS)
  problems = []
  for module in defaults.SECTIONS + SECTION_OWNERS:
    for rule in getattr(module, 'RULES', ()):
      values = []
      for name in rule.keys:
        found, value = _get(config, name)
        values.append(value if found else declared[name].default if name in declared else None)
      line = rule.problem(*values)
      if line:
        problems.append(line)
  return problems


def problems_of(config) -> List[str]:
  """Every rule `config` breaks, one line each (empty when it is valid)."""
  problems: List[str] = []
  _check_keys(config, defaults.run_keys(SECTION_OWNERS), problems)
  found, evals = _get(config, 'evals')
  if found and evals is not None:
    _check_evals(evals, problems)
  for prefix in ('',) + tuple(f'{name}.' for name in COMPARISON_MODELS):
    found, model = _get(config, prefix + 'model')
    if found and model is not None:
      _check_model(_zoo_sections_at_defaults(config, model) if not prefix else model, prefix + 'model.', problems)
      found_loss, loss = _get(config, prefix + 'loss')
      if found_loss and loss is not None:
        _check_loss(loss, model, prefix + 'loss.', problems)
  if problems:
    return problems
  problems.extend(_across_problems(config))   # the rules across keys, declared beside them
  found, zoo_options = _get(config, 'routing_zoo.options')
  if found and zoo_options is not None and 'model' in config:
    problems.extend(_zoo_options_problems(config, zoo_options))
    problems.extend(_zoo_sections_problems(config))
  found, recipes = _get(config, 'ensemble.recipes')
  if found and recipes:
    problems.extend(_recipe_problems(config))
  found, variants = _get(config, 'sweep.variants')
  if found and variants:
    problems.extend(_sweep_problems(config, variants))
  return problems


def _sweep_problems(config, variants) -> List[str]:
  """Each sweep variant checked as the config it trains (one line per rule broken, naming
  the variant): a bad variant is refused before the first one trains."""
  try:
    parsed = [sweep.parse_variant(spec) for spec in variants]
  except ConfigError as e:
    return [str(e)]
  names = [name for name, _ in parsed]
  if len(set(names)) != len(names):
    return [f'config.sweep.variants: variant names repeat: {names}']
  problems = []
  for name, overrides in parsed:
    try:
      variant = sweep.variant_config(config, overrides)
    except ConfigError as e:
      problems.append(f'sweep variant {name!r}: {e}')
      continue
    variant.sweep.variants = ()   # the variant trains alone
    problems += [f'sweep variant {name!r}: {line}' for line in problems_of(variant)]
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
  if not problems:
    try:
      assemble.members(config)   # what only the program as a whole can break (the shared model's bounds)
    except ConfigError as e:
      return [str(e)]
  return problems


def _zoo_routings(config) -> Tuple[str, ...]:
  found, routings = _get(config, 'routing_zoo.routings')
  return tuple(routings) if found and routings else ()


def _zoo_sections_at_defaults(config, model):
  """The model as the base config's check sees it: the sections of the routings the zoo
  trains beside model.routing are their members' (checked there), at their defaults here."""
  sections = model.get('routing_options')
  others = [name for name in _zoo_routings(config) if name != model.get('routing') and name in ROUTINGS]
  if not others or not hasattr(sections, 'keys') or not any(name in sections for name in others):
    return model
  checked = ml_collections.ConfigDict(model.to_dict())
  for name in others:
    if name in checked.routing_options:
      checked.routing_options[name] = routing_option_defaults(name)
  return checked


def _zoo_sections_problems(config) -> List[str]:
  """model.routing_options.NAME of a routing the zoo trains, checked as its member's own
  section (the options it takes, the values their rules allow)."""
  sections = config.model.get('routing_options')
  problems = []
  for name in _zoo_routings(config):
    if name == config.model.get('routing') or name not in ROUTINGS or not hasattr(sections, 'keys') \
        or name not in sections or not hasattr(sections[name], 'items'):
      continue
    problems.extend(line for line in _member_problems(config, name, sections[name])
                    if f'routing_options.{name}.' in line)
  return problems


def _member_problems(config, name: str, options) -> List[str]:
  """The problems of config.model as the zoo's member of routing `name` with `options`
  (its own section) sees it."""
  member = config.model.to_dict()
  member.update(routing=name, routing_options={name: dict(options)})
  problems: List[str] = []
  _check_model(ml_collections.ConfigDict(member), 'model.', problems)
  return problems


def _zoo_options_problems(config, zoo_options) -> List[str]:
  """routing_zoo.options checked as each member's model.routing_options is: a routing the
  zoo trains, options it takes, values the model's rules allow."""
  if not hasattr(zoo_options, 'keys'):
    return [f'config.routing_zoo.options={zoo_options!r}: allowed a dict: routing name → its options']
  problems = []
  routings = tuple(_value(config, 'routing_zoo.routings'))
  for name, options in zoo_options.items():
    where = f'config.routing_zoo.options.{name}'
    if name not in routings:
      problems.append(f'{where}: {name!r} is not among routing_zoo.routings ({", ".join(routings)})')
      continue
    if not hasattr(options, 'keys'):
      problems.append(f'{where}={options!r}: allowed a dict of the routing\'s options')
      continue
    problems.extend(line.replace(f'config.model.routing_options.{name}.', f'{where}.')
                    for line in _member_problems(config, name, options))
  return problems


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
  """Raises ConfigError naming the first invalid key, its value and what is allowed."""
  problems = problems_of(config)
  if problems:
    more = f' (and {len(problems) - 1} more problem(s))' if len(problems) > 1 else ''
    raise ConfigError(problems[0] + more)


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
