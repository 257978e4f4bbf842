"""One registry type for every extensible kind: model families, objectives, routings, data
sources, tasks and programs.

A `Registry` maps names to entries. Each entry holds the registered value (a function or
a class) and its *capabilities*: the facts callers ask instead of comparing names
(`ROUTINGS['dynamic'].returns_logits`, `MODELS[name].has_decoder(model_config)`). A
registry declares the capabilities its entries have, with defaults, so an entry that
says nothing has the default and an entry that names an undeclared one is refused at
registration (a typo would otherwise pass silently).

    ROUTINGS = Registry('routing', iterative=True, returns_logits=False)

    @ROUTINGS.register('my_routing', iterative=False)
    def my_routing(...): ...

Registration is explicit: a decorator in the module that defines the entry, and that
module imported by whoever needs it (the package imports its own; a user's config
imports theirs). No package is imported for its side effects.
"""
import keyword
from typing import Any, Callable, Dict, Iterator, Tuple, TypeVar

from capsjax.errors import ArgumentError, ConfigError

T = TypeVar('T')


class Entry:
  """A registered name: `value` (what was registered) and its capabilities as attributes."""

  def __init__(self, name: str, value: Any, capabilities: Dict[str, Any]):
    self.name = name
    self.value = value
    self.capabilities = dict(capabilities)

  def __getattr__(self, key: str) -> Any:
    capabilities = self.__dict__.get('capabilities', {})
    if key in capabilities:
      return capabilities[key]
    raise AttributeError(f'{type(self).__name__} {self.__dict__.get("name")!r} has no capability {key!r}')

  def __repr__(self) -> str:
    return f'Entry({self.name!r}, {self.capabilities})'


class UnknownName(ConfigError, KeyError):
  """A name no entry of the registry has (a ConfigError: one line on the command line)."""

  def __str__(self) -> str:   # KeyError would quote the message
    return str(self.args[0])


class Registry:
  """Names → entries of one kind, in registration order. `doc`: what this registry holds
  (its docstring, for help() and the API reference)."""

  def __init__(self, kind: str, *, doc: str = '', **capability_defaults: Any):
    if doc:
      self.__doc__ = doc
    self.kind = kind
    self.defaults = capability_defaults
    self._entries: Dict[str, Entry] = {}

  def register(self, name: str, value: Any = None, **capabilities: Any) -> Callable[[T], T]:
    """Decorator (`@REGISTRY.register(name, capability=...)`) or, given `value`, a direct
    registration. Registering a name again replaces its entry (a re-imported module)."""
    unknown = set(capabilities) - set(self.defaults)
    if unknown:
      raise ArgumentError(f'{self.kind} {name!r}: unknown capabilities {sorted(unknown)}; '
                          f'{self._a_kind()} declares {sorted(self.defaults)}')
    if not isinstance(name, str) or not name:
      raise ArgumentError(f'{self._a_kind()} name must be a non-empty string, got {name!r}')
    if not name.isidentifier() or keyword.iskeyword(name):   # 'a.b' registered, then unreachable
      raise ArgumentError(f'{self._a_kind()} name must be a config key (letters, digits and _, not a digit first '
                          f'nor a Python keyword), got {name!r}')

    def register(registered: T) -> T:
      self._entries[name] = Entry(name, registered, {**self.defaults, **capabilities})
      return registered
    if value is not None:
      return register(value)
    return register

  def _a_kind(self) -> str:
    return ('an ' if self.kind[:1] in 'aeiou' else 'a ') + self.kind

  def unregister(self, name: str) -> None:
    self._entries.pop(name, None)

  def __getitem__(self, name: str) -> Entry:
    try:
      return self._entries[name]
    except (KeyError, TypeError):
      raise UnknownName(f'unknown {self.kind} {name!r}; registered: {", ".join(self.names())}') from None

  def get(self, name: str) -> Any:
    """The registered value of `name` (UnknownName, listing the names, otherwise)."""
    return self[name].value

  def names(self) -> Tuple[str, ...]:
    return tuple(self._entries)

  def entries(self) -> Tuple[Entry, ...]:
    return tuple(self._entries.values())

  def __contains__(self, name: object) -> bool:
    return isinstance(name, str) and name in self._entries

  def __iter__(self) -> Iterator[str]:
    return iter(tuple(self._entries))

  def __len__(self) -> int:
    return len(self._entries)

  def __repr__(self) -> str:
    return f'Registry({self.kind!r}: {", ".join(self._entries)})'
