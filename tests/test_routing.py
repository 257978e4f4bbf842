"""capsjax/routing.py: Procedure 1 against a plain loop written from the paper (vmap over
r, gradients, squash), and the registry: every algorithm against a plain float64 numpy
reference written from its paper (values, and gradients against central finite
differences of the reference), a traced iteration count under vmap, each in a CapsNet,
and the routing zoo."""
import importlib.util
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capsjax import routing
from capsjax import validation
from capsjax.errors import CapsjaxError, RunStopped
from capsjax.routing import coupling_coefficients, dynamic_routing, squash
from helpers import SPEEDY_CONV, evaluators_off

# Compiling many small programs is this module's time: XLA's cheap compilation (conftest.py).
pytestmark = [pytest.mark.float32_matmuls, pytest.mark.compile_bound]


def reference_squash(s):
  norm = np.linalg.norm(s, axis=-1, keepdims=True)
  return (norm ** 2 / (1 + norm ** 2)) * s / np.maximum(norm, 1e-30)


def reference_routing(u_hat, r, log_priors=None, leaky=False, bias=None):
  """Procedure 1, literally, in float64 numpy loops over i and j (`bias` [out, dim] added
  to s_j, as the authors' code does)."""
  u_hat = np.asarray(u_hat, np.float64)
  batch, in_caps, out_caps, dim = u_hat.shape
  b = np.zeros((batch, in_caps, out_caps))
  if log_priors is not None:
    b = b + np.asarray(log_priors, np.float64)
  history = []
  for _ in range(r):
    logits = np.concatenate([b, np.zeros((batch, in_caps, 1))], -1) if leaky else b
    e = np.exp(logits - logits.max(-1, keepdims=True))
    c = (e / e.sum(-1, keepdims=True))[..., :out_caps]
    v = np.zeros((batch, out_caps, dim))
    for n in range(batch):
      for j in range(out_caps):
        s = sum(c[n, i, j] * u_hat[n, i, j] for i in range(in_caps))
        v[n, j] = reference_squash(s if bias is None else s + np.float64(bias[j]))
    for n in range(batch):
      for i in range(in_caps):
        for j in range(out_caps):
          b[n, i, j] += u_hat[n, i, j] @ v[n, j]
    history.append(b.copy())
  return v, np.stack(history)


def random_predictions(seed=0, shape=(2, 12, 4, 5), scale=0.5):
  return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.mark.parametrize('r', [1, 2, 3, 5])
def test_matches_procedure_1(r):
  u_hat = random_predictions(r)
  expected, _ = reference_routing(u_hat, r)
  np.testing.assert_allclose(dynamic_routing(u_hat, r).parents, expected, rtol=2e-5, atol=1e-6)
  # Without û: the paper's votes W_ij u_i routed from W and u, with a bias added to s_j.
  weights, capsules = random_predictions(r + 10, (12, 4, 5, 3)), random_predictions(r + 20, (2, 12, 3), 1.0)
  bias = random_predictions(r + 30, (4, 5), 0.1)
  votes = np.einsum('ijdk,bik->bijd', np.float64(weights), np.float64(capsules))
  expected, _ = reference_routing(votes, r, bias=bias)
  np.testing.assert_allclose(routing.per_capsule_dynamic_routing(weights, capsules, r, bias=bias), expected,
                             rtol=2e-5, atol=1e-6)


def test_jit_and_static_bound_agree_with_reference():
  u_hat = random_predictions(7)
  expected, _ = reference_routing(u_hat, 3)
  routed = jax.jit(lambda u, r: dynamic_routing(u, r, max_iterations=5).parents)(u_hat, 3)
  np.testing.assert_allclose(routed, expected, rtol=2e-5, atol=1e-6)


def test_iterations_change_the_result():
  # Guards against a loop that silently runs once: r=1 and r=3 must differ.
  u_hat = random_predictions(3)
  assert not np.allclose(dynamic_routing(u_hat, 1).parents, dynamic_routing(u_hat, 3).parents, atol=1e-4)


def test_one_iteration_is_uniform_coupling():
  u_hat = random_predictions(4)
  out_caps = u_hat.shape[2]
  expected = reference_squash(np.asarray(u_hat, np.float64).sum(1) / out_caps)
  np.testing.assert_allclose(dynamic_routing(u_hat, 1).parents, expected, rtol=2e-5, atol=1e-6)


def test_vmap_over_iteration_count_equals_separate_calls():
  u_hat = random_predictions(5)
  counts = jnp.array([1, 2, 3, 4])
  batched = jax.jit(jax.vmap(lambda r: dynamic_routing(u_hat, r, max_iterations=4).parents))(counts)
  for k, r in enumerate([1, 2, 3, 4]):
    np.testing.assert_allclose(batched[k], dynamic_routing(u_hat, r).parents, rtol=1e-5, atol=1e-6)


def _directional_derivatives(fn, x, num_directions=3, eps=1e-3):
  """(autodiff, central difference) pairs of a scalar fn's derivative along random
  directions, in float64."""
  grad = np.asarray(jax.grad(fn)(x), np.float64)
  rng = np.random.default_rng(0)
  pairs = []
  for _ in range(num_directions):
    direction = rng.standard_normal(x.shape)
    direction /= np.linalg.norm(direction)
    d = jnp.asarray(direction, x.dtype)
    numeric = (float(fn(x + eps * d)) - float(fn(x - eps * d))) / (2 * eps)
    pairs.append(((grad * direction).sum(), numeric))
  return np.asarray(pairs)


@pytest.mark.parametrize('traced', [False, True])
def test_gradients_match_finite_differences(traced):
  u_hat = random_predictions(6, (2, 8, 3, 4))
  weights = jax.random.normal(jax.random.key(1), (2, 3, 4))
  if traced:
    fn = lambda u: jnp.sum(weights * dynamic_routing(u, jnp.asarray(3), max_iterations=4).parents)
  else:
    fn = lambda u: jnp.sum(weights * dynamic_routing(u, 3).parents)
  with jax.enable_x64(True):
    pairs = _directional_derivatives(fn, jnp.asarray(u_hat, jnp.float64))
  autodiff, numeric = pairs[:, 0], pairs[:, 1]
  np.testing.assert_allclose(autodiff, numeric, rtol=2e-2, atol=1e-4)


def test_traced_and_static_gradients_agree():
  u_hat = random_predictions(8)
  # (Jitted here and below: one program each, not one per operation.)
  static = jax.jit(jax.grad(lambda u: jnp.sum(dynamic_routing(u, 2).parents ** 2)))(u_hat)
  traced = jax.jit(jax.grad(lambda u: jnp.sum(dynamic_routing(u, jnp.asarray(2), max_iterations=5).parents ** 2)))(
      u_hat)
  np.testing.assert_allclose(traced, static, rtol=1e-5, atol=1e-7)


