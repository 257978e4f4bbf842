"""Self-routing (Hahn, Pyeon, Kim, NeurIPS 2019)."""
import jax
import jax.numpy as jnp

from capsjax.routing.base import RoutingResult, register_routing


@register_routing('self_routing', iterative=False, returns_couplings=True,
                  learned={'logit_weights': (lambda i, j, d: (i, j, d), 0.0), 'logit_bias': (lambda i, j, d: (i, j), 0.0)})
def self_routing(prediction_vectors, input_activations, *, logit_weights, logit_bias, return_couplings=False):
  """Self-routing (Hahn, Pyeon, Kim, NeurIPS 2019): each child capsule's own routing network,
  no agreement and no iterations.

  Child i's routing logits over the parents come from its own learned linear map,
  b_ij = w_ij · û_{j|i} + β_ij, and r_ij = softmax_j(b_ij). With the child's activation a_i
  (the primary capsule's length): parent activation a_j = Σ_i a_i r_ij / Σ_i a_i and parent
  pose v_j = Σ_i (a_i r_ij / Σ_k a_k r_kj) û_{j|i}. The paper maps the child's pose u_i by
  W_i to the logits; with vector capsules the map acts on û_{j|i} = W_ij u_i, the same
  family of linear functions of u_i (BUILD.md). w and β start at 0 (uniform routing), as in
  the authors' code. logit_weights [in, out, dim], logit_bias [in, out]. Not iterative.
  Poses are not squashed (the paper's are not); activations are
  a_j, in [0, 1]. Couplings: r_ij.
  """
  # b_ij = w_ij · û_{j|i} + β_ij                                           [batch, in, out]
  logits = jnp.einsum('bijd,ijd->bij', prediction_vectors, logit_weights) + logit_bias
  routes = jax.nn.softmax(logits, axis=-1)                                    # r_ij [batch, in, out]
  weighted = input_activations[..., None] * routes                            # a_i r_ij [batch, in, out]
  totals = jnp.sum(weighted, axis=1)                                          # Σ_i a_i r_ij [batch, out]
  # A zero total (every child inactive) gives zero poses, not NaN.
  coupling = weighted / jnp.where(totals > 0, totals, 1.0)[:, None, :]        # [batch, in, out]
  poses = jnp.einsum('bij,bijd->bjd', coupling, prediction_vectors)           # v_j [batch, out, dim]
  activity = jnp.sum(input_activations, axis=1, keepdims=True)                # Σ_i a_i [batch, 1]
  activations = totals / jnp.where(activity > 0, activity, 1.0)
  return RoutingResult(poses, activations, couplings=(routes, routes) if return_couplings else None)
