"""EM routing (Hinton, Sabour, Frosst, ICLR 2018) on vector poses."""
import math
from typing import Annotated

import jax
import jax.numpy as jnp

from capsjax.keys import About, number_in
from capsjax.routing.base import RoutingResult, register_routing
from capsjax.routing.core import iterate


@register_routing('em', learned={'beta_u': (lambda i, j, d: (j,), 0.0), 'beta_a': (lambda i, j, d: (j,), 0.0)},
                  returns_couplings=True)
def em(prediction_vectors, input_activations, routing_iterations, *, beta_u, beta_a, max_iterations=None,
       unroll=False, return_couplings=False,
       inverse_temperature: Annotated[float, About(number_in(0, math.inf, low_open=True), (
           'the final inverse temperature λ (λ rises linearly to it over the iterations)'))] = 1.0,
       variance_epsilon: Annotated[float, About(number_in(0, math.inf, low_open=True), (
           'added to every variance σ² (keeps log σ finite)'))] = 1e-8):
  """EM routing (Hinton, Sabour, Frosst, ICLR 2018, Procedure 1) on vector poses.

  Votes V_ij = û_{j|i}, input activations a_i. R_ij = 1/|out|; r times: M-step
  (R_ij ← R_ij a_i; μ_j, σ²_j per dimension, weighted by R; cost_j = Σ_h (β_u + log σ_jh) ·
  Σ_i R_ij; a_j = logistic(λ_t (β_a − ĉost_j))), then, except after the last, E-step
  (R_ij = a_j p_j(V_ij) / Σ_k a_k p_k(V_ij), p a diagonal Gaussian). Choices where the
  paper leaves them open (docs/results.md): ĉost_j = (cost_j − mean_k cost_k) / (std_k cost_k + ε)
  standardised over the parents (the raw cost grows with the number of inputs; a mean
  instead of the sum stayed at chance for 200 steps); λ_t = inverse_temperature ·
  (t + 1) / r (rising to inverse_temperature, default 1, at the last iteration: a final 4
  left mnist_smoke at chance, 1 reached 83 % training accuracy by step 100); σ² +
  variance_epsilon (1e-8, below the variances of the small initial votes). β_u, β_a: [out]
  (learned per output capsule). Returns (μ [batch, out, dim], a [batch, out]); couplings:
  the responsibilities R_ij the first and the last M-step weighted the votes by.
  """
  batch, in_caps, out_caps, dim = prediction_vectors.shape
  votes = prediction_vectors                                             # [batch, in, out, dim]
  count = jnp.asarray(routing_iterations, votes.dtype)

  def m_step(t, responsibilities):
    weighted = responsibilities * input_activations[:, :, None]          # [batch, in, out]
    mass = jnp.sum(weighted, axis=1) + 1e-9                              # Σ_i R_ij [batch, out]
    # μ_jh = Σ_i R_ij V_ijh / Σ_i R_ij                                   [batch, out, dim]
    means = jnp.einsum('bij,bijd->bjd', weighted, votes) / mass[..., None]
    # σ²_jh = Σ_i R_ij (V_ijh − μ_jh)² / Σ_i R_ij                         [batch, out, dim]
    variances = jnp.einsum('bij,bijd->bjd', weighted, jnp.square(votes - means[:, None])) / mass[..., None]
    variances = variances + variance_epsilon
    cost = jnp.sum(beta_u[:, None] + 0.5 * jnp.log(variances), axis=-1) * mass          # [batch, out]
    mean = jnp.mean(cost, axis=-1, keepdims=True)
    # The floor changes no value that matters (it is far below the 1e-6 beside it); at equal
    # costs (all-zero votes: a blank image through an unbiased PrimaryCaps) √0's infinite
    # derivative made every gradient NaN.
    spread = jnp.sqrt(jnp.maximum(jnp.mean(jnp.square(cost - mean), axis=-1, keepdims=True), 1e-24))
    standardised = (cost - mean) / (spread + 1e-6)                                     # [batch, out]
    temperature = inverse_temperature * (t + 1) / count
    activations = jax.nn.sigmoid(temperature * (beta_a - standardised))               # [batch, out]
    return means, variances, activations

  def e_step(means, variances, activations):
    # log p_j(V_ij) for a diagonal Gaussian                               [batch, in, out]
    log_p = -0.5 * jnp.sum(jnp.log(2 * jnp.pi * variances)[:, None]
                           + jnp.square(votes - means[:, None]) / variances[:, None], axis=-1)
    return jax.nn.softmax(jnp.log(activations + 1e-9)[:, None] + log_p, axis=-1)

  def body(t, carry):
    responsibilities, _, _, _ = carry
    means, variances, activations = m_step(t, responsibilities)
    return e_step(means, variances, activations), means, activations, responsibilities

  uniform_couplings = jnp.full((batch, in_caps, out_caps), 1.0 / out_caps, votes.dtype)
  initial = (uniform_couplings, jnp.zeros((batch, out_caps, dim), votes.dtype),
             jnp.zeros((batch, out_caps), votes.dtype), uniform_couplings)
  # The last iteration's E-step does not reach the outputs (μ, a come from its M-step).
  _, means, activations, last_used = iterate(body, initial, routing_iterations, max_iterations, unroll)
  return RoutingResult(means, activations, couplings=(uniform_couplings, last_used) if return_couplings else None)
