"""Routing-by-agreement (Sabour et al. 2017, Procedure 1) as pure functions of arrays.

Shapes used throughout:
  prediction_vectors  û_{j|i}   [batch, in_caps, out_caps, out_dim]
  routing_logits      b_ij      [batch, in_caps, out_caps]
  coupling            c_ij      [batch, in_caps, out_caps]   (softmax of b over out_caps)
  parents             v_j       [batch, out_caps, out_dim]
"""
import inspect
from typing import Any, Callable, Dict, Optional, Tuple, Union

import chex
import jax
import jax.numpy as jnp

from capsjax.registry import Registry

Array = jax.Array

def vector_norm(vectors: Array, axis: int = -1, keepdims: bool = False) -> Array:
  """|v| along `axis`, exact (no ε), with gradient 0 at the zero vector.

  The norm's own gradient is infinite at 0, so zero vectors take a separate branch (the
  double-where trick); capsule lengths and squash both use it.
  vectors [..., dim] → lengths [...] ([..., 1] with keepdims).

  Example:
    >>> capsjax.vector_norm(jnp.array([[3.0, 4.0], [0.0, 0.0]]))   # [2, dim] → [2]
    Array([5., 0.], dtype=float32)
  """
  return _safe_sqrt(jnp.sum(jnp.square(vectors), axis=axis, keepdims=keepdims))


def _safe_sqrt(squared_norm: Array) -> Array:
  nonzero = squared_norm > 0
  return jnp.where(nonzero, jnp.sqrt(jnp.where(nonzero, squared_norm, 1.0)), 0.0)


def squash(vectors: Array, axis: int = -1) -> Array:
  """v = |s|² / (1 + |s|²) · s / |s| = s · |s| / (1 + |s|²): keeps direction, length → [0, 1).

  Written as s·|s|/(1+|s|²) there is no division by |s|; at the origin value and gradient
  are 0, squash's true derivative there (see `vector_norm`).
  vectors [..., dim] (any shape; `axis` is the capsule dimension) → the same shape.

  Example:
    >>> v = capsjax.squash(jnp.array([[3.0, 4.0]]))   # |s| = 5 → |v| = 25 / 26
    >>> v.shape, round(float(capsjax.vector_norm(v)[0]), 4)
    ((1, 2), 0.9615)
  """
  squared_norm = jnp.sum(jnp.square(vectors), axis=axis, keepdims=True)
  return vectors * (_safe_sqrt(squared_norm) / (1.0 + squared_norm))


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

  Example:
    >>> votes = jax.random.normal(jax.random.key(0), (2, 6, 3, 4))   # û [batch, in, out, dim]
    >>> parents = capsjax.dynamic_routing(votes, num_iterations=3)
    >>> parents.shape                                                 # v [batch, out, dim]
    (2, 3, 4)
    >>> bool(jnp.all(capsjax.vector_norm(parents) < 1))               # squashed
    True
    >>> # r traced under vmap, as the routing ablations do: one program for r = 1, 2, 3.
    >>> route_r = lambda r: capsjax.dynamic_routing(votes, r, max_iterations=3)
    >>> jax.vmap(route_r)(jnp.arange(1, 4)).shape                     # [r, batch, out, dim]
    (3, 2, 3, 4)
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
  # b, parent-major. Behind an optimization barrier: XLA would otherwise fold the unrolled
  # first iteration's softmax over this constant at compile time, element by element.
  routing_logits = jax.lax.optimization_barrier(jnp.zeros((batch, out_caps, in_caps), dtype))
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

  Example:
    >>> votes = jax.random.normal(jax.random.key(0), (2, 6, 3, 4))   # [batch, in, out, dim]
    >>> _, logits = capsjax.dynamic_routing(votes, 4, return_logits=True)
    >>> logits.shape                                                  # [iterations, batch, in, out]
    (4, 2, 6, 3)
    >>> capsjax.routing_logit_changes(logits).shape                   # one mean |Δb| per iteration
    (4,)
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


