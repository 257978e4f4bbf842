"""Objectives per model family, registered and chosen by `config.loss.name`: the per-example loss and
the class scores that accuracy is measured on.

'capsnet': margin loss (+ weight × reconstruction loss in training, the decoder input
masked by the true label(s)); scores are the capsule lengths. 'sigmoid_xent' /
'softmax_xent': the CNN baselines' losses on logits; scores are the logits.
"""
import functools
from typing import Annotated, Callable, Dict, List, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from capsjax import losses
from capsjax.errors import ConfigError
from capsjax.keys import About, Key, annotated_keys, check_values, is_int, one_of, registered
from capsjax.registry import Registry

Array = jax.Array


def labels_to_targets(labels: jax.Array, num_classes: int) -> jax.Array:
  """Integer labels [batch] or [batch, k] (k positives) → multi-hot targets [batch, classes]."""
  one_hot = jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)
  return one_hot if labels.ndim == 1 else jnp.clip(jnp.sum(one_hot, axis=1), 0.0, 1.0)


Objective = Callable[..., Tuple[Array, Array, Dict[str, Array]]]
# config.loss.name → function(model, params, batch, train, knobs=None, *, num_classes,
#   **options) → (loss [batch], class scores [batch, classes], named loss parts); its
# options are config.loss's other keys. What callers ask of an objective:
#   families       the model families it trains (validation pairs them)
#   knobs          the ensemble knobs it reads (capsjax.ensembles): traced per member
#   probabilities  class scores → the class probabilities predict shows
#   check          (loss config, key prefix) → problems, one line each (validation)
OBJECTIVES = Registry('objective', families=(), knobs=(), probabilities=lambda scores: scores,
                      check=lambda loss, prefix: [],
                      doc="""The objectives by name (`config.loss.name`, `make_objective(name, ...)`): each
entry's value is the function (model, params, batch, train, knobs, *, num_classes,
**options) → (loss [batch], class scores [batch, classes], loss parts); its capabilities
(the comment above this registry) say which model families it trains.

Example:
  >>> capsjax.OBJECTIVES.names()
  ('capsnet', 'sigmoid_xent', 'softmax_xent')
  >>> capsjax.OBJECTIVES['capsnet'].families
  ('capsnet',)
""")


def register_objective(name: str, **capabilities):
  """Function decorator: `config.loss.name = name` trains with this objective."""
  return OBJECTIVES.register(name, **capabilities)


def make_objective(name: str, num_classes: int, **options) -> Objective:
  """The objective `name` with its options bound: (model, params, batch, train, knobs)
  → (loss [batch], scores [batch, classes], parts). Built once, where the config is
  read (capsjax.train); the jitted step never sees the config. A batch is a dict:
  'images' [batch, h, w, c] float, 'labels' [batch] int (or [batch, k] for k objects).

  Example:
    The paper's loss of a small CapsNet, and its gradient.

    >>> objective = capsjax.make_objective('capsnet', num_classes=10, reconstruction_weight=0.0005)
    >>> model = capsjax.CapsNet(conv1_channels=32, primary_types=8)
    >>> batch = {'images': jnp.zeros((4, 28, 28, 1)), 'labels': jnp.array([0, 1, 2, 3])}
    >>> params = jax.jit(model.init)(jax.random.key(0), batch['images'])['params']   # jitted: one program
    >>> step = lambda p: objective(model, p, batch, True)        # (model, params, batch, train)
    >>> loss, scores, parts = jax.jit(step)(params)              # jitted: one program, not one per operation
    >>> loss.shape, scores.shape, sorted(parts)
    ((4,), (4, 10), ['margin_loss', 'reconstruction_loss'])
    >>> grads = jax.jit(jax.grad(lambda p: step(p)[0].mean()))(params)
    >>> jax.tree.structure(grads) == jax.tree.structure(params)
    True
  """
  OBJECTIVES.get(name)   # UnknownName, listing them
  if not is_int(num_classes) or num_classes < 1:
    raise ConfigError(f'make_objective: num_classes={num_classes!r}: allowed an integer >= 1')
  problems = option_problems(name, options)
  if problems:   # the command's line for the same config.loss value (an unknown option once failed at trace time)
    raise ConfigError(problems[0])
  return bound_objective(name, num_classes, options)


def bound_objective(name: str, num_classes: int, options: Dict[str, object]) -> Objective:
  """make_objective without its checks: for a config validation has checked (capsjax.assemble)."""
  return functools.partial(OBJECTIVES.get(name), num_classes=num_classes, **options)


def option_problems(name: str, options: Dict[str, object]) -> List[str]:
  """What is wrong with make_objective's `options` for objective `name`, as config.loss's
  lines: an option it does not take, a value its key's rule refuses, its own check."""
  keys = loss_keys(name)
  unknown = sorted(set(options) - set(keys) - {'name'})
  if unknown:
    return [f'config.loss.{unknown[0]}: not an option of the {name!r} objective (its options: '
            f'{", ".join(key for key in keys if key != "name") or "none"})']
  loss = ml_collections.ConfigDict({'name': name, **{key: k.default for key, k in keys.items() if key != 'name'},
                                    **options})
  problems: List[str] = []
  check_values(loss, keys, problems, 'loss.')
  return problems or list(OBJECTIVES[name].check(loss, 'loss.'))


