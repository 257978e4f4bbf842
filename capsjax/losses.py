"""The paper's losses as pure functions; every loss is per example, shape [batch]."""
import math
from typing import Optional

import jax
import jax.numpy as jnp

from capsjax.errors import ArgumentError, ConfigError
from capsjax.keys import PYTHON_VALUES, About, argument_problems, as_python, number_in, positive_number

Array = jax.Array


MARGIN_REDUCTIONS = ('sum', 'official')
# The margin loss's numbers (eq. 4), declared once: margin_loss checks the Python numbers it
# is given by these rules, and config.loss of the capsnet objective declares its keys by them.
M_PLUS = About(number_in(0, 1, low_open=True), 'margin loss m+ (0.9)')
M_MINUS = About(number_in(0, 1, high_open=True), 'margin loss m− (0.1)')
# margin_loss's `scale`: the factor on the summed loss (margin_reduction_scale's values).
MARGIN_SCALE = positive_number()
NEGATIVE_WEIGHT = About(number_in(0, math.inf), 'margin loss λ for absent classes (0.5)')
RECONSTRUCTION_WEIGHT = About(number_in(0, math.inf), 'reconstruction loss weight (0.0005)')


def margin_problems(m_plus, m_minus, negative_weight, prefix: str = '') -> list:
  """One line per margin number its rule refuses (`{prefix}m_plus=…: allowed …`), then
  m− ≥ m+ (a margin loss whose absent classes are pushed above its present ones). Traced
  values (a vmapped margin) are not Python numbers and pass: they cannot be read here."""
  problems = argument_problems({'m_plus': (m_plus, M_PLUS.rule), 'm_minus': (m_minus, M_MINUS.rule),
                                'negative_weight': (negative_weight, NEGATIVE_WEIGHT.rule)}, prefix)
  m_plus, m_minus = as_python(m_plus), as_python(m_minus)
  if not problems and all(isinstance(m, PYTHON_VALUES) for m in (m_plus, m_minus)) and m_minus >= m_plus:
    problems.append(f'{prefix}m_minus={m_minus!r}: allowed a value below m_plus={m_plus!r}')
  return problems


def _check_same_shape(what: str, first: str, a, second: str, b) -> None:
  """ValueError naming both arrays unless they have one shape (broadcasting would hide a
  mistake: labels [batch] against lengths [batch, classes] broadcast to nonsense or fail
  with no name)."""
  if tuple(a.shape) == tuple(b.shape):
    return
  hint = class_indices_hint(b, a.shape[-1]) if first == 'lengths' else ''
  raise ArgumentError(f'{what}: {second} {tuple(b.shape)} must have the shape of {first} {tuple(a.shape)}{hint}')


def class_indices_hint(given, num_classes: int) -> str:
  """' (class indices? one-hot them: …)' where `given`, in place of one-hot targets or a
  mask, is a [batch] of integers; else ''."""
  if len(given.shape) == 1 and jnp.issubdtype(given.dtype, jnp.integer):
    return f' (class indices? one-hot them: jax.nn.one_hot(labels, {num_classes}))'
  return ''


