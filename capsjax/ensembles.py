"""Ensembles: several configurations trained as one vmapped program.

The members (capsjax.assemble.members: the product of config.ensemble's seeds, routing
iterations and reconstruction weights) become traced knobs here; a run without an
ensemble uses the model's and the objective's own static values.
"""
import jax.numpy as jnp


def member_knobs(members):
  """Stacked traced hyper-parameters [members] for the vmapped steps."""
  return {'seed': jnp.asarray([m['seed'] for m in members], jnp.int32),
          'routing_iterations': jnp.asarray([m['routing_iterations'] for m in members], jnp.int32),
          'reconstruction_weight': jnp.asarray([m['reconstruction_weight'] for m in members], jnp.float32)}
