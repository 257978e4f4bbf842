"""A family's module from a model section (config.model): its keys (`model_keys`, the
section at its defaults `model_config`), the rules it breaks (`model_problems`), the
module checked and built (`build_model`), or built from a validated section with its
formulation chosen for a platform (`model_for_platform`)."""
import dataclasses
from typing import Any, Dict, List, Optional

import flax.linen as nn
import ml_collections

from capsjax import formulations
from capsjax.keys import Key, annotated_keys, check_values, lookup, nested, registered
from capsjax.errors import ConfigError
from capsjax.layout import moved_key_hint
from capsjax.models.base import MODELS, left_to_the_data


def model_keys(name: str) -> Dict[str, Key]:
  """config.model's keys for the family `name`: `name` itself and its module's annotated
  fields (each field's default, rule and help: capsjax.keys)."""
  family = Key('name', name, registered(MODELS.names), 'the model family (registered in capsjax.models / '
               'capsjax.families)')
  return {'name': family, **annotated_keys(MODELS.get(name))}


def model_config(name: str = 'capsnet') -> ml_collections.ConfigDict:
  """config.model of family `name` at its defaults (the paper's CapsNet: 8,215,568 parameters,
  6,804,224 without the decoder).

  Example:
    >>> capsjax.model_config('cnn').conv_channels
    (512, 256)
  """
  return ml_collections.ConfigDict(nested(model_keys(name).values()))


def model_problems(model, prefix: str = 'model.') -> List[str]:
  """Every rule the model section `model` (config.model) breaks, one line each, keys named
  `config.{prefix}KEY`: its family's keys, each routing's options, the family's own checks.
  capsjax.validation and `build_model` run it."""
  problems: List[str] = []
  family = model.get('name')
  if family not in MODELS:
    return [f'config.{prefix}name={family!r}: allowed one of {", ".join(MODELS.names())}']
  declared = model_keys(family)
  names = dict.fromkeys(name.split('.')[0] for name in declared)   # its keys and sections
  unknown = [key for key in model.keys() if key not in names]
  if unknown:
    problems.append(f'config.{prefix}{unknown[0]}: not a key of the {family!r} model (its keys: '
                    f'{", ".join(names)})' + moved_key_hint(prefix + unknown[0]))
  for section in (name for name in names if name not in declared):
    found, value = lookup(model, section)
    keys_of = [name[len(section) + 1:] for name in declared if name.startswith(section + '.')]
    if found and not hasattr(value, 'keys'):
      problems.append(f'config.{prefix}{section}={value!r}: allowed a section of {", ".join(keys_of)}')
    elif found and any(key not in keys_of for key in value.keys()):
      other = next(key for key in value.keys() if key not in keys_of)
      problems.append(f'config.{prefix}{section}.{other}: not a key of model.{section} (its keys: '
                      f'{", ".join(keys_of)})')
  # The routings' sections: by the family's own check (the model's routing's options by
  # their rules, another routing's left at its defaults: capsnet.routing_options_problems).
  check_values(model, declared, problems, prefix)
  if problems:
    return problems   # the family's own cross-field checks need valid fields
  (has_impl, impl), (has_inputs, inputs) = (lookup(model, f'formulation.{key}') for key in ('conv_impl', 'conv_inputs'))
  inputs_problem = formulations.conv_inputs_problem(impl, inputs) if has_impl and has_inputs else None
  if inputs_problem:
    problems.append(f'config.{prefix}formulation.conv_inputs={inputs!r}: {inputs_problem}')
  return problems + list(MODELS[family].check(model, prefix))


