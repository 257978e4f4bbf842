"""The jitted computations of a run: state, the train step, evaluation, a member's traced
knobs (a run's or a vmapped ensemble's steps are put together as one `RunSteps` by
capsjax.experiment.build_program; the optimizer, its schedules and their config keys:
capsjax.optimization).

State is a plain pytree {'params', 'opt_state', 'step'}; the step's randomness is
`fold_in(key(seed), step)`, and the data order is a function of (seed, epoch), so a run
resumed from a checkpoint continues exactly as the uninterrupted run would have.
"""
import functools
from typing import Any, Dict

import jax
import jax.numpy as jnp
import numpy as np
import optax

from capsjax import sharding
from capsjax.optimization import SCHEDULES
from capsjax.objectives import non_finite, top_k_correct
from capsjax.routing import coupling_changes, routing_logit_changes

State = Dict[str, Any]


def initial_state(model, optimizer, input_shape, seed: int, member_seeds=None, ema: bool = False) -> State:
  """The fresh state of a run, or of every member of an ensemble (`member_seeds`) stacked
  on axis 0; with `ema`, an exponential moving average of the parameters beside them."""
  if member_seeds is None:   # compiled: op by op, the paper model's took 5x as long (docs/results.md)
    return jax.jit(lambda: init_state(model, optimizer, input_shape, seed, ema))()
  seeds = jnp.asarray(member_seeds, jnp.int32)
  return jax.jit(jax.vmap(lambda member_seed: init_state(model, optimizer, input_shape, member_seed, ema)))(seeds)


def init_state(model, optimizer, input_shape, seed, ema: bool = False) -> State:
  """Fresh state from `seed` (may be traced, for a vmapped ensemble). The average starts
  at the initial parameters."""
  dummy = jnp.zeros((1,) + tuple(input_shape), jnp.float32)
  params = model.init(jax.random.key(seed), dummy)['params']
  state = {'params': params, 'opt_state': optimizer.init(params), 'step': jnp.zeros((), jnp.int32)}
  if ema:
    state['ema_params'] = jax.tree.map(jnp.copy, params)
  return state


def ema_update(average, params, decay: float):
  """decay · average + (1 − decay) · params, leaf by leaf (config.ema_decay; big_vision keeps
  such an average and evaluates it beside the parameters)."""
  return jax.tree.map(lambda a, p: decay * a + (1.0 - decay) * p, average, params)


