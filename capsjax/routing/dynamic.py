"""Routing-by-agreement, the paper's Procedure 1 (Sabour, Frosst, Hinton 2017): on û, on
shared-transform votes without û, and the convergence probes of appendix A."""
from typing import Optional, Union

import chex
import jax
import jax.numpy as jnp
import numpy as np

from capsjax.errors import ArgumentError
from capsjax.routing.base import RoutingResult, register_routing
from capsjax.routing.core import (Array, check_flags, check_prediction_vectors, coupling_coefficients,
                                  iterate, loop_length, pooled_votes, squash, vector_norm, vote_dots)


def procedure1_iteration(logits: Array, couple, total_input_of, agreement_of, bias: Optional[Array]):
  """One pass of Procedure 1's loop body, the one written here (û's form and the
  shared-transform form without û both call it with their own sums): c = couple(b),
  s_j = Σ_i c_ij û_{j|i} (`total_input_of(c)`), plus the bias, v_j = squash(s_j),
  b_ij += û_{j|i}·v_j (`agreement_of(v)`). Returns (parents v_j, updated logits b)."""
  total_input = total_input_of(couple(logits))
  if bias is not None:
    total_input = total_input + bias
  parents = squash(total_input)
  return parents, logits + agreement_of(parents)


def _routing_iteration(predictions_by_parent, logits_by_parent, leaky, bias):
  """Procedure 1's pass on û, parent-major: returns (parents v_j, updated logits b)."""
  return procedure1_iteration(
      logits_by_parent,
      lambda logits: coupling_coefficients(logits, leaky, axis=1),                 # c [batch, out_caps, in_caps]
      # s_j = sum_i c_ij û_{j|i}                                                   # [batch, out_caps, out_dim]
      lambda coupling: jnp.einsum('bji,bjid->bjd', coupling, predictions_by_parent),
      # a_ij = û_{j|i} · v_j                                                       # [batch, out_caps, in_caps]
      lambda parents: jnp.einsum('bjid,bjd->bji', predictions_by_parent, parents),
      bias)


