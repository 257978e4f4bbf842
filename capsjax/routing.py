"""Routing-by-agreement (Sabour et al. 2017, Procedure 1) as pure functions of arrays.

Shapes used throughout:
  prediction_vectors  û_{j|i}   [batch, in_caps, out_caps, out_dim]
  routing_logits      b_ij      [batch, in_caps, out_caps]
  coupling            c_ij      [batch, in_caps, out_caps]   (softmax of b over out_caps)
  parents             v_j       [batch, out_caps, out_dim]
"""
from typing import Optional, Union

import chex
import jax
import jax.numpy as jnp

Array = jax.Array

def vector_norm(vectors: Array, axis: int = -1, keepdims: bool = False) -> Array:
  """|v| along `axis`, exact (no ε), with gradient 0 at the zero vector.

  The norm's own gradient is infinite at 0, so zero vectors take a separate branch (the
  double-where trick); capsule lengths and squash both use it.
  """
  return _safe_sqrt(jnp.sum(jnp.square(vectors), axis=axis, keepdims=keepdims))


def _safe_sqrt(squared_norm: Array) -> Array:
  nonzero = squared_norm > 0
  return jnp.where(nonzero, jnp.sqrt(jnp.where(nonzero, squared_norm, 1.0)), 0.0)


def squash(vectors: Array, axis: int = -1) -> Array:
  """v = |s|² / (1 + |s|²) · s / |s| = s · |s| / (1 + |s|²): keeps direction, length → [0, 1).

  Written as s·|s|/(1+|s|²) there is no division by |s|; at the origin value and gradient
  are 0, squash's true derivative there (see `vector_norm`).
  """
  squared_norm = jnp.sum(jnp.square(vectors), axis=axis, keepdims=True)
  return vectors * (_safe_sqrt(squared_norm) / (1.0 + squared_norm))


def coupling_coefficients(routing_logits: Array, leaky: bool = False, axis: int = -1) -> Array:
  """c_ij = softmax over the parents (`axis`) of b_ij; `leaky` adds a parent with logit 0.

  The leaky "none-of-the-above" parent takes a share of every child's output and is then
  dropped, so children that agree with no real parent can route away from all of them.
  """
  if not leaky:
    return jax.nn.softmax(routing_logits, axis=axis)
  axis = axis % routing_logits.ndim
  leak_shape = routing_logits.shape[:axis] + (1,) + routing_logits.shape[axis + 1:]
  logits = jnp.concatenate([routing_logits, jnp.zeros(leak_shape, routing_logits.dtype)], axis=axis)
  num_parents = routing_logits.shape[axis]
  return jax.lax.slice_in_dim(jax.nn.softmax(logits, axis=axis), 0, num_parents, axis=axis)


# Inside the loop the arrays are kept parent-major ([batch, out_caps, in_caps, ...]): both
# per-iteration contractions are then batched mat-vecs over contiguous memory, where the
# public [batch, in_caps, out_caps, dim] layout made XLA transpose û twice per iteration
# (measured: routing forward 206 → 118 ms at the paper's size on a 2-core CPU).

def _routing_iteration(predictions_by_parent, logits_by_parent, leaky, bias):
  """One pass of Procedure 1's loop body: returns (parents v_j, updated logits b)."""
  coupling = coupling_coefficients(logits_by_parent, leaky, axis=1)  # [batch, out_caps, in_caps]
  # s_j = sum_i c_ij û_{j|i}                              # [batch, out_caps, out_dim]
  total_input = jnp.einsum('bji,bjid->bjd', coupling, predictions_by_parent)
  if bias is not None:
    total_input = total_input + bias
  parents = squash(total_input)
  # a_ij = û_{j|i} · v_j                                  # [batch, out_caps, in_caps]
  agreement = jnp.einsum('bjid,bjd->bji', predictions_by_parent, parents)
  return parents, logits_by_parent + agreement


