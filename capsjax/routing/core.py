"""The machinery every routing shares: capsule lengths, squash, coupling coefficients,
the iteration loop, and votes from class-capsule transforms shared over positions.

Shapes used throughout:
  prediction_vectors  û_{j|i}   [batch, in_caps, out_caps, out_dim]
  routing_logits      b_ij      [batch, in_caps, out_caps]
  coupling            c_ij      [batch, in_caps, out_caps]   (softmax of b over out_caps)
  parents             v_j       [batch, out_caps, out_dim]
"""
import functools
import operator
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from capsjax.errors import ArgumentError

Array = jax.Array


# An upper bound on a config's iteration counts that only stops mistakes: a routing of 10⁶
# iterations compiles and then runs for hours (the paper's appendix goes to 10).
MAX_ROUTING_ITERATIONS = 100

def vector_norm(vectors: Array, axis: int = -1, keepdims: bool = False) -> Array:
  """|v| along `axis`, exact (no ε), with gradient 0 at the zero vector.

  The norm's own gradient is infinite at 0, so zero vectors take a separate branch (the
  double-where trick); capsule lengths and squash both use it. A NaN component gives NaN.
  vectors [..., dim] → lengths [...] ([..., 1] with keepdims).

  Example:
    >>> capsjax.vector_norm(jnp.array([[3.0, 4.0], [0.0, 0.0]]))   # [2, dim] → [2]
    Array([5., 0.], dtype=float32)
  """
  check_axis('vector_norm', 'vectors', vectors, axis)
  return _safe_sqrt(jnp.sum(jnp.square(vectors), axis=axis, keepdims=keepdims))


def check_flags(what: str, **flags) -> None:
  """One line for a switch that is not True or False ('no' is true: it switched on);
  `unroll` may also be UNROLLED_INFERENCE."""
  for name, value in flags.items():
    if not (isinstance(value, (bool, np.bool_)) or (name == 'unroll' and value == UNROLLED_INFERENCE)):
      also = f" or {UNROLLED_INFERENCE!r} (unrolled where nothing differentiates)" if name == 'unroll' else ''
      raise ArgumentError(f'{what}: {name}={value!r}: allowed True or False{also}')


def check_axis(what: str, name: str, array: Array, axis) -> None:
  """One line for an `axis` that is not an axis of `array` (NumPy's words named neither
  the function nor the array)."""
  if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
    raise ArgumentError(f'{what}: axis takes an integer, got {axis!r}')
  if not -np.ndim(array) <= axis < np.ndim(array):
    raise ArgumentError(f'{what}: axis {axis} is out of bounds for {name} of shape {np.shape(array)}')


def _safe_sqrt(squared_norm: Array) -> Array:
  # Tested as `== 0`, not `> 0`: a NaN (a diverged model, a NaN input) stays NaN, never a
  # length of 0 that reads as "every class absent".
  zero = squared_norm == 0
  return jnp.where(zero, 0.0, jnp.sqrt(jnp.where(zero, 1.0, squared_norm)))


def squash(vectors: Array, axis: int = -1) -> Array:
  """v = |s|² / (1 + |s|²) · s / |s| = s · |s| / (1 + |s|²): keeps direction, length → [0, 1).

  Written as s·|s|/(1+|s|²) there is no division by |s|; at the origin value and gradient
  are 0, squash's true derivative there (see `vector_norm`). Computed on s / c with c its
  largest |component| (held constant: the value does not depend on it, so neither does the
  gradient), as (s/c)·r / (c⁻² + r²) with r = |s/c| ≤ √dim: no square overflows, and a
  vector longer than float32's √max (1.8e19, as a diverging run makes) squashes to unit
  length, not to NaN.
  vectors [..., dim] (any shape; `axis` is the capsule dimension) → the same shape.

  Example:
    >>> v = capsjax.squash(jnp.array([[3.0, 4.0]]))   # |s| = 5 → |v| = 25 / 26
    >>> v.shape, round(float(capsjax.vector_norm(v)[0]), 4)
    ((1, 2), 0.9615)
  """
  check_axis('squash', 'vectors', vectors, axis)
  largest = jax.lax.stop_gradient(jnp.max(jnp.abs(vectors), axis=axis, keepdims=True))
  largest = jnp.where(largest == 0, 1.0, largest)      # a zero vector stays as it is (a NaN stays NaN)
  scaled = vectors / largest                           # [..., dim], largest |component| 1
  length = _safe_sqrt(jnp.sum(jnp.square(scaled), axis=axis, keepdims=True))   # |s| / c
  return scaled * (length / (1.0 / jnp.square(largest) + jnp.square(length)))