def train_step_fn(objective, model, optimizer, pipeline, seed: int, ema_decay: float = 0.0, member_optimizer=None):
  """The un-jitted step: (state, source, host_batch, knobs) → (state, metrics).
  `objective`: capsjax.objectives.make_objective's; `seed` the run's (an ensemble's
  members carry theirs in the knobs); a state with `ema_params` has them averaged with
  `ema_decay`. Recipe members (capsjax.ensembles) carry their learning rate schedule and
  weight decay (`member_optimizer`: knobs → optimizer), EMA decay and augmentation
  strengths in the knobs."""

  def train_step(state: State, source, host_batch, knobs=None):
    member_seed = seed if knobs is None else knobs['seed']
    step_key = jax.random.fold_in(jax.random.key(member_seed), state['step'])
    if knobs is not None and 'augment' in knobs:
      batch = pipeline.device_batch(source, host_batch, step_key, augmentation_strengths=knobs['augment'])
    else:
      batch = pipeline.device_batch(source, host_batch, step_key)
    # Its own stream: the step key already drew the batch's shifts (or placements).
    batch['dropout_key'] = jax.random.fold_in(step_key, 1)

    def loss_fn(params):
      per_example, scores, parts = objective(model, params, batch, True, knobs)
      return jnp.mean(per_example), (scores, parts)

    (loss, (scores, parts)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
    transform = optimizer if member_optimizer is None or knobs is None else member_optimizer(knobs)
    updates, opt_state = transform.update(grads, state['opt_state'], state['params'])
    params = optax.apply_updates(state['params'], updates)
    correct, _ = top_k_correct(scores, batch['labels'])
    metrics = {
        'loss': loss,
        'accuracy': jnp.mean(correct),
        # A finite loss can still come with a non-finite update (a NaN gradient); the
        # divergence check looks at both so that no non-finite parameters get saved.
        'update_norm': optax.tree.norm(updates),
        **{name: jnp.mean(value) for name, value in parts.items()},
    }
    new_state = {'params': params, 'opt_state': opt_state, 'step': state['step'] + 1}
    if 'ema_params' in state:
      decay = knobs['ema_decay'] if knobs is not None and 'ema_decay' in knobs else ema_decay
      new_state['ema_params'] = ema_update(state['ema_params'], params, decay)
    return new_state, metrics

  return train_step


def make_train_step(objective, model, optimizer, pipeline, seed: int, ensemble: bool = False, mesh=None,
                    ema_decay: float = 0.0, member_optimizer=None):
  """The jitted step; with `ensemble`, vmapped over a leading member axis of
  (state, host_batch, knobs), the data source shared. With `mesh`, state, source and
  knobs are replicated and the batch is split over the mesh's `data` axis (data
  parallelism: XLA inserts the gradient all-reduce)."""
  step = train_step_fn(objective, model, optimizer, pipeline, seed, ema_decay, member_optimizer)
  if ensemble:
    step = jax.vmap(step, in_axes=(0, None, 0, 0))
  shardings = {}
  if mesh is not None:
    replicated = sharding.replicated(mesh)
    batch = sharding.batch_sharding(mesh, leading_axes=1 if ensemble else 0)
    shardings = dict(in_shardings=(replicated, replicated, batch) + ((replicated,) if ensemble else ()),
                     out_shardings=(replicated, replicated))
  # The old state is dead after the step: donating it lets XLA update parameters in place.
  return jax.jit(step, donate_argnums=(0,), **shardings)


def make_eval_step(objective, model, pipeline, ensemble: bool = False, shift_averaging: int = 0, groups=(),
                   summed: bool = True):
  """Sums over one padded batch: correct examples, correct digits, loss, count; per member
  for an ensemble, plus (`summed`: members that differ by seed alone) `ensemble_correct`:
  the ensemble's prediction is the class with the largest score summed over the members
  (for CapsNets, the summed capsule lengths).
  With `shift_averaging` = s > 0 also `shift_correct` (and `shift_ensemble_correct`):
  the class scores averaged over the (2s + 1)² views of each image shifted by every
  (dy, dx) in [-s, s]² with zero fill (test-time augmentation; the choice of model never
  reads it). `groups` (an ensemble's recipes: tuples of member indices): also
  `group_ensemble_correct` [groups], each group's members' scores summed as one."""

  def member_outputs(params, batch, knobs):
    per_example, scores, _ = objective(model, params, batch, False, knobs)
    return per_example, scores

  def shift_averaged_scores(params, batch, knobs):
    # The views by static slices (a traced offset's dynamic slice inside the loop failed
    # XLA:CPU's code generation, jax 0.10.2), the model run on one view at a time
    # (lax.map): traced once, the memory of one evaluation batch.
    views = shifted_views(batch['images'], shift_averaging)                  # [views, batch, h, w, c]
    view_scores = lambda images: member_outputs(params, dict(batch, images=images), knobs)[1]
    return jnp.mean(jax.lax.map(view_scores, views), axis=0)                 # [batch, classes]

  def eval_step(params, source, host_batch, weights, knobs=None):
    batch = pipeline.device_batch(source, host_batch, None)
    labels = batch['labels']
    if not ensemble:
      per_example, scores = member_outputs(params, batch, knobs)            # [batch], [batch, classes]
      correct, digits_correct = top_k_correct(scores, labels)
      sums = {'correct': jnp.sum(correct * weights), 'digits_correct': jnp.sum(digits_correct * weights),
              'loss': jnp.sum(per_example * weights), 'count': jnp.sum(weights),
              'non_finite': jnp.sum(non_finite(scores) * weights)}
      if shift_averaging:
        shift_correct, _ = top_k_correct(shift_averaged_scores(params, batch, knobs), labels)
        sums['shift_correct'] = jnp.sum(shift_correct * weights)
      return sums
    # Every member sees the same test batch.            # [members, batch], [members, batch, classes]
    per_example, scores = jax.vmap(member_outputs, in_axes=(0, None, 0))(params, batch, knobs)
    correct, digits_correct = jax.vmap(top_k_correct, in_axes=(0, None))(scores, labels)
    members = scores.shape[0]
    sums = {'correct': jnp.sum(correct * weights, -1), 'digits_correct': jnp.sum(digits_correct * weights, -1),
            'loss': jnp.sum(per_example * weights, -1), 'count': jnp.full((members,), jnp.sum(weights)),
            'non_finite': jnp.sum(non_finite(scores) * weights, -1)}
    if summed:
      sums['ensemble_correct'] = jnp.sum(top_k_correct(jnp.sum(scores, axis=0), labels)[0] * weights)
    group_correct = lambda member_scores: jnp.stack([   # [groups]
        jnp.sum(top_k_correct(jnp.sum(member_scores[jnp.asarray(group)], axis=0), labels)[0] * weights)
        for group in groups])
    if groups:
      sums['group_ensemble_correct'] = group_correct(scores)
    if shift_averaging:                                  # [members, batch, classes]
      averaged = jax.vmap(shift_averaged_scores, in_axes=(0, None, 0))(params, batch, knobs)
      shift_correct, _ = jax.vmap(top_k_correct, in_axes=(0, None))(averaged, labels)
      sums['shift_correct'] = jnp.sum(shift_correct * weights, -1)
      if summed:
        sums['shift_ensemble_correct'] = jnp.sum(top_k_correct(jnp.sum(averaged, axis=0), labels)[0] * weights)
      if groups:
        sums['shift_group_ensemble_correct'] = group_correct(averaged)
    return sums

  return jax.jit(eval_step)   # shardings follow the (global) arguments


def shifted_views(images, max_shift: int):
  """Images [batch, h, w, c] → [(2s + 1)², batch, h, w, c]: the content moved by every
  (dy, dx) in [-s, s]², zero fill (dy-major)."""
  _, height, width, _ = images.shape
  padded = jnp.pad(images, ((0, 0), (max_shift, max_shift), (max_shift, max_shift), (0, 0)))
  return jnp.stack([padded[:, max_shift - dy:max_shift - dy + height, max_shift - dx:max_shift - dx + width]
                    for dy in range(-max_shift, max_shift + 1) for dx in range(-max_shift, max_shift + 1)])


def eval_batches(pipeline, batch_size: int, mesh):
  """The evaluation batches of `batch_size` examples; with `mesh`, each padded to a
  multiple of its devices (the padding weighs 0 in every sum: any batch size evaluates on
  any device count), global arrays of which this process read only its rows."""
  if mesh is None:
    yield from pipeline.eval_batches(batch_size)
    return
  padded = sharding.padded_batch_size(batch_size, mesh)
  for host_batch, weights in pipeline.eval_batches(batch_size, sharding.process_rows(padded), padded):
    yield sharding.global_batch(mesh, (host_batch, weights), padded)


class EvaluationInterrupted(Exception):
  """A stop request (SIGTERM, Ctrl-C) arrived during an evaluation: it ends there."""


def evaluate(eval_step, params, pipeline, batch_size: int, knobs=None, mesh=None,
             source=None, should_stop=None, on_batch=None) -> Dict[str, Any]:
  """Accuracy (all labels right), per-digit accuracy and mean loss over the test set:
  floats, or for an ensemble lists with one value per member. With `mesh`, every batch
  is split over the data axis (`source`: the pipeline's source, replicated). `on_batch(done,
  total, wait)`: called after each batch's dispatch (progress lines; `total` None where
  unknown; `wait()` blocks until the batches so far are computed)."""
  source = pipeline.source if source is None else source
  total = getattr(pipeline, 'num_examples', None)
  total = -(-total // batch_size) if total else None
  totals = None
  for done, (host_batch, weights) in enumerate(eval_batches(pipeline, batch_size, mesh), 1):
    if should_stop is not None and should_stop():   # between batches: acted on within a batch's time
      raise EvaluationInterrupted()
    sums = eval_step(params, source, host_batch, weights, knobs)
    totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    if on_batch is not None:   # (`wait`: the progress is of batches computed, not queued)
      on_batch(done, total, functools.partial(jax.block_until_ready, totals))
  totals = jax.tree.map(lambda x: np.asarray(x, np.float64), sharding.to_host(totals))
  count = totals['count']
  accuracy = totals['correct'] / count
  metrics = {'accuracy': accuracy, 'error': 1.0 - accuracy,
             'digit_accuracy': totals['digits_correct'] / count, 'loss': totals['loss'] / count}
  if np.any(totals.get('non_finite', 0)):   # NaN or infinite class scores: counted wrong, and named
    metrics['non_finite_examples'] = totals['non_finite']
  if 'ensemble_correct' in totals:   # the members' summed scores as one classifier
    metrics['ensemble_accuracy'] = totals['ensemble_correct'] / count[0]
    metrics['ensemble_error'] = 1.0 - metrics['ensemble_accuracy']
  if 'shift_correct' in totals:      # config.eval_shift_averaging: the shifted views' mean scores
    metrics['shift_averaged_error'] = 1.0 - totals['shift_correct'] / count
  if 'shift_ensemble_correct' in totals:
    metrics['shift_averaged_ensemble_error'] = 1.0 - totals['shift_ensemble_correct'] / count[0]
  if 'group_ensemble_correct' in totals:   # each recipe's seeds as one classifier
    metrics['recipe_ensemble_error'] = 1.0 - totals['group_ensemble_correct'] / count[0]
  if 'shift_group_ensemble_correct' in totals:
    metrics['shift_averaged_recipe_ensemble_error'] = 1.0 - totals['shift_group_ensemble_correct'] / count[0]
  return {name: value.tolist() for name, value in metrics.items()}


def make_routing_probe(model, pipeline, iterations: int, examples: int, batch_size: int):
  """Mean |Δb| and |Δc| per routing iteration on the first test examples (appendix A).

  Runs `iterations` iterations (which may exceed the model's own count, to see where
  routing settles) on the first `examples` images of the first test batch (of
  `batch_size`). For a single run of a model whose routing returns logits (the caller
  asks MODELS[...].routing_probe and ROUTINGS[...].returns_logits).
  """

  @jax.jit
  def changes(params, source, host_batch):
    images = pipeline.device_batch(source, host_batch, None)['images'][:examples]
    logits = model.apply({'params': params}, images, iterations, None, True, method='routed').logits
    return {'routing_logit_changes': routing_logit_changes(logits),        # [iterations]
            'coupling_changes': coupling_changes(logits)}                   # [iterations]

  def probe(params, mesh=None, source=None):
    host_batch, _ = next(eval_batches(pipeline, batch_size, mesh))
    source = pipeline.source if source is None else source
    return {k: v.tolist() for k, v in sharding.to_host(changes(params, source, host_batch)).items()}

  return probe


# ----------------------------------------------------------------------------- a run's steps

# A recipe member's fields that are numbers in the step (the rest: the schedule's and the
# reduction's names, turned into numbers by member_knobs; capsjax.ensembles).
SCHEDULE_FIELDS = ('learning_rate', 'lr_decay_rate', 'lr_decay_steps', 'lr_min', 'warmup_steps', 'weight_decay',
                   'ema_decay')


def member_knobs(members):
  """Stacked traced hyper-parameters [members] for the vmapped steps."""
  knobs = {'seed': jnp.asarray([m['seed'] for m in members], jnp.int32),
           'routing_iterations': jnp.asarray([m['routing_iterations'] for m in members], jnp.int32),
           'reconstruction_weight': jnp.asarray([m['reconstruction_weight'] for m in members], jnp.float32)}
  if 'recipe' not in members[0]:
    return knobs
  stacked = lambda field, dtype=jnp.float32: jnp.asarray([m[field] for m in members], dtype)
  knobs.update({field: stacked(field) for field in SCHEDULE_FIELDS})
  knobs['lr_schedule'] = jnp.asarray([SCHEDULES.index(m['lr_schedule']) for m in members], jnp.int32)
  knobs['lr_staircase'] = stacked('lr_staircase', jnp.bool_)
  knobs['margin_scale'] = stacked('margin_scale')
  if any(any(m['augment'].values()) for m in members):   # else the pipeline runs no augmentation
    knobs['augment'] = {key: jnp.asarray([m['augment'][key] for m in members], jnp.float32)
                        for key in members[0]['augment']}
  return knobs


def seeds_alone(members) -> bool:
  """Whether an ensemble's members differ by seed alone: only then are their summed scores
  one classifier worth reporting (an ablation's or a recipe program's members are compared,
  not pooled; a recipe's own seeds are: recipe_groups)."""
  rest = [{field: value for field, value in member.items() if field != 'seed'} for member in members or ()]
  return bool(rest) and all(other == rest[0] for other in rest)


def recipe_groups(members) -> tuple:
  """The member indices of each recipe, in the recipes' order (empty without recipes)."""
  if not members or 'recipe' not in members[0]:
    return ()
  names = list(dict.fromkeys(member['recipe'] for member in members))
  return tuple(tuple(k for k, member in enumerate(members) if member['recipe'] == name) for name in names)
