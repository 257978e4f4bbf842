"""A model family is one file: a module registered by name and its objective. This test is
that file (a linear softmax classifier), trained through the unchanged loop."""
from typing import Sequence

import flax.linen as nn
import jax
import optax
import pytest

from capsjax import models, objectives, train
from capsjax.validation import problems_of
from tests.test_train import tiny_config


@pytest.fixture
def linear_family():
  @models.register_model('linear')
  class Linear(nn.Module):   # pylint: disable=unused-variable
    num_classes: int = 10
    input_shape: Sequence[int] = (28, 28, 1)

    @nn.compact
    def __call__(self, images, train: bool = False):
      return {'logits': nn.Dense(self.num_classes)(images.reshape(images.shape[0], -1))}

  @objectives.register_objective('linear_xent')
  def linear_xent(config, model, params, batch, train, knobs=None):   # pylint: disable=unused-variable
    del train, knobs
    logits = model.apply({'params': params}, batch['images'])['logits']
    targets = jax.nn.one_hot(batch['labels'], config.model.num_classes)
    return optax.softmax_cross_entropy(logits, targets), logits, {}

  yield
  del models.MODELS['linear'], objectives.OBJECTIVES['linear_xent']


def test_a_registered_family_trains_through_the_loop(linear_family, mnist_dir, tmp_path):
  config = tiny_config(mnist_dir, num_steps=60, eval_every_steps=0, routing_probe_iterations=0)
  config.model = dict(name='linear', num_classes=10, input_shape=(28, 28, 1))
  config.loss = dict(name='linear_xent')
  assert problems_of(config) == []
  results = train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert results['num_params'] == 28 * 28 * 10 + 10
  assert results['test_accuracy'] > 0.6   # a linear classifier after 60 steps of 32


def test_unknown_family_names_are_refused():
  config = tiny_config('')
  config.model.name = 'linear'
  assert "config.model.name='linear': allowed one of capsnet, cnn" in problems_of(config)[0]
