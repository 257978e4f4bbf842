"""Ensembles: several configurations trained as one vmapped program.

The members (capsjax.assemble.members: the product of config.ensemble's seeds, routing
iterations and reconstruction weights) become traced knobs here; a run without an
ensemble uses the model's and the objective's own static values.
"""
import jax.numpy as jnp

from capsjax.keys import Rule, declare, ints_at_least, numbers_at_least

# None: a single run. The members are the product of the tuples (capsjax.assemble.members;
# an empty tuple = the config's own value).
declare('ensemble', None, Rule(lambda v: v is None or hasattr(v, 'keys'), 'a dict, or None'),
        'several configurations as one vmapped program: seeds × routing_iterations × reconstruction_weights')
declare('ensemble.seeds', (), ints_at_least(0), 'ensemble members: one per seed', in_base=False)
declare('ensemble.routing_iterations', (), ints_at_least(1), 'ensemble members: routing iterations each (at most '
        'model.routing_iterations)', in_base=False)
declare('ensemble.reconstruction_weights', (), numbers_at_least(0), 'ensemble members: reconstruction loss weights',
        in_base=False)

def member_knobs(members):
  """Stacked traced hyper-parameters [members] for the vmapped steps."""
  return {'seed': jnp.asarray([m['seed'] for m in members], jnp.int32),
          'routing_iterations': jnp.asarray([m['routing_iterations'] for m in members], jnp.int32),
          'reconstruction_weight': jnp.asarray([m['reconstruction_weight'] for m in members], jnp.float32)}