def dynamic_routing(
    prediction_vectors: Array,
    routing_iterations: Union[int, Array],
    *,
    max_iterations: Optional[int] = None,
    stop_gradient_predictions: bool = False,
    leaky: bool = False,
    log_priors: Optional[Array] = None,
    bias: Optional[Array] = None,
    return_logits: bool = False,
    unroll: bool = False,
):
  """Procedure 1 of the paper: routing by agreement.

  b = log_priors (0 by default); repeat r times: c = softmax_j(b), s_j = Σ_i c_ij û_{j|i},
  v_j = squash(s_j), b_ij += û_{j|i}·v_j. Returns v from the last iteration.

  Args:
    prediction_vectors: û, [batch, in_caps, out_caps, out_dim].
    routing_iterations: r ≥ 1. A Python (or NumPy) int runs exactly r iterations. A traced
      JAX integer (`jax.vmap` over r, r as a jit argument) needs `max_iterations`.
    max_iterations: static bound on r, required when r is traced: the loop runs that many
      times and iterations ≥ r keep the state (reverse-mode differentiable, which a
      while_loop with traced bounds is not).
    stop_gradient_predictions: gradients reach û through the last iteration only (the authors' later code).
    leaky: add a "none-of-the-above" parent with a zero logit (`coupling_coefficients`).
    log_priors: initial logits, broadcastable to [batch, in_caps, out_caps] (default 0):
      the paper's learned log priors (section 2).
    bias: optional [out_caps, out_dim] added to s_j before squash.
    return_logits: also return the logits after every iteration, [max_iterations or r,
      batch, in_caps, out_caps] (rows past r repeat the last), for convergence analysis.
    unroll: the iterations as straight-line code (`fori_loop(..., unroll=True)`), which XLA
      fuses across; same values (the model's `routing_loop`: capsjax.formulations).

  Returns:
    RoutingResult: parents v [batch, out_caps, out_dim], activations |v_j| [batch, out_caps],
    with `return_logits` the logits per iteration.

  Example:
    >>> votes = jax.random.normal(jax.random.key(0), (2, 6, 3, 4))   # û [batch, in, out, dim]
    >>> parents = capsjax.dynamic_routing(votes, routing_iterations=3).parents
    >>> parents.shape                                                 # v [batch, out, dim]
    (2, 3, 4)
    >>> bool(jnp.all(capsjax.vector_norm(parents) < 1))               # squashed
    True
    >>> # r traced under vmap, as the routing ablations do: one program for r = 1, 2, 3.
    >>> route_r = lambda r: capsjax.dynamic_routing(votes, r, max_iterations=3).parents
    >>> jax.vmap(route_r)(jnp.arange(1, 4)).shape                     # [r, batch, out, dim]
    (3, 2, 3, 4)
  """
  prediction_vectors = _checked_votes(prediction_vectors, log_priors, bias,
                                      stop_gradient_predictions=stop_gradient_predictions, leaky=leaky,
                                      return_logits=return_logits, unroll=unroll)
  batch, in_caps, out_caps, out_dim = prediction_vectors.shape
  length, static_count = loop_length(routing_iterations, max_iterations)
  last_iteration = jnp.asarray(routing_iterations if static_count is None else static_count) - 1
  dtype = prediction_vectors.dtype
  predictions_by_parent = jnp.transpose(prediction_vectors, (0, 2, 1, 3))  # [batch, out, in, dim]
  routing_logits = _initial_logits(log_priors, batch, in_caps, out_caps, dtype)   # b [batch, out, in]
  history = jnp.zeros((length, batch, in_caps, out_caps), dtype) if return_logits else None
  frozen_predictions = jax.lax.stop_gradient(predictions_by_parent)

  def body(t, carry):
    _, routing_logits, history = carry
    predictions = predictions_by_parent
    if stop_gradient_predictions:
      # Forward values are identical; only the gradient path differs.
      predictions = jnp.where(t == last_iteration, predictions_by_parent, frozen_predictions)
    parents, routing_logits = _routing_iteration(predictions, routing_logits, leaky, bias)
    if history is not None:
      history = history.at[t].set(jnp.transpose(routing_logits, (0, 2, 1)))   # [batch, in, out]
    return parents, routing_logits, history

  # A traced r: iterations ≥ r keep the state (iterate), their history rows repeat the last logits.
  parents, routing_logits, history = iterate(body, (jnp.zeros((batch, out_caps, out_dim), dtype), routing_logits,
                                                    history), routing_iterations, max_iterations, unroll)
  if history is not None and static_count is None:
    ran = (jnp.arange(length) <= last_iteration)[:, None, None, None]   # [iterations, 1, 1, 1]
    history = jnp.where(ran, history, jnp.transpose(routing_logits, (0, 2, 1))[None])
  return RoutingResult(parents, vector_norm(parents), logits=history)


def _checked_votes(prediction_vectors, log_priors, bias, **flags) -> Array:
  """û as a JAX array (NumPy's float64 → JAX's float), its flags and the shapes of
  log_priors and bias checked (XLA's error would name neither)."""
  check_prediction_vectors(prediction_vectors, 'dynamic_routing')
  prediction_vectors = jnp.asarray(prediction_vectors)
  check_flags('dynamic_routing', **flags)
  batch, in_caps, out_caps, out_dim = prediction_vectors.shape
  for name, given, target, layout in (('log_priors', log_priors, (batch, in_caps, out_caps), 'in_caps, out_caps'),
                                      ('bias', bias, (batch, out_caps, out_dim), 'out_caps, out_dim')):
    if given is not None and not _broadcasts(np.shape(given), target):
      raise ArgumentError(f'dynamic_routing: {name} of shape {np.shape(given)} does not broadcast to the votes\' '
                          f'[batch, {layout}] {target}')
  return prediction_vectors


