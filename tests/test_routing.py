"""Routing against a plain loop written from Procedure 1; vmap over r; gradients; squash."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capsjax.routing import coupling_coefficients, dynamic_routing, squash

# Compares formulations / the model's own answers at float32 tolerances (see conftest).
pytestmark = pytest.mark.float32_matmuls


def reference_squash(s):
  norm = np.linalg.norm(s, axis=-1, keepdims=True)
  return (norm ** 2 / (1 + norm ** 2)) * s / np.maximum(norm, 1e-30)


def reference_routing(u_hat, r, log_priors=None, leaky=False):
  """Procedure 1, literally, in float64 numpy loops over i and j."""
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
        v[n, j] = reference_squash(s)
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
  np.testing.assert_allclose(dynamic_routing(u_hat, r), expected, rtol=2e-5, atol=1e-6)


def test_jit_and_static_bound_agree_with_reference():
  u_hat = random_predictions(7)
  expected, _ = reference_routing(u_hat, 3)
  routed = jax.jit(lambda u, r: dynamic_routing(u, r, max_iterations=5))(u_hat, 3)
  np.testing.assert_allclose(routed, expected, rtol=2e-5, atol=1e-6)


def test_iterations_change_the_result():
  # Guards against a loop that silently runs once: r=1 and r=3 must differ.
  u_hat = random_predictions(3)
  assert not np.allclose(dynamic_routing(u_hat, 1), dynamic_routing(u_hat, 3), atol=1e-4)


def test_one_iteration_is_uniform_coupling():
  u_hat = random_predictions(4)
  out_caps = u_hat.shape[2]
  expected = reference_squash(np.asarray(u_hat, np.float64).sum(1) / out_caps)
  np.testing.assert_allclose(dynamic_routing(u_hat, 1), expected, rtol=2e-5, atol=1e-6)


def test_vmap_over_iteration_count_equals_separate_calls():
  u_hat = random_predictions(5)
  counts = jnp.array([1, 2, 3, 4])
  batched = jax.jit(jax.vmap(lambda r: dynamic_routing(u_hat, r, max_iterations=4)))(counts)
  for k, r in enumerate([1, 2, 3, 4]):
    np.testing.assert_allclose(batched[k], dynamic_routing(u_hat, r), rtol=1e-5, atol=1e-6)


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
    fn = lambda u: jnp.sum(weights * dynamic_routing(u, jnp.asarray(3), max_iterations=4))
  else:
    fn = lambda u: jnp.sum(weights * dynamic_routing(u, 3))
  with jax.enable_x64(True):
    pairs = _directional_derivatives(fn, jnp.asarray(u_hat, jnp.float64))
  autodiff, numeric = pairs[:, 0], pairs[:, 1]
  np.testing.assert_allclose(autodiff, numeric, rtol=2e-2, atol=1e-4)


def test_traced_and_static_gradients_agree():
  u_hat = random_predictions(8)
  static = jax.grad(lambda u: jnp.sum(dynamic_routing(u, 2) ** 2))(u_hat)
  traced = jax.grad(lambda u: jnp.sum(dynamic_routing(u, jnp.asarray(2), max_iterations=5) ** 2))(u_hat)
  np.testing.assert_allclose(traced, static, rtol=1e-5, atol=1e-7)


def test_stop_gradient_keeps_values_and_changes_only_gradients():
  u_hat = random_predictions(9)
  loss = lambda u, sg: jnp.sum(dynamic_routing(u, 3, stop_gradient_predictions=sg) ** 2)
  np.testing.assert_allclose(dynamic_routing(u_hat, 3, stop_gradient_predictions=True),
                             dynamic_routing(u_hat, 3), rtol=1e-6)
  full, stopped = jax.grad(loss)(u_hat, False), jax.grad(loss)(u_hat, True)
  assert not np.allclose(full, stopped, atol=1e-6)
  # With the coupling frozen, the gradient is that of one pass with fixed c.
  c = coupling_coefficients(dynamic_routing(u_hat, 3, return_logits=True)[1][1])
  frozen = lambda u: jnp.sum(squash(jnp.einsum('bij,bijd->bjd', c, u)) ** 2)
  np.testing.assert_allclose(stopped, jax.grad(frozen)(u_hat), rtol=1e-4, atol=1e-7)
  # With one iteration there is nothing to stop.
  one_pass = lambda u, sg: jnp.sum(dynamic_routing(u, 1, stop_gradient_predictions=sg) ** 2)
  np.testing.assert_allclose(jax.grad(one_pass)(u_hat, True), jax.grad(one_pass)(u_hat, False), rtol=1e-6)


def test_leaky_routing_matches_reference_with_extra_parent():
  u_hat = random_predictions(10)
  expected, _ = reference_routing(u_hat, 3, leaky=True)
  np.testing.assert_allclose(dynamic_routing(u_hat, 3, leaky=True), expected, rtol=2e-5, atol=1e-6)
  coupling = coupling_coefficients(jnp.zeros((1, 2, 4)), leaky=True)
  np.testing.assert_allclose(coupling, 0.2)  # 4 parents + the leak share equally


def test_log_priors_start_the_logits():
  u_hat = random_predictions(11)
  priors = jax.random.normal(jax.random.key(2), u_hat.shape[1:3])
  expected, _ = reference_routing(u_hat, 2, log_priors=priors)
  np.testing.assert_allclose(dynamic_routing(u_hat, 2, log_priors=priors), expected, rtol=2e-5, atol=1e-6)


def test_returned_logits_are_every_iteration():
  u_hat = random_predictions(12)
  _, expected = reference_routing(u_hat, 3)
  _, history = dynamic_routing(u_hat, 3, return_logits=True)
  np.testing.assert_allclose(history, expected, rtol=2e-5, atol=1e-5)
  _, padded = dynamic_routing(u_hat, jnp.asarray(3), max_iterations=5, return_logits=True)
  assert padded.shape[0] == 5
  np.testing.assert_allclose(padded[3], padded[2])
  np.testing.assert_allclose(padded[4], padded[2])


def test_bad_iteration_counts_are_rejected():
  u_hat = random_predictions(0)
  with pytest.raises(ValueError, match='max_iterations'):
    jax.jit(lambda r: dynamic_routing(u_hat, r))(3)
  with pytest.raises(ValueError, match='>= 1'):
    dynamic_routing(u_hat, 0)


def test_squash_limits_and_direction():
  long = jnp.array([[300.0, 400.0]])
  short = jnp.array([[3e-3, 4e-3]])
  np.testing.assert_allclose(jnp.linalg.norm(squash(long), axis=-1), 250000 / 250001, rtol=1e-6)
  np.testing.assert_allclose(jnp.linalg.norm(squash(short), axis=-1), 25e-6 / (1 + 25e-6), rtol=1e-5)
  np.testing.assert_allclose(squash(long) / jnp.linalg.norm(squash(long)), [[0.6, 0.8]], rtol=1e-6)
  unit = squash(jnp.array([[1.0, 0.0]]))
  np.testing.assert_allclose(unit, [[0.5, 0.0]], rtol=1e-6)


def test_squash_is_safe_at_zero():
  zero = jnp.zeros((3, 8))
  assert np.all(squash(zero) == 0)
  grad = jax.grad(lambda s: jnp.sum(squash(s)))(zero)
  assert np.all(np.isfinite(grad))
  jac = jax.jacobian(squash)(jnp.zeros(4))
  np.testing.assert_array_equal(jac, np.zeros((4, 4)))  # squash(s) = O(|s|²) near 0
  routed_grad = jax.grad(lambda u: jnp.sum(dynamic_routing(u, 3)))(jnp.zeros((1, 4, 2, 3)))
  assert np.all(np.isfinite(routed_grad))


def test_convergence_measures_match_the_reference_loop():
  from capsjax.routing import coupling_changes, routing_logit_changes  # pylint: disable=g-import-not-at-top
  u_hat = random_predictions(seed=5)
  _, logits = dynamic_routing(u_hat, 4, return_logits=True)
  _, history = reference_routing(u_hat, 4)
  previous = np.concatenate([np.zeros_like(history[:1]), history[:-1]])
  expected_db = np.abs(history - previous).mean(axis=(1, 2, 3))
  np.testing.assert_allclose(routing_logit_changes(logits), expected_db, rtol=1e-4)
  # Iteration t's own agreement û·v_t is its logit change: |Δb_1| = mean |û·v_1|.
  softmax = lambda b: np.exp(b) / np.exp(b).sum(-1, keepdims=True)
  couplings = [softmax(b) for b in np.concatenate([np.zeros_like(history[:1]), history])]
  expected_dc = [np.abs(couplings[t + 1] - couplings[t]).mean() for t in range(4)]
  np.testing.assert_allclose(coupling_changes(logits), expected_dc, rtol=1e-4)
