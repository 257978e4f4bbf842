"""Config keys, each declared once where the code that reads it lives: default, rule and help.

Three forms, one meaning:
- a run-level key: `key('batch_size', 128, int_at_least(1), 'training examples per step')`,
  an entry of the `KEYS` tuple of the module that reads it (capsjax.steps, capsjax.data.…),
  which capsjax.defaults collects by a fixed list of those modules; the run's own keys are
  the annotated fields of capsjax.settings.RunSettings;
- a model key: a field of the model family's Flax module, its type `Annotated` with
  `About(rule, help)` (`conv1_channels: Annotated[int, About(int_at_least(1), '…')] = 256`);
  a field whose default is a dataclass of such fields is a section of keys
  (`formulation: Formulation = Formulation(dtype='auto')`: model.formulation.*);
- a routing's or an objective's option: a keyword argument of the routing or objective
  function, `Annotated` the same way.

`capsjax.defaults.base_config()`, `capsjax.validation` and `--help` are generated from these
declarations; nothing else repeats a default, a rule or a help line. This module imports
nothing of capsjax, so any module may declare its keys.
"""
import dataclasses
import functools
import inspect
import math
import re
import typing
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np


# ----------------------------------------------------------------------------- rules

class Rule:
  """A check on a value and the words for what it allows (`str(rule)`; a function giving
  them where they name what is registered when the config is checked)."""

  def __init__(self, check: Callable[[Any], bool], allowed: Union[str, Callable[[], str]]):
    self.check, self._allowed = check, allowed

  def __call__(self, value) -> bool:
    return bool(self.check(value))

  def __str__(self) -> str:
    return self._allowed() if callable(self._allowed) else self._allowed


def is_int(value) -> bool:
  """An int that is not a bool (True is an int to Python, never a count to a config)."""
  return isinstance(value, int) and not isinstance(value, bool)


# The largest finite float32: a config number reaches the computation as float32, where a
# larger one would be infinite ('a finite number' means finite there).
FLOAT32_MAX = 3.4028234663852886e38


def as_python(value):
  """A NumPy scalar (np.float32(2.0), a 0-d array) as the Python number or bool it holds; any
  other value as it is. The rules read Python values: a NumPy scalar once skipped them (a NaN
  passed) or failed them (a valid 2.0 refused)."""
  if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.ndim == 0):
    return value.item()
  return value


def _is_number(value) -> bool:
  value = as_python(value)
  return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and abs(value) <= FLOAT32_MAX)


def int_at_least(low: int) -> Rule:
  return Rule(lambda v: is_int(v) and v >= low, f'an integer >= {low}')


def int_in(low: int, high: int) -> Rule:
  return Rule(lambda v: is_int(v) and low <= v <= high, f'an integer in [{low}, {high}]')


def number_in(low: float, high: float, low_open: bool = False, high_open: bool = False) -> Rule:
  def check(v):
    return _is_number(v) and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
  if math.isinf(high):   # '(0, inf]' would read as if inf were allowed
    return Rule(check, f'a finite number {">" if low_open else ">="} {low}')
  return Rule(check, f'a finite number in {"(" if low_open else "["}{low}, {high}{")" if high_open else "]"}')


def positive_number() -> Rule:
  return Rule(lambda v: _is_number(v) and v > 0, 'a finite number > 0')


def boolean() -> Rule:
  return Rule(lambda v: isinstance(v, bool), 'True or False')


def one_of(choices: Iterable[str]) -> Rule:
  choices = tuple(choices)
  return Rule(lambda v: v in choices, f'one of {", ".join(choices)}')


def text(allowed: str = 'a string') -> Rule:
  return Rule(lambda v: isinstance(v, str), allowed)


def ints_at_least(low: int, allow_empty: bool = True) -> Rule:
  def check(v):
    return isinstance(v, (tuple, list)) and (allow_empty or len(v) > 0) and all(is_int(x) and x >= low for x in v)
  return Rule(check, f'a tuple of integers >= {low}' + ('' if allow_empty else ' (at least one)'))


# A seed reaches JAX and the data order as an int32: the largest it can be.
SEED_MAX = 2 ** 31 - 1


def seed_value() -> Rule:
  return int_in(0, SEED_MAX)


