"""Uniform coupling: the no-routing baseline (Paik, Kwak, Kim 2019)."""
import jax.numpy as jnp

from capsjax.routing.base import RoutingResult, register_routing
from capsjax.routing.core import squash, vector_norm


@register_routing('uniform', iterative=False, returns_couplings=True)
def uniform(prediction_vectors, input_activations, *, return_couplings=False):
  """No routing, the baseline every routing is measured against (Paik, Kwak, Kim 2019,
  "Capsule Networks Need an Improved Routing Algorithm": uniform coupling).

  c_ij = 1 / (number of parents) for every child and parent, as Procedure 1's first
  iteration couples before any agreement: v_j = squash(Σ_i û_{j|i} / n_out), activations
  |v_j|. Equal to `dynamic` with one iteration. Input activations are ignored (as
  Procedure 1 ignores them); not iterative.
  """
  del input_activations
  out_caps = prediction_vectors.shape[2]
  parents = squash(jnp.sum(prediction_vectors, axis=1) / out_caps)   # [batch, out, dim]
  if not return_couplings:
    return RoutingResult(parents, vector_norm(parents))
  couplings = jnp.full(prediction_vectors.shape[:3], 1.0 / out_caps, prediction_vectors.dtype)   # [batch, in, out]
  return RoutingResult(parents, vector_norm(parents), couplings=(couplings, couplings))
