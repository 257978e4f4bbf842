"""Losses against values computed by hand."""
import jax
import jax.numpy as jnp
import numpy as np

from capsjax.losses import capsnet_loss, margin_loss, reconstruction_loss
from capsjax.models import longest_capsule_mask, mask_capsules


def test_margin_loss_hand_computed():
  lengths = jnp.array([[0.95, 0.05, 0.30],    # present & long, absent & short, absent & long
                       [0.50, 0.20, 0.10]])
  targets = jnp.array([[1, 0, 0], [1, 1, 0]])
  # row 0: 0 + 0 + 0.5*(0.30-0.1)^2 = 0.02
  # row 1: (0.9-0.5)^2 + (0.9-0.2)^2 + 0.5*max(0, 0.1-0.1)^2 = 0.16 + 0.49 = 0.65
  np.testing.assert_allclose(margin_loss(lengths, targets), [0.02, 0.65], rtol=1e-6)


def test_margin_loss_parameters_are_used():
  lengths = jnp.array([[0.5, 0.5]])
  targets = jnp.array([[1, 0]])
  # (0.8-0.5)^2 + 0.25*(0.5-0.2)^2 = 0.09 + 0.0225
  np.testing.assert_allclose(margin_loss(lengths, targets, m_plus=0.8, m_minus=0.2, negative_weight=0.25),
                             [0.1125], rtol=1e-6)


def test_margin_loss_gradient_sign():
  grad = jax.grad(lambda l: margin_loss(l, jnp.array([[1.0, 0.0]])).sum())(jnp.array([[0.5, 0.5]]))
  # The present class is pushed longer, the absent one shorter.
  assert grad[0, 0] < 0 < grad[0, 1]


def test_reconstruction_loss_is_sum_of_squares_per_image():
  images = jnp.zeros((2, 2, 2, 1))
  recon = jnp.array([[[[1.0], [0.0]], [[0.5], [0.0]]], [[[0.0], [0.0]], [[0.0], [0.2]]]])
  np.testing.assert_allclose(reconstruction_loss(recon, images), [1.25, 0.04], rtol=1e-6)


def test_total_loss_scales_reconstruction_by_0_0005():
  lengths = jnp.array([[0.5, 0.1]])
  targets = jnp.array([[1.0, 0.0]])
  images = jnp.zeros((1, 2, 2, 1))
  recon = jnp.ones((1, 2, 2, 1))  # squared error 4
  total, parts = capsnet_loss(lengths, targets, recon, images)
  np.testing.assert_allclose(total, [0.16 + 0.0005 * 4], rtol=1e-6)
  np.testing.assert_allclose(parts['reconstruction_loss'], [4.0])


def test_masking_by_label_and_by_longest_capsule():
  capsules = jnp.arange(2 * 3 * 2, dtype=jnp.float32).reshape(2, 3, 2)
  lengths = jnp.array([[0.1, 0.9, 0.2], [0.7, 0.1, 0.3]])
  mask = longest_capsule_mask(lengths)
  np.testing.assert_array_equal(mask, [[0, 1, 0], [1, 0, 0]])
  masked = mask_capsules(capsules, mask)
  np.testing.assert_array_equal(masked[0], [[0, 0], [2, 3], [0, 0]])
  np.testing.assert_array_equal(masked[1], [[6, 7], [0, 0], [0, 0]])
