"""Where a run's config becomes typed pieces: the one place below the programs that reads
a ConfigDict for the training path.

The jitted step, the objective, the model, the pipelines and the hooks take these pieces
(functions, modules, numbers), never the config, as big_vision builds `Model(**config.model)`
at its boundary and flax's `train_step` never sees a config.
"""
from typing import List, Optional

import optax

from capsjax import steps
from capsjax.ensembles import ensemble_members
from capsjax.models import MODELS, build_model
from capsjax.objectives import Objective, make_objective
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
  return build_model(config.model)


def total_steps(config, num_train_examples: int) -> int:
  return steps.total_steps(config.num_steps, config.num_epochs, config.batch_size, num_train_examples)


def member_seeds(config) -> Optional[List[int]]:
  members = ensemble_members(config)
  return None if members is None else [member['seed'] for member in members]


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