def test_stop_gradient_keeps_values_and_changes_only_gradients():
  u_hat = random_predictions(9)
  loss = lambda u, sg: jnp.sum(dynamic_routing(u, 3, stop_gradient_predictions=sg).parents ** 2)
  parents = jax.jit(lambda u, sg: dynamic_routing(u, 3, stop_gradient_predictions=sg).parents, static_argnums=1)
  np.testing.assert_allclose(parents(u_hat, True), parents(u_hat, False), rtol=1e-6)
  grad_of = lambda f: jax.jit(jax.grad(f), static_argnums=1)
  full, stopped = grad_of(loss)(u_hat, False), grad_of(loss)(u_hat, True)
  assert not np.allclose(full, stopped, atol=1e-6)
  # With the coupling frozen, the gradient is that of one pass with fixed c.
  c = coupling_coefficients(jax.jit(lambda u: dynamic_routing(u, 3, return_logits=True).logits[1])(u_hat))
  frozen = lambda u: jnp.sum(squash(jnp.einsum('bij,bijd->bjd', c, u)) ** 2)
  np.testing.assert_allclose(stopped, jax.jit(jax.grad(frozen))(u_hat), rtol=1e-4, atol=1e-7)
  # With one iteration there is nothing to stop.
  one_pass = lambda u, sg: jnp.sum(dynamic_routing(u, 1, stop_gradient_predictions=sg).parents ** 2)
  np.testing.assert_allclose(grad_of(one_pass)(u_hat, True), grad_of(one_pass)(u_hat, False), rtol=1e-6)


def test_leaky_routing_matches_reference_with_extra_parent():
  u_hat = random_predictions(10)
  expected, _ = reference_routing(u_hat, 3, leaky=True)
  np.testing.assert_allclose(dynamic_routing(u_hat, 3, leaky=True).parents, expected, rtol=2e-5, atol=1e-6)
  coupling = coupling_coefficients(jnp.zeros((1, 2, 4)), leaky=True)
  np.testing.assert_allclose(coupling, 0.2)  # 4 parents + the leak share equally


def test_log_priors_start_the_logits():
  u_hat = random_predictions(11)
  priors = jax.random.normal(jax.random.key(2), u_hat.shape[1:3])
  expected, _ = reference_routing(u_hat, 2, log_priors=priors)
  np.testing.assert_allclose(dynamic_routing(u_hat, 2, log_priors=priors).parents, expected, rtol=2e-5, atol=1e-6)


def test_returned_logits_are_every_iteration():
  u_hat = random_predictions(12)
  _, expected = reference_routing(u_hat, 3)
  history = dynamic_routing(u_hat, 3, return_logits=True).logits
  np.testing.assert_allclose(history, expected, rtol=2e-5, atol=1e-5)
  padded = dynamic_routing(u_hat, jnp.asarray(3), max_iterations=5, return_logits=True).logits
  assert padded.shape[0] == 5
  np.testing.assert_allclose(padded[3], padded[2])
  np.testing.assert_allclose(padded[4], padded[2])


def test_bad_iteration_counts_are_rejected():
  u_hat = random_predictions(0)
  with pytest.raises(ValueError, match='max_iterations'):
    jax.jit(lambda r: dynamic_routing(u_hat, r).parents)(3)
  with pytest.raises(ValueError, match='>= 1'):
    dynamic_routing(u_hat, 0).parents
  # A count that is no integer is named, not read as traced (2.5 once asked for max_iterations).
  for count, got in ((2.5, 'got 2.5'), (True, 'got True'), (jnp.float32(2), 'got dtype float32')):
    with pytest.raises(ValueError, match=f'routing_iterations must be an integer, {got}'):
      routing.route('em', u_hat, routing_iterations=count)
  with pytest.raises(ValueError, match='must be an integer, got dtype float32'):
    jax.vmap(lambda r: dynamic_routing(u_hat, r, max_iterations=3).parents)(jnp.arange(1.0, 3.0))
  # A NumPy integer is a host constant like a Python int: exactly r iterations, no bound needed.
  routed = dynamic_routing(u_hat, np.int64(2), return_logits=True)
  assert routed.logits.shape[0] == 2
  np.testing.assert_array_equal(routed.parents, dynamic_routing(u_hat, 2).parents)


def test_votes_that_are_not_floating_batch_in_out_dim_are_named():
  u_hat = random_predictions(0)
  for votes, got in ((u_hat[0], f'got shape {tuple(u_hat.shape[1:])} float32'),
                     (u_hat.astype(jnp.int32), f'got shape {tuple(u_hat.shape)} int32')):
    with pytest.raises(ValueError, match=re.escape(f'dynamic_routing: prediction_vectors must be a floating array '
                                                   f'[batch, in_caps, out_caps, dim], {got}')):
      dynamic_routing(votes, 3)
    with pytest.raises(ValueError, match=re.escape(f"route('em'): prediction_vectors must be a floating array")):
      routing.route('em', votes, routing_iterations=2)
  # Every refusal is a CapsjaxError too (a ValueError and TypeError as well): one except
  # catches what the library refuses. An axis that is no axis named the function nowhere.
  for call, line in [(lambda: dynamic_routing(u_hat[0], 3), 'dynamic_routing: prediction_vectors must be'),
                     (lambda: squash(u_hat, axis=4), 'squash: axis 4 is out of bounds for vectors of shape (2, 12, 4, 5)'),
                     (lambda: routing.vector_norm(u_hat, axis=1.0), 'vector_norm: axis takes an integer, got 1.0'),
                     (lambda: routing.coupling_coefficients(u_hat[..., 0], axis=-4),
                      'coupling_coefficients: axis -4 is out of bounds for routing_logits of shape (2, 12, 4)'),
                     # a switch of 'no' is true: it switched leaky routing, or the unrolled loop, on
                     (lambda: dynamic_routing(u_hat, 3, leaky='no'), "dynamic_routing: leaky='no': allowed True or False"),
                     (lambda: routing.route('em', u_hat, unroll='no'), "route('em'): unroll='no': allowed True or False")]:
    with pytest.raises(CapsjaxError, match=f'^{re.escape(line)}') as raised:
      call()
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, TypeError)


def test_squash_limits_and_direction():
  long = jnp.array([[300.0, 400.0]])
  short = jnp.array([[3e-3, 4e-3]])
  np.testing.assert_allclose(jnp.linalg.norm(squash(long), axis=-1), 250000 / 250001, rtol=1e-6)
  np.testing.assert_allclose(jnp.linalg.norm(squash(short), axis=-1), 25e-6 / (1 + 25e-6), rtol=1e-5)
  np.testing.assert_allclose(squash(long) / jnp.linalg.norm(squash(long)), [[0.6, 0.8]], rtol=1e-6)
  unit = squash(jnp.array([[1.0, 0.0]]))
  np.testing.assert_allclose(unit, [[0.5, 0.0]], rtol=1e-6)
  # Past float32's √max (|s|² overflows: inf / inf was NaN), unit length, gradient finite.
  huge = jnp.array([[3e30, 4e30], [-3e20, 4e20]])
  np.testing.assert_allclose(squash(huge), [[0.6, 0.8], [-0.6, 0.8]], rtol=1e-6)
  assert np.all(np.isfinite(jax.grad(lambda s: jnp.sum(squash(s)))(huge)))