def shared_dynamic_routing(capsules: Array, transforms: Array, offsets: Array, num_iterations, *,
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
    coupling = jax.nn.softmax(logits, axis=-1)                                 # [batch, pos, types, out]
    total_input = pooled_votes(coupling, capsules, transforms, offsets)        # s_j [batch, out, dim]
    if bias is not None:
      total_input = total_input + bias
    parents = squash(total_input)                                              # [batch, out, dim]
    agreement = vote_dots(parents, capsules, transforms, offsets)              # [batch, pos, types, out]
    return parents, logits + agreement

  state = (jnp.zeros((batch, out_caps, out_dim), dtype), jnp.zeros((batch, positions, types, out_caps), dtype))
  parents, _ = _iterate(body, state, num_iterations, max_iterations, unroll)
  return parents


# ============================================================================= the registry
# Every routing algorithm has one signature:
#   function(prediction_vectors [batch, in, out, dim], input_activations [batch, in],
#            num_iterations, *, max_iterations=None, unroll=False, **options)
#     → (parents [batch, out, dim], activations [batch, out] in [0, 1])
# and is registered with `@register_routing(name, ...)`, whose capabilities are:
#   iterative        whether num_iterations means anything
#   learned          option → (shape from (in_caps, out_caps, dim), initial value): what a
#                    model learns; `route` fills each one it is not given with its initial value
#   returns_logits   accepts return_logits=True and then returns a third value, the routing
#                    logits after every iteration [iterations, batch, in, out] (the
#                    convergence probe and figure read them)
#   returns_couplings accepts return_couplings=True and then returns a third value, the
#                    pair (couplings the first iteration used, couplings the last one used),
#                    each [batch, in, out], a distribution over the parents per child (the
#                    routing diagnostics read them; equal for a routing without iterations)
#   layer_inputs     which of the capsule layer's own features it reads, passed as keyword
#                    arguments when the model enables them: 'bias' ([out, dim], added to s_j),
#                    'log_priors' ([in, out], initial logits), 'leaky' (bool), and
#                    'stop_gradient_predictions' (bool); see capsjax.layers.LAYER_FEATURES
#   shared           for class-capsule transforms shared over positions (one W per primary
#                    type and class, û_{j|i} = W_{t(i)j} u_i + the position offset of i): the
#                    same routing written without û, `shared(capsules [batch, positions,
#                    types, in_dim], transforms [types, out, dim, in_dim], offsets
#                    [positions, dim], num_iterations, *, max_iterations, unroll, **options)`
#                    → as the routing; None: the layer materialises û (see shared_votes)
# Every other keyword argument with a default is an option a config may set
# (config.model.routing_options). Activations are what the margin loss, the explorer and
# predict read.

ROUTINGS = Registry('routing', iterative=True, learned={}, returns_logits=False, returns_couplings=False,
                    layer_inputs=(), shared=None,
                    doc="""The routing algorithms by name (`config.model.routing`, `CapsuleLayer.routing`,
`route(name, ...)`): each entry's value is the routing function, û [batch, in, out, dim] →
(parents [batch, out, dim], activations [batch, out]), and its capabilities say what it
does (`iterative`, `learned`, `returns_logits`, `layer_inputs`, `shared`). Add one with
`register_routing`.

Example:
  >>> capsjax.ROUTINGS.names()
  ('dynamic', 'em', 'self_attention', 'inverted_dot_product', 'self_routing', 'uniform', 'max_pooling', 'variational_bayes')
  >>> capsjax.ROUTINGS['dynamic'].returns_logits, capsjax.ROUTINGS['em'].learned.keys()
  (True, dict_keys(['beta_u', 'beta_a']))
""")
# The routing's own arguments: neither options nor learned.
_OWN_ARGUMENTS = ('prediction_vectors', 'input_activations', 'num_iterations', 'max_iterations', 'unroll',
                  'return_logits', 'return_couplings')


def register_routing(name: str, *, iterative: bool = True,
                     learned: Optional[Dict[str, Tuple[Callable[[int, int, int], tuple], float]]] = None,
                     returns_logits: bool = False, returns_couplings: bool = False,
                     layer_inputs: Tuple[str, ...] = (), shared: Optional[Callable[..., Any]] = None):
  """Function decorator: `config.model.routing = name` routes with this function.

  The function takes prediction_vectors û [batch, in_caps, out_caps, dim],
  input_activations [batch, in_caps], num_iterations, and keywords max_iterations and
  unroll (plus options of its own, each with a default, which `config.model.routing_options`
  may set; `learned` ones become parameters of the capsule layer), and returns
  (parents [batch, out_caps, dim], activations [batch, out_caps]). `iterative`: whether
  num_iterations means anything to it; `returns_logits`: it accepts return_logits=True and
  then also returns the logits per iteration; `returns_couplings`: it accepts
  return_couplings=True and then also returns (first, last) couplings [batch, in, out]
  (the routing diagnostics); `layer_inputs`: which of the capsule layer's
  features (bias, log_priors, leaky, stop_gradient_predictions) it reads; `shared`: a form
  that routes shared-transform votes without û (see the module's comment above ROUTINGS).

  Example:
    Uniform coupling: every child sends its vote to every parent equally.

    >>> @capsjax.register_routing('uniform_example', iterative=False)
    ... def uniform(prediction_vectors, input_activations, num_iterations, *, max_iterations=None,
    ...             unroll=False):
    ...   parents = capsjax.squash(prediction_vectors.mean(axis=1))   # [batch, out, dim]
    ...   return parents, capsjax.vector_norm(parents)
    >>> parents, activations = capsjax.route('uniform_example', jnp.ones((1, 4, 2, 3)))
    >>> activations                                                  # |squash(1, 1, 1)| = 3 / 4
    Array([[0.75, 0.75]], dtype=float32)
    >>> capsjax.ROUTINGS.unregister('uniform_example')
  """
  return ROUTINGS.register(name, iterative=iterative, learned=dict(learned or {}), returns_logits=returns_logits,
                           returns_couplings=returns_couplings, layer_inputs=tuple(layer_inputs), shared=shared)


def shared_form(name: str, options: Dict[str, Any]) -> Optional[Callable[..., Any]]:
  """Routing `name` written without û for shared transforms (its registered `shared`), if
  it has one that takes every option in `options`; else None (the layer then materialises
  û). Procedure 1's takes the bias but not the per-capsule features (log priors per input
  capsule, leaky routing, stopped-gradient votes), nor return_logits."""
  shared = ROUTINGS[name].shared
  if shared is None:
    return None
  accepted = inspect.signature(shared).parameters
  return shared if all(option in accepted for option in options) else None


def route(name: str, prediction_vectors: Array, input_activations: Optional[Array] = None,
          num_iterations: Union[int, Array] = 3, **options) -> Tuple[Array, Array]:
  """(parents [batch, out, dim], activations [batch, out]) of routing `name`.

  prediction_vectors û [batch, in, out, dim]; input_activations [batch, in] (default ones;
  Procedure 1 ignores them); num_iterations a Python int or, with `max_iterations=`, a
  traced integer (vmap over r, with gradients). Learned options not given take their
  initial values.

  Example:
    >>> votes = jax.random.normal(jax.random.key(0), (2, 6, 3, 4))   # û [batch, in, out, dim]
    >>> for name in ('dynamic', 'em'):
    ...   parents, activations = capsjax.route(name, votes, num_iterations=2)
    ...   print(name, parents.shape, activations.shape)
    dynamic (2, 3, 4) (2, 3)
    em (2, 3, 4) (2, 3)
  """
  entry = ROUTINGS[name]
  chex.assert_rank(prediction_vectors, 4)   # [batch, in_caps, out_caps, dim]
  batch, in_caps, out_caps, dim = prediction_vectors.shape
  if input_activations is None:
    input_activations = jnp.ones((batch, in_caps), prediction_vectors.dtype)
  for option, (shape, initial) in entry.learned.items():
    if option not in options or options[option] is None:
      options[option] = jnp.full(shape(in_caps, out_caps, dim), initial, prediction_vectors.dtype)
  return entry.value(prediction_vectors, input_activations, num_iterations, **options)


def routing_option_defaults(name: str) -> Dict[str, Any]:
  """The options a config may set for routing `name` (keyword arguments that are neither
  learned, nor the loop's own, nor the capsule layer's features), with their defaults."""
  import inspect  # pylint: disable=g-import-not-at-top
  entry = ROUTINGS[name]
  return {p.name: p.default for p in inspect.signature(entry.value).parameters.values()
          if p.name not in _OWN_ARGUMENTS and p.name not in entry.learned and p.name not in entry.layer_inputs}


def own_routing_options(name: str, options: Dict[str, Any], *, others_at_default: bool = False) -> Dict[str, Any]:
  """The options in `options` that routing `name` takes; ValueError for any other (a typo,
  another routing's option), naming what it takes. `others_at_default`: another routing's
  option left at its default is dropped instead (a config's routing_options lists every
  routing's options at their defaults, so that any of them can be set from the command line)."""
  own = routing_option_defaults(name)
  every = configurable_routing_options() if others_at_default else {}
  kept = {}
  for option, value in options.items():
    if option in own:
      kept[option] = value
    elif not (option in every and _same_value(value, every[option])):
      takes = f'its options are {", ".join(own)}' if own else 'it takes no options'
      raise ValueError(f'routing {name!r} takes no option {option!r} ({takes})')
  return kept


def _same_value(a, b) -> bool:
  try:
    return bool(a == b)
  except (TypeError, ValueError):
    return False


def configurable_routing_options() -> Dict[str, Any]:
  """Every option of the registered routings, at its default: what
  config.model.routing_options holds."""
  options = {}
  for name in ROUTINGS:
    options.update(routing_option_defaults(name))
  return options


def _loop_length(num_iterations, max_iterations) -> int:
  if isinstance(num_iterations, int):
    if num_iterations < 1:
      raise ValueError(f'num_iterations must be >= 1, got {num_iterations}')
    if max_iterations is not None and num_iterations > max_iterations:
      raise ValueError(f'num_iterations={num_iterations} exceeds max_iterations={max_iterations}')
    return num_iterations
  if max_iterations is None:
    raise ValueError('a traced num_iterations needs a static max_iterations bound')
  return max_iterations


def _iterate(body, state, num_iterations, max_iterations, unroll):
  """state after body(t, state) for t = 0 … r−1 (a fori_loop). A traced r runs
  max_iterations times and iterations ≥ r keep the state (as dynamic_routing does), so
  reverse-mode gradients stay available."""
  length = _loop_length(num_iterations, max_iterations)
  static = isinstance(num_iterations, int)

  def step(t, carry):
    new = body(t, carry)
    if static:
      return new
    active = t < num_iterations
    return jax.tree.map(lambda n, o: jnp.where(active, n, o), new, carry)
  return jax.lax.fori_loop(0, length, step, state, unroll=unroll)


def _dynamic_shared(capsules, transforms, offsets, num_iterations, *, max_iterations=None, unroll=False,
                    bias=None):
  """`dynamic` on shared-transform votes without û (the layer features other than the bias
  need û or per-capsule logits: with them the layer materialises û, see shared_form)."""
  parents = shared_dynamic_routing(capsules, transforms, offsets, num_iterations, max_iterations=max_iterations,
                                   unroll=unroll, bias=bias)
  return parents, vector_norm(parents)


@register_routing('dynamic', returns_logits=True, returns_couplings=True,
                  layer_inputs=('bias', 'log_priors', 'leaky', 'stop_gradient_predictions'), shared=_dynamic_shared)
def dynamic(prediction_vectors, input_activations, num_iterations, *, max_iterations=None, unroll=False,
            return_logits=False, return_couplings=False, stop_gradient_predictions=False, leaky=False,
            log_priors=None, bias=None):
  """Procedure 1 (`dynamic_routing`); input activations are ignored; activations |v_j|.
  Couplings: softmax(b) before the first and before the last iteration (without the
  leaky parent's share)."""
  del input_activations
  result = dynamic_routing(prediction_vectors, num_iterations, max_iterations=max_iterations,
                           stop_gradient_predictions=stop_gradient_predictions, leaky=leaky,
                           log_priors=log_priors, bias=bias, unroll=unroll,
                           return_logits=return_logits or return_couplings)
  parents, logits = result if (return_logits or return_couplings) else (result, None)
  outputs = (parents, vector_norm(parents))
  if return_logits:
    return outputs + (logits,)
  if return_couplings:
    initial = jnp.zeros(logits.shape[1:], logits.dtype)                       # b before iteration 1
    if log_priors is not None:
      initial = initial + jnp.broadcast_to(log_priors.astype(logits.dtype), initial.shape)
    before = jnp.concatenate([initial[None], logits], axis=0)                 # b before iteration t + 1
    last = jnp.asarray(num_iterations) - 1                                    # traced r too
    couplings = lambda b: coupling_coefficients(b, leaky)                     # [batch, in, out]
    # The first couplings from b's smallest shape, then broadcast: the same values, but a
    # softmax over a [batch, in, out] constant is folded by XLA at compile time (5.6 s for
    # the evaluation batch of 500 at the paper's size).
    distinct = jnp.zeros((1, 1, initial.shape[-1]), logits.dtype)
    if log_priors is not None:
      distinct = distinct + log_priors.astype(logits.dtype)
    first = jnp.broadcast_to(couplings(distinct), initial.shape)
    return outputs + ((first, couplings(before[last])),)
  return outputs


@register_routing('em', learned={'beta_u': (lambda i, j, d: (j,), 0.0), 'beta_a': (lambda i, j, d: (j,), 0.0)},
                  returns_couplings=True)
def em(prediction_vectors, input_activations, num_iterations, *, beta_u, beta_a, max_iterations=None,
       unroll=False, return_couplings=False, inverse_temperature=1.0, variance_epsilon=1e-8):
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
  count = jnp.asarray(num_iterations, votes.dtype)

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
    spread = jnp.sqrt(jnp.mean(jnp.square(cost - mean), axis=-1, keepdims=True))
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
  _, means, activations, last_used = _iterate(body, initial, num_iterations, max_iterations, unroll)
  if return_couplings:
    return means, activations, (uniform_couplings, last_used)
  return means, activations


def efficient_squash(vectors: Array, axis: int = -1) -> Array:
  """Efficient-CapsNet's squash: (1 − e^{−|s|}) s / |s| (0 at the origin)."""
  norm = vector_norm(vectors, axis=axis, keepdims=True)
  safe = jnp.where(norm > 0, norm, 1.0)
  return jnp.where(norm > 0, vectors * (-jnp.expm1(-norm) / safe), 0.0)


def _self_attention_shared(capsules, transforms, offsets, num_iterations, *, log_priors, max_iterations=None,
                           unroll=False):
  """`self_attention` on shared-transform votes without û: the vote sums Σ_k û_{j|k}, the
  scores û_{j|i}·Σ_k û_{j|k} and s_j = Σ_i (c_ij + b_ij) û_{j|i} each contract in the input
  pose space (pooled_votes, vote_dots)."""
  del num_iterations, max_iterations, unroll
  _, positions, types, _ = capsules.shape
  out_caps, dim = transforms.shape[1], transforms.shape[2]
  offsets = offsets.astype(capsules.dtype)
  everyone = jnp.ones(capsules.shape[:3] + (out_caps,), capsules.dtype)       # [batch, pos, types, out]
  vote_sums = pooled_votes(everyone, capsules, transforms, offsets)           # Σ_k û_{j|k} [batch, out, dim]
  scores = vote_dots(vote_sums, capsules, transforms, offsets) / jnp.sqrt(dim)  # [batch, pos, types, out]
  coupling = jax.nn.softmax(scores, axis=-1) + log_priors.reshape(positions, types, out_caps)
  parents = efficient_squash(pooled_votes(coupling, capsules, transforms, offsets))   # [batch, out, dim]
  return parents, vector_norm(parents)


@register_routing('self_attention', iterative=False, learned={'log_priors': (lambda i, j, d: (i, j), 0.0)},
                  returns_couplings=True, shared=_self_attention_shared)
def self_attention(prediction_vectors, input_activations, num_iterations, *, log_priors, max_iterations=None,
                   unroll=False, return_couplings=False):
  """Efficient-CapsNet's self-attention routing (Mazzia, Salvetti, Chiaberge 2021), one pass.

  For each parent j: A_j = Û_j Û_jᵀ / √d over the children's predictions; the coupling of
  child i is the softmax over parents of Σ_k A_j[i, k]; the log priors B [in, out] are
  added to it (after the softmax, as in the paper's s_j = Û_jᵀ (C_j + B_j) and the
  authors' code); s_j = Σ_i û_{j|i} (c_ij + b_ij), v_j = (1 − e^{−|s_j|}) s_j / |s_j|.
  Activations |v_j|. Not iterative: num_iterations is ignored. Couplings: the softmax part
  (the priors are added after it and are no distribution).
  """
  del input_activations, num_iterations, max_iterations, unroll
  dim = prediction_vectors.shape[-1]
  # Σ_k A_j[i, k] = û_{j|i} · Σ_k û_{j|k} / √d                          [batch, in, out]
  scores = jnp.einsum('bijd,bjd->bij', prediction_vectors, jnp.sum(prediction_vectors, axis=1)) / jnp.sqrt(dim)
  attention = jax.nn.softmax(scores, axis=-1)                            # [batch, in, out]
  coupling = attention + log_priors                                      # [batch, in, out]
  # s_j = Σ_i (c_ij + b_ij) û_{j|i}                                    [batch, out, dim]
  parents = efficient_squash(jnp.einsum('bij,bijd->bjd', coupling, prediction_vectors))
  if return_couplings:
    return parents, vector_norm(parents), (attention, attention)
  return parents, vector_norm(parents)


def layer_norm(vectors: Array, scale: Array, offset: Array, epsilon: float = 1e-5) -> Array:
  """LayerNorm over the last axis with gain `scale` and bias `offset`."""
  mean = jnp.mean(vectors, axis=-1, keepdims=True)
  variance = jnp.mean(jnp.square(vectors - mean), axis=-1, keepdims=True)
  return (vectors - mean) * jax.lax.rsqrt(variance + epsilon) * scale + offset


def _inverted_dot_product_shared(capsules, transforms, offsets, num_iterations, *, layer_norm_scale,
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
  poses, total = _iterate(body, (zeros, zeros), num_iterations, max_iterations, unroll)
  return poses, vector_norm(squash(total))


@register_routing('inverted_dot_product', learned={'layer_norm_scale': (lambda i, j, d: (d,), 1.0),
                                                   'layer_norm_offset': (lambda i, j, d: (d,), 0.0)},
                  returns_couplings=True, shared=_inverted_dot_product_shared)
def inverted_dot_product(prediction_vectors, input_activations, num_iterations, *, layer_norm_scale,
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
  poses, total, last_used = _iterate(body, (zeros, zeros, uniform_couplings), num_iterations, max_iterations,
                                     unroll)
  if return_couplings:
    return poses, vector_norm(squash(total)), (uniform_couplings, last_used)
  return poses, vector_norm(squash(total))


@register_routing('self_routing', iterative=False, returns_couplings=True,
                  learned={'logit_weights': (lambda i, j, d: (i, j, d), 0.0), 'logit_bias': (lambda i, j, d: (i, j), 0.0)})
def self_routing(prediction_vectors, input_activations, num_iterations, *, logit_weights, logit_bias,
                 max_iterations=None, unroll=False, return_couplings=False):
  """Self-routing (Hahn, Pyeon, Kim, NeurIPS 2019): each child capsule's own routing network,
  no agreement and no iterations.

  Child i's routing logits over the parents come from its own learned linear map,
  b_ij = w_ij · û_{j|i} + β_ij, and r_ij = softmax_j(b_ij). With the child's activation a_i
  (the primary capsule's length): parent activation a_j = Σ_i a_i r_ij / Σ_i a_i and parent
  pose v_j = Σ_i (a_i r_ij / Σ_k a_k r_kj) û_{j|i}. The paper maps the child's pose u_i by
  W_i to the logits; with vector capsules the map acts on û_{j|i} = W_ij u_i, the same
  family of linear functions of u_i (BUILD.md). w and β start at 0 (uniform routing), as in
  the authors' code. logit_weights [in, out, dim], logit_bias [in, out]. Not iterative:
  num_iterations is ignored. Poses are not squashed (the paper's are not); activations are
  a_j, in [0, 1]. Couplings: r_ij.
  """
  del num_iterations, max_iterations, unroll
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
  if return_couplings:
    return poses, activations, (routes, routes)
  return poses, activations


@register_routing('uniform', iterative=False, returns_couplings=True)
def uniform(prediction_vectors, input_activations, num_iterations, *, max_iterations=None, unroll=False,
            return_couplings=False):
  """No routing, the baseline every routing is measured against (Paik, Kwak, Kim 2019,
  "Capsule Networks Need an Improved Routing Algorithm": uniform coupling).

  c_ij = 1 / (number of parents) for every child and parent, as Procedure 1's first
  iteration couples before any agreement: v_j = squash(Σ_i û_{j|i} / n_out), activations
  |v_j|. Equal to `dynamic` with one iteration. Input activations are ignored (as
  Procedure 1 ignores them); not iterative: num_iterations is ignored.
  """
  del input_activations, num_iterations, max_iterations, unroll
  out_caps = prediction_vectors.shape[2]
  parents = squash(jnp.sum(prediction_vectors, axis=1) / out_caps)   # [batch, out, dim]
  if return_couplings:
    couplings = jnp.full(prediction_vectors.shape[:3], 1.0 / out_caps, prediction_vectors.dtype)
    return parents, vector_norm(parents), (couplings, couplings)
  return parents, vector_norm(parents)


@register_routing('max_pooling', iterative=False)
def max_routing(prediction_vectors, input_activations, num_iterations, *, max_iterations=None, unroll=False):
  """Max-pooling as a routing: each parent takes the vote of its most active child only,
  "the very primitive form of routing implemented by max-pooling" that the paper's
  routing replaces (Sabour et al. 2017, section 1).

  For parent j the child i* = argmax_i a_i |û_{j|i}| (the longest activation-weighted vote;
  the first of equals) gives v_j = squash(û_{j|i*}), activations |v_j|; gradients reach the
  winning vote only, as through max-pooling. With the primary capsules' lengths as a_i.
  Not iterative: num_iterations is ignored. No couplings: its choice is over the children
  of each parent, not a distribution over the parents of each child.
  """
  del num_iterations, max_iterations, unroll
  strength = input_activations[..., None] * vector_norm(prediction_vectors)   # a_i |û_{j|i}| [batch, in, out]
  winners = jax.nn.one_hot(jnp.argmax(strength, axis=1), prediction_vectors.shape[1], axis=1,
                           dtype=prediction_vectors.dtype)                     # [batch, in, out]
  parents = squash(jnp.einsum('bij,bijd->bjd', winners, prediction_vectors))  # [batch, out, dim]
  return parents, vector_norm(parents)


@register_routing('variational_bayes', returns_couplings=True,
                  learned={'prior_log_alpha': (lambda i, j, d: (j,), 0.0),
                           'prior_log_kappa': (lambda i, j, d: (j,), 0.0),
                           'prior_log_inverse_scale': (lambda i, j, d: (j, d), 0.0),
                           'beta_u': (lambda i, j, d: (j,), 0.0), 'beta_a': (lambda i, j, d: (j,), 0.0)})
def variational_bayes(prediction_vectors, input_activations, num_iterations, *, prior_log_alpha, prior_log_kappa,
                      prior_log_inverse_scale, beta_u, beta_a, max_iterations=None, unroll=False,
                      return_couplings=False, prior_extra_dof=1.0, inverse_temperature=1.0):
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
  _, posterior, last_used = _iterate(body, initial, num_iterations, max_iterations, unroll)
  means, _, _, _, expected_log_precision, expected_log_mix = posterior
  entropy = 0.5 * dim * jnp.log(2 * jnp.pi * jnp.e) - 0.5 * expected_log_precision   # H[q_j] [batch, out]
  score = beta_a - (jnp.exp(expected_log_mix) * entropy + beta_u)                     # [batch, out]
  mean = jnp.mean(score, axis=-1, keepdims=True)
  spread = jnp.sqrt(jnp.mean(jnp.square(score - mean), axis=-1, keepdims=True))
  activations = jax.nn.sigmoid(inverse_temperature * (score - mean) / (spread + 1e-6))
  if return_couplings:
    return means, activations, (uniform_couplings, last_used)
  return means, activations
