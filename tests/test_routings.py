"""The routing registry: every algorithm against a plain float64 numpy reference written
from its paper (a loop per equation), in value and in gradient (central finite
differences of the reference), and a traced iteration count under vmap."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from capsjax import routing
from capsjax.errors import RunStopped

pytestmark = pytest.mark.float32_matmuls

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
  """EM routing (Hinton et al. 2018, Procedure 1) with capsjax's choices (BUILD.md): the
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


REFERENCES = {
    'dynamic': (reference_dynamic, {}),
    'em': (reference_em, {'beta_u': np.array([0.1, -0.2, 0.3]), 'beta_a': np.array([0.5, 0.0, -0.4])}),
    'self_attention': (reference_self_attention, {'log_priors': np.linspace(-0.1, 0.1, IN_CAPS * OUT_CAPS)
                                                                .reshape(IN_CAPS, OUT_CAPS)}),
    'inverted_dot_product': (reference_inverted_dot_product, {'scale': np.array([1.0, 0.8, 1.2, 0.9]),
                                                              'offset': np.array([0.0, 0.1, -0.1, 0.05])}),
}
# The reference's argument names → the registered function's option names.
OPTION_NAMES = {'scale': 'layer_norm_scale', 'offset': 'layer_norm_offset'}


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  u = rng.normal(0, 0.5, (BATCH, IN_CAPS, OUT_CAPS, DIM))
  a = rng.uniform(0.2, 1.0, (BATCH, IN_CAPS))
  return u, a


def _reference_batch(name, u, a, r, params):
  function, _ = REFERENCES[name]
  outputs = [function(u[n], a[n], r, **params) for n in range(len(u))]
  return np.stack([o[0] for o in outputs]), np.stack([o[1] for o in outputs])


def _route(name, u, a, r, params):
  options = {OPTION_NAMES.get(k, k): jnp.asarray(v) for k, v in params.items()}
  return routing.route(name, u, a, r, **options)


def test_the_registry_holds_the_four_algorithms_and_route_works_as_it_stands():
  assert set(REFERENCES) <= set(routing.ROUTINGS)
  u, a = _inputs()
  for name in routing.ROUTINGS:
    parents, activations = routing.route(name, jnp.asarray(u, jnp.float32))
    assert parents.shape == (BATCH, OUT_CAPS, DIM) and activations.shape == (BATCH, OUT_CAPS)
    assert jnp.all((activations >= 0) & (activations <= 1)), name


