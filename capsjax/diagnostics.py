"""Routing diagnostics: what the critical literature asks of a routing, for any registered one.

At the evaluations of a CapsNet run (the `routing_diagnostics` evaluator, capsjax.evaluators;
`config.evals.routing_diagnostics`) on the first `examples` test images (0: the whole split):

- coupling entropy: per child, the entropy of its couplings over the parents divided by
  log(parents) (1 = uniform, 0 = all to one parent), its mean and standard deviation over
  children and images, from the couplings the last routing iteration used;
- coupling movement: per child, the total-variation distance between the couplings of
  the first and of the last iteration (0: routing changed nothing for this input; the
  dynamic-parse-tree question of Mitterreiter et al., AAAI 2023);
- per-class consistency: the mean cosine similarity of two images' couplings (their
  deviations from uniform, all children and parents as one vector) for pairs of the same
  class and for pairs of different classes, within each evaluation batch;
- capsule activity: the share of primary and of class capsules whose activation stays
  below 0.1 on every image evaluated (starved capsules, Everett et al. 2023, "Vanishing
  Activations"), and the mean activation per layer. A primary capsule's activation is its
  length; a class capsule's is what the routing reports as its presence: the length for
  the routings that code presence in it, the separate activation a_j for `em` and
  `variational_bayes` (whose poses are not squashed: their lengths say nothing of it);
- test-time iterations: accuracy with r = 1 … `iterations` routing
  iterations, as one vmapped evaluation, for an iterative routing.

A routing without couplings (ROUTINGS[name].returns_couplings False) reports the coupling
fields as None (absent, not zero); a non-iterative one has no iteration sweep. Every
function below but the probe is a pure function of arrays.
"""
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

from capsjax import sharding
from capsjax.routing import ROUTINGS

Array = jax.Array
# A capsule is inactive where its activation stays below this on every image (Everett et al.).
INACTIVE_ACTIVATION = 0.1
COUPLING_FIELDS = ('routing_coupling_entropy', 'routing_coupling_entropy_std', 'routing_coupling_movement',
                   'routing_consistency_same_class', 'routing_consistency_other_class')


def coupling_entropy(couplings: Array) -> Array:
  """Entropy of each child's couplings over the parents / log(parents): [batch, in, out]
  → [batch, in] in [0, 1] (1: uniform)."""
  out_caps = couplings.shape[-1]
  safe = jnp.clip(couplings, 1e-12, 1.0)
  entropy = -jnp.sum(jnp.where(couplings > 0, couplings * jnp.log(safe), 0.0), axis=-1)   # [batch, in]
  return entropy / jnp.log(out_caps)


def coupling_movement(first: Array, last: Array) -> Array:
  """Total-variation distance per child between two couplings [batch, in, out] → [batch, in]."""
  return 0.5 * jnp.sum(jnp.abs(last - first), axis=-1)


def consistency_sums(couplings: Array, labels: Array, weights: Array) -> Dict[str, Array]:
  """Sums and counts of the cosine similarity between the images' couplings (deviations from
  uniform, flattened) over pairs of distinct weighted images of the same and of different
  classes. couplings [batch, in, out], labels [batch] ints, weights [batch] (0: padding)."""
  batch, _, out_caps = couplings.shape
  deviation = (couplings - 1.0 / out_caps).reshape(batch, -1)                     # [batch, in*out]
  unit = deviation / jnp.maximum(jnp.linalg.norm(deviation, axis=-1, keepdims=True), 1e-12)
  cosine = unit @ unit.T                                                           # [batch, batch]
  pairs = weights[:, None] * weights[None, :] * (1.0 - jnp.eye(batch))             # distinct, real
  same = (labels[:, None] == labels[None, :]).astype(cosine.dtype)
  return {'same_sum': jnp.sum(cosine * pairs * same), 'same_count': jnp.sum(pairs * same),
          'other_sum': jnp.sum(cosine * pairs * (1 - same)), 'other_count': jnp.sum(pairs * (1 - same))}


def batch_sums(details: Dict[str, Any], labels: Optional[Array], weights: Array,
               sweep_activations: Optional[Array] = None) -> Dict[str, Array]:
  """What one evaluation batch adds to the diagnostics (see `summarize`). details: the
  model's `routing_details`; labels [batch] ints or None (multi-label: no consistency and
  no sweep); weights [batch]; sweep_activations [iterations, batch, classes] or None."""
  real = weights > 0
  primary, classes = details['primary_lengths'], details['activations']      # [batch, in], [batch, out]
  sums = {'count': jnp.sum(weights),
          'primary_activation_sum': jnp.sum(primary * weights[:, None]),
          'class_activation_sum': jnp.sum(classes * weights[:, None]),
          # The most each capsule got on a real image: inactive where < INACTIVE_ACTIVATION.
          'primary_max_activation': jnp.max(jnp.where(real[:, None], primary, 0.0), axis=0),   # [in]
          'class_max_activation': jnp.max(jnp.where(real[:, None], classes, 0.0), axis=0)}     # [out]
  if details['couplings'] is not None:
    first, last = details['couplings']
    entropy = coupling_entropy(last)                                               # [batch, in]
    child_weights = jnp.broadcast_to(weights[:, None], entropy.shape)
    sums.update(entropy_sum=jnp.sum(entropy * child_weights), entropy_square_sum=jnp.sum(entropy ** 2 * child_weights),
                movement_sum=jnp.sum(coupling_movement(first, last) * child_weights),
                child_count=jnp.sum(child_weights))
    if labels is not None:
      sums.update(consistency_sums(last, labels, weights))
  if sweep_activations is not None and labels is not None:
    correct = jnp.argmax(sweep_activations, axis=-1) == labels                     # [iterations, batch]
    sums['sweep_correct'] = jnp.sum(correct * weights, axis=-1)                    # [iterations]
  return sums