def test_squash_is_safe_at_zero():
  zero = jnp.zeros((3, 8))
  assert np.all(squash(zero) == 0)
  grad = jax.jit(jax.grad(lambda s: jnp.sum(squash(s))))(zero)
  assert np.all(np.isfinite(grad))
  jac = jax.jit(jax.jacobian(squash))(jnp.zeros(4))
  np.testing.assert_array_equal(jac, np.zeros((4, 4)))  # squash(s) = O(|s|²) near 0
  # Gradients at all-zero votes (a blank image through an unbiased PrimaryCaps), one program,
  # for the routings that normalise by a spread: EM's of equal costs once gave √0's infinite
  # derivative (the others' were finite; all eight compiled here took 7 s).
  names = ('dynamic', 'em')
  routed_grads = jax.jit(lambda u: [jax.grad(lambda u_: jnp.sum(routing.route(name, u_, None, 3).parents))(u)
                                    for name in names])(jnp.zeros((1, 4, 2, 3)))
  assert [name for name, grad in zip(names, routed_grads) if not np.all(np.isfinite(grad))] == []


def test_nan_stays_nan_through_lengths_squash_predict_and_evaluation():
  """A NaN capsule once read as length 0 ("every class absent", predict exit 0): it stays
  NaN, the zero vector keeps its gradient 0, an evaluation counts it wrong and names it, and
  predict refuses with the parameters it found non-finite."""
  import dataclasses   # pylint: disable=g-import-not-at-top
  from capsjax import vector_norm   # pylint: disable=g-import-not-at-top
  from capsjax.models import capsule_lengths   # pylint: disable=g-import-not-at-top
  from capsjax.objectives import non_finite, top_k_correct   # pylint: disable=g-import-not-at-top
  vectors = jnp.array([[np.nan, 1.0], [0.0, 0.0], [3.0, 4.0], [np.inf, 0.0]])
  np.testing.assert_array_equal(vector_norm(vectors), [np.nan, 0.0, 5.0, np.inf])
  np.testing.assert_array_equal(capsule_lengths(vectors[None]), [[np.nan, 0.0, 5.0, np.inf]])
  assert np.all(np.isnan(squash(vectors[:1]))) and np.all(squash(vectors[1:2]) == 0)
  np.testing.assert_array_equal(jax.grad(lambda v: vector_norm(v).sum())(jnp.zeros(3)), np.zeros(3))
  scores, labels = jnp.array([[np.nan, 0.1], [0.9, 0.1]]), jnp.array([0, 0])   # NaN where the label is
  np.testing.assert_array_equal(top_k_correct(scores, labels)[0], [0.0, 1.0])
  np.testing.assert_array_equal(non_finite(scores), [1.0, 0.0])
  from capsjax.app.predict import Predictor   # pylint: disable=g-import-not-at-top
  from capsjax.app.trained import TrainedModel   # pylint: disable=g-import-not-at-top
  trained = TrainedModel.shipped()
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x.at[(0,) * x.ndim].set(np.nan) if 'Decoder' not in jax.tree_util.keystr(path) else x,
      trained.params)
  with pytest.raises(CapsjaxError, match=r'^NaN or infinite class scores for digit: .* holds non-finite parameters \('):
    Predictor(dataclasses.replace(trained, params=params)).predict([np.full((28, 28), 200, np.uint8)], ['digit'])


def test_convergence_measures_match_the_reference_loop():
  from capsjax.routing import coupling_changes, routing_logit_changes  # pylint: disable=g-import-not-at-top
  u_hat = random_predictions(seed=5)
  logits = dynamic_routing(u_hat, 4, return_logits=True).logits
  _, history = reference_routing(u_hat, 4)
  previous = np.concatenate([np.zeros_like(history[:1]), history[:-1]])
  expected_db = np.abs(history - previous).mean(axis=(1, 2, 3))
  np.testing.assert_allclose(routing_logit_changes(logits), expected_db, rtol=1e-4)
  # Iteration t's own agreement û·v_t is its logit change: |Δb_1| = mean |û·v_1|.
  softmax = lambda b: np.exp(b) / np.exp(b).sum(-1, keepdims=True)
  couplings = [softmax(b) for b in np.concatenate([np.zeros_like(history[:1]), history])]
  expected_dc = [np.abs(couplings[t + 1] - couplings[t]).mean() for t in range(4)]
  np.testing.assert_allclose(coupling_changes(logits), expected_dc, rtol=1e-4)


# ----------------------------------------------------------------------------- the registry

BATCH, IN_CAPS, OUT_CAPS, DIM = 2, 5, 3, 4


def _squash(s):
  norm = np.sqrt(np.sum(s * s))
  return s * norm / (1 + norm * norm)


def _softmax(x):
  e = np.exp(x - np.max(x))
  return e / np.sum(e)


def reference_dynamic(u, a, r):
  """Procedure 1 (Sabour et al. 2017) for one example: u [in, out, dim]."""
  del a
  n_in, n_out, _ = u.shape
  b = np.zeros((n_in, n_out))
  for _ in range(r):
    c = np.stack([_softmax(b[i]) for i in range(n_in)])
    v = np.stack([_squash(sum(c[i, j] * u[i, j] for i in range(n_in))) for j in range(n_out)])
    for i in range(n_in):
      for j in range(n_out):
        b[i, j] += u[i, j] @ v[j]
  return v, np.array([np.linalg.norm(v[j]) for j in range(n_out)])


def reference_em(u, a, r, beta_u, beta_a, inverse_temperature=1.0, eps=1e-8):
  """EM routing (Hinton et al. 2018, Procedure 1) with capsjax's choices (docs/results.md): the
  cost standardised over the parents, λ rising linearly to inverse_temperature."""
  n_in, n_out, dim = u.shape
  R = np.full((n_in, n_out), 1.0 / n_out)
  for t in range(r):
    lam = inverse_temperature * (t + 1) / r
    Ra = R * a[:, None]                                          # M-step: R_ij ← R_ij a_i
    mu, var, cost = np.zeros((n_out, dim)), np.zeros((n_out, dim)), np.zeros(n_out)
    for j in range(n_out):
      mass = np.sum(Ra[:, j]) + 1e-9
      mu[j] = sum(Ra[i, j] * u[i, j] for i in range(n_in)) / mass
      var[j] = sum(Ra[i, j] * (u[i, j] - mu[j]) ** 2 for i in range(n_in)) / mass + eps
      cost[j] = np.sum((beta_u[j] + np.log(np.sqrt(var[j]))) * mass)
    standardised = (cost - cost.mean()) / (cost.std() + 1e-6)
    act = np.array([1 / (1 + np.exp(-lam * (beta_a[j] - standardised[j]))) for j in range(n_out)])
    for i in range(n_in):                                        # E-step
      p = np.array([np.prod(1 / np.sqrt(2 * np.pi * var[j])) * np.exp(-np.sum((u[i, j] - mu[j]) ** 2 / (2 * var[j])))
                    for j in range(n_out)])
      R[i] = act * p / np.sum(act * p)
  return mu, act


def reference_self_attention(u, a, r, log_priors):
  """Efficient-CapsNet (Mazzia et al. 2021): A_j = Û_j Û_jᵀ/√d, C = softmax over parents of
  Σ_k A_j[i, k], s_j = Û_jᵀ (C_j + B_j), v = (1 − e^{−|s|}) s/|s|."""
  del a, r
  n_in, n_out, dim = u.shape
  A = [np.array([[u[i, j] @ u[k, j] / np.sqrt(dim) for k in range(n_in)] for i in range(n_in)]) for j in range(n_out)]
  C = np.stack([_softmax(np.array([np.sum(A[j][i]) for j in range(n_out)])) for i in range(n_in)])
  v = []
  for j in range(n_out):
    s = sum((C[i, j] + log_priors[i, j]) * u[i, j] for i in range(n_in))
    norm = np.linalg.norm(s)
    v.append((1 - np.exp(-norm)) * s / norm)
  v = np.stack(v)
  return v, np.linalg.norm(v, axis=-1)


