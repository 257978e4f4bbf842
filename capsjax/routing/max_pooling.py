"""Max-pooling as a routing: the primitive routing the paper's replaces."""
import jax
import jax.numpy as jnp

from capsjax.routing.base import RoutingResult, register_routing
from capsjax.routing.core import squash, vector_norm


@register_routing('max_pooling', iterative=False)
def max_routing(prediction_vectors, input_activations):
  """Max-pooling as a routing: each parent takes the vote of its most active child only,
  "the very primitive form of routing implemented by max-pooling" that the paper's
  routing replaces (Sabour et al. 2017, section 1).

  For parent j the child i* = argmax_i a_i |û_{j|i}| (the longest activation-weighted vote;
  the first of equals) gives v_j = squash(û_{j|i*}), activations |v_j|; gradients reach the
  winning vote only, as through max-pooling. With the primary capsules' lengths as a_i.
  Not iterative. No couplings: its choice is over the children
  of each parent, not a distribution over the parents of each child.
  """
  strength = input_activations[..., None] * vector_norm(prediction_vectors)   # a_i |û_{j|i}| [batch, in, out]
  winners = jax.nn.one_hot(jnp.argmax(strength, axis=1), prediction_vectors.shape[1], axis=1,
                           dtype=prediction_vectors.dtype)                     # [batch, in, out]
  parents = squash(jnp.einsum('bij,bijd->bjd', winners, prediction_vectors))  # [batch, out, dim]
  return RoutingResult(parents, vector_norm(parents))