def _initial_logits(log_priors: Optional[Array], batch: int, in_caps: int, out_caps: int, dtype) -> Array:
  """b before the first iteration, parent-major [batch, out_caps, in_caps]: log_priors, or
  zeros behind an optimization barrier (XLA would otherwise fold the unrolled first
  iteration's softmax over this constant at compile time, element by element)."""
  logits = jax.lax.optimization_barrier(jnp.zeros((batch, out_caps, in_caps), dtype))
  if log_priors is None:
    return logits
  priors = jnp.broadcast_to(log_priors.astype(dtype), (batch, in_caps, out_caps))
  return logits + jnp.transpose(priors, (0, 2, 1))


def routing_logit_changes(logits_per_iteration: Array, initial_logits: Optional[Array] = None) -> Array:
  """Mean |b_t − b_{t−1}| for every routing iteration t (the paper's appendix A).

  logits_per_iteration: [iterations, batch, in_caps, out_caps] from
  `dynamic_routing(..., return_logits=True)`; b_0 = `initial_logits` (zeros by default,
  Procedure 1). Returns [iterations].

  Example:
    >>> votes = jax.random.normal(jax.random.key(0), (2, 6, 3, 4))   # [batch, in, out, dim]
    >>> logits = capsjax.dynamic_routing(votes, 4, return_logits=True).logits
    >>> logits.shape                                                  # [iterations, batch, in, out]
    (4, 2, 6, 3)
    >>> capsjax.routing_logit_changes(logits).shape                   # one mean |Δb| per iteration
    (4,)
  """
  logits = _from_initial(logits_per_iteration, initial_logits, 'routing_logit_changes')   # [iterations + 1, …]
  return jnp.mean(jnp.abs(logits[1:] - logits[:-1]), axis=(1, 2, 3))


def _from_initial(logits_per_iteration: Array, initial_logits: Optional[Array], caller: str) -> Array:
  """b_0 (`initial_logits`, zeros by default, broadcast over the batch) then every
  iteration's logits: [iterations + 1, batch, in_caps, out_caps]; shapes that do not fit named."""
  shape = np.shape(logits_per_iteration)
  if len(shape) != 4:
    raise ArgumentError(f'{caller} takes logits [iterations, batch, in_caps, out_caps] (dynamic_routing(…, '
                        f'return_logits=True).logits), got shape {shape}')
  if initial_logits is not None and not _broadcasts(np.shape(initial_logits), shape[1:]):
    raise ArgumentError(f'{caller}: initial_logits of shape {np.shape(initial_logits)} do not broadcast to the '
                        f"logits' [batch, in_caps, out_caps] {shape[1:]}")
  initial = jnp.zeros_like(logits_per_iteration[:1]) if initial_logits is None else (
      jnp.broadcast_to(initial_logits, shape[1:])[None])
  return jnp.concatenate([initial, logits_per_iteration], axis=0)


def _broadcasts(shape, target) -> bool:
  """Whether an array of `shape` broadcasts to `target` (numpy's rules). A symbolic size (an
  export's batch: jax.export, jax2onnx) is not compared: it cannot be read while tracing.
  Shapes are read with NumPy's np.shape: jax2onnx traces jnp.shape as an array, whose
  iteration is JAX 0.12's `unstack` primitive, which jax2onnx 0.12 cannot convert."""
  known = lambda size: isinstance(size, int)
  return len(shape) <= len(target) and all(not known(s) or not known(t) or s in (1, t)
                                           for s, t in zip(reversed(shape), reversed(target)))


def coupling_changes(logits_per_iteration: Array, initial_logits: Optional[Array] = None) -> Array:
  """Mean |c_{t+1} − c_t| for every routing iteration t: how much iteration t moves the
  coupling coefficients c = softmax_j(b).

  Under Procedure 1 the logits keep growing (b_t − b_{t−1} = û·v_t tends to û·v*, not to
  0), so |Δb| does not vanish at convergence; the couplings do settle, and this measures
  that. Same arguments as `routing_logit_changes`; returns [iterations].
  """
  logits = _from_initial(logits_per_iteration, initial_logits, 'coupling_changes')
  couplings = jax.nn.softmax(logits, axis=-1)              # [iterations + 1, batch, in, out]
  return jnp.mean(jnp.abs(couplings[1:] - couplings[:-1]), axis=(1, 2, 3))



