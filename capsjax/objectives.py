"""Objectives per model family, chosen by `config.loss.name`: the per-example loss and
the class scores that accuracy is measured on.

'capsnet': margin loss (+ weight × reconstruction loss in training, the decoder input
masked by the true label(s)); scores are the capsule lengths. 'sigmoid_xent' /
'softmax_xent': the CNN baselines' losses on logits; scores are the logits.
"""
from typing import Any, Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import optax

from capsjax import losses

Array = jax.Array


def labels_to_targets(labels: jax.Array, num_classes: int) -> jax.Array:
  """Integer labels [batch] or [batch, k] (k positives) → multi-hot targets [batch, classes]."""
  one_hot = jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)
  return one_hot if labels.ndim == 1 else jnp.clip(jnp.sum(one_hot, axis=1), 0.0, 1.0)


Objective = Callable[..., Tuple[Array, Array, Dict[str, Array]]]
# config.loss.name → (config, model, params, batch, train, knobs) → (loss [batch], scores, parts).
OBJECTIVES: Dict[str, Objective] = {}


def register_objective(name: str):
  """Function decorator: `config.loss.name = name` trains with this objective."""
  def register(function: Objective) -> Objective:
    OBJECTIVES[name] = function
    return function
  return register


@register_objective('capsnet')
def capsnet_objective(config, model, params, batch, train: bool, knobs=None):
  """Margin (+ reconstruction) loss of a CapsNet.

  `knobs` (see `capsjax.ensembles.member_knobs`) replaces the routing iteration count and
  the reconstruction weight by traced values, so that one vmapped program trains an
  ensemble of configurations; None uses the config's own (static) values.
  In training the decoder input is masked by the true label(s): each label's capsule
  reconstructs its own digit when the batch has `digits` (MultiMNIST), else the image
  (`reconstruction_targets` when the model sees a standardised one).
  In evaluation only the margin loss (the classification) is computed: no decoder.
  """
  loss_config = config.loss
  images, labels = batch['images'], batch['labels']
  num_classes = config.model.num_classes
  targets = labels_to_targets(labels, num_classes)
  variables = {'params': params}
  margin_kwargs = dict(m_plus=loss_config.m_plus, m_minus=loss_config.m_minus,
                       negative_weight=loss_config.negative_weight,
                       reduction=loss_config.margin_reduction)
  routing_kwargs, reconstruction_weight = {}, loss_config.reconstruction_weight
  if knobs is not None:
    # The model's own (static) count bounds the traced one; see dynamic_routing.
    routing_kwargs = dict(routing_iterations=knobs['routing_iterations'],
                          max_iterations=config.model.routing_iterations)
    reconstruction_weight = knobs['reconstruction_weight']
  if not train:
    _, activations = model.apply(variables, images, method='classify', **routing_kwargs)
    return losses.margin_loss(activations, targets, **margin_kwargs), activations, {}
  per_label = labels if labels.ndim == 2 else labels[:, None]                 # [batch, k]
  if 'digits' in batch:                          # MultiMNIST: each digit on its own
    reconstruction_targets = batch['digits']     # [batch, k, h, w, c]
  else:                                          # the image in [0, 1] (before standardisation)
    reconstruction_targets = batch.get('reconstruction_targets', images)[:, None]
  outputs = model.apply(variables, images, jax.nn.one_hot(per_label, num_classes), **routing_kwargs)
  total, parts = losses.capsnet_loss(
      outputs['activations'], targets, outputs.get('reconstructions'), reconstruction_targets,
      reconstruction_weight, **margin_kwargs)
  return total, outputs['activations'], parts


def _logits(config, model, params, batch, train: bool):
  rngs = {'dropout': batch['dropout_key']} if train else None
  return model.apply({'params': params}, batch['images'], train=train, rngs=rngs)['logits']


@register_objective('sigmoid_xent')
def sigmoid_xent_objective(config, model, params, batch, train: bool, knobs=None):
  """Independent sigmoid per class (MultiMNIST baseline: two positives)."""
  del knobs
  logits = _logits(config, model, params, batch, train)
  targets = labels_to_targets(batch['labels'], config.model.num_classes)
  return optax.sigmoid_binary_cross_entropy(logits, targets).sum(-1), logits, {}


@register_objective('softmax_xent')
def softmax_xent_objective(config, model, params, batch, train: bool, knobs=None):
  """Softmax cross-entropy (the MNIST baseline CNN)."""
  del knobs
  logits = _logits(config, model, params, batch, train)
  targets = labels_to_targets(batch['labels'], config.model.num_classes)
  return optax.softmax_cross_entropy(logits, targets), logits, {}


def objective(config, model, params, batch, train: bool, knobs: Optional[Dict[str, Any]] = None):
  """(per-example loss [batch], class scores [batch, classes], named loss parts) for
  config.loss.name (a registered objective; `capsjax.validation` checks the name)."""
  return registered_objectives()[config.loss.name](config, model, params, batch, train, knobs)


def registered_objectives() -> Dict[str, Objective]:
  """Every objective: the ones above and those of capsjax.families' modules."""
  import capsjax.families  # pylint: disable=g-import-not-at-top,unused-import  (registers on import)
  return OBJECTIVES


def top_k_correct(scores: jax.Array, labels: jax.Array):
  """(all labels among the k best scores [batch], fraction of labels found [batch]).

  k is the number of labels per example (1 for MNIST, 2 for MultiMNIST); with k = 1 the
  first is plain argmax accuracy.
  """
  labels = labels if labels.ndim == 2 else labels[:, None]
  _, predicted = jax.lax.top_k(scores, labels.shape[1])                   # [batch, k]
  found = jnp.any(labels[:, :, None] == predicted[:, None, :], axis=-1)   # [batch, k]
  return jnp.all(found, -1).astype(jnp.float32), jnp.mean(found.astype(jnp.float32), -1)