def distinct_seeds(allow_empty: bool = True) -> Rule:
  """Distinct seeds: two members of one seed would train identically."""
  def check(v):
    return (isinstance(v, (tuple, list)) and (allow_empty or len(v) > 0) and len(set(v)) == len(v)
            and all(is_int(x) and 0 <= x <= SEED_MAX for x in v))
  return Rule(check, f'a tuple of distinct integers in [0, {SEED_MAX}]' + ('' if allow_empty else ' (at least one)'))


def numbers_at_least(low: float) -> Rule:
  return Rule(lambda v: isinstance(v, (tuple, list)) and all(_is_number(x) and x >= low for x in v),
              f'a tuple of finite numbers >= {low}')


def host_port() -> Rule:
  return Rule(lambda v: isinstance(v, str) and (not v or re.fullmatch(r'\S+:\d{1,5}', v) is not None),
              'HOST:PORT, or empty (detected)')


class Registered(Rule):
  """'one of …' over a registry read when a config is checked (families may add names)."""

  def __init__(self, names: Callable[[], Iterable[str]]):
    super().__init__(lambda v: v in tuple(names()), '')
    self.names = names

  def __str__(self) -> str:
    return f'one of {", ".join(self.names())}'


class RegisteredTuple(Registered):
  """A tuple of distinct registered names (non-empty unless `allow_empty`); on the command
  line also one comma-separated word (`--config.routing_zoo.routings=dynamic,em`,
  validation.split_name_lists)."""

  def __init__(self, names: Callable[[], Iterable[str]], what: str, allow_empty: bool = False):
    super().__init__(names)
    self.what = what
    self.check = lambda v: (isinstance(v, (tuple, list)) and (allow_empty or len(v) > 0) and len(set(v)) == len(v)
                            and all(x in tuple(names()) for x in v))
    self.allow_empty = allow_empty

  def __str__(self) -> str:
    return (f'a tuple of distinct {self.what} ({", ".join(self.names())})'
            + (', or () for none' if self.allow_empty else ''))


def registered(names: Callable[[], Iterable[str]]) -> Rule:
  return Registered(names)


def registered_tuple(names: Callable[[], Iterable[str]], what: str, allow_empty: bool = False) -> Rule:
  return RegisteredTuple(names, what, allow_empty)


# ----------------------------------------------------------------------------- declarations

@dataclasses.dataclass(frozen=True)
class About:
  """What an `Annotated` field or keyword argument carries: its rule (None: any value the
  code accepts) and its help line. `config_default`: where the config's default is not the
  code's (a model's routing_options: every routing's section in the config, the module's
  own routing's options in the code), a function giving the config's."""
  rule: Optional[Rule]
  help: str
  config_default: Optional[Callable[[], Any]] = None


@dataclasses.dataclass(frozen=True)
class Key:
  """A declared config key: its dotted name (relative to its section), default, rule, help.
  `in_base`: whether the base config has it (False: a key of some experiments only, e.g.
  multimnist.*, set by the experiments that use it)."""
  name: str
  default: Any
  rule: Optional[Rule]
  help: str
  in_base: bool = True


@dataclasses.dataclass(frozen=True)
class Across:
  """A rule across keys, declared beside them (a module's `RULES`): `problem(*values)` of
  the keys named in `keys` (dotted, from the config's top; a missing run-level key at its
  default) is the error line, 'config.KEY=VALUE: …', or None. Checked once every key holds
  a value its own rule allows (capsjax.validation)."""
  keys: Tuple[str, ...]
  problem: Callable[..., Optional[str]]


def key(name: str, default: Any, rule: Optional[Rule], help: str, *,  # pylint: disable=redefined-builtin
        in_base: bool = True) -> Key:
  """The run-level key `name` (dotted for a key inside a section): an entry of its module's
  `KEYS`, which capsjax.defaults collects by a fixed list of those modules."""
  return Key(name, default, rule, help, in_base)


def nested(keys: Iterable[Key], strip: str = '') -> Dict[str, Any]:
  """The defaults of `keys` as a nested dict (their dotted names as sections; `strip`: a
  prefix removed from every name)."""
  values: Dict[str, Any] = {}
  for declared in keys:
    *parents, leaf = declared.name[len(strip):].split('.')
    node = values
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = declared.default
  return values


def section_defaults(keys: Iterable[Key], name: str) -> Dict[str, Any]:
  """The defaults of section `name`'s keys among `keys`, nested as a dict (what an
  experiment that uses the section starts from)."""
  return nested([declared for declared in keys if declared.name.startswith(name + '.')], name + '.')


