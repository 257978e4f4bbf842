"""Routing diagnostics (capsjax.diagnostics): hand-computed values of each measure, absent
couplings reported as absent, and the fields a CapsNet run's evaluation writes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capsjax import diagnostics, routing
from helpers import SPEEDY_CONV

# Compiling many small programs is this module's time: XLA's cheap compilation (conftest.py).
pytestmark = pytest.mark.compile_bound


def test_entropy_is_one_for_uniform_and_zero_for_one_parent_and_movement_is_total_variation():
  uniform = jnp.full((1, 2, 4), 0.25)
  one_parent = jnp.zeros((1, 2, 4)).at[:, :, 1].set(1.0)
  np.testing.assert_allclose(diagnostics.coupling_entropy(uniform), 1.0, rtol=1e-6)
  np.testing.assert_allclose(diagnostics.coupling_entropy(one_parent), 0.0, atol=1e-6)
  half = jnp.array([[[0.5, 0.5, 0.0, 0.0]]])   # log 2 / log 4
  np.testing.assert_allclose(diagnostics.coupling_entropy(half), 0.5, rtol=1e-6)
  # ½ Σ_j |last − first|: from uniform to one parent moves 3/4 of the mass.
  np.testing.assert_allclose(diagnostics.coupling_movement(uniform, one_parent), 0.75, rtol=1e-6)


def test_consistency_compares_pairs_of_the_same_and_of_different_classes():
  base = jnp.full((3, 2), 0.5)
  towards = base.at[:, 0].add(0.2).at[:, 1].add(-0.2)     # children lean to parent 0
  away = base.at[:, 0].add(-0.2).at[:, 1].add(0.2)        # … to parent 1
  couplings = jnp.stack([towards, towards, away, towards * 0 + 0.5])   # [4, in=3, out=2]
  labels = jnp.array([7, 7, 3, 9])
  weights = jnp.array([1.0, 1.0, 1.0, 0.0])               # the last row is padding
  sums = diagnostics.consistency_sums(couplings, labels, weights)
  assert float(sums['same_count']) == 2 and float(sums['same_sum']) == pytest.approx(2.0, rel=1e-5)
  assert float(sums['other_count']) == 4 and float(sums['other_sum']) == pytest.approx(-4.0, rel=1e-5)


def test_activity_and_absent_couplings_in_the_summary():
  details = {'primary_lengths': jnp.array([[0.05, 0.5, 0.09], [0.08, 0.2, 0.3]]),
             'activations': jnp.array([[0.9, 0.01], [0.95, 0.02]]), 'couplings': None}
  totals = diagnostics.batch_sums(details, jnp.array([0, 1]), jnp.array([1.0, 1.0]))
  metrics = diagnostics.summarize({k: np.asarray(v, np.float64) for k, v in totals.items()}, has_couplings=False)
  assert metrics['primary_capsules_inactive'] == pytest.approx(1 / 3)    # capsule 0 never reaches 0.1
  assert metrics['class_capsules_inactive'] == pytest.approx(1 / 2)
  assert metrics['class_capsule_mean_activation'] == pytest.approx((0.9 + 0.01 + 0.95 + 0.02) / 4)
  assert metrics['primary_capsule_mean_activation'] == pytest.approx((0.05 + 0.5 + 0.09 + 0.08 + 0.2 + 0.3) / 6)
  assert all(metrics[field] is None for field in diagnostics.COUPLING_FIELDS)   # absent, not 0


def test_every_routing_says_whether_it_has_couplings_and_they_are_distributions_over_parents():
  from capsjax.formulations import Formulation  # pylint: disable=g-import-not-at-top
  from capsjax.models import CapsNet  # pylint: disable=g-import-not-at-top
  images = jax.random.uniform(jax.random.key(0), (3, 28, 28, 1))
  for name in routing.ROUTINGS:
    model = CapsNet(conv1_channels=8, primary_types=2, decoder_hidden=(16,), routing=name,
                    formulation=Formulation(conv_impl=SPEEDY_CONV, dtype='auto'))
    params = jax.jit(model.init)(jax.random.key(1), images)['params']
    # One program for both calls: the details, and the activations classify reports.
    details, (_, activations) = jax.jit(lambda p: (
        model.apply({'params': p}, images, method='routing_details'),
        model.apply({'params': p}, images, method='classify')))(params)
    assert details['primary_lengths'].shape == (3, 72) and details['activations'].shape == (3, 10)
    # Class-capsule activity reads what the routing reports as presence (EM's and VB's a_j,
    # not their unsquashed poses' lengths).
    np.testing.assert_allclose(details['activations'], activations, rtol=1e-5, err_msg=name)
    if not routing.ROUTINGS[name].returns_couplings:
      assert details['couplings'] is None, name
      continue
    first, last = details['couplings']
    assert first.shape == last.shape == (3, 72, 10)
    np.testing.assert_allclose(jnp.sum(last, axis=-1), 1.0, rtol=1e-5, err_msg=name)
    if not routing.ROUTINGS[name].iterative:
      np.testing.assert_array_equal(first, last)   # nothing to move