def shared_dynamic_routing(capsules: Array, transforms: Array, offsets: Array, routing_iterations, *,
                           max_iterations=None, unroll: bool = False, bias: Optional[Array] = None) -> Array:
  """Procedure 1 on shared-transform votes without materialising û: the same values as
  `dynamic_routing(shared_votes(capsules, transforms, offsets), …)`.

  Both sums of Procedure 1 contract in the input pose space:
    s_j = Σ_i c_ij û_{j|i} = Σ_t W_tj (Σ_p c_(p,t)j u_(p,t)) + Σ_(p,t) c_(p,t)j o_p
    û_{j|i}·v_j = u_(p,t)·(W_tjᵀ v_j) + o_p·v_j
  so the largest tensor is the logits [batch, positions, types, out], not û's
  [batch, positions·types, out, dim]. Returns parents [batch, out, dim].
  """
  chex.assert_rank(capsules, 4)   # [batch, positions, types, in_dim]
  batch, positions, types, _ = capsules.shape
  out_caps, out_dim = transforms.shape[1], transforms.shape[2]
  dtype = capsules.dtype
  offsets = offsets.astype(dtype)

  def body(t, carry):
    _, logits = carry
    return procedure1_iteration(
        logits,
        lambda logits: jax.nn.softmax(logits, axis=-1),                           # c [batch, pos, types, out]
        lambda coupling: pooled_votes(coupling, capsules, transforms, offsets),   # s_j [batch, out, dim]
        lambda parents: vote_dots(parents, capsules, transforms, offsets),        # [batch, pos, types, out]
        bias)

  state = (jnp.zeros((batch, out_caps, out_dim), dtype), jnp.zeros((batch, positions, types, out_caps), dtype))
  parents, _ = iterate(body, state, routing_iterations, max_iterations, unroll)
  return parents


def per_capsule_dynamic_routing(weights: Array, capsules: Array, routing_iterations: int, *,
                                bias: Optional[Array] = None) -> Array:
  """Procedure 1 on the paper's votes û_{j|i} = W_ij u_i without materialising û: the same
  values as `dynamic_routing(û, r, bias=bias).parents`.

  Both sums contract in the input pose space:
    s_j = Σ_i c_ij W_ij u_i = W_j · (c_j ⊙ u)      (W_j [in·in_dim, out_dim])
    û_{j|i}·v_j = u_i·(W_ijᵀ v_j)
  so the largest tensors are [out, batch, in, in_dim] (half û's for 8-D inputs and 16-D
  outputs), and the first iteration, c = 1/out, is one matmul of u [batch, in·in_dim] by
  W [in·in_dim, out·out_dim]. The iterations are straight-line code (r a Python int), so
  the last one's unused agreement is dropped when jitted. weights [in, out, out_dim,
  in_dim], capsules [batch, in, in_dim] → parents v [batch, out, out_dim].
  """
  in_caps, out_caps, out_dim, in_dim = weights.shape
  batch = capsules.shape[0]
  if bias is not None:   # in the parents' layout [out, batch, out_dim]
    bias = jnp.swapaxes(jnp.broadcast_to(bias, (batch, out_caps, out_dim)), 0, 1)
  by_input = jnp.transpose(weights, (0, 3, 1, 2)).reshape(in_caps * in_dim, out_caps * out_dim)  # [in·in_dim, out·out_dim]
  by_parent = jnp.transpose(weights, (1, 0, 3, 2)).reshape(out_caps, in_caps * in_dim, out_dim)  # [out, in·in_dim, out_dim]

  def uniform_total_input(_):   # s_j = Σ_i û_{j|i} / out                        # [out, batch, out_dim]
    total = jnp.einsum('bn,nm->bm', capsules.reshape(batch, in_caps * in_dim), by_input) / out_caps
    return jnp.swapaxes(total.reshape(batch, out_caps, out_dim), 0, 1)

  def total_input(coupling):   # s_j = Σ_i c_ij W_ij u_i                        # [out, batch, out_dim]
    coupled = (coupling[..., None] * capsules).reshape(out_caps, batch, in_caps * in_dim)   # c_ij u_i
    return jnp.einsum('jbn,jnd->jbd', coupled, by_parent)

  def agreement(parents):   # u_i·(W_ijᵀ v_j), the dot as a product and sum (an einsum's batched
    # matvecs made XLA transpose W_ijᵀ v_j to [batch, in, in_dim, out] first)   # [out, batch, in]
    pulled_back = jnp.einsum('jbd,jnd->jbn', parents, by_parent).reshape(out_caps, batch, in_caps, in_dim)
    return jnp.sum(pulled_back * capsules, axis=-1)

  parents, logits = procedure1_iteration(0.0, lambda logits: None, uniform_total_input, agreement, bias)
  for _ in range(1, routing_iterations):
    parents, logits = procedure1_iteration(logits, lambda logits: jax.nn.softmax(logits, axis=0),
                                           total_input, agreement, bias)
  return jnp.swapaxes(parents, 0, 1)


