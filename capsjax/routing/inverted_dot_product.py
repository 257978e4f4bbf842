"""Inverted dot-product attention routing (Tsai, Srivastava, Goh, Salakhutdinov, ICLR 2020)."""
import jax
import jax.numpy as jnp

from capsjax.routing.base import RoutingResult, register_routing
from capsjax.routing.core import Array, iterate, pooled_votes, squash, vector_norm, vote_dots


def layer_norm(vectors: Array, scale: Array, offset: Array, epsilon: float = 1e-5) -> Array:
  """LayerNorm over the last axis with gain `scale` and bias `offset`."""
  mean = jnp.mean(vectors, axis=-1, keepdims=True)
  variance = jnp.mean(jnp.square(vectors - mean), axis=-1, keepdims=True)
  return (vectors - mean) * jax.lax.rsqrt(variance + epsilon) * scale + offset


def _inverted_dot_product_shared(capsules, transforms, offsets, routing_iterations, *, layer_norm_scale,
                                 layer_norm_offset, max_iterations=None, unroll=False):
  """`inverted_dot_product` on shared-transform votes without û: the agreement p_j·û_{j|i}
  and s_j = Σ_i r_ij û_{j|i} contract in the input pose space; the layer norm acts on s_j."""
  batch = capsules.shape[0]
  out_caps, dim = transforms.shape[1], transforms.shape[2]
  offsets = offsets.astype(capsules.dtype)

  def body(t, carry):
    poses, _ = carry
    agreement = vote_dots(poses, capsules, transforms, offsets)             # a_ij [batch, pos, types, out]
    coupling = jax.nn.softmax(agreement, axis=-1)                            # r_ij over parents
    total = pooled_votes(coupling, capsules, transforms, offsets)            # s_j [batch, out, dim]
    return layer_norm(total, layer_norm_scale, layer_norm_offset), total

  zeros = jnp.zeros((batch, out_caps, dim), capsules.dtype)
  poses, total = iterate(body, (zeros, zeros), routing_iterations, max_iterations, unroll)
  return RoutingResult(poses, vector_norm(squash(total)))


@register_routing('inverted_dot_product', learned={'layer_norm_scale': (lambda i, j, d: (d,), 1.0),
                                                   'layer_norm_offset': (lambda i, j, d: (d,), 0.0)},
                  returns_couplings=True, shared=_inverted_dot_product_shared)
def inverted_dot_product(prediction_vectors, input_activations, routing_iterations, *, layer_norm_scale,
                         layer_norm_offset, max_iterations=None, unroll=False, return_couplings=False):
  """Inverted dot-product attention routing (Tsai, Srivastava, Goh, Salakhutdinov, ICLR 2020).

  Parent poses p_j start at 0; r times: a_ij = p_j · û_{j|i} (the parent as the query),
  r_ij = softmax over parents j of a_ij, s_j = Σ_i r_ij û_{j|i}, p_j = LayerNorm(s_j)
  (learned gain and bias over the pose dimensions). The first iteration, with p = 0,
  couples uniformly. Activations (the paper classifies from poses and defines none):
  |squash(s_j)| of the last iteration, in [0, 1) as Procedure 1's (docs/results.md). Input
  activations are ignored. Couplings: r_ij of the first (uniform) and the last iteration.
  """
  del input_activations
  batch, in_caps, out_caps, dim = prediction_vectors.shape

  def body(t, carry):
    poses, _, _ = carry
    agreement = jnp.einsum('bijd,bjd->bij', prediction_vectors, poses)   # a_ij [batch, in, out]
    coupling = jax.nn.softmax(agreement, axis=-1)                        # r_ij over parents
    total = jnp.einsum('bij,bijd->bjd', coupling, prediction_vectors)    # s_j [batch, out, dim]
    return layer_norm(total, layer_norm_scale, layer_norm_offset), total, coupling

  zeros = jnp.zeros((batch, out_caps, dim), prediction_vectors.dtype)
  uniform_couplings = jnp.full((batch, in_caps, out_caps), 1.0 / out_caps, prediction_vectors.dtype)
  poses, total, last_used = iterate(body, (zeros, zeros, uniform_couplings), routing_iterations, max_iterations,
                                     unroll)
  return RoutingResult(poses, vector_norm(squash(total)),
                       couplings=(uniform_couplings, last_used) if return_couplings else None)
