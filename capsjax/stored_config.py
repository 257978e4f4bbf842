"""A workdir's config.json: read (upgraded from every earlier layout, the keys added since at
their defaults), compared with a run's config (`config_differences`: what would change,
recipes and sweep variants compared as what they set), and migrated (`upgraded`: flat
formulation, evaluator and routing-option keys into their sections, routing-input flags
into `model.routing_inputs`); a run bound to it (`bind_config`: a run with another config is
refused with the differing keys unless it allows a change; `record_config` writes it, which
the loop does once the first step has run, so a run that fails before it binds nothing;
`answered_from_files`: a finished run answered without reading data). capsjax.app.trained
and the programs read it.
"""
import json
import os
import re
from typing import Any, Dict, Iterator, List, Optional, Tuple

import jax
import ml_collections

from capsjax import defaults, ensembles, evaluators, formulations, optimization, sizing
from capsjax.errors import ConfigError, WorkdirError
from capsjax.layout import FLAT_EVALUATOR_KEYS, FORMULATION_KEYS, ROUTING_INPUT_FLAGS
from capsjax.models import MODELS, model_config
from capsjax.routing import ROUTINGS, configurable_routing_options, routing_option_defaults
from capsjax.workdir import CONFIG_FILE, run_status, write_json

# Keys that say how a run is carried out, not what it computes: they may change between
# invocations of one run (e.g. another data folder, another checkpoint cadence).
RUNTIME_KEYS = frozenset({
    'data_dir', 'tfds_data_dir', 'host_images', 'log_every_steps', 'log_every_seconds', 'eval_every_steps',
    'eval_batch_size',
    'checkpoint_every_steps', 'checkpoint_every_secs', 'keep_checkpoints', 'stop_at_step',
    'distributed', 'coordinator_address', 'num_processes', 'process_id', 'distributed_timeout_s',
    'allow_config_change', 'reevaluate', 'check_memory', 'evals',
    # Names only: a run started before class names were recorded has none.
    'class_names',
})


def _flatten(tree: Dict[str, Any], prefix: str = '') -> Iterator[Tuple[str, Any]]:
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from _flatten(value, f'{prefix}{key}.')
    else:
      yield f'{prefix}{key}', value


def _comparable(value):
  # JSON turns tuples into lists; compare in that form.
  return json.loads(json.dumps(value, default=str))


# A model's dtype 'auto' stands for a backend's entry of capsjax.formulations.FASTEST: a
# value and the 'auto' that resolves to it on this backend compute the same (a run recorded
# with dtype 'float32' before 'auto' was the default resumes on a CPU unchanged; on a GPU,
# where 'auto' is bfloat16, it is a change).
# Recipes and sweep variants ('NAME: key=value, …') compare as what they set: spacing and
# the order of their assignments are the writer's.
_OVERRIDE_LISTS = ('ensemble.recipes', 'sweep.variants')


def _resolved(key: str, value):
  if key.startswith('model.') and key.endswith('.dtype') and isinstance(value, str):
    try:
      return formulations.resolve('dtype', value)
    except ValueError:
      return value
  if key in _OVERRIDE_LISTS and isinstance(value, list) and all(isinstance(entry, str) for entry in value):
    try:
      return [_comparable(ensembles.parse_variant(entry)) for entry in value]
    except ConfigError:
      return value
  return value


def _same_values(key: str) -> bool:
  """A formulation option whose choices compute the same values (conv_impl, …): a run
  may continue in another (on another backend, say) as it may with another log cadence."""
  *section, option = key.split('.')
  return section[-1:] == ['formulation'] and option in formulations.SAME_VALUES


def config_differences(saved: Dict[str, Any], config: ml_collections.ConfigDict) -> List[str]:
  """'key: saved → new' for every result-changing key that differs."""
  old = dict(_flatten(_comparable(saved)))   # (upgraded's defaults: tuples where JSON has lists)
  new = dict(_flatten(_comparable(config.to_dict())))
  differences = []
  for key in sorted(set(old) | set(new)):
    if key.split('.')[0] in RUNTIME_KEYS or _same_values(key):
      continue
    if _resolved(key, old.get(key, '<absent>')) != _resolved(key, new.get(key, '<absent>')):
      differences.append(f'{key}: {old.get(key, "<absent>")!r} → {new.get(key, "<absent>")!r}')
  return differences