def dynamic_routing(
    prediction_vectors: Array,
    num_iterations: Union[int, Array],
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
    num_iterations: r ≥ 1. A Python int runs exactly r iterations. A traced integer (for
      `jax.vmap` over r, or r as a jit argument) needs `max_iterations`, a static bound:
      the loop then runs max_iterations times and iterations ≥ r leave the state as it
      is, which keeps reverse-mode differentiation available (a loop with traced bounds
      would be a while_loop, which cannot be reverse-differentiated).
    max_iterations: static upper bound on r; required when r is traced.
    stop_gradient_predictions: gradients reach û only through the last iteration, as in
      the authors' later code; the earlier iterations only choose the coupling.
    leaky: add a "none-of-the-above" parent with a constant zero logit (see
      `coupling_coefficients`).
    log_priors: initial logits, broadcastable to [batch, in_caps, out_caps]; learned
      log priors (the paper's section 2) are passed here. Default zeros.
    bias: optional [out_caps, out_dim] added to s_j before squash.
    return_logits: also return the logits after every iteration,
      [max_iterations or r, batch, in_caps, out_caps] (rows past r repeat the final
      logits), for routing-convergence analysis.
    unroll: unroll the fori_loop (`fori_loop(..., unroll=True)`): the same iterations as
      straight-line code, which lets XLA fuse across them; same values (model option
      `routing_loop`, resolved per backend by capsjax.formulations).

  Returns:
    parents [batch, out_caps, out_dim], or (parents, logits_per_iteration).
  """
  chex.assert_rank(prediction_vectors, 4)   # [batch, in_caps, out_caps, dim]
  batch, in_caps, out_caps, out_dim = prediction_vectors.shape
  static_count = isinstance(num_iterations, int)
  if static_count:
    if num_iterations < 1:
      raise ValueError(f'num_iterations must be >= 1, got {num_iterations}')
    if max_iterations is not None and num_iterations > max_iterations:
      raise ValueError(f'num_iterations={num_iterations} exceeds max_iterations={max_iterations}')
    loop_length = num_iterations
  elif max_iterations is None:
    raise ValueError('a traced num_iterations needs a static max_iterations bound')
  else:
    loop_length = max_iterations
  last_iteration = jnp.asarray(num_iterations) - 1

  dtype = prediction_vectors.dtype
  predictions_by_parent = jnp.transpose(prediction_vectors, (0, 2, 1, 3))  # [batch, out, in, dim]
  routing_logits = jnp.zeros((batch, out_caps, in_caps), dtype)             # b, parent-major
  if log_priors is not None:
    priors = jnp.broadcast_to(log_priors.astype(dtype), (batch, in_caps, out_caps))
    routing_logits = routing_logits + jnp.transpose(priors, (0, 2, 1))
  parents = jnp.zeros((batch, out_caps, out_dim), dtype)
  history = jnp.zeros((loop_length, batch, in_caps, out_caps), dtype) if return_logits else None
  frozen_predictions = jax.lax.stop_gradient(predictions_by_parent)

  def body(t, carry):
    parents, routing_logits, history = carry
    predictions = predictions_by_parent
    if stop_gradient_predictions:
      # Forward values are identical; only the gradient path differs.
      predictions = jnp.where(t == last_iteration, predictions_by_parent, frozen_predictions)
    new_parents, new_logits = _routing_iteration(predictions, routing_logits, leaky, bias)
    if not static_count:
      active = t <= last_iteration
      new_parents = jnp.where(active, new_parents, parents)
      new_logits = jnp.where(active, new_logits, routing_logits)
    if history is not None:
      history = history.at[t].set(jnp.transpose(new_logits, (0, 2, 1)))
    return new_parents, new_logits, history

  parents, _, history = jax.lax.fori_loop(
      0, loop_length, body, (parents, routing_logits, history), unroll=unroll)
  if return_logits:
    return parents, history
  return parents


def routing_logit_changes(logits_per_iteration: Array, initial_logits: Optional[Array] = None) -> Array:
  """Mean |b_t − b_{t−1}| for every routing iteration t (the paper's appendix A).

  logits_per_iteration: [iterations, batch, in_caps, out_caps] from
  `dynamic_routing(..., return_logits=True)`; b_0 = `initial_logits` (zeros by default,
  Procedure 1). Returns [iterations].
  """
  initial = jnp.zeros_like(logits_per_iteration[:1]) if initial_logits is None else (
      jnp.broadcast_to(initial_logits, logits_per_iteration.shape[1:])[None])
  previous = jnp.concatenate([initial, logits_per_iteration[:-1]], axis=0)
  return jnp.mean(jnp.abs(logits_per_iteration - previous), axis=(1, 2, 3))


def coupling_changes(logits_per_iteration: Array, initial_logits: Optional[Array] = None) -> Array:
  """Mean |c_{t+1} − c_t| for every routing iteration t: how much iteration t moves the
  coupling coefficients c = softmax_j(b).

  Under Procedure 1 the logits keep growing (b_t − b_{t−1} = û·v_t tends to û·v*, not to
  0), so |Δb| does not vanish at convergence; the couplings do settle, and this measures
  that. Same arguments as `routing_logit_changes`; returns [iterations].
  """
  initial = jnp.zeros_like(logits_per_iteration[:1]) if initial_logits is None else (
      jnp.broadcast_to(initial_logits, logits_per_iteration.shape[1:])[None])
  logits = jnp.concatenate([initial, logits_per_iteration], axis=0)
  couplings = jax.nn.softmax(logits, axis=-1)              # [iterations + 1, batch, in, out]
  return jnp.mean(jnp.abs(couplings[1:] - couplings[:-1]), axis=(1, 2, 3))