def _dynamic_shared(capsules, transforms, offsets, routing_iterations, *, max_iterations=None, unroll=False,
                    bias=None):
  """`dynamic` on shared-transform votes without û (the layer features other than the bias
  need û or per-capsule logits: with them the layer materialises û, see shared_form)."""
  parents = shared_dynamic_routing(capsules, transforms, offsets, routing_iterations, max_iterations=max_iterations,
                                   unroll=unroll, bias=bias)
  return RoutingResult(parents, vector_norm(parents))


def _couplings_used(logits, routing_iterations, leaky, log_priors):
  """(first, last): the couplings softmax(b) before the first and before the last
  iteration [batch, in, out], from the logits after every iteration."""
  initial = jnp.zeros(logits.shape[1:], logits.dtype)                       # b before iteration 1
  if log_priors is not None:
    initial = initial + jnp.broadcast_to(log_priors.astype(logits.dtype), initial.shape)
  before = jnp.concatenate([initial[None], logits], axis=0)                 # b before iteration t + 1
  last = jnp.asarray(routing_iterations) - 1                                    # traced r too
  couplings = lambda b: coupling_coefficients(b, leaky)                     # [batch, in, out]
  # The first couplings from b's smallest shape, then broadcast: the same values, but XLA
  # would fold a softmax over a [batch, in, out] constant at compile time, slowly.
  distinct = jnp.zeros((1, 1, initial.shape[-1]), logits.dtype)
  if log_priors is not None:
    distinct = distinct + log_priors.astype(logits.dtype)
  first = jnp.broadcast_to(couplings(distinct), initial.shape)
  return first, couplings(before[last])


@register_routing('dynamic', returns_logits=True, returns_couplings=True,
                  layer_inputs=('bias', 'log_priors', 'leaky', 'stop_gradient_predictions'), shared=_dynamic_shared,
                  per_capsule=per_capsule_dynamic_routing)
def dynamic(prediction_vectors, input_activations, routing_iterations, *, max_iterations=None, unroll=False,
            return_logits=False, return_couplings=False, stop_gradient_predictions=False, leaky=False,
            log_priors=None, bias=None):
  """Procedure 1 (`dynamic_routing`); input activations are ignored; activations |v_j|.
  Couplings: softmax(b) before the first and before the last iteration (without the
  leaky parent's share)."""
  del input_activations
  with_logits = return_logits or return_couplings
  result = dynamic_routing(prediction_vectors, routing_iterations, max_iterations=max_iterations,
                           stop_gradient_predictions=stop_gradient_predictions, leaky=leaky,
                           log_priors=log_priors, bias=bias, unroll=unroll, return_logits=with_logits)
  return RoutingResult(
      result.parents, result.activations,
      couplings=_couplings_used(result.logits, routing_iterations, leaky, log_priors) if return_couplings else None,
      logits=result.logits if return_logits else None)