def _about(annotation) -> Optional[About]:
  for extra in getattr(annotation, '__metadata__', ()):
    if isinstance(extra, About):
      return extra
  return None


@functools.lru_cache(maxsize=None)
def _annotated_arguments(owner) -> Tuple[Tuple[str, Any, Any], ...]:
  """(name, annotation, default) of each key `owner` declares. Read once per owner: the
  signatures and type hints are most of what --help and validation spend on a config's
  ~100 keys (`config_default`s are still called each time: they follow registrations)."""
  if dataclasses.is_dataclass(owner):
    hints = typing.get_type_hints(owner, include_extras=True)
    return tuple((field.name, hints.get(field.name), field.default) for field in dataclasses.fields(owner)
                 if field.name not in ('parent', 'name'))   # Flax's own fields
  return tuple((p.name, p.annotation, p.default) for p in inspect.signature(owner).parameters.values()
               if p.kind == p.KEYWORD_ONLY and p.default is not p.empty)


def annotated_keys(owner) -> Dict[str, Key]:
  """The keys a dataclass (a Flax module: its fields) or a function (its keyword-only
  arguments with defaults) declares, by name, in their order, at the config's defaults; the
  rule and help from `Annotated[…, About(…)]` (none: any value, no help line). A field
  whose default is a dataclass (a model's `formulation`) is a section: its class's keys,
  dotted under the field's name, at the default's values."""
  declared = {}
  for name, annotation, default in _annotated_arguments(owner):
    if dataclasses.is_dataclass(default) and not isinstance(default, type):
      # A section (a model's formulation): its class's keys, at this field's values.
      for inner in annotated_keys(type(default)).values():
        declared[f'{name}.{inner.name}'] = dataclasses.replace(
            inner, name=f'{name}.{inner.name}', default=getattr(default, inner.name))
      continue
    about = _about(annotation) or About(None, '')
    default = about.config_default() if about.config_default else default
    declared[name] = Key(name, default, about.rule, about.help)
  return declared


# ----------------------------------------------------------------------------- checking values

def lookup(config, dotted: str):
  """(True, value) for an existing dotted key, else (False, None)."""
  node = config
  for part in dotted.split('.'):
    if node is None or not hasattr(node, 'keys') or part not in node.keys():
      return False, None
    node = node[part]
  return True, node


def check_values(config, declared: Dict[str, 'Key'], problems: List[str], prefix: str = '') -> None:
  """Each declared key's value by its rule; None passes only a key whose default is None
  (a section left out, a value chosen later): elsewhere the code would read None as a number."""
  for dotted, key in declared.items():
    found, value = lookup(config, dotted)
    if value is None and key.default is None:
      continue
    if found and key.rule is not None and not key.rule(value):
      problems.append(f'config.{prefix}{dotted}={value!r}: allowed {key.rule}')


# What a caller's argument can be checked as, at trace time too: an array (a traced one,
# vmapped over) is the caller's computation and passes.
PYTHON_VALUES = (bool, int, float, str)


def argument_problems(given: Dict[str, Tuple[Any, Optional[Rule]]], prefix: str = '') -> List[str]:
  """One line per argument name → (value, rule) whose Python value its rule refuses, in the
  config's words (`{prefix}NAME=VALUE: allowed …`): a pure function's numbers, as a config
  key's (the losses' margins, a routing's options)."""
  given = {name: (as_python(value), rule) for name, (value, rule) in given.items()}
  return [f'{prefix}{name}={value!r}: allowed {rule}' for name, (value, rule) in given.items()
          if rule is not None and isinstance(value, PYTHON_VALUES) and not rule(value)]


def field_problems(instance, kinds: Tuple[type, ...] = (object,)) -> List[str]:
  """Each annotated field of a dataclass instance (a Flax module or a Formulation built
  directly, not from a config) that its rule refuses, one line each in the config's words
  with the class for `config.model`: `CapsNet.num_classes=1: allowed …`. Only values of
  `kinds` are checked; None passes a field whose default is None, as in check_values; a
  section (a dataclass value) is its own class's to check."""
  problems = []
  for name, annotation, default in _annotated_arguments(type(instance)):
    about, value = _about(annotation), getattr(instance, name)
    if (about is None or about.rule is None or (value is None and default is None)
        or dataclasses.is_dataclass(value) or not isinstance(value, kinds)):
      continue
    if not about.rule(value):
      problems.append(f'{type(instance).__name__}.{name}={value!r}: allowed {about.rule}')
  return problems