def loss_keys(name: str) -> Dict[str, Key]:
  """config.loss's keys for the objective `name`: `name` and its annotated options."""
  objective = Key('name', name, registered(OBJECTIVES.names), 'the loss (capsnet: margin + reconstruction; '
                  'cross-entropies for the CNNs)')
  return {'name': objective, **annotated_keys(OBJECTIVES.get(name))}


def _margin_problems(loss, prefix: str):
  # (A section of another objective's keys has none of them: nothing to check.)
  return losses.margin_problems(*(loss.get(key) for key in ('m_plus', 'm_minus', 'negative_weight')),
                                prefix=f'config.{prefix}')


@register_objective('capsnet', families=('capsnet',), knobs=('routing_iterations', 'reconstruction_weight'),
                    check=_margin_problems)
def capsnet_objective(
    model, params, batch, train: bool, knobs=None, *, num_classes: int,
    m_plus: Annotated[float, losses.M_PLUS] = 0.9,
    m_minus: Annotated[float, losses.M_MINUS] = 0.1,
    negative_weight: Annotated[float, losses.NEGATIVE_WEIGHT] = 0.5,
    reconstruction_weight: Annotated[float, losses.RECONSTRUCTION_WEIGHT] = 0.0005,
    margin_reduction: Annotated[str, About(one_of(losses.MARGIN_REDUCTIONS), (
        "sum over classes (the paper, eq. 4) or official (the authors' code: 0.5 × mean)"))] = 'sum'):
  """Margin (+ reconstruction) loss of a CapsNet.

  `knobs` (see `capsjax.steps.member_knobs`) replaces the routing iteration count and
  the reconstruction weight by traced values, so that one vmapped program trains an
  ensemble of configurations; None uses the model's and the options' own (static) values.
  In training the decoder input is masked by the true label(s): each label's capsule
  reconstructs its own digit when the batch has `digits` (MultiMNIST), else the image
  (`reconstruction_targets` when the model sees a standardised one).
  In evaluation only the margin loss (the classification) is computed: no decoder.
  """
  images, labels = batch['images'], batch['labels']
  targets = labels_to_targets(labels, num_classes)
  variables = {'params': params}
  margin_kwargs = dict(m_plus=m_plus, m_minus=m_minus, negative_weight=negative_weight,
                       reduction=margin_reduction)
  routing_kwargs = {}
  if knobs is not None:
    # The model's own (static) count bounds the traced one; see dynamic_routing.
    routing_kwargs = dict(routing_iterations=knobs['routing_iterations'], max_iterations=model.routing_iterations)
    reconstruction_weight = knobs['reconstruction_weight']
    if 'margin_scale' in knobs:   # a recipe's reduction, as the margin loss's traced scale
      margin_kwargs['scale'] = knobs['margin_scale']
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


def _logits(model, params, batch, train: bool):
  rngs = {'dropout': batch['dropout_key']} if train else None
  return model.apply({'params': params}, batch['images'], train=train, rngs=rngs)['logits']


@register_objective('sigmoid_xent', families=('cnn',), probabilities=jax.nn.sigmoid)
def sigmoid_xent_objective(model, params, batch, train: bool, knobs=None, *, num_classes: int):
  """Independent sigmoid per class (MultiMNIST baseline: two positives)."""
  del knobs
  logits = _logits(model, params, batch, train)
  targets = labels_to_targets(batch['labels'], num_classes)
  return optax.sigmoid_binary_cross_entropy(logits, targets).sum(-1), logits, {}


@register_objective('softmax_xent', families=('cnn',), probabilities=jax.nn.softmax)
def softmax_xent_objective(model, params, batch, train: bool, knobs=None, *, num_classes: int):
  """Softmax cross-entropy (the MNIST baseline CNN)."""
  del knobs
  logits = _logits(model, params, batch, train)
  targets = labels_to_targets(batch['labels'], num_classes)
  return optax.softmax_cross_entropy(logits, targets), logits, {}


def top_k_correct(scores: jax.Array, labels: jax.Array):
  """(all labels among the k best scores [batch], fraction of labels found [batch]).

  k is the number of labels per example (1 for MNIST, 2 for MultiMNIST); with k = 1 the
  first is plain argmax accuracy. An example with a non-finite score is wrong (top_k ranks
  NaN first: it would count as right when its label happened to be there).
  """
  labels = labels if labels.ndim == 2 else labels[:, None]
  _, predicted = jax.lax.top_k(scores, labels.shape[1])                   # [batch, k]
  found = jnp.any(labels[:, :, None] == predicted[:, None, :], axis=-1)   # [batch, k]
  found = found & jnp.all(jnp.isfinite(scores), -1, keepdims=True)        # [batch, k]
  return jnp.all(found, -1).astype(jnp.float32), jnp.mean(found.astype(jnp.float32), -1)


def non_finite(scores: jax.Array) -> jax.Array:
  """Per example, whether any class score is NaN or infinite: scores [..., batch, classes] →
  [..., batch] float32 (a diverged model, a NaN input)."""
  return jnp.any(~jnp.isfinite(scores), -1).astype(jnp.float32)