def coupling_coefficients(routing_logits: Array, leaky: bool = False, axis: int = -1) -> Array:
  """c_ij = softmax over the parents (`axis`) of b_ij; `leaky` adds a parent with logit 0.

  The leaky "none-of-the-above" parent takes a share of every child's output and is then
  dropped, so children that agree with no real parent can route away from all of them.
  routing_logits [batch, in_caps, out_caps] → coupling [batch, in_caps, out_caps].

  Example:
    >>> c = capsjax.coupling_coefficients(jnp.zeros((1, 3, 4)))   # [batch, in_caps, out_caps]
    >>> c[0, 0]                                                   # uniform before any agreement
    Array([0.25, 0.25, 0.25, 0.25], dtype=float32)
  """
  check_axis('coupling_coefficients', 'routing_logits', routing_logits, axis)
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
# (docs/results.md, "CPU speed": the routing loop's layout).


def check_prediction_vectors(prediction_vectors, what: str) -> None:
  """ValueError naming `what` unless û is a floating [batch, in_caps, out_caps, dim] array."""
  shape, dtype = getattr(prediction_vectors, 'shape', None), getattr(prediction_vectors, 'dtype', None)
  if shape is None or len(shape) != 4 or not jnp.issubdtype(dtype, jnp.floating):
    got = f'shape {tuple(shape)} {dtype}' if shape is not None else type(prediction_vectors).__name__
    raise ArgumentError(f'{what}: prediction_vectors must be a floating array [batch, in_caps, out_caps, dim], '
                        f'got {got}')


def static_iterations(routing_iterations) -> Optional[int]:
  """routing_iterations as a Python int where it is a host constant (an int or a NumPy
  integer), None where it is a JAX integer (traced under vmap or jit, or concrete: its
  loop runs max_iterations times either way); a ValueError for anything else (2.5, True)."""
  dtype = getattr(routing_iterations, 'dtype', None)
  if isinstance(routing_iterations, bool) or (dtype is not None and not jnp.issubdtype(dtype, jnp.integer)):
    got = f'dtype {dtype}' if dtype is not None else repr(routing_iterations)
    raise ArgumentError(f'routing_iterations must be an integer, got {got}')
  if isinstance(routing_iterations, jax.Array):
    return None
  try:
    return operator.index(routing_iterations)
  except TypeError:
    raise ArgumentError(f'routing_iterations must be an integer, got {routing_iterations!r}') from None


def loop_length(routing_iterations, max_iterations) -> Tuple[int, Optional[int]]:
  """(how many times the loop runs, the static count or None where it is traced)."""
  static = static_iterations(routing_iterations)
  if static is not None:
    if static < 1:
      raise ArgumentError(f'routing_iterations must be >= 1, got {static}')
    if max_iterations is not None and static > max_iterations:
      raise ArgumentError(f'routing_iterations={static} exceeds max_iterations={max_iterations}')
    return static, static
  if max_iterations is None:
    raise ArgumentError('routing_iterations as a JAX array (traced under vmap or jit) needs a static max_iterations '
                        'bound; a Python int runs exactly that many iterations')
  return max_iterations, None


# `unroll` of fori_loop and iterate: True, False, or this: unrolled where nothing
# differentiates the loop (an evaluation, predict, the explorer), rolled inside a training
# step's gradient (formulations: routing_loop 'unrolled_inference').
UNROLLED_INFERENCE = 'inference'


def fori_loop(lower: int, upper: int, body, state, unroll: Union[bool, str] = False):
  """jax.lax.fori_loop over static bounds; `unroll` True: the iterations as straight-line
  code (a Python loop: what fori_loop(..., unroll=True) makes, and what a converter that
  replaces fori_loop while it traces, jax2onnx for capsjax-export, can read);
  UNROLLED_INFERENCE: straight-line code where nothing differentiates the loop, the rolled
  loop's derivatives where something does (the same values either way)."""
  if unroll == UNROLLED_INFERENCE:
    # The arrays `body` closes over (û, …) become explicit arguments, so the derivative
    # rule sees them (a custom_jvp must not differentiate through a closure).
    converted, constants = jax.closure_convert(body, lower, state)
    return _unrolled_unless_differentiated(lower, upper, converted, state, constants)
  if unroll:
    for t in range(lower, upper):
      state = body(t, state)
    return state
  return jax.lax.fori_loop(lower, upper, body, state)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _unrolled_unless_differentiated(lower, upper, body, state, constants):
  for t in range(lower, upper):
    state = body(t, state, *constants)
  return state


@_unrolled_unless_differentiated.defjvp
def _rolled_derivatives(lower, upper, body, primals, tangents):
  """A training step differentiates the rolled loop: its linearisation keeps one loop (and
  trained faster than the unrolled one on a CPU: docs/results.md, "CPU speed")."""
  def rolled(state, constants):
    return jax.lax.fori_loop(lower, upper, lambda t, carry: body(t, carry, *constants), state)
  return jax.jvp(rolled, primals, tangents)


