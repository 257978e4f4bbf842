"""Where a run's config becomes typed pieces: the one place below the programs that reads
a ConfigDict for the training path.

The jitted step, the objective, the model, the pipelines and the hooks take these pieces
(functions, modules, numbers), never the config, as big_vision builds `Model(**config.model)`
at its boundary and flax's `train_step` never sees a config.
"""
from typing import Any, Dict, List, Optional

import optax

from capsjax import steps
from capsjax.errors import ConfigError
from capsjax.models import MODELS, build_model
from capsjax.objectives import OBJECTIVES, Objective, make_objective
from capsjax.routing import ROUTINGS


def objective(config) -> Objective:
  """config.loss's objective with its options bound (and the model's class count)."""
  options = dict(config.loss)
  name = options.pop('name')
  return make_objective(name, int(config.model.num_classes), **options)


def schedule(config) -> optax.Schedule:
  return steps.learning_rate_schedule(config.learning_rate, config.lr_decay_steps, config.lr_decay_rate,
                                      config.lr_staircase, config.lr_min)


def optimizer(config) -> optax.GradientTransformation:
  return steps.make_optimizer(schedule(config))


def model(config):
  return build_model(**config.model)


def total_steps(config, num_train_examples: int) -> int:
  return steps.total_steps(config.num_steps, config.num_epochs, config.batch_size, num_train_examples)


def members(config) -> Optional[List[Dict[str, Any]]]:
  """The members of config.ensemble as dicts (seed, routing_iterations,
  reconstruction_weight), or None for a single run.

  config.ensemble holds tuples `seeds`, `routing_iterations`, `reconstruction_weights`;
  the members are their product (an empty tuple = the config's own value).
  """
  spec = config.ensemble
  if not spec:
    return None
  seeds = tuple(spec.get('seeds') or (config.seed,))
  knobs = OBJECTIVES[config.loss.name].knobs   # what the objective reads per member
  iterations = tuple(spec.get('routing_iterations') or ()) or (
      (config.model.routing_iterations,) if 'routing_iterations' in knobs else (0,))
  weights = tuple(spec.get('reconstruction_weights') or ()) or (
      (config.loss.reconstruction_weight,) if 'reconstruction_weight' in knobs else (0.0,))
  if 'routing_iterations' in knobs and max(iterations) > config.model.routing_iterations:
    raise ConfigError(f'ensemble routing_iterations {iterations} exceed the model bound '
                      f'model.routing_iterations={config.model.routing_iterations}')
  return [dict(seed=int(s), routing_iterations=int(r), reconstruction_weight=float(w))
          for r in iterations for w in weights for s in seeds]


def member_seeds(config) -> Optional[List[int]]:
  listed = members(config)
  return None if listed is None else [member['seed'] for member in listed]


def initial_state(config, model_module, optimizer_transform):
  """The fresh state (stacked over the members of an ensemble)."""
  return steps.initial_state(model_module, optimizer_transform, config.model.input_shape, config.seed,
                             member_seeds(config))


def has_decoder(config) -> bool:
  return MODELS[config.model.name].has_decoder(config.model)


def wants_routing_probe(config) -> bool:
  """A single run of a family and routing that expose routing logits, with probe iterations."""
  family = MODELS[config.model.name]
  return bool(config.get('routing_probe_iterations')) and not config.get('ensemble') and \
      family.routing_probe and ROUTINGS[config.model.routing].returns_logits


def routing_probe(config, model_module, pipeline):
  """capsjax.steps.make_routing_probe for this run, or None where it does not apply."""
  if not wants_routing_probe(config):
    return None
  return steps.make_routing_probe(model_module, pipeline, config.routing_probe_iterations,
                                  config.routing_probe_examples, config.eval_batch_size)

