"""Variational-Bayes routing (Ribeiro, Leontidis, Kollias, AAAI 2020) on vector poses."""
import math
from typing import Annotated

import jax
import jax.numpy as jnp

from capsjax.keys import About, number_in
from capsjax.routing.base import RoutingResult, register_routing
from capsjax.routing.core import iterate


@register_routing('variational_bayes', returns_couplings=True,
                  learned={'prior_log_alpha': (lambda i, j, d: (j,), 0.0),
                           'prior_log_kappa': (lambda i, j, d: (j,), 0.0),
                           'prior_log_inverse_scale': (lambda i, j, d: (j, d), 0.0),
                           'beta_u': (lambda i, j, d: (j,), 0.0), 'beta_a': (lambda i, j, d: (j,), 0.0)})
def variational_bayes(prediction_vectors, input_activations, routing_iterations, *, prior_log_alpha, prior_log_kappa,
                      prior_log_inverse_scale, beta_u, beta_a, max_iterations=None, unroll=False,
                      return_couplings=False,
                      prior_extra_dof: Annotated[float, About(number_in(0, math.inf, low_open=True), (
                          "the Wishart prior's degrees of freedom ν₀ beyond the capsule dimension (ν₀ = D + this, "
                          '> D − 1)'))] = 1.0,
                      inverse_temperature: Annotated[float, About(number_in(0, math.inf, low_open=True),
                                                                  'λ of its activations')] = 1.0):
  """Variational-Bayes routing (Ribeiro, Leontidis, Kollias, AAAI 2020) on vector poses.

  Each parent j is a Gaussian with diagonal precision Λ_j over the votes V_ij = û_{j|i},
  mixed by π; priors Dirichlet(α₀) on π, Normal-Wishart(m₀ = 0, κ₀, Ψ₀, ν₀) on (μ_j, Λ_j).
  R_ij = 1/|out|; r times: the posteriors' update (with w_ij = R_ij a_i, R_j = Σ_i w_ij:
  α_j = α₀ + R_j, κ_j = κ₀ + R_j, ν_j = ν₀ + R_j, μ̄_j = Σ_i w_ij V_ij / R_j,
  m_j = R_j μ̄_j / κ_j, Ψ_j⁻¹ = Ψ₀⁻¹ + Σ_i w_ij (V_ij − μ̄_j)² + κ₀ R_j / κ_j μ̄_j²), then,
  except after the last, the assignments' update: ln ρ_ij = E[ln π_j] + ½ E[ln|Λ_j|] −
  (D/2) ln 2π − ½ (D/κ_j + ν_j Σ_h Ψ_jh (V_ijh − m_jh)²), R_ij = softmax_j(ln ρ_ij), with
  E[ln π_j] = ψ(α_j) − ψ(Σ_k α_k), E[ln|Λ_j|] = Σ_{h<D} ψ((ν_j − h)/2) + D ln 2 + ln|Ψ_j|.
  Activations: a_j = logistic(λ · standardised_j(β_a − (e^{E[ln π_j]} H[q_j] + β_u))), the
  posterior entropy H[q_j] = (D/2) ln(2πe) − ½ E[ln|Λ_j|]; the paper batch-normalises this
  where capsjax standardises over the parents (as `em` does: a routing keeps no batch
  statistics). Poses: the posterior means m_j. The priors are learned per parent
  (`prior_log_alpha` → α₀, `prior_log_kappa` → κ₀, `prior_log_inverse_scale` → diag Ψ₀⁻¹,
  initial α₀ = κ₀ = 1, Ψ₀ = I as in the authors' code) with ν₀ = D + prior_extra_dof.
  """
  votes = prediction_vectors                                                  # [batch, in, out, dim]
  batch, in_caps, out_caps, dim = votes.shape
  alpha0, kappa0 = jnp.exp(prior_log_alpha), jnp.exp(prior_log_kappa)        # [out]
  inverse_scale0 = jnp.exp(prior_log_inverse_scale)                          # diag Ψ₀⁻¹ [out, dim]
  nu0 = dim + prior_extra_dof
  halves = jnp.arange(dim, dtype=votes.dtype)                                 # h = 0 … D−1

  def posteriors(responsibilities):
    weighted = responsibilities * input_activations[:, :, None]             # w_ij [batch, in, out]
    mass = jnp.sum(weighted, axis=1) + 1e-9                                 # R_j [batch, out]
    alpha, kappa, nu = alpha0 + mass, kappa0 + mass, nu0 + mass             # [batch, out]
    # μ̄_j = Σ_i w_ij V_ij / R_j                                           [batch, out, dim]
    vote_means = jnp.einsum('bij,bijd->bjd', weighted, votes) / mass[..., None]
    means = (mass / kappa)[..., None] * vote_means                         # m_j [batch, out, dim]
    scatter = jnp.einsum('bij,bijd->bjd', weighted, jnp.square(votes - vote_means[:, None]))
    inverse_scale = (inverse_scale0 + scatter
                     + (kappa0 * mass / kappa)[..., None] * jnp.square(vote_means))   # Ψ_j⁻¹ [batch, out, dim]
    log_det_scale = -jnp.sum(jnp.log(inverse_scale), axis=-1)              # ln|Ψ_j| [batch, out]
    expected_log_precision = (jnp.sum(jax.scipy.special.digamma(0.5 * (nu[..., None] - halves)), axis=-1)
                              + dim * jnp.log(2.0) + log_det_scale)        # E[ln|Λ_j|] [batch, out]
    expected_log_mix = (jax.scipy.special.digamma(alpha)
                        - jax.scipy.special.digamma(jnp.sum(alpha, axis=-1, keepdims=True)))   # [batch, out]
    return means, kappa, nu, inverse_scale, expected_log_precision, expected_log_mix

  def assignments(means, kappa, nu, inverse_scale, expected_log_precision, expected_log_mix):
    # E[(V − μ)ᵀ Λ (V − μ)] = D/κ_j + ν_j Σ_h (V_ijh − m_jh)² / Ψ⁻¹_jh     [batch, in, out]
    quadratic = dim / kappa[:, None] + nu[:, None] * jnp.sum(
        jnp.square(votes - means[:, None]) / inverse_scale[:, None], axis=-1)
    log_p = 0.5 * expected_log_precision[:, None] - 0.5 * dim * jnp.log(2 * jnp.pi) - 0.5 * quadratic
    return jax.nn.softmax(expected_log_mix[:, None] + log_p, axis=-1)      # R_ij [batch, in, out]

  def body(t, carry):
    responsibilities, _, _ = carry
    posterior = posteriors(responsibilities)
    return assignments(*posterior), posterior, responsibilities

  uniform_couplings = jnp.full((batch, in_caps, out_caps), 1.0 / out_caps, votes.dtype)
  initial = (uniform_couplings, posteriors(uniform_couplings), uniform_couplings)
  # The last iteration's assignment update does not reach the outputs (as in `em`).
  _, posterior, last_used = iterate(body, initial, routing_iterations, max_iterations, unroll)
  means, _, _, _, expected_log_precision, expected_log_mix = posterior
  entropy = 0.5 * dim * jnp.log(2 * jnp.pi * jnp.e) - 0.5 * expected_log_precision   # H[q_j] [batch, out]
  score = beta_a - (jnp.exp(expected_log_mix) * entropy + beta_u)                     # [batch, out]
  mean = jnp.mean(score, axis=-1, keepdims=True)
  spread = jnp.sqrt(jnp.mean(jnp.square(score - mean), axis=-1, keepdims=True))
  activations = jax.nn.sigmoid(inverse_temperature * (score - mean) / (spread + 1e-6))
  return RoutingResult(means, activations, couplings=(uniform_couplings, last_used) if return_couplings else None)