def read_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a run in `workdir` was started with."""
  path = os.path.join(workdir, CONFIG_FILE)
  results = os.path.join(workdir, 'results.json')   # runs made before config.json existed
  if not os.path.isdir(workdir):
    raise WorkdirError(f'{workdir} is not a directory')   # the commands' --workdir words
  if not os.path.isfile(path) and not os.path.isfile(results):
    raise WorkdirError(f'no {CONFIG_FILE} in {workdir}: train there first')
  try:
    if os.path.isfile(path):
      with open(path) as f:
        stored = json.load(f)
    else:
      with open(results) as f:
        stored = json.load(f)['config']
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise WorkdirError(f'cannot read the config in {workdir}: {e}') from None
  check_stored(stored, path)
  return ml_collections.ConfigDict(upgraded(stored))


def check_stored(stored, path: str) -> None:
  if not isinstance(stored, dict) or not all(isinstance(value, dict) for key, value in stored.items()
                                             if key in ('model', 'loss')):
    raise WorkdirError(f'{path} is not a capsjax config (a JSON object of config keys); move it away to '
                       'start afresh')


def upgraded(stored: Dict[str, Any]) -> Dict[str, Any]:
  """A stored config in today's layout, with the keys added since at their defaults."""
  return _model_sections_with_defaults(with_defaults(_formulation_sections(_evaluators_as_sections(
      _routing_inputs_from_flags(_sectioned_routing_options(stored)))), defaults.base_config().to_dict()))


def _model_sections_with_defaults(tree: Dict[str, Any]) -> Dict[str, Any]:
  # Every model section, at any depth (config.model, ablation's config.baseline.model,
  # affNIST's config.cnn.model), takes the keys its family added since from that family's
  # defaults: a CNN baseline recorded before its config carried the formulation resumes.
  upgraded_tree = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      value = _model_sections_with_defaults(value)
      if key == 'model' and value.get('name') in MODELS:
        value = with_defaults(value, model_config(value['name']).to_dict())
    upgraded_tree[key] = value
  return upgraded_tree


_FLAG_OVERRIDE = re.compile(r'model\.(%s)\s*=\s*(True|False)' % '|'.join(ROUTING_INPUT_FLAGS))


def _routing_inputs_from_flags(tree: Dict[str, Any]) -> Dict[str, Any]:
  """A model section's input flags as its routing_inputs (the names set), in every model
  section of the tree; a sweep's variants (override strings) likewise."""
  tree = {key: _routing_inputs_from_flags(value) if isinstance(value, dict) else value
          for key, value in tree.items()}
  if any(flag in tree for flag in ROUTING_INPUT_FLAGS):
    tree['routing_inputs'] = [input_ for flag, input_ in ROUTING_INPUT_FLAGS.items() if tree.pop(flag, False)]
  if isinstance(tree.get('variants'), (list, tuple)):
    tree['variants'] = [_variant_with_inputs(variant) for variant in tree['variants']]
  return tree


def _variant_with_inputs(variant):
  """'name: model.digit_bias=True, …' → 'name: model.routing_inputs=('bias',), …' (the
  routing_inputs where the first flag stood). Variants of that time held no comma in a value."""
  if not isinstance(variant, str) or not _FLAG_OVERRIDE.search(variant):
    return variant
  name, _, assignments = variant.partition(':')
  parts = [part.strip() for part in assignments.split(',') if part.strip()]
  flags = [_FLAG_OVERRIDE.fullmatch(part) for part in parts]
  inputs = tuple(ROUTING_INPUT_FLAGS[flag[1]] for flag in flags if flag and flag[2] == 'True')
  kept = [part for part, flag in zip(parts, flags) if not flag]
  kept.insert(next(index for index, flag in enumerate(flags) if flag), f'model.routing_inputs={inputs!r}')
  return f'{name}: {", ".join(kept)}'


# A sweep variant's flat formulation override ('model.conv_impl=xla').
_FLAT_FORMULATION = re.compile(r'(\bmodel\.)(%s)\b(?=\s*=)' % '|'.join(FORMULATION_KEYS))


def _formulation_sections(tree: Dict[str, Any]) -> Dict[str, Any]:
  """Every model section's formulation options (flat model keys before model.formulation)
  moved into its formulation section, over its family's defaults; a sweep's variants
  (override strings) likewise."""
  tree = {key: _formulation_sections(value) if isinstance(value, dict) else value for key, value in tree.items()}
  model = tree.get('model')
  if isinstance(model, dict) and any(option in model for option in FORMULATION_KEYS):
    family = model.get('name')
    section = model_config(family).formulation.to_dict() if family in MODELS else {}
    section.update({option: model.pop(option) for option in FORMULATION_KEYS if option in model})
    tree['model'] = {**model, 'formulation': section}
  if isinstance(tree.get('variants'), (list, tuple)):
    tree['variants'] = [_FLAT_FORMULATION.sub(r'\1formulation.\2', variant) if isinstance(variant, str) else variant
                        for variant in tree['variants']]
  return tree


def _evaluators_as_sections(tree: Dict[str, Any]) -> Dict[str, Any]:
  """The evaluators' flat keys of a config recorded before config.evals as its sections
  (a convergence probe of 0 iterations was the probe switched off)."""
  tree = dict(tree)
  evals = {name: dict(section) for name, section in dict(tree.get('evals') or {}).items()}
  for old, (name, key, translate) in FLAT_EVALUATOR_KEYS.items():
    if old in tree:
      value = translate(tree.pop(old))
      if value is None:
        evals.setdefault(name, {})['enabled'] = False
      else:
        evals.setdefault(name, {})[key] = value
  if evals:
    tree['evals'] = with_defaults(evals, evaluators.evals_config())
  return tree