def margin_loss(lengths: Array, targets: Array, m_plus: float = 0.9, m_minus: float = 0.1,
                negative_weight: float = 0.5, reduction: str = 'sum', scale: Optional[Array] = None) -> Array:
  """Eq. 4: L_k = T_k max(0, m+ − |v_k|)² + λ (1 − T_k) max(0, |v_k| − m−)².

  reduction 'sum': summed over the classes k, as the paper says ("the total loss is simply
  the sum of the losses of all digit capsules"). 'official': as the authors' released code,
  0.5·L_k averaged over the classes, i.e. the sum / (2·classes): 20× lighter for 10 classes,
  which makes the reconstruction term relatively heavier. `scale` (a number or a traced
  scalar) replaces the reduction's factor on the sum: one vmapped program trains members
  of either reduction (`margin_reduction_scale`; a recipe ensemble's knob).
  lengths [batch, classes]; targets [batch, classes] in {0, 1}, any number of positives
  (two for MultiMNIST). Returns [batch].

  Example:
    >>> lengths = jnp.array([[0.95, 0.3]])   # [batch, classes]: class 0 present, class 1 absent
    >>> targets = jnp.array([[1.0, 0.0]])
    >>> loss = capsjax.margin_loss(lengths, targets)   # 0 + 0.5 · (0.3 − 0.1)²
    >>> loss.shape, round(float(loss[0]), 4)
    ((1,), 0.02)
  """
  if reduction not in MARGIN_REDUCTIONS:
    raise ArgumentError(f'margin reduction must be one of {MARGIN_REDUCTIONS}, got {reduction!r}')
  problems = margin_problems(m_plus, m_minus, negative_weight, prefix='margin_loss: ')
  if scale is not None:   # a number here; a traced scalar (a vmapped member's factor) passes
    problems += argument_problems({'scale': (scale, MARGIN_SCALE)}, prefix='margin_loss: ')
  if problems:   # the command's words, and its exception
    raise ConfigError(problems[0])
  if lengths.ndim != 2:   # a [classes] vector would sum to one number, not a loss per example
    raise ArgumentError(f'margin_loss takes lengths [batch, classes]; got shape {tuple(lengths.shape)}')
  _check_same_shape('margin_loss', 'lengths', lengths, 'targets', targets)   # [batch, classes]
  targets = targets.astype(lengths.dtype)
  present = targets * jnp.square(jax.nn.relu(m_plus - lengths))
  absent = negative_weight * (1.0 - targets) * jnp.square(jax.nn.relu(lengths - m_minus))
  per_class = present + absent                                   # [batch, classes]
  if scale is not None:
    return scale * jnp.sum(per_class, axis=-1)
  if reduction == 'official':
    return 0.5 * jnp.mean(per_class, axis=-1)
  return jnp.sum(per_class, axis=-1)


def margin_reduction_scale(reduction: str, num_classes: int) -> float:
  """The factor that turns the summed margin loss into `reduction`'s (1 for 'sum'; for
  'official' 0.5 × mean = sum / (2 · classes))."""
  if reduction not in MARGIN_REDUCTIONS:
    raise ArgumentError(f'margin reduction must be one of {MARGIN_REDUCTIONS}, got {reduction!r}')
  return 1.0 if reduction == 'sum' else 0.5 / num_classes


def reconstruction_loss(reconstructions: Array, images: Array) -> Array:
  """Sum of squared pixel differences per example (section 4.1), [batch, ...] → [batch].

  With one reconstruction per digit ([batch, k, h, w, c], MultiMNIST) the k digits'
  losses are summed.

  Example:
    >>> capsjax.reconstruction_loss(jnp.full((2, 28, 28, 1), 0.5), jnp.zeros((2, 28, 28, 1)))
    Array([196., 196.], dtype=float32)
  """
  _check_same_shape('reconstruction_loss', 'reconstructions', reconstructions, 'images', images)
  squared = jnp.square(reconstructions.astype(jnp.float32) - images.astype(jnp.float32))
  return jnp.sum(squared.reshape(squared.shape[0], -1), axis=-1)


def capsnet_loss(lengths: Array, targets: Array, reconstructions, images: Array,
                 reconstruction_weight: float = 0.0005, **margin_kwargs):
  """margin + reconstruction_weight × reconstruction; returns (per-example total, parts).

  lengths, targets [batch, classes]; reconstructions and images [batch, k, h, w, c] (k
  reconstructed digits per example) or reconstructions None (no decoder). Returns
  (total [batch], {'margin_loss': [batch], 'reconstruction_loss': [batch]}).

  Example:
    >>> total, parts = capsjax.capsnet_loss(
    ...     jnp.array([[0.95, 0.3]]), jnp.array([[1.0, 0.0]]),           # lengths, targets
    ...     jnp.full((1, 1, 28, 28, 1), 0.5), jnp.zeros((1, 1, 28, 28, 1)))   # [batch, k, h, w, c]
    >>> round(float(total[0]), 4), sorted(parts)                      # 0.02 + 0.0005 × 196
    (0.118, ['margin_loss', 'reconstruction_loss'])
  """
  problems = argument_problems({'reconstruction_weight': (reconstruction_weight, RECONSTRUCTION_WEIGHT.rule)},
                               'capsnet_loss: ')
  if problems:
    raise ConfigError(problems[0])
  margin = margin_loss(lengths, targets, **margin_kwargs)
  if reconstructions is None:
    recon = jnp.zeros_like(margin)
  else:
    recon = reconstruction_loss(reconstructions, images)
  return margin + reconstruction_weight * recon, {'margin_loss': margin, 'reconstruction_loss': recon}
