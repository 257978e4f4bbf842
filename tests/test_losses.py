"""Losses against values computed by hand."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capsjax.errors import ConfigError
from capsjax.losses import capsnet_loss, margin_loss, reconstruction_loss
from capsjax.models import longest_capsule_mask, mask_capsules

# Compiling many small programs is this module's time: XLA's cheap compilation (conftest.py).
pytestmark = pytest.mark.compile_bound


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


def test_margin_numbers_the_command_refuses_are_refused_in_its_words_and_traced_ones_pass():
  """margin_loss once took m+ < m− (a loss pushing absent classes above present ones) and a
  [classes] vector (one number, not a loss per example) without a word."""
  lengths, targets = jnp.array([[0.95, 0.3]]), jnp.array([[1.0, 0.0]])
  for arguments, line in [(dict(m_plus=0.1, m_minus=0.9), 'margin_loss: m_minus=0.9: allowed a value below m_plus=0.1'),
                          (dict(m_plus=1.5), 'margin_loss: m_plus=1.5: allowed a finite number in (0, 1]'),
                          (dict(negative_weight=-1), 'margin_loss: negative_weight=-1: allowed a finite number >= 0')]:
    with pytest.raises(ConfigError, match='^' + re.escape(line) + '$'):
      margin_loss(lengths, targets, **arguments)
  with pytest.raises(ValueError, match=re.escape('margin_loss takes lengths [batch, classes]; got shape (2,)')):
    margin_loss(lengths[0], targets[0])
  with pytest.raises(ConfigError, match=re.escape('capsnet_loss: reconstruction_weight=-0.0005: allowed a finite number >= 0')):
    capsnet_loss(lengths, targets, None, None, reconstruction_weight=-0.0005)
  # A vmapped margin (an ablation over m+) is traced: not checked, computed.
  swept = jax.jit(jax.vmap(lambda m: margin_loss(lengths, targets, m_plus=m)))(jnp.array([0.9, 1.0]))
  np.testing.assert_allclose(swept[:, 0], [0.02, 0.0025 + 0.02], rtol=1e-5)


def test_targets_or_images_of_another_shape_are_named_not_broadcast():
  # Class indices [batch] once failed deep in broadcasting; [batch, 1] targets broadcast
  # silently into a loss of the wrong meaning.
  lengths = jnp.full((4, 10), 0.5)
  with pytest.raises(ValueError, match=re.escape('margin_loss: targets (4,) must have the shape of lengths (4, 10) '
                                                 '(class indices? one-hot them: jax.nn.one_hot(labels, 10))')):
    margin_loss(lengths, jnp.array([1, 2, 3, 4]))
  with pytest.raises(ValueError, match=re.escape('margin_loss: targets (4, 1) must have the shape of lengths (4, 10)') + '$'):
    margin_loss(lengths, jnp.ones((4, 1)))
  with pytest.raises(ValueError, match=re.escape('reconstruction_loss: images (4, 28, 28, 1) must have the shape of '
                                                 'reconstructions (4, 784)')):
    capsnet_loss(lengths, jnp.ones((4, 10)), jnp.zeros((4, 784)), jnp.zeros((4, 28, 28, 1)))
  # The decoder's mask likewise (CapsNet(images, mask=...)).
  with pytest.raises(ValueError, match=re.escape('mask (4,) must be one-hot [batch, classes] = (4, 10) (class '
                                                 'indices? one-hot them: jax.nn.one_hot(labels, 10))')):
    mask_capsules(jnp.ones((4, 10, 16)), jnp.array([1, 2, 3, 4]))


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


def test_a_recipe_s_margin_scale_is_an_argument_of_the_loss_so_an_added_term_trains_in_every_member(monkeypatch):
  """The official reduction of a recipe member is the margin loss's `scale` (one traced
  factor): the objective no longer rewrites capsnet_loss's total, so a term a researcher
  adds to capsnet_loss reaches members of either reduction."""
  from capsjax import losses, objectives  # pylint: disable=g-import-not-at-top
  from capsjax.models import CapsNet  # pylint: disable=g-import-not-at-top
  lengths, targets = jnp.array([[0.95, 0.3], [0.2, 0.7]]), jnp.array([[1.0, 0.0], [0.0, 1.0]])
  summed = margin_loss(lengths, targets)
  np.testing.assert_allclose(margin_loss(lengths, targets, reduction='official'), summed / 4, rtol=1e-6)
  np.testing.assert_allclose(margin_loss(lengths, targets, scale=jnp.float32(0.25)), summed / 4, rtol=1e-6)
  original = losses.capsnet_loss

  def with_an_added_term(*arguments, **keywords):
    total, parts = original(*arguments, **keywords)
    return total + 7.0, parts
  model = CapsNet(conv1_channels=4, primary_types=2, digit_dim=4, decoder_hidden=(8,), num_classes=2)
  batch = {'images': jnp.zeros((2, 28, 28, 1)), 'labels': jnp.array([0, 1])}
  params = jax.jit(model.init)(jax.random.key(0), batch['images'])['params']
  objective = objectives.make_objective('capsnet', num_classes=2)
  official = dict(routing_iterations=jnp.int32(3), reconstruction_weight=jnp.float32(0.0005),
                  margin_scale=jnp.float32(losses.margin_reduction_scale('official', 2)))
  train = lambda: jax.jit(lambda knobs: objective(model, params, batch, True, knobs))   # traced anew each
  plain, _, parts = train()(official)
  monkeypatch.setattr(losses, 'capsnet_loss', with_an_added_term)
  added, _, added_parts = train()(official)
  np.testing.assert_allclose(added, plain + 7.0, rtol=1e-6)
  np.testing.assert_allclose(parts['margin_loss'], added_parts['margin_loss'])
