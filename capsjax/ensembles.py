"""Ensembles: several configurations trained as one vmapped program.

config.ensemble holds tuples `seeds`, `routing_iterations`, `reconstruction_weights`;
the members are their product (an empty tuple = the config's own value). A run without
an ensemble is an ensemble of one whose knobs are the config's own static values.
"""
import jax.numpy as jnp

from capsjax.errors import ConfigError
from capsjax.objectives import OBJECTIVES


def ensemble_members(config):
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


def member_knobs(members):
  """Stacked traced hyper-parameters [members] for the vmapped steps."""
  return {'seed': jnp.asarray([m['seed'] for m in members], jnp.int32),
          'routing_iterations': jnp.asarray([m['routing_iterations'] for m in members], jnp.int32),
          'reconstruction_weight': jnp.asarray([m['reconstruction_weight'] for m in members], jnp.float32)}
