"""Efficient-CapsNet's self-attention routing (Mazzia, Salvetti, Chiaberge 2021)."""
import jax
import jax.numpy as jnp

from capsjax.routing.base import RoutingResult, register_routing
from capsjax.routing.core import Array, pooled_votes, vector_norm, vote_dots


def efficient_squash(vectors: Array, axis: int = -1) -> Array:
  """Efficient-CapsNet's squash: (1 − e^{−|s|}) s / |s| (0 at the origin)."""
  norm = vector_norm(vectors, axis=axis, keepdims=True)
  safe = jnp.where(norm > 0, norm, 1.0)
  return jnp.where(norm > 0, vectors * (-jnp.expm1(-norm) / safe), 0.0)


def _self_attention_shared(capsules, transforms, offsets, *, log_priors):
  """`self_attention` on shared-transform votes without û: the vote sums Σ_k û_{j|k}, the
  scores û_{j|i}·Σ_k û_{j|k} and s_j = Σ_i (c_ij + b_ij) û_{j|i} each contract in the input
  pose space (pooled_votes, vote_dots)."""
  _, positions, types, _ = capsules.shape
  out_caps, dim = transforms.shape[1], transforms.shape[2]
  offsets = offsets.astype(capsules.dtype)
  everyone = jnp.ones(capsules.shape[:3] + (out_caps,), capsules.dtype)       # [batch, pos, types, out]
  vote_sums = pooled_votes(everyone, capsules, transforms, offsets)           # Σ_k û_{j|k} [batch, out, dim]
  scores = vote_dots(vote_sums, capsules, transforms, offsets) / jnp.sqrt(dim)  # [batch, pos, types, out]
  coupling = jax.nn.softmax(scores, axis=-1) + log_priors.reshape(positions, types, out_caps)
  parents = efficient_squash(pooled_votes(coupling, capsules, transforms, offsets))   # [batch, out, dim]
  return RoutingResult(parents, vector_norm(parents))


@register_routing('self_attention', iterative=False, learned={'log_priors': (lambda i, j, d: (i, j), 0.0)},
                  returns_couplings=True, shared=_self_attention_shared)
def self_attention(prediction_vectors, input_activations, *, log_priors, return_couplings=False):
  """Efficient-CapsNet's self-attention routing (Mazzia, Salvetti, Chiaberge 2021), one pass.

  For each parent j: A_j = Û_j Û_jᵀ / √d over the children's predictions; the coupling of
  child i is the softmax over parents of Σ_k A_j[i, k]; the log priors B [in, out] are
  added to it (after the softmax, as in the paper's s_j = Û_jᵀ (C_j + B_j) and the
  authors' code); s_j = Σ_i û_{j|i} (c_ij + b_ij), v_j = (1 − e^{−|s_j|}) s_j / |s_j|.
  Activations |v_j|. Not iterative. Couplings: the softmax part
  (the priors are added after it and are no distribution).
  """
  del input_activations
  dim = prediction_vectors.shape[-1]
  # Σ_k A_j[i, k] = û_{j|i} · Σ_k û_{j|k} / √d                          [batch, in, out]
  scores = jnp.einsum('bijd,bjd->bij', prediction_vectors, jnp.sum(prediction_vectors, axis=1)) / jnp.sqrt(dim)
  attention = jax.nn.softmax(scores, axis=-1)                            # [batch, in, out]
  coupling = attention + log_priors                                      # [batch, in, out]
  # s_j = Σ_i (c_ij + b_ij) û_{j|i}                                    [batch, out, dim]
  parents = efficient_squash(jnp.einsum('bij,bijd->bjd', coupling, prediction_vectors))
  return RoutingResult(parents, vector_norm(parents), couplings=(attention, attention) if return_couplings else None)