def iterate(body, state, routing_iterations, max_iterations, unroll):
  """state after body(t, state) for t = 0 … r−1 (a fori_loop): the loop of an iterative
  routing of your own (registered with `iterative=True`, it receives `routing_iterations,
  max_iterations, unroll` and hands them on here). A traced r runs max_iterations times
  and iterations ≥ r keep the state (as dynamic_routing does), so `jax.vmap` over r and
  reverse-mode gradients stay available. `state`: any pytree, e.g. the routing logits
  [batch, in_caps, out_caps].

  Example:
    >>> from capsjax.routing import iterate
    >>> logits = jnp.zeros((1, 2, 3))                   # [batch, in_caps, out_caps]
    >>> step = lambda t, b: b + 1.0                      # one routing iteration
    >>> iterate(step, logits, 3, None, False)[0, 0]     # r = 3, a Python int
    Array([3., 3., 3.], dtype=float32)
    >>> counts = jnp.array([1, 2])                       # r traced: vmap over it, at most 3
    >>> jax.vmap(lambda r: iterate(step, logits, r, 3, False)[0, 0, 0])(counts)
    Array([1., 2.], dtype=float32)
  """
  length, static = loop_length(routing_iterations, max_iterations)

  def step(t, carry):
    new = body(t, carry)
    if static is not None:
      return new
    active = t < routing_iterations
    return jax.tree.map(lambda n, o: jnp.where(active, n, o), new, carry)
  return fori_loop(0, length, step, state, unroll)


# ============================================================================= shared transforms
# Class-capsule transforms shared over positions (Hinton, Sabour & Frosst, "Matrix capsules
# with EM routing", ICLR 2018): primary capsule i = (position p, type t) votes
# û_{j|i} = W_tj u_i + o_p, where o_p puts p's scaled (row, column), centred, in the first
# two vote coordinates ("coordinate addition"). The parameters no longer grow with the image.


def coordinate_offsets(height: int, width: int, dim: int) -> Array:
  """o_p [height·width, dim]: the centre of grid cell p relative to the grid's centre,
  (row + ½)/height − ½ and (column + ½)/width − ½, in coordinates 0 and 1; zeros
  elsewhere. Row-major, as capsules are ordered (row, column, type). Centred because
  Procedure 1 sums the votes (EM averages them): uncentred, Σ_i c_ij o_p would add about
  in_caps/(2·classes) to every class's first two coordinates and saturate every length."""
  rows, columns = jnp.meshgrid((jnp.arange(height) + 0.5) / height - 0.5, (jnp.arange(width) + 0.5) / width - 0.5,
                               indexing='ij')
  offsets = jnp.zeros((height * width, dim), jnp.float32)
  return offsets.at[:, 0].set(rows.ravel()).at[:, 1].set(columns.ravel())


def shared_votes(capsules: Array, transforms: Array, offsets: Array) -> Array:
  """û materialised: capsules [batch, positions, types, in_dim], transforms [types, out,
  dim, in_dim], offsets [positions, dim] → [batch, positions·types, out, dim] (capsule
  order (position, type), as PrimaryCaps')."""
  batch, positions, types, _ = capsules.shape
  # û_{j|(p,t)} = W_tj u_(p,t) + o_p                 # [batch, positions, types, out, dim]
  votes = jnp.einsum('tjdk,bptk->bptjd', transforms, capsules) + offsets[None, :, None, None, :]
  return votes.reshape(batch, positions * types, transforms.shape[1], transforms.shape[2])


def pooled_votes(weights: Array, capsules: Array, transforms: Array, offsets: Array) -> Array:
  """Σ_i w_ij û_{j|i} without û: weights [batch, positions, types, out] → [batch, out, dim].

  Σ_(p,t) w_(p,t)j (W_tj u_(p,t) + o_p) = Σ_t W_tj (Σ_p w_(p,t)j u_(p,t)) + Σ_(p,t) w_(p,t)j o_p:
  the sum over positions happens in the input pose space."""
  pooled = jnp.einsum('bptj,bptk->btjk', weights, capsules)                   # [batch, types, out, in_dim]
  return (jnp.einsum('tjdk,btjk->bjd', transforms, pooled)                    # [batch, out, dim]
          + jnp.einsum('bptj,pd->bjd', weights, offsets))


def vote_dots(vectors: Array, capsules: Array, transforms: Array, offsets: Array) -> Array:
  """û_{j|i}·x_j without û: vectors [batch, out, dim] → [batch, positions, types, out].

  (W_tj u_(p,t) + o_p)·x_j = u_(p,t)·(W_tjᵀ x_j) + o_p·x_j: x is pulled back to the input
  pose space once per type, not pushed forward once per capsule."""
  pulled_back = jnp.einsum('tjdk,bjd->btjk', transforms, vectors)             # [batch, types, out, in_dim]
  return (jnp.einsum('bptk,btjk->bptj', capsules, pulled_back)                # [batch, pos, types, out]
          + jnp.einsum('pd,bjd->bpj', offsets, vectors)[:, :, None, :])