def reference_inverted_dot_product(u, a, r, scale, offset):
  """Tsai et al. 2020: p_j = 0; r times a_ij = p_j·û_{j|i}, r_ij = softmax_j, p_j = LN(Σ_i r_ij û_{j|i})."""
  del a
  n_in, n_out, dim = u.shape
  p = np.zeros((n_out, dim))
  for _ in range(r):
    agreement = np.array([[p[j] @ u[i, j] for j in range(n_out)] for i in range(n_in)])
    coupling = np.stack([_softmax(agreement[i]) for i in range(n_in)])
    s = np.stack([sum(coupling[i, j] * u[i, j] for i in range(n_in)) for j in range(n_out)])
    p = np.stack([(s[j] - s[j].mean()) / np.sqrt(s[j].var() + 1e-5) * scale + offset for j in range(n_out)])
  return p, np.array([np.linalg.norm(_squash(s[j])) for j in range(n_out)])


def reference_self_routing(u, a, r, w, beta):
  """Hahn, Pyeon, Kim 2019: b_ij = w_ij·û_{j|i} + β_ij (the child's own linear routing map),
  r_ij = softmax_j, a_j = Σ_i a_i r_ij / Σ_i a_i, v_j = Σ_i a_i r_ij û_{j|i} / Σ_i a_i r_ij."""
  del r
  n_in, n_out, _ = u.shape
  routes = np.stack([_softmax(np.array([w[i, j] @ u[i, j] + beta[i, j] for j in range(n_out)]))
                     for i in range(n_in)])
  v = np.stack([sum(a[i] * routes[i, j] * u[i, j] for i in range(n_in)) / sum(a[i] * routes[i, j]
                                                                                for i in range(n_in))
                for j in range(n_out)])
  activations = np.array([sum(a[i] * routes[i, j] for i in range(n_in)) / np.sum(a) for j in range(n_out)])
  return v, activations


def reference_uniform(u, a, r):
  """No routing: c_ij = 1 / n_out, v_j = squash(Σ_i c_ij û_{j|i}) (Paik et al. 2019's baseline)."""
  del a, r
  n_in, n_out, _ = u.shape
  v = np.stack([_squash(sum(u[i, j] for i in range(n_in)) / n_out) for j in range(n_out)])
  return v, np.array([np.linalg.norm(v[j]) for j in range(n_out)])


def reference_max(u, a, r):
  """Max-pooling: parent j takes the vote of the child with the longest a_i û_{j|i}."""
  del r
  n_in, n_out, _ = u.shape
  winners = [max(range(n_in), key=lambda i: a[i] * np.linalg.norm(u[i, j])) for j in range(n_out)]
  v = np.stack([_squash(u[winners[j], j]) for j in range(n_out)])
  return v, np.array([np.linalg.norm(v[j]) for j in range(n_out)])


def reference_variational_bayes(u, a, r, prior_log_alpha, prior_log_kappa, prior_log_inverse_scale, beta_u, beta_a):
  """Ribeiro, Leontidis, Kollias 2020, diagonal precisions, m0 = 0, ν0 = D + 1, written per
  parent from the VB updates of a Gaussian mixture with Dirichlet / Normal-Wishart priors."""
  from scipy.special import digamma  # pylint: disable=g-import-not-at-top
  n_in, n_out, d = u.shape
  alpha0, kappa0, inv_scale0, nu0 = np.exp(prior_log_alpha), np.exp(prior_log_kappa), np.exp(prior_log_inverse_scale), d + 1.0
  R = np.full((n_in, n_out), 1.0 / n_out)
  for t in range(r):
    post = []
    for j in range(n_out):
      w = R[:, j] * a
      mass = w.sum() + 1e-9
      alpha, kappa, nu = alpha0[j] + mass, kappa0[j] + mass, nu0 + mass
      mu_bar = sum(w[i] * u[i, j] for i in range(n_in)) / mass
      m = mass * mu_bar / kappa
      inv_scale = inv_scale0[j] + sum(w[i] * (u[i, j] - mu_bar) ** 2 for i in range(n_in)) + kappa0[j] * mass / kappa * mu_bar ** 2
      e_log_lambda = sum(digamma((nu - h) / 2) for h in range(d)) + d * np.log(2) - np.sum(np.log(inv_scale))
      post.append((alpha, kappa, nu, m, inv_scale, e_log_lambda))
    alphas = np.array([p[0] for p in post])
    e_log_pi = digamma(alphas) - digamma(alphas.sum())
    if t < r - 1:
      for i in range(n_in):
        log_rho = np.array([e_log_pi[j] + 0.5 * post[j][5] - 0.5 * d * np.log(2 * np.pi)
                            - 0.5 * (d / post[j][1] + post[j][2] * np.sum((u[i, j] - post[j][3]) ** 2 / post[j][4]))
                            for j in range(n_out)])
        R[i] = _softmax(log_rho)
  entropy = np.array([0.5 * d * np.log(2 * np.pi * np.e) - 0.5 * p[5] for p in post])
  score = beta_a - (np.exp(e_log_pi) * entropy + beta_u)
  standardised = (score - score.mean()) / (np.sqrt(np.mean((score - score.mean()) ** 2)) + 1e-6)
  return np.stack([p[3] for p in post]), 1 / (1 + np.exp(-standardised))


REFERENCES = {
    'dynamic': (reference_dynamic, {}),
    'variational_bayes': (reference_variational_bayes, {
        'prior_log_alpha': np.array([0.0, 0.3, -0.2]), 'prior_log_kappa': np.array([0.1, 0.0, -0.1]),
        'prior_log_inverse_scale': np.linspace(-0.2, 0.2, OUT_CAPS * DIM).reshape(OUT_CAPS, DIM),
        'beta_u': np.array([0.1, -0.2, 0.3]), 'beta_a': np.array([0.5, 0.0, -0.4])}),
    'uniform': (reference_uniform, {}),
    'max_pooling': (reference_max, {}),
    'em': (reference_em, {'beta_u': np.array([0.1, -0.2, 0.3]), 'beta_a': np.array([0.5, 0.0, -0.4])}),
    'self_attention': (reference_self_attention, {'log_priors': np.linspace(-0.1, 0.1, IN_CAPS * OUT_CAPS)
                                                                .reshape(IN_CAPS, OUT_CAPS)}),
    'inverted_dot_product': (reference_inverted_dot_product, {'scale': np.array([1.0, 0.8, 1.2, 0.9]),
                                                              'offset': np.array([0.0, 0.1, -0.1, 0.05])}),
    'self_routing': (reference_self_routing, {'w': np.random.default_rng(3).normal(0, 0.5, (IN_CAPS, OUT_CAPS, DIM)),
                                              'beta': np.linspace(-0.3, 0.3, IN_CAPS * OUT_CAPS)
                                              .reshape(IN_CAPS, OUT_CAPS)}),
}
# The reference's argument names → the registered function's option names.
OPTION_NAMES = {'scale': 'layer_norm_scale', 'offset': 'layer_norm_offset', 'w': 'logit_weights',
                'beta': 'logit_bias'}


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  u = rng.normal(0, 0.5, (BATCH, IN_CAPS, OUT_CAPS, DIM))
  a = rng.uniform(0.2, 1.0, (BATCH, IN_CAPS))
  return u, a