def summarize(totals: Dict[str, np.ndarray], has_couplings: bool) -> Dict[str, Any]:
  """Metrics (floats, a list for the sweep) from the summed `batch_sums` of one model."""
  count = float(totals['count'])
  metrics = {
      'primary_capsules_inactive': float(np.mean(totals['primary_max_activation'] < INACTIVE_ACTIVATION)),
      'class_capsules_inactive': float(np.mean(totals['class_max_activation'] < INACTIVE_ACTIVATION)),
      'primary_capsule_mean_activation': (float(totals['primary_activation_sum'])
                                          / (count * totals['primary_max_activation'].size)),
      'class_capsule_mean_activation': float(totals['class_activation_sum']) / (count * totals['class_max_activation'].size),
  }
  metrics.update({field: None for field in COUPLING_FIELDS})   # absent unless measured
  if has_couplings:
    children = float(totals['child_count'])
    mean = float(totals['entropy_sum']) / children
    metrics.update(routing_coupling_entropy=mean,
                   routing_coupling_entropy_std=float(np.sqrt(max(float(totals['entropy_square_sum']) / children
                                                                   - mean ** 2, 0.0))),
                   routing_coupling_movement=float(totals['movement_sum']) / children)
    if 'same_sum' in totals:
      ratio = lambda s, c: float(totals[s]) / float(totals[c]) if float(totals[c]) > 0 else None
      metrics.update(routing_consistency_same_class=ratio('same_sum', 'same_count'),
                     routing_consistency_other_class=ratio('other_sum', 'other_count'))
  if 'sweep_correct' in totals:
    metrics['accuracy_by_routing_iterations'] = (np.asarray(totals['sweep_correct'], np.float64) / count).tolist()
  return metrics


def make_routing_diagnostics(model, pipeline, examples: int, batch_size: int, sweep_iterations: int,
                             ensemble: bool = False):
  """probe(params, mesh=None, source=None, knobs=None) → the diagnostics as metrics fields
  (one value per member, as lists, for an ensemble). `examples`: the first test images
  evaluated (0: all); `sweep_iterations`: r = 1 … this at test time for an iterative
  routing (0: no sweep). For a CapsNet (its `routing_details` method)."""
  entry = ROUTINGS[model.routing]
  sweep = sweep_iterations if entry.iterative and sweep_iterations else 0
  bound = max(sweep, model.routing_iterations)

  def member_sums(params, images, labels, weights, iterations):
    details = model.apply({'params': params}, images, iterations, bound if iterations is not None else None,
                          method='routing_details')
    sweep_activations = None
    if sweep:
      classify = lambda r: model.apply({'params': params}, images, r, bound, method='classify')[1]
      sweep_activations = jax.vmap(classify)(jnp.arange(1, sweep + 1))             # [iterations, batch, out]
    return batch_sums(details, labels, weights, sweep_activations)

  @jax.jit
  def sums(params, source, host_batch, weights, knobs):
    batch = pipeline.device_batch(source, host_batch, None)
    labels = batch['labels'] if batch['labels'].ndim == 1 else None
    if not ensemble:
      return member_sums(params, batch['images'], labels, weights, None)
    return jax.vmap(member_sums, in_axes=(0, None, None, None, 0))(
        params, batch['images'], labels, weights, knobs['routing_iterations'])

  def probe(params, mesh=None, source=None, knobs=None):
    from capsjax.steps import eval_batches  # pylint: disable=g-import-not-at-top
    source = pipeline.source if source is None else source
    totals, seen = None, 0
    for host_batch, weights in eval_batches(pipeline, batch_size, mesh):
      batch_totals = sharding.to_host(sums(params, source, host_batch, weights, knobs))
      totals = batch_totals if totals is None else {
          k: np.maximum(totals[k], v) if k.endswith('max_activation') else totals[k] + v
          for k, v in batch_totals.items()}
      seen += batch_size
      if examples and seen >= examples:
        break
    totals = {k: np.asarray(v, np.float64) for k, v in totals.items()}
    if not ensemble:
      return summarize(totals, entry.returns_couplings)
    members = [summarize({k: v[m] for k, v in totals.items()}, entry.returns_couplings)
               for m in range(totals['count'].shape[0])]
    return {field: [member[field] for member in members] for field in members[0]}

  return probe
