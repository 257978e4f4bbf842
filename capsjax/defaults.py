"""The base config: every key a run has, at its declared default — the paper's MNIST setup
(section 5). Each key is declared once, where the code that reads it lives (capsjax.keys):
the model's keys are its Flax fields, the loss's the objective's keyword arguments, a
routing's options its signature's, the run's the `KEYS` of the modules that read them,
collected here by a fixed list (`SECTIONS`; an experiment program's section is named by
the caller: `section('affnist', capsjax.app.programs.affnist)`).
Experiments (experiments/NAME.py) start from `base_config()` and change what they need;
the library reads its defaults here (a workdir made before a key existed ran with that
key's default), never from an experiment.
"""
from typing import Any, Dict, List, Sequence, Tuple

import ml_collections

from capsjax import ensembles, keys, optimization, runtime, settings
from capsjax.data import augment, images, pipeline, rows, tasks
from capsjax.data.datasets import dataset_info
from capsjax.data.sources import core


# The modules whose `KEYS` are the run-level keys (in the base config unless a key says
# in_base=False), in the order the base config lists them.
SECTIONS = (settings, tasks, core, images, rows, pipeline, augment, optimization, ensembles, runtime)


# Modules outside the library declaring a section of their own (an experiment program's:
# capsjax.app.programs.affnist declares affnist.*), each added by `register_section` when it
# is imported: validation checks their keys and `RULES` with the library's.
_REGISTERED_SECTIONS: List[Any] = []


def register_section(module: Any) -> None:
  """Adds `module`'s `KEYS` (and `RULES`, and a `config_problems(config)` returning the lines
  of what only the program can check) to what capsjax.validation checks. Called by the
  module itself at import; registering the same module again changes nothing."""
  if all(module.__name__ != known.__name__ for known in _REGISTERED_SECTIONS):
    _REGISTERED_SECTIONS.append(module)
  else:   # the module imported again (a reload): its newest declarations
    _REGISTERED_SECTIONS[:] = [module if known.__name__ == module.__name__ else known for known in _REGISTERED_SECTIONS]


def registered_sections() -> Tuple[Any, ...]:
  """The modules `register_section` added, in the order they registered."""
  return tuple(_REGISTERED_SECTIONS)


def run_keys(sections: Sequence[Any] = ()) -> Dict[str, keys.Key]:
  """Every run-level key by dotted name: those of SECTIONS, then those of `sections`
  (modules with a `KEYS` of their own: an experiment program's, capsjax.app.programs.*).
  A key declared twice is a ValueError."""
  found: Dict[str, keys.Key] = {}
  for module in SECTIONS + tuple(sections):
    for declared in module.KEYS:
      if declared.name in found:
        raise ValueError(f'config key {declared.name!r} is declared twice ({module.__name__})')
      found[declared.name] = declared
  return found


def capsnet_config() -> ml_collections.ConfigDict:
  """The paper's CapsNet: 8,215,568 parameters (6,804,224 without the decoder)."""
  from capsjax.models import model_config  # pylint: disable=g-import-not-at-top
  return model_config('capsnet')


def base_config() -> ml_collections.ConfigDict:
  """Every key a run has, at its default: the paper's MNIST CapsNet and training setup
  (section 5). Experiments (`capsjax.experiments.NAME.get_config()`) start from it; `capsjax
  --experiment=NAME --help` explains each key and its allowed values.

  Example:
    >>> config = capsjax.base_config()
    >>> config.batch_size, config.model.routing_iterations, config.loss.m_plus, config.loss.m_minus
    (128, 3, 0.9, 0.1)
  """
  from capsjax.evaluators import evals_config  # pylint: disable=g-import-not-at-top
  from capsjax.objectives import loss_keys  # pylint: disable=g-import-not-at-top
  config = ml_collections.ConfigDict(keys.nested(key for key in run_keys().values() if key.in_base))
  config.evals = ml_collections.ConfigDict(evals_config())
  config.loss = ml_collections.ConfigDict({key.name: key.default for key in loss_keys('capsnet').values()})
  config.model = capsnet_config()
  return config


def section(name: str, owner: Any = None) -> ml_collections.ConfigDict:
  """An experiment's own section (multimnist, affnist, routing_zoo, …) at its declared
  defaults: the library's, or that of `owner` (the module declaring it).

  Example:
    >>> capsjax.defaults.section('multimnist')
    examples_per_digit: 1000
    test_seed: 1
    <BLANKLINE>
  """
  values = keys.section_defaults(run_keys(() if owner is None else (owner,)).values(), name)
  if not values:
    raise KeyError(f'no config section {name!r} is declared here: name the module that declares it '
                   "(section('affnist', capsjax.app.programs.affnist))")
  return ml_collections.ConfigDict(values)


def dataset_config(name: str) -> ml_collections.ConfigDict:
  """This recipe on dataset `name` (capsjax.data.datasets): the experiment of that name,
  the model's input shape and class count taken from the dataset's description."""
  config = base_config()
  info = dataset_info(name)
  config.experiment = config.dataset = name
  config.model.input_shape = info.input_shape
  config.model.num_classes = info.num_classes
  return config