def _reference_batch(name, u, a, r, params):
  function, _ = REFERENCES[name]
  outputs = [function(u[n], a[n], r, **params) for n in range(len(u))]
  return np.stack([o[0] for o in outputs]), np.stack([o[1] for o in outputs])


def _pair(result):
  return result.parents, result.activations


def _route(name, u, a, r, params):
  options = {OPTION_NAMES.get(k, k): jnp.asarray(v) for k, v in params.items()}
  return routing.route(name, u, a, r, **options)


def test_the_registry_holds_the_four_algorithms_and_route_works_as_it_stands():
  assert set(REFERENCES) <= set(routing.ROUTINGS)
  u, a = _inputs()   # NumPy float64, as a user's arrays come
  for name in routing.ROUTINGS:
    with warnings.catch_warnings():
      warnings.simplefilter('error')   # (JAX warned of float64 truncated once per array it made)
      parents, activations = _pair(routing.route(name, u, a))
    assert parents.shape == (BATCH, OUT_CAPS, DIM) and activations.shape == (BATCH, OUT_CAPS)
    assert parents.dtype == activations.dtype == jnp.float32, name
    assert jnp.all((activations >= 0) & (activations <= 1)), name
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    assert dynamic_routing(u, 3).parents.dtype == jnp.float32


@pytest.mark.parametrize('name', sorted(REFERENCES))
def test_values_and_gradients_match_the_papers_reference(name):
  _, params = REFERENCES[name]
  u, a = _inputs(1)
  r = 3
  expected_parents, expected_activations = _reference_batch(name, u, a, r, params)
  rng = np.random.default_rng(7)
  w_parents, w_activations = rng.normal(size=expected_parents.shape), rng.normal(size=expected_activations.shape)
  with jax.enable_x64(True):
    parents, activations = _pair(_route(name, jnp.asarray(u), jnp.asarray(a), r, params))
    # EM divides by the spread of its costs over the parents, which scales rounding up.
    tolerance = dict(rtol=1e-6, atol=1e-8) if name == 'em' else dict(rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(parents, expected_parents, **tolerance)
    np.testing.assert_allclose(activations, expected_activations, **tolerance)

    def loss(u_, a_):
      p, act = _pair(_route(name, u_, a_, r, params))
      return jnp.sum(p * w_parents) + jnp.sum(act * w_activations)
    grad_u, grad_a = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(u), jnp.asarray(a))   # one compilation

  def reference_loss(u_, a_):
    p, act = _reference_batch(name, u_, a_, r, params)
    return np.sum(p * w_parents) + np.sum(act * w_activations)

  h = 1e-6
  for index in [(0, 0, 0, 0), (1, 4, 2, 3), (0, 2, 1, 1), (1, 1, 0, 2)]:
    step = np.zeros_like(u)
    step[index] = h
    numeric = (reference_loss(u + step, a) - reference_loss(u - step, a)) / (2 * h)
    assert grad_u[index] == pytest.approx(numeric, rel=1e-5, abs=1e-7), (name, index)
  for index in [(0, 0), (1, 3)]:
    step = np.zeros_like(a)
    step[index] = h
    numeric = (reference_loss(u, a + step) - reference_loss(u, a - step)) / (2 * h)
    assert grad_a[index] == pytest.approx(numeric, rel=1e-5, abs=1e-7), (name, index)