def _sectioned_routing_options(tree: Dict[str, Any]) -> Dict[str, Any]:
  """Routing options as one section per routing (since 2026-11-25). Before, one flat dict
  held every routing's options: the recorded routing's become its section, the others'
  (then at their defaults) today's defaults."""
  tree = {key: _sectioned_routing_options(value) if isinstance(value, dict) else value
          for key, value in tree.items()}
  flat = tree.get('routing_options')
  if isinstance(flat, dict) and flat and not all(isinstance(value, dict) for value in flat.values()):
    name = tree.get('routing', 'dynamic')
    sections = configurable_routing_options()
    own = routing_option_defaults(name) if name in ROUTINGS else flat
    sections[name] = {option: value for option, value in flat.items() if option in own}
    tree['routing_options'] = {section: options for section, options in sections.items() if options}
  return tree


def with_defaults(stored: Dict[str, Any], fallback: Dict[str, Any]) -> Dict[str, Any]:
  """`stored` with the keys it lacks taken from `fallback` (the base config's values): a run started before a key
  existed ran with that key's default behaviour. A section whose `name` differs (a CNN
  model against the base CapsNet) is left as stored."""
  merged = dict(stored)
  for key, default in fallback.items():
    if key not in merged:
      merged[key] = default
    elif isinstance(default, dict) and isinstance(merged[key], dict) and \
        merged[key].get('name') == default.get('name'):
      merged[key] = with_defaults(merged[key], default)
  return merged


def bind_config(workdir: str, config: ml_collections.ConfigDict, allow_change: bool = False) -> List[str]:
  """Refuses a config other than the workdir's config.json unless `allow_change` (the run's
  allow_config_change); returns the differences (writes nothing: `record_config`). Keys
  the config leaves to the run (`left_to_the_run`: what the data and the model's choice fill in)
  are not compared: the run fills them as its first invocation did (config.json keeps its
  choices), so a run is bound before its data is read."""
  path = os.path.join(workdir, CONFIG_FILE)
  differences = []
  if os.path.isfile(path):
    try:
      with open(path) as f:
        saved = json.load(f)
    except (OSError, ValueError) as e:
      raise WorkdirError(f'cannot read {path} ({e}); move it away to start afresh') from None
    check_stored(saved, path)
    # Keys added to capsjax since the run started count as their defaults, not as changes.
    left_open = left_to_the_run(config)
    differences = [line for line in config_differences(upgraded(saved), config)
                   if line.split(':')[0] not in left_open]
    if differences and not allow_change:
      shown = '; '.join(differences[:6]) + (f'; and {len(differences) - 6} more' if len(differences) > 6 else '')
      raise ConfigError(f'workdir {workdir} holds a run with another config ({shown}); use another '
                        '--workdir, or pass --config.allow_config_change=True to continue it with this one')
  return differences


def left_to_the_run(config) -> set:
  """The keys `config` leaves to the run, dotted: what the data fills in (an open
  model.input_shape or num_classes, class_names) and the model's 'auto' keys, which
  capsjax.sizing chooses for the image size and memory."""
  model = config.model   # any family: the data fills input_shape and num_classes where they are open
  left = {key for key, is_open in (('model.input_shape', 'input_shape' in model and not tuple(model.input_shape)),
                                   ('model.num_classes', 'num_classes' in model and model.num_classes == 0),
                                   ('class_names', not tuple(config.class_names)))
          if is_open}
  return left | {f'model.{key}' for key in sizing.open_keys(model)}


def record_config(workdir: str, recorded: Dict[str, Any]) -> None:
  """Writes config.json (`recorded`: the config as a dict) when it is missing or differs
  (after `bind_config` allowed it)."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(path) or bind_config(workdir, ml_collections.ConfigDict(recorded), allow_change=True):
    write_json(path, recorded)


def answered_from_files(workdir: str, config, reevaluate: bool, previous: Dict[str, Any],
                        newest: Optional[int]) -> bool:
  """Whether the run is finished for this same config (run_status, at the length this
  config gives) as its files say, so that nothing need be read or compiled. Keys the data
  fills in (an open model.input_shape / num_classes, class_names) are not compared."""
  if not previous.get('completed') or jax.process_count() > 1 or newest != previous.get('steps'):
    return False
  left_open = left_to_the_run(config)
  if any(line.split(':')[0] not in left_open for line in config_differences(read_config(workdir).to_dict(), config)):
    return False
  if not config.num_steps and 'num_train_examples' not in previous:
    return False
  length = optimization.total_steps(config.num_steps, config.num_epochs, config.batch_size,
                             previous.get('num_train_examples', 0))
  return run_status(workdir, reevaluate, previous, newest, length) == 'finished'
