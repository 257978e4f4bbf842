"""The base config: every key a run has, at its declared default — the paper's MNIST setup
(section 5). Each key is declared once, where the code that reads it lives (capsjax.keys):
the model's keys are its Flax fields, the loss's the objective's keyword arguments, a
routing's options its signature's, the run's `keys.declare(...)` in their modules.
Experiments (experiments/NAME.py) start from `base_config()` and change what they need;
the library reads its defaults here (a workdir made before a key existed ran with that
key's default), never from an experiment.
"""
from typing import Dict

import ml_collections

from capsjax import experiment, keys
from capsjax.data.datasets import dataset_info


def _owners():
  """The modules that declare the base config's other run-level keys (keys.declare)."""
  # pylint: disable=g-import-not-at-top
  from capsjax import diagnostics, ensembles, runtime, steps
  from capsjax.data import augment, images, pipeline, rows, sources, tasks
  return (tasks, sources, images, rows, pipeline, augment, steps, ensembles, runtime, diagnostics)


def run_keys() -> Dict[str, keys.Key]:
  """Every run-level key by dotted name: the run's own (experiment.RunSettings), those the
  modules above declare, and those of any experiment section whose module is imported
  (capsjax.app.programs.*: validation imports them)."""
  _owners()
  own = experiment.run_keys()
  twice = set(own) & set(keys.RUN_KEYS)
  if twice:
    raise ValueError(f'config keys declared twice (RunSettings and keys.declare): {sorted(twice)}')
  return {**own, **keys.RUN_KEYS}


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
  run_keys()   # every declaring module imported
  own = {name: key.default for name, key in experiment.run_keys().items()}
  config = ml_collections.ConfigDict({**own, **keys.base_values()})
  config.evals = ml_collections.ConfigDict(evals_config())
  config.loss = ml_collections.ConfigDict({key.name: key.default for key in loss_keys('capsnet').values()})
  config.model = capsnet_config()
  return config


def section(name: str) -> ml_collections.ConfigDict:
  """An experiment's own section (multimnist, affnist, routing_zoo, …) at its declared defaults.

  Example:
    >>> capsjax.defaults.section('multimnist')
    examples_per_digit: 1000
    test_seed: 1
    <BLANKLINE>
  """
  run_keys()
  values = keys.section_defaults(name)
  if not values:
    raise KeyError(f'no config section {name!r} is declared: import the module that declares it '
                   '(capsjax.app.programs.affnist declares affnist)')
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