@pytest.mark.parametrize('name', sorted(REFERENCES))
def test_permuting_the_input_capsules_changes_nothing(name):
  # Routing sums over children: relabelling them (and their learned per-child options
  # with them) must leave the parents and activations as they were.
  _, params = REFERENCES[name]
  u, a = _inputs(4)
  order = np.array([3, 0, 4, 2, 1])
  per_child = {k: (v[order] if np.ndim(v) and np.shape(v)[0] == IN_CAPS else v) for k, v in params.items()}
  with jax.enable_x64(True):
    parents, activations = _pair(_route(name, jnp.asarray(u), jnp.asarray(a), 3, params))
    permuted = _pair(_route(name, jnp.asarray(u[:, order]), jnp.asarray(a[:, order]), 3, per_child))
  np.testing.assert_allclose(permuted[0], parents, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(permuted[1], activations, rtol=1e-10, atol=1e-12)


def test_uniform_is_one_iteration_of_procedure_1_and_max_follows_the_longest_vote():
  u, a = _inputs(5)
  u, a = jnp.asarray(u, jnp.float32), jnp.asarray(a, jnp.float32)
  np.testing.assert_allclose(routing.route('uniform', u, a).parents, routing.route('dynamic', u, a, 1).parents, rtol=1e-6)
  # One child's vote for parent 1 made far the longest: max's parent 1 is that vote, squashed.
  loud = u.at[0, 2, 1].set(10 * u[0, 2, 1] / routing.vector_norm(u[0, 2, 1]))
  parents, activations = _pair(routing.route('max_pooling', loud, a.at[0, 2].set(1.0)))
  np.testing.assert_allclose(parents[0, 1], routing.squash(loud[0, 2, 1]), rtol=1e-6)
  assert activations[0, 1] == pytest.approx(100 / 101, rel=1e-6)   # |squash(s)| = |s|² / (1 + |s|²)
  # Only the winning child's vote gets a gradient from parent 1.
  grad = jax.grad(lambda x: jnp.sum(routing.route('max_pooling', x, a.at[0, 2].set(1.0)).parents[0, 1]))(loud)
  assert jnp.count_nonzero(jnp.abs(grad[0, :, 1]).sum(-1)) == 1 and jnp.any(grad[0, 2, 1] != 0)


@pytest.mark.parametrize('name', [n for n in sorted(REFERENCES) if routing.ROUTINGS[n].iterative])
def test_traced_iteration_count_under_vmap_matches_separate_calls(name):
  u, a = _inputs(2)
  u, a = jnp.asarray(u, jnp.float32), jnp.asarray(a, jnp.float32)

  def summed(count):
    parents, activations = _pair(routing.route(name, u, a, count, max_iterations=4))
    return jnp.sum(parents) + jnp.sum(activations)

  values = jax.jit(jax.vmap(summed))(jnp.arange(1, 5))   # one program over r = 1 … 4
  # Each static count r routed on its own, the four in one jitted program (not one per
  # count, nor one per operation: the compilations are this test's time).
  separate = jax.jit(lambda: [sum(jnp.sum(x) for x in _pair(routing.route(name, u, a, count)))
                               for count in range(1, 5)])()
  for value, alone in zip(values, separate):
    assert value == pytest.approx(float(alone), rel=1e-5)
  # Gradients through the traced count equal the static ones.
  traced = jax.jit(jax.grad(lambda u_: jnp.sum(routing.route(name, u_, a, jnp.asarray(2), max_iterations=4)
                                               .activations)))(u)
  static_gradient = jax.jit(jax.grad(lambda u_: jnp.sum(routing.route(name, u_, a, 2).activations)))
  static = static_gradient(u)
  np.testing.assert_allclose(traced, static, rtol=1e-5, atol=1e-7)
  # All-zero votes (a blank image through an unbiased PrimaryCaps): finite gradients, from
  # the same program (EM's spread of equal costs once gave √0's infinite derivative: NaN).
  assert np.all(np.isfinite(static_gradient(jnp.zeros_like(u)))), name



# ----------------------------------------------------------------------------- in a CapsNet

def _tiny_capsnet_config(name):
  from capsjax.experiments import mnist  # pylint: disable=g-import-not-at-top
  config = mnist.get_config()
  config.model.update(routing=name, conv1_channels=8, primary_types=2, decoder_hidden=(16, 32))
  config.model.formulation.conv_impl = SPEEDY_CONV
  return config


def _tiny_capsnet(name):
  from capsjax.models import build_model  # pylint: disable=g-import-not-at-top
  config = _tiny_capsnet_config(name)
  model = build_model(**config.model)
  pixels = np.random.default_rng(0).integers(0, 256, (4, 28, 28, 1)).astype(np.uint8)
  images = jnp.asarray(pixels / 255.0, jnp.float32)
  params = jax.jit(model.init)(jax.random.key(1), images)['params']
  return config, model, params, pixels, images


@pytest.mark.parametrize('name', sorted(REFERENCES))
def test_every_routing_drives_the_capsnet_and_its_loss(name):
  from capsjax import assemble  # pylint: disable=g-import-not-at-top
  config, model, params, _, images = _tiny_capsnet(name)
  learned = {f'routing_{option}' for option in routing.ROUTINGS[name].learned}
  assert learned <= set(params['digit_caps'])
  apply = jax.jit(model.apply, static_argnames='method')   # (op by op: a compilation per operation)
  outputs = apply({'params': params}, images)
  _, activations = apply({'params': params}, images, method='classify')
  np.testing.assert_allclose(outputs['activations'], activations, rtol=1e-6)
  assert jnp.all((activations >= 0) & (activations <= 1))
  batch = {'images': images, 'labels': jnp.arange(4)}
  grads = jax.jit(jax.grad(lambda p: jnp.mean(assemble.objective(config)(model, p, batch, True)[0])))(params)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  assert any(bool(jnp.any(g != 0)) for g in jax.tree.leaves(grads['digit_caps']))


def test_explorer_and_predict_show_the_routings_activations():
  # EM: activations that are not the capsule lengths.
  from capsjax.app.explorer.backend import Explorer  # pylint: disable=g-import-not-at-top
  from capsjax.app.predict import Predictor  # pylint: disable=g-import-not-at-top
  from capsjax.app.trained import TrainedModel  # pylint: disable=g-import-not-at-top
  from capsjax.data.rows import ImageRows  # pylint: disable=g-import-not-at-top
  config, model, params, pixels, images = _tiny_capsnet('em')
  _, activations = jax.jit(model.apply, static_argnames='method')({'params': params}, images, method='classify')
  explorer = Explorer(TrainedModel(config, model, params, 'a test model'), np.asarray(images), np.arange(4))
  answer = explorer.example(2)
  # (The explorer encodes padded batches of another size: float32 rounding differs a little.)
  np.testing.assert_allclose(answer['activations'], activations[2], rtol=1e-4, atol=1e-4)
  assert not np.allclose(answer['activations'], answer['lengths'], atol=1e-3)
  predictor = Predictor(TrainedModel(config, model, params, 'a test model'))
  predicted = predictor.predict(pixels)
  assert [p['activations'][str(c)] for p in predicted for c in range(10)] == pytest.approx(
      np.asarray(activations).ravel().tolist(), rel=1e-4, abs=1e-6)
  # A split read on demand (capsjax.data.rows.ImageRows) predicts as its array does: once,
  # its rows iterated as nothing and the prediction failed to stack.
  on_demand = ImageRows(lambda ids: pixels[ids], pixels.shape[1:], num_rows=len(pixels))
  assert [p['activations'] for p in predictor.predict(on_demand)] == [p['activations'] for p in predicted]
  # One line each for what is not images (once: one image's 28 rows classified as 28 images,
  # and a TypeError for None).
  for images, line in [(pixels[0], r'predict takes a list of images or a batch \[n, h, w, c\]; one image of shape '
                                   r'\[28, 28, 1\] is predict\(\[image\]\)$'),
                       (None, r'predict takes images \(arrays, or a batch \[n, h, w, c\]\), got None; files: '),
                       ('digit.png', r"predict takes images .*, got 'digit.png'; files: predict\(read_files"),
                       (['digit.png'], r"image 0: a file name \('digit.png'\), not an image array; files: predict\(read_f")]:
    with pytest.raises(CapsjaxError, match='^' + line):
      predictor.predict(images)
  # What load_trained returns predicts as its TrainedModel does; what is no model, one line.
  assert Predictor((config, model, params)).predict(pixels[:2])[1]['activations'] == predicted[1]['activations']
  with pytest.raises(CapsjaxError, match=r"^a trained model is a TrainedModel, a run's workdir or load_trained's "
                                         r'\(config, model, params\), got int$'):
    Predictor(42)


def test_routing_zoo_writes_a_row_per_algorithm(mnist_dir, tmp_path):
  from capsjax.app.programs import routing_zoo  # pylint: disable=g-import-not-at-top
  from capsjax.experiments import routing_zoo_smoke  # pylint: disable=g-import-not-at-top
  config = routing_zoo_smoke.get_config()
  config.data_dir = mnist_dir
  evaluators_off(config, keep=('routing_diagnostics',))   # the zoo's table reads the diagnostics
  assert set(config.routing_zoo.routings) == set(routing.ROUTINGS)   # the smoke has a row per algorithm
  # Two here (the program's mechanics; each algorithm trains in the smoke, docs/results.md):
  # Procedure 1 and a user's own routing from a file of theirs, docs/routing.md's example, which
  # has no couplings: its coupling diagnostics read "absent", its activity is measured.
  (tmp_path / 'my_routing.py').write_text(
      "from capsjax.routing import register_routing, squash, vector_norm\n\n"
      "@register_routing('user_mean', iterative=False)\n"
      "def user_mean(prediction_vectors, input_activations, *, scale=1.0):\n"
      "  parents = squash(scale * prediction_vectors.mean(axis=1))\n"
      "  return parents, vector_norm(parents)\n")
  spec = importlib.util.spec_from_file_location('my_routing', tmp_path / 'my_routing.py')
  spec.loader.exec_module(importlib.util.module_from_spec(spec))
  config.routing_zoo.routings = ('dynamic', 'user_mean')
  # An option of the user's routing, which is not the base model.routing (dynamic): valid,
  # given to its own members only, and named in the table.
  config.model.routing_options.user_mean = {'scale': 2.0}
  validation.validate(config)
  config.model.update(conv1_channels=8, primary_types=2, decoder_hidden=(16, 32))
  config.model.formulation.conv_impl = SPEEDY_CONV
  config.update(num_train_examples=600, validation_examples=200, num_test_examples=200, num_steps=10,
                eval_every_steps=5, log_every_steps=5, checkpoint_every_steps=5, eval_batch_size=100,
                stop_at_step=5)
  config.routing_zoo.update(speed_rounds=2, speed_steps=1)
  with pytest.raises(RunStopped, match='stopped at step 5 of 10'):   # resumable, never a KeyError
    routing_zoo.run(config, str(tmp_path))
  config.stop_at_step = 0
  try:
    summary = routing_zoo.run(config, str(tmp_path))
  finally:
    routing.ROUTINGS.unregister('user_mean')
  rows = {row['routing']: row for row in summary['rows']}
  assert list(rows) == ['dynamic', 'user_mean']
  for row in rows.values():
    assert len(row['test_error']) == 2 and len(row['test_error_at_best_validation']) == 2   # two seeds
    assert row['train_images_per_s'] > 0 and row['infer_images_per_s'] > 0 and row['num_params'] > 0
  table = (tmp_path / 'routing.md').read_text()
  assert all(table.count(f'| {name} |') == 3 for name in rows)   # accuracy, speed, diagnostics tables
  assert '| vs dynamic |' in table and '| vs uniform |' not in table   # the baselines that ran
  assert 'Routing options other than their defaults: `user_mean` scale=2.0.' in table
  assert '2 interleaved rounds' in table and all(
      row['train_speed']['min'] <= row['train_speed']['median'] <= row['train_speed']['max'] for row in rows.values())
  assert (tmp_path / 'routing_test_error.png').stat().st_size > 0
  assert summary['curves']['user_mean']['steps'] == [5, 10]
  # The diagnostics: every field for Procedure 1, the couplings absent for the user's routing.
  dynamic, user = rows['dynamic']['diagnostics'], rows['user_mean']['diagnostics']
  assert 0 < dynamic['routing_coupling_entropy'] <= 1 and dynamic['routing_coupling_movement'] > 0
  assert len(dynamic['accuracy_by_routing_iterations']) == 5 and 'accuracy_by_routing_iterations' not in user
  assert user['routing_coupling_entropy'] is None and 0 <= user['primary_capsules_inactive'] <= 1
  assert '## Routing diagnostics' in table and '| user_mean | absent | absent | absent / absent |' in table
  assert (tmp_path / 'routing_diagnostics.png').stat().st_size > 0
  assert summary['diagnostic_curves']['dynamic']['steps'] == [5, 10]


def test_the_zoo_reads_the_newest_evaluation_of_each_step():
  from capsjax.app.programs import routing_zoo  # pylint: disable=g-import-not-at-top
  rows = [{'split': 'train', 'step': 200, 'loss': 1.0},
          {'split': 'test', 'step': 200, 'error': [0.2, 0.4]},
          {'split': 'validation', 'step': 200, 'error': [0.1, 0.1]},
          {'split': 'test', 'step': 400, 'error': [0.1, 0.3]},
          {'split': 'test', 'step': 400, 'error': [0.1, 0.1]}]   # --config.reevaluate=True at the end
  assert routing_zoo.error_curve(rows) == ([200, 400], [pytest.approx(0.3), pytest.approx(0.1)])


def test_a_difference_beyond_the_seed_spread_is_marked():
  from capsjax.app.programs import routing_zoo  # pylint: disable=g-import-not-at-top
  # Seeds' errors 2, 3, 4 % (sample variance 1) against 5, 6, 7 %: −3 points, standard error
  # sqrt(1/3 + 1/3) = 0.82, beyond twice it; against 2.5, 3.5, 4.5 %: −0.5, within.
  delta, beyond = routing_zoo.difference([0.02, 0.03, 0.04], [0.05, 0.06, 0.07])
  assert delta == pytest.approx(-3.0) and beyond is True
  delta, beyond = routing_zoo.difference([0.02, 0.03, 0.04], [0.025, 0.035, 0.045])
  assert delta == pytest.approx(-0.5) and beyond is False
  assert routing_zoo.difference([0.02], [0.05]) == (pytest.approx(-3.0), None)   # one seed: no spread


def test_interleaved_rounds_share_a_burst_of_load_between_the_routings():
  """A burst of load during four samples: measured one routing after the other it falls on
  one of them and reorders them; in rotated rounds each gets some, the medians keep the
  order and the range shows the burst."""
  from capsjax.app.programs import routing_zoo  # pylint: disable=g-import-not-at-top
  calls = []

  def sampler(name, speed):
    def sample():
      calls.append(name)
      return speed / (5.0 if 6 <= len(calls) <= 9 else 1.0)   # the 6th to 9th samples are slowed
    return sample
  measured = routing_zoo.interleaved({'slower': sampler('slower', 100.0), 'faster': sampler('faster', 110.0)}, 5)
  assert calls == ['slower', 'faster', 'faster', 'slower', 'slower', 'faster', 'faster', 'slower', 'slower', 'faster']
  assert measured['faster']['median'] == 110.0 and measured['slower']['median'] == 100.0
  assert measured['faster']['min'] == 22.0 and measured['faster']['max'] == 110.0


def test_shared_transform_routing_equals_procedure_1_on_the_materialised_votes():
  """û_{j|(p,t)} = W_tj u_(p,t) + o_p: Procedure 1 written without û gives what
  dynamic_routing gives on û itself, in value and in gradient (float64)."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(7)
    batch, height, width, types, in_dim, out_caps, out_dim = 2, 3, 2, 3, 4, 5, 6
    capsules = jnp.asarray(rng.normal(size=(batch, height * width, types, in_dim)) * 0.5)
    transforms = jnp.asarray(rng.normal(size=(types, out_caps, out_dim, in_dim)) * 0.5)
    bias = jnp.asarray(rng.normal(size=(out_caps, out_dim)) * 0.1)
    offsets = routing.coordinate_offsets(height, width, out_dim).astype(jnp.float64)
    assert offsets[3, :2].tolist() == [(1 + 0.5) / 3 - 0.5, (1 + 0.5) / 2 - 0.5] and not offsets[:, 2:].any()
    weights = jnp.asarray(rng.normal(size=(batch, out_caps, out_dim)))

    def materialised(capsules, transforms, bias):
      votes = routing.shared_votes(capsules, transforms, offsets)     # [batch, pos·types, out, dim]
      return jnp.sum(weights * routing.dynamic_routing(votes, 3, bias=bias).parents)

    def factored(capsules, transforms, bias):
      return jnp.sum(weights * routing.shared_dynamic_routing(capsules, transforms, offsets, 3, bias=bias))

    value, grads = jax.jit(jax.value_and_grad(materialised, argnums=(0, 1, 2)))(capsules, transforms, bias)
    factored_value, factored_grads = jax.jit(jax.value_and_grad(factored, argnums=(0, 1, 2)))(capsules, transforms, bias)
    np.testing.assert_allclose(factored_value, value, rtol=1e-12)
    for ours, reference in zip(factored_grads, grads):
      np.testing.assert_allclose(ours, reference, rtol=1e-10, atol=1e-12)
    # The votes themselves: W_tj u_(p,t) + o_p, capsule (p, t) at row p·types + t.
    votes = routing.shared_votes(capsules, transforms, offsets)
    np.testing.assert_allclose(votes[1, 4 * types + 2, 3],
                               transforms[2, 3] @ capsules[1, 4, 2] + offsets[4], rtol=1e-12)


# EM's variances Σ_i R_ij (V_ijh − μ_jh)² would need per-type second moments Σ R u uᵀ and
# evaluate each variance as E[V²] − μ², which cancels in float32 exactly where the votes
# agree (BUILD.md): EM gets û materialised.
FACTORED_ROUTINGS = ('dynamic', 'self_attention', 'inverted_dot_product')


def test_every_routing_with_a_shared_form_is_listed():
  assert tuple(name for name in routing.ROUTINGS.names() if routing.ROUTINGS[name].shared) == FACTORED_ROUTINGS


@pytest.mark.parametrize('name', FACTORED_ROUTINGS)
def test_each_shared_form_equals_its_routing_on_the_materialised_votes(name):
  """Value and gradient (float64) with respect to the capsules, the transforms and every
  learned option, against the routing itself on û = shared_votes(…)."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(11)
    batch, height, width, types, in_dim, out_caps, out_dim = 2, 2, 3, 2, 4, 3, 5
    in_caps = height * width * types
    capsules = jnp.asarray(rng.normal(size=(batch, height * width, types, in_dim)) * 0.5)
    transforms = jnp.asarray(rng.normal(size=(types, out_caps, out_dim, in_dim)) * 0.5)
    offsets = routing.coordinate_offsets(height, width, out_dim).astype(jnp.float64)
    options = {option: jnp.asarray(initial + 0.3 * rng.normal(size=shape(in_caps, out_caps, out_dim)))
               for option, (shape, initial) in routing.ROUTINGS[name].learned.items()}
    weights = jnp.asarray(rng.normal(size=(batch, out_caps, out_dim)))
    activation_weights = jnp.asarray(rng.normal(size=(batch, out_caps)))

    def loss(result):
      return jnp.sum(weights * result.parents) + jnp.sum(activation_weights * result.activations)

    def materialised(capsules, transforms, options):
      votes = routing.shared_votes(capsules, transforms, offsets)     # [batch, pos·types, out, dim]
      lengths = routing.vector_norm(capsules).reshape(batch, in_caps)
      return loss(routing.route(name, votes, lengths, 3, **options))

    def factored(capsules, transforms, options):
      assert routing.shared_form(name, options) is not None
      return loss(routing.call(name, (capsules, transforms, offsets), 3, shared=True, **options))

    # (Jitted: one compilation each, not one per operation.)
    value, grads = jax.jit(jax.value_and_grad(materialised, argnums=(0, 1, 2)))(capsules, transforms, options)
    factored_value, factored_grads = jax.jit(jax.value_and_grad(factored, argnums=(0, 1, 2)))(
        capsules, transforms, options)
    np.testing.assert_allclose(factored_value, value, rtol=1e-12)
    chex.assert_trees_all_close(factored_grads, grads, rtol=1e-9, atol=1e-12)
    assert all(np.any(np.asarray(g) != 0) for g in jax.tree_util.tree_leaves(grads))   # every input matters
  assert routing.shared_form('dynamic', {'leaky': True}) is None   # a per-capsule feature: û materialised
  assert routing.shared_form('dynamic', {'return_logits': True}) is None and routing.shared_form('em', {}) is None


def test_the_capsnet_routes_the_newer_algorithms_without_votes_too():
  # In the model: factored and materialised votes give the same class capsules with the
  # same parameters (learned routing options included; 6×6 positions × 4 types at 28 px),
  # and the factored routing step
  # with gradients holds no û (traced peak at 64 px, the paper's sizes otherwise).
  from benchmarks.factored_routing import peaks  # pylint: disable=g-import-not-at-top
  from capsjax import assemble  # pylint: disable=g-import-not-at-top
  from capsjax.experiments import mnist  # pylint: disable=g-import-not-at-top
  images = jnp.asarray(np.random.default_rng(0).random((2, 28, 28, 1)), jnp.float32)
  for name in FACTORED_ROUTINGS[1:]:   # dynamic: the test below
    encoded, params = {}, None
    for votes in ('factored', 'materialised'):   # the same parameters either way
      config = mnist.get_config()
      config.model.update(transforms='per_type', votes=votes, routing=name, conv1_channels=16, primary_types=4,
                          decoder_hidden=(16, 32))
      model = assemble.model(config)
      params = params or jax.jit(model.init)(jax.random.key(0), images[:1])['params']
      with jax.default_matmul_precision('float32'):
        encoded[votes] = jax.jit(lambda p, x: model.apply({'params': p}, x, method='classify'))(params, images)
    for ours, reference in zip(encoded['factored'], encoded['materialised']):   # capsules, activations
      # Relative to the largest value: the layer norm of inverted dot-product routing
      # divides vote sums of about 1e-4 by their spread, float32 rounding with them.
      np.testing.assert_allclose(ours, reference, atol=1e-4 * float(jnp.max(jnp.abs(reference))), err_msg=name)
    factored, materialised = peaks(name, grid=24, types=32, batch=8, classes=10, dim=16, in_dim=8)
    assert factored < materialised / 3, name   # measured 41 vs 389 and 67 vs 427 MB


def test_shared_transforms_in_the_capsnet_route_without_votes_and_do_not_grow_with_the_image():
  from capsjax import assemble, memory  # pylint: disable=g-import-not-at-top
  from capsjax.experiments import mnist  # pylint: disable=g-import-not-at-top
  shapes = {}
  for size in (28, 64):
    config = mnist.get_config()
    config.model.update(transforms='per_type', conv1_channels=16, primary_types=4, decoder_hidden=(16, 32),
                        input_shape=(size, size, 1))
    model = assemble.model(config)
    shapes[size] = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, size, size, 1)))['params']
  assert shapes[28]['digit_caps']['weights'].shape == shapes[64]['digit_caps']['weights'].shape == (4, 10, 16, 8)
  # The factored routing (classify) and the materialised votes (the probe's path,
  # return_logits) give the same capsules (at 36 px: a 10×10 grid of primary capsules).
  config.model.input_shape = (36, 36, 1)
  model = assemble.model(config)
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 36, 36, 1)))['params']
  images = jnp.asarray(np.random.default_rng(0).random((2, 36, 36, 1)), jnp.float32)
  with jax.default_matmul_precision('float32'):
    capsules, _ = jax.jit(lambda p, x: model.apply({'params': p}, x, method='classify'))(params, images)
    materialised = jax.jit(lambda p, x: model.apply({'params': p}, x, None, None, True, method='routed').parents)(
        params, images)
  np.testing.assert_allclose(capsules, materialised, rtol=1e-4, atol=1e-6)

  # Peak memory of the routing with gradients at 64 px (576 positions × 32 types, the
  # paper's sizes otherwise): the factored form holds no û.
  batch, positions, types = 8, 24 * 24, 32
  args = (jax.ShapeDtypeStruct((batch, positions, types, 8), jnp.float32),
          jax.ShapeDtypeStruct((types, 10, 16, 8), jnp.float32))
  offsets = routing.coordinate_offsets(24, 24, 16)
  factored = jax.jit(jax.grad(lambda u, w: jnp.sum(routing.shared_dynamic_routing(u, w, offsets, 3)), (0, 1)))
  votes = jax.jit(jax.grad(lambda u, w: jnp.sum(routing.dynamic_routing(routing.shared_votes(u, w, offsets), 3).parents),
                           (0, 1)))
  vote_bytes = batch * positions * types * 10 * 16 * 4
  with_votes = memory.traced_peak_bytes(votes, *args)
  assert with_votes > 2 * vote_bytes   # û and its companions (measured 421 MB; û is 94 MB)
  assert memory.traced_peak_bytes(factored, *args) < with_votes / 4   # measured 67 MB