@pytest.mark.parametrize('name', sorted(REFERENCES))
def test_values_and_gradients_match_the_papers_reference(name):
  _, params = REFERENCES[name]
  u, a = _inputs(1)
  r = 3
  expected_parents, expected_activations = _reference_batch(name, u, a, r, params)
  rng = np.random.default_rng(7)
  w_parents, w_activations = rng.normal(size=expected_parents.shape), rng.normal(size=expected_activations.shape)
  with jax.enable_x64(True):
    parents, activations = _route(name, jnp.asarray(u), jnp.asarray(a), r, params)
    # EM divides by the spread of its costs over the parents, which scales rounding up.
    tolerance = dict(rtol=1e-6, atol=1e-8) if name == 'em' else dict(rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(parents, expected_parents, **tolerance)
    np.testing.assert_allclose(activations, expected_activations, **tolerance)

    def loss(u_, a_):
      p, act = _route(name, u_, a_, r, params)
      return jnp.sum(p * w_parents) + jnp.sum(act * w_activations)
    grad_u, grad_a = jax.grad(loss, argnums=(0, 1))(jnp.asarray(u), jnp.asarray(a))

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


@pytest.mark.parametrize('name', [n for n in sorted(REFERENCES) if routing.ROUTINGS[n].iterative])
def test_traced_iteration_count_under_vmap_matches_separate_calls(name):
  u, a = _inputs(2)
  u, a = jnp.asarray(u, jnp.float32), jnp.asarray(a, jnp.float32)

  def summed(count):
    parents, activations = routing.route(name, u, a, count, max_iterations=4)
    return jnp.sum(parents) + jnp.sum(activations)

  values = jax.vmap(summed)(jnp.arange(1, 5))   # one program over r = 1 … 4
  for count, value in zip(range(1, 5), values):
    parents, activations = routing.route(name, u, a, count)
    assert value == pytest.approx(float(jnp.sum(parents) + jnp.sum(activations)), rel=1e-5)
  # Gradients through the traced count equal the static ones.
  traced = jax.grad(lambda u_: jnp.sum(routing.route(name, u_, a, jnp.asarray(2), max_iterations=4)[1]))(u)
  static = jax.grad(lambda u_: jnp.sum(routing.route(name, u_, a, 2)[1]))(u)
  np.testing.assert_allclose(traced, static, rtol=1e-5, atol=1e-7)



# ----------------------------------------------------------------------------- in a CapsNet

def _tiny_capsnet_config(name):
  from experiments import mnist  # pylint: disable=g-import-not-at-top
  config = mnist.get_config()
  config.model.update(routing=name, conv1_channels=8, primary_types=2, decoder_hidden=(16, 32))
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
  outputs = model.apply({'params': params}, images)
  _, activations = model.apply({'params': params}, images, method='classify')
  np.testing.assert_allclose(outputs['activations'], activations, rtol=1e-6)
  assert jnp.all((activations >= 0) & (activations <= 1))
  batch = {'images': images, 'labels': jnp.arange(4)}
  grads = jax.jit(jax.grad(lambda p: jnp.mean(assemble.objective(config)(model, p, batch, True)[0])))(params)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  assert any(bool(jnp.any(g != 0)) for g in jax.tree.leaves(grads['digit_caps']))


def test_explorer_and_predict_show_the_routings_activations():
  # EM: activations that are not the capsule lengths.
  from capsjax.explorer.backend import Explorer  # pylint: disable=g-import-not-at-top
  from capsjax.predict import Predictor  # pylint: disable=g-import-not-at-top
  from capsjax.trained import TrainedModel  # pylint: disable=g-import-not-at-top
  config, model, params, pixels, images = _tiny_capsnet('em')
  _, activations = model.apply({'params': params}, images, method='classify')
  explorer = Explorer(TrainedModel(config, model, params, 'a test model'), np.asarray(images), np.arange(4))
  answer = explorer.example(2)
  # (The explorer encodes padded batches of another size: float32 rounding differs a little.)
  np.testing.assert_allclose(answer['activations'], activations[2], rtol=1e-4, atol=1e-4)
  assert not np.allclose(answer['activations'], answer['lengths'], atol=1e-3)
  predicted = Predictor(TrainedModel(config, model, params, 'a test model')).predict(pixels)
  assert [p['activations'][str(c)] for p in predicted for c in range(10)] == pytest.approx(
      np.asarray(activations).ravel().tolist(), rel=1e-4, abs=1e-6)


def test_routing_zoo_writes_a_row_per_algorithm(mnist_dir, tmp_path):
  from capsjax.programs import routing_zoo  # pylint: disable=g-import-not-at-top
  from experiments import routing_zoo_smoke  # pylint: disable=g-import-not-at-top
  config = routing_zoo_smoke.get_config()
  config.data_dir = mnist_dir
  assert set(config.routing_zoo.routings) == set(routing.ROUTINGS)   # the smoke has a row per algorithm
  # Two of them here (the program's mechanics; each algorithm trains in the smoke, BUILD.md).
  config.routing_zoo.routings = ('dynamic', 'em')
  config.model.update(conv1_channels=8, primary_types=2, decoder_hidden=(16, 32))
  config.update(num_train_examples=600, validation_examples=200, num_test_examples=200, num_steps=10,
                eval_every_steps=5, log_every_steps=5, checkpoint_every_steps=5, eval_batch_size=100,
                stop_at_step=5)
  with pytest.raises(RunStopped, match='stopped at step 5 of 10'):   # resumable, never a KeyError
    routing_zoo.run(config, str(tmp_path))
  config.stop_at_step = 0
  summary = routing_zoo.run(config, str(tmp_path))
  rows = {row['routing']: row for row in summary['rows']}
  assert list(rows) == ['dynamic', 'em']
  for row in rows.values():
    assert len(row['test_error']) == 2 and len(row['test_error_at_best_validation']) == 2   # two seeds
    assert row['train_images_per_s'] > 0 and row['infer_images_per_s'] > 0 and row['num_params'] > 0
  table = (tmp_path / 'routing.md').read_text()
  assert all(f'| {name} |' in table for name in rows)
  assert (tmp_path / 'routing_test_error.png').stat().st_size > 0
  assert summary['curves']['em']['steps'] == [5, 10]