def build_model(name, **fields) -> nn.Module:
  """The model family `name` with `fields` (config.model's other keys: `build_model(**config.model)`,
  or the section itself, `build_model(config.model)`) as its sizes (lists become tuples),
  checked first as the config's model is (capsjax.ConfigError, the command's line).
  `routing_options` has one shape everywhere: a section per routing ({'em': {...}}).

  Example:
    >>> model = capsjax.build_model('capsnet', conv1_channels=32, primary_types=8, routing='em')
    >>> type(model).__name__, model.routing, model.primary_types
    ('CapsNet', 'em', 8)
    >>> config = capsjax.base_config()
    >>> paper = capsjax.build_model(**config.model)             # the config's model
    >>> paper.conv1_channels, paper.routing_iterations
    (256, 3)
    >>> capsjax.build_model(config.model).num_classes            # the same, given the section
    10
    >>> capsjax.build_model('capsnet', routing_iterations=0)
    Traceback (most recent call last):
    ...
    capsjax.errors.ConfigError: config.model.routing_iterations=0: allowed an integer in [1, 100]
  """
  if hasattr(name, 'keys') and 'model' in name.keys():
    raise ConfigError('build_model takes the model section, build_model(config.model) or '
                      'build_model(**config.model), not the whole config')
  name, fields, sections = _family_fields(name, fields)
  problems = model_problems(_as_config(name, fields, sections))
  if problems:
    raise ConfigError(problems[0])
  # A module built from a config's "from the data" values would have no classes or no image size.
  left = left_to_the_data(fields.get('num_classes'), fields.get('input_shape'))
  if left:
    meaning, needed = left
    raise ConfigError(f'config.model.{meaning}, filled in when a run reads them; build_model needs {needed}')
  return _construct(MODELS.get(name), fields, sections)


def _family_fields(name, fields: Dict[str, Any]):
  """(family, fields as its module takes them, its sections' defaults) of a model section
  (`name`: the family's name, or the section with the name inside) and `fields`: lists as
  tuples, a ConfigDict section as a dict. Nothing is checked here."""
  if hasattr(name, 'keys'):   # build_model(config.model): the section, its name inside
    fields = {**dict(name.items()), **fields}
    name = fields.pop('name', None)
  if name not in MODELS:
    raise ConfigError(f'config.model.name={name!r}: allowed one of {", ".join(MODELS.names())}')
  sections = {field.name: field.default for field in dataclasses.fields(MODELS.get(name))
              if dataclasses.is_dataclass(field.default) and not isinstance(field.default, type)}
  fields = {key: tuple(value) if isinstance(value, list) else value.to_dict()
            if isinstance(value, ml_collections.ConfigDict) else value for key, value in fields.items()}
  return name, fields, sections


def _construct(cls, fields: Dict[str, Any], sections: Dict[str, Any]) -> nn.Module:
  """The module of family `cls` with `fields` (checked), a section's dict over its defaults."""
  for key, value in fields.items():
    if key in sections and isinstance(value, dict):   # a config's section: its keys over the family's
      fields[key] = dataclasses.replace(sections[key], **value)
  return cls(**fields)


def _as_config(name: str, fields: Dict[str, Any], sections: Dict[str, Any]) -> ml_collections.ConfigDict:
  """The model section `fields` make (the family's defaults for what they leave out, a
  section given as its dataclass as its dict), as validation sees config.model."""
  model = model_config(name).to_dict()
  for key, value in fields.items():
    if key in sections and dataclasses.is_dataclass(value):
      value = {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
    if isinstance(model.get(key), dict) and isinstance(value, dict) and key != 'routing_options':
      value = {**model[key], **value}
    model[key] = value
  return ml_collections.ConfigDict(model)


def model_for_platform(model, platform: str = '', ensemble: bool = False) -> nn.Module:
  """The module of the model config `model` (config.model, validated: capsjax.validation
  checked it once, and the module's own setup refuses what only the data can fill), its
  formulation's 'auto' options chosen once for `platform` (capsjax.formulations.
  for_platform; '' : JAX's default backend) and for an `ensemble`'s members or one model:
  what a run, the planner and the memory estimate build. `build_model` checks a section
  given from Python."""
  name, fields, sections = _family_fields(model, {})
  if 'formulation' in model:   # a user's family may declare none
    fields['formulation'] = formulations.for_platform(model.formulation, platform, ensemble)
  return _construct(MODELS.get(name), fields, sections)


def formulation_of(module: nn.Module) -> Optional[formulations.Formulation]:
  """The formulation a built model computes with (what `model_for_platform` chose), or
  None for a family without one."""
  return getattr(module, 'formulation', None)
