"""The one training loop: `train_and_evaluate(config, workdir)`.

Sections: setup · data · model and optimizer · steps · checkpoints · loop · results.
State is a plain pytree {'params', 'opt_state', 'step'}; the step's randomness is
`fold_in(key(seed), step)`, and the data order is a function of (seed, epoch), so a run
resumed from a checkpoint continues exactly as the uninterrupted run would have.
"""
import json
import math
import os
import time
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp

from capsjax import losses, sharding
from capsjax.data.pipeline import make_pipelines
from capsjax.errors import CheckpointError, ConfigError, NaNLossError
from capsjax.models import build_model, capsule_lengths, count_params
from capsjax.routing import coupling_changes, routing_logit_changes

State = Dict[str, Any]


# ----------------------------------------------------------------------------- setup

def _log(message: str) -> None:
  if sharding.is_main_process():   # one console for a multi-host run
    print(message, flush=True)


class MetricsWriter:
  """Appends one JSON object per line to workdir/metrics.jsonl (process 0 only)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, 'metrics.jsonl')

  def write(self, **record) -> None:
    if not sharding.is_main_process():
      return
    with open(self.path, 'a') as f:
      f.write(json.dumps(record) + '\n')


def _format_duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  hours, rest = divmod(seconds, 3600)
  return f'{hours}h{rest // 60:02d}m' if hours else f'{rest // 60}m{rest % 60:02d}s'


# ----------------------------------------------------------------------------- data

def labels_to_targets(labels: jax.Array, num_classes: int) -> jax.Array:
  """Integer labels [batch] or [batch, k] (k positives) → multi-hot targets [batch, classes]."""
  one_hot = jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)
  return one_hot if labels.ndim == 1 else jnp.clip(jnp.sum(one_hot, axis=1), 0.0, 1.0)


def total_steps(config, num_train_examples: int) -> int:
  if config.num_steps:
    return int(config.num_steps)
  return int(math.ceil(config.num_epochs * (num_train_examples // config.batch_size)))


# ----------------------------------------------------------------------------- model and optimizer

def make_optimizer(config) -> optax.GradientTransformation:
  schedule = optax.exponential_decay(
      init_value=config.learning_rate, transition_steps=config.lr_decay_steps,
      decay_rate=config.lr_decay_rate, staircase=config.lr_staircase)
  return optax.adam(schedule)


def initial_state(config, model, optimizer, members=None) -> State:
  """The fresh state of a run, or of every member of an ensemble stacked on axis 0."""
  if members is None:
    return init_state(config, model, optimizer)
  seeds = jnp.asarray([m['seed'] for m in members], jnp.int32)
  return jax.jit(jax.vmap(lambda seed: init_state(config, model, optimizer, seed)))(seeds)


def init_state(config, model, optimizer, seed=None) -> State:
  """Fresh state from `seed` (default config.seed; may be traced, for a vmapped ensemble)."""
  dummy = jnp.zeros((1,) + tuple(config.model.input_shape), jnp.float32)
  params = model.init(jax.random.key(config.seed if seed is None else seed), dummy)['params']
  return {'params': params, 'opt_state': optimizer.init(params), 'step': jnp.zeros((), jnp.int32)}


# ----------------------------------------------------------------------------- steps

def objective(config, model, params, batch, train: bool, knobs=None):
  """Per-example loss [batch] and class scores [batch, classes] for config.loss.name.

  `knobs` (see `member_knobs`) replaces config.seed, the routing iteration count and the
  reconstruction weight by traced values, so that one vmapped program trains an
  ensemble of configurations; None uses the config's own (static) values.

  'capsnet': in training, margin loss + weight × reconstruction loss, the decoder input
  masked by the true label(s): each label's capsule reconstructs its own digit when the
  batch has `digits` (MultiMNIST), else the image. In evaluation only the margin loss
  (the classification) is computed, so the decoder is not run.
  'sigmoid_xent' / 'softmax_xent': the CNN baselines' losses on logits.
  """
  loss_config = config.loss
  images, labels = batch['images'], batch['labels']
  num_classes = config.model.num_classes
  targets = labels_to_targets(labels, num_classes)
  variables = {'params': params}
  if loss_config.name == 'capsnet':
    margin_kwargs = dict(m_plus=loss_config.m_plus, m_minus=loss_config.m_minus,
                         negative_weight=loss_config.negative_weight)
    routing_kwargs, reconstruction_weight = {}, loss_config.reconstruction_weight
    if knobs is not None:
      # The model's own (static) count bounds the traced one; see dynamic_routing.
      routing_kwargs = dict(routing_iterations=knobs['routing_iterations'],
                            max_iterations=config.model.routing_iterations)
      reconstruction_weight = knobs['reconstruction_weight']
    if not train:
      lengths = capsule_lengths(model.apply(variables, images, method='encode', **routing_kwargs))
      return losses.margin_loss(lengths, targets, **margin_kwargs), lengths, {}
    per_label = labels if labels.ndim == 2 else labels[:, None]                 # [batch, k]
    reconstruction_targets = batch['digits'] if 'digits' in batch else images[:, None]  # [batch, k, h, w, c]
    outputs = model.apply(variables, images, jax.nn.one_hot(per_label, num_classes), **routing_kwargs)
    total, parts = losses.capsnet_loss(
        outputs['lengths'], targets, outputs.get('reconstructions'), reconstruction_targets,
        reconstruction_weight, **margin_kwargs)
    return total, outputs['lengths'], parts
  rngs = {'dropout': batch['dropout_key']} if train else None
  logits = model.apply(variables, images, train=train, rngs=rngs)['logits']
  if loss_config.name == 'sigmoid_xent':
    total = optax.sigmoid_binary_cross_entropy(logits, targets).sum(-1)
  elif loss_config.name == 'softmax_xent':
    total = optax.softmax_cross_entropy(logits, targets)
  else:
    raise ConfigError(f'unknown loss {loss_config.name!r}')
  return total, logits, {}


def top_k_correct(scores: jax.Array, labels: jax.Array):
  """(all labels among the k best scores [batch], fraction of labels found [batch]).

  k is the number of labels per example (1 for MNIST, 2 for MultiMNIST); with k = 1 the
  first is plain argmax accuracy.
  """
  labels = labels if labels.ndim == 2 else labels[:, None]
  _, predicted = jax.lax.top_k(scores, labels.shape[1])                   # [batch, k]
  found = jnp.any(labels[:, :, None] == predicted[:, None, :], axis=-1)   # [batch, k]
  return jnp.all(found, -1).astype(jnp.float32), jnp.mean(found.astype(jnp.float32), -1)


def train_step_fn(config, model, optimizer, pipeline):
  """The un-jitted step: (state, source, host_batch, knobs) → (state, metrics)."""

  def train_step(state: State, source, host_batch, knobs=None):
    seed = config.seed if knobs is None else knobs['seed']
    step_key = jax.random.fold_in(jax.random.key(seed), state['step'])
    batch = pipeline.device_batch(source, host_batch, step_key)
    # Its own stream: the step key already drew the batch's shifts (or placements).
    batch['dropout_key'] = jax.random.fold_in(step_key, 1)

    def loss_fn(params):
      per_example, scores, parts = objective(config, model, params, batch, train=True, knobs=knobs)
      return jnp.mean(per_example), (scores, parts)

    (loss, (scores, parts)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
    updates, opt_state = optimizer.update(grads, state['opt_state'], state['params'])
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
    return {'params': params, 'opt_state': opt_state, 'step': state['step'] + 1}, metrics

  return train_step


def make_train_step(config, model, optimizer, pipeline, ensemble: bool = False, mesh=None):
  """The jitted step; with `ensemble`, vmapped over a leading member axis of
  (state, host_batch, knobs), the data source shared. With `mesh`, state, source and
  knobs are replicated and the batch is split over the mesh's `data` axis (data
  parallelism: XLA inserts the gradient all-reduce)."""
  step = train_step_fn(config, model, optimizer, pipeline)
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


def make_eval_step(config, model, pipeline, ensemble: bool = False):
  """Sums over one padded batch: correct examples, correct digits, loss, count."""

  def eval_step(params, source, host_batch, weights, knobs=None):
    batch = pipeline.device_batch(source, host_batch, None)
    per_example, scores, _ = objective(config, model, params, batch, train=False, knobs=knobs)
    correct, digits_correct = top_k_correct(scores, batch['labels'])
    return {'correct': jnp.sum(correct * weights), 'digits_correct': jnp.sum(digits_correct * weights),
            'loss': jnp.sum(per_example * weights), 'count': jnp.sum(weights)}

  if ensemble:  # every member sees the same test batch
    eval_step = jax.vmap(eval_step, in_axes=(0, None, None, None, 0))
  return jax.jit(eval_step)   # shardings follow the (global) arguments


def _eval_batches(pipeline, batch_size: int, mesh):
  for host_batch, weights in pipeline.eval_batches(batch_size):
    if mesh is not None:
      host_batch, weights = sharding.global_batch(mesh, (host_batch, weights))
    yield host_batch, weights


def evaluate(eval_step, params, pipeline, batch_size: int, knobs=None, mesh=None,
             source=None) -> Dict[str, Any]:
  """Accuracy (all labels right), per-digit accuracy and mean loss over the test set:
  floats, or for an ensemble lists with one value per member. With `mesh`, every batch
  is split over the data axis (`source`: the pipeline's source, replicated)."""
  source = pipeline.source if source is None else source
  totals = None
  for host_batch, weights in _eval_batches(pipeline, batch_size, mesh):
    sums = eval_step(params, source, host_batch, weights, knobs)
    totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
  totals = jax.tree.map(lambda x: np.asarray(x, np.float64), sharding.to_host(totals))
  count = totals['count']
  accuracy = totals['correct'] / count
  metrics = {'accuracy': accuracy, 'error': 1.0 - accuracy,
             'digit_accuracy': totals['digits_correct'] / count, 'loss': totals['loss'] / count}
  return {name: value.tolist() for name, value in metrics.items()}


def make_routing_probe(config, model, pipeline):
  """Mean |Δb| and |Δc| per routing iteration on the first test examples (appendix A), or None.

  Runs config.routing_probe_iterations iterations (which may exceed the model's own
  count, to see where routing settles) on the first `routing_probe_examples` images of
  the first test batch. Single CapsNet runs only.
  """
  iterations = config.get('routing_probe_iterations', 0)
  if not iterations or config.loss.name != 'capsnet' or config.get('ensemble'):
    return None
  examples = config.get('routing_probe_examples', 100)

  @jax.jit
  def changes(params, source, host_batch):
    images = pipeline.device_batch(source, host_batch, None)['images'][:examples]
    _, logits = model.apply({'params': params}, images, iterations, None, True, method='encode')
    return {'routing_logit_changes': routing_logit_changes(logits),        # [iterations]
            'coupling_changes': coupling_changes(logits)}                   # [iterations]

  def probe(params, mesh=None, source=None):
    host_batch, _ = next(_eval_batches(pipeline, config.eval_batch_size, mesh))
    source = pipeline.source if source is None else source
    return {k: v.tolist() for k, v in sharding.to_host(changes(params, source, host_batch)).items()}

  return probe


# ----------------------------------------------------------------------------- ensembles

def ensemble_members(config):
  """The members of config.ensemble as dicts (seed, routing_iterations,
  reconstruction_weight), or None for a single run.

  config.ensemble holds tuples `seeds`, `routing_iterations`, `reconstruction_weights`;
  the members are their product (an empty tuple = the config's own value).
  """
  spec = config.get('ensemble')
  if not spec:
    return None
  seeds = tuple(spec.get('seeds') or (config.seed,))
  is_capsnet = config.loss.name == 'capsnet'
  iterations = tuple(spec.get('routing_iterations') or ()) or (
      (config.model.routing_iterations,) if is_capsnet else (0,))
  weights = tuple(spec.get('reconstruction_weights') or ()) or (
      (config.loss.reconstruction_weight,) if is_capsnet else (0.0,))
  if is_capsnet and max(iterations) > config.model.routing_iterations:
    raise ConfigError(f'ensemble routing_iterations {iterations} exceed the model bound '
                      f'model.routing_iterations={config.model.routing_iterations}')
  return [dict(seed=int(s), routing_iterations=int(r), reconstruction_weight=float(w))
          for r in iterations for w in weights for s in seeds]


def member_config(config, member) -> ml_collections.ConfigDict:
  """The stand-alone config that trains exactly like `member` of config's ensemble."""
  single = ml_collections.ConfigDict(config.to_dict())
  single.ensemble = None
  single.seed = member['seed']
  if single.loss.name == 'capsnet':
    single.model.routing_iterations = member['routing_iterations']
    single.loss.reconstruction_weight = member['reconstruction_weight']
  return single


def with_model_of(config, key: str) -> ml_collections.ConfigDict:
  """config with the model and loss of config[key] (a comparison model such as a CNN
  baseline): the same data, optimiser and schedule; experiment named EXPERIMENT_KEY."""
  derived = ml_collections.ConfigDict(config.to_dict())
  derived.experiment = f'{config.experiment}_{key}'
  derived.model = ml_collections.ConfigDict(config[key].model.to_dict())
  derived.loss = ml_collections.ConfigDict(config[key].loss.to_dict())
  return derived


def member_knobs(members):
  """Stacked traced hyper-parameters [members] for the vmapped steps."""
  return {'seed': jnp.asarray([m['seed'] for m in members], jnp.int32),
          'routing_iterations': jnp.asarray([m['routing_iterations'] for m in members], jnp.int32),
          'reconstruction_weight': jnp.asarray([m['reconstruction_weight'] for m in members], jnp.float32)}


# ----------------------------------------------------------------------------- checkpoints

def step_of(state: State) -> int:
  """The step count of a state (an ensemble's members all share it)."""
  return int(np.asarray(sharding.to_host(state['step'])).reshape(-1)[0])


def make_checkpoint_manager(config, workdir: str) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=config.keep_checkpoints, create=True)
  return ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), 'checkpoints'), options=options)


def save_checkpoint(manager: ocp.CheckpointManager, state: State) -> None:
  # A host copy first: the device buffers are donated to the next step while orbax writes.
  host_state = jax.tree.map(np.array, sharding.to_host(state))
  manager.save(step_of(host_state), args=ocp.args.StandardSave(host_state))


def restore_checkpoint(manager: ocp.CheckpointManager, state: State) -> State:
  """The latest checkpoint in the workdir, or `state` unchanged when there is none."""
  step = manager.latest_step()
  if step is None:
    return state
  abstract = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), sharding.to_host(state))
  try:
    restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
  except Exception as e:  # orbax raises many types for unreadable / mismatched files.
    raise CheckpointError(
        f'cannot restore checkpoint step {step} in {manager.directory} '
        f'({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}); '
        f'it was left in place: move it away to start afresh') from None
  return jax.tree.map(jnp.asarray, restored)


def load_trained(workdir: str):
  """(config, model, params) of the run in `workdir`: its results.json config and latest
  checkpoint (an ensemble's params carry a leading member axis)."""
  path = os.path.join(workdir, 'results.json')
  if not os.path.isfile(path):
    raise CheckpointError(f'no results.json in {workdir}: train there first')
  with open(path) as f:
    config = ml_collections.ConfigDict(json.load(f)['config'])
  model = build_model(config.model)
  optimizer = make_optimizer(config)
  manager = make_checkpoint_manager(config, workdir)
  if manager.latest_step() is None:
    raise CheckpointError(f'no checkpoint in {manager.directory}')
  state = restore_checkpoint(manager, initial_state(config, model, optimizer, ensemble_members(config)))
  manager.close()
  return config, model, state['params']


def _previous_results(workdir: str) -> Dict[str, Any]:
  path = os.path.join(workdir, 'results.json')
  if not os.path.isfile(path):
    return {}
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def check_losses(pending, manager) -> None:
  """Raises NaNLossError naming the first step whose loss (+ update norm) is not finite."""
  if not pending:
    return
  steps, values = zip(*pending)
  values = np.asarray(sharding.to_host(list(values)), np.float64)
  bad = np.flatnonzero(~np.isfinite(values))
  if bad.size:
    manager.wait_until_finished()
    last = manager.latest_step()
    kept = f'last good checkpoint: step {last} in {manager.directory}' if last is not None else 'no checkpoint was written yet'
    raise NaNLossError(f'training diverged: non-finite loss or update at step {steps[bad[0]]}; '
                       f'stopped ({kept})')


# ----------------------------------------------------------------------------- loop

def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       stop_at_step: Optional[int] = None) -> Dict[str, Any]:
  """Trains `config`'s model, evaluating periodically; resumes from workdir's checkpoint.

  `stop_at_step` (or config.stop_at_step) ends this invocation early (after
  checkpointing), as a preemption would; calling again with the same workdir continues
  the same run. A SIGTERM (or, on several processes, JAX's preemption notice) does the
  same at the next step. Every device of every process trains data-parallel on one
  `data` mesh (see capsjax.sharding); only process 0 writes files.
  """
  os.makedirs(workdir, exist_ok=True)
  start_time = time.time()
  stop_at_step = stop_at_step or config.get('stop_at_step', 0) or None
  mesh = sharding.data_mesh()
  sharding.check_batch_size(config.batch_size, mesh)
  sharding.check_batch_size(config.eval_batch_size, mesh, 'eval_batch_size')
  train, test = make_pipelines(config)
  num_steps = total_steps(config, train.num_examples)
  steps_per_epoch = train.num_examples // config.batch_size

  model = build_model(config.model)
  optimizer = make_optimizer(config)
  members = ensemble_members(config)
  ensemble = members is not None
  knobs = sharding.replicate(member_knobs(members), mesh) if ensemble else None
  state = initial_state(config, model, optimizer, members)
  num_params = count_params(state['params']) // (len(members) if ensemble else 1)
  train_step = make_train_step(config, model, optimizer, train, ensemble, mesh)
  eval_step = make_eval_step(config, model, test, ensemble)
  routing_probe = make_routing_probe(config, model, test)
  train_source = sharding.replicate(train.source, mesh)
  test_source = sharding.replicate(test.source, mesh)

  rows = sharding.process_rows(config.batch_size)   # this process reads only these rows

  def host_batch(step):
    if not ensemble:
      return sharding.global_batch(mesh, train.host_batch(step, rows=rows), global_size=config.batch_size)
    parts = [train.host_batch(step, member['seed'], rows) for member in members]
    stacked = tuple(np.stack(arrays) for arrays in zip(*parts))  # [members, rows, ...]
    return sharding.global_batch(mesh, stacked, leading_axes=1, global_size=config.batch_size)

  def run_eval():
    return evaluate(eval_step, state['params'], test, config.eval_batch_size, knobs, mesh, test_source)

  def describe(values):
    return ' '.join(f'{v:.4f}' for v in values) if ensemble else f'{values:.4f}'

  def describe_test(accuracy, error):
    if ensemble:
      return f'accuracy per member {describe(accuracy)}'
    return f'accuracy {accuracy:.4f} (error {100 * error:.2f}%)'

  manager = make_checkpoint_manager(config, workdir)
  state = sharding.replicate(sharding.to_host(restore_checkpoint(manager, state)), mesh)
  first_step = step_of(state)
  if first_step:
    _log(f'resumed from checkpoint at step {first_step}')
  metrics_writer = MetricsWriter(workdir)
  _log(f'{config.experiment}: {num_params:,} parameters, {train.num_examples} train / {test.num_examples} test '
       f'examples, {num_steps} steps of {config.batch_size} ({num_steps / steps_per_epoch:.2f} epochs)'
       + (f', {len(members)} members in one vmapped program' if ensemble else ''))

  last_step = num_steps if stop_at_step is None else min(num_steps, stop_at_step)
  # Early stopping (config.stop_at_test_accuracy > 0, single runs): the run is complete at
  # the first evaluation that reaches the target; a finished run stays finished.
  target_accuracy = 0.0 if ensemble else config.get('stop_at_test_accuracy', 0.0)
  previous = _previous_results(workdir)
  stopped_early = bool(target_accuracy and previous.get('stopped_early') and previous.get('steps') == first_step)
  if stopped_early:
    last_step = num_steps = first_step
  unchecked_steps = []
  window_start, window_images = time.time(), 0
  train_metrics = None
  # A SIGTERM on one process is noticed at the next step; on several processes JAX's
  # preemption service makes every process stop at the same step.
  multi_process = jax.process_count() > 1
  # (JAX's own SIGTERM handler serves the multi-process case; ours must not replace it.)
  preemption = sharding.PreemptionFlag(install=not multi_process)

  def preempted(step: int) -> bool:
    return manager.reached_preemption(step) if multi_process else preemption.raised

  def checked_save():
    # Never save parameters from after a non-finite loss: check the pending steps first.
    nonlocal unchecked_steps
    check_losses(unchecked_steps, manager)
    unchecked_steps = []
    save_checkpoint(manager, state)

  with preemption:
    for step in range(first_step, last_step):
      if ensemble:
        state, train_metrics = train_step(state, train_source, host_batch(step), knobs)
      else:
        state, train_metrics = train_step(state, train_source, host_batch(step))
      unchecked_steps.append((step, jnp.sum(train_metrics['loss'] + train_metrics['update_norm'])))
      window_images += config.batch_size
      done = step + 1
      is_last = done == last_step

      if done % config.log_every_steps == 0 or is_last:
        check_losses(unchecked_steps, manager)
        unchecked_steps = []
        host_metrics = {k: np.asarray(v).tolist() for k, v in sharding.to_host(train_metrics).items()}
        elapsed = time.time() - window_start
        images_per_s = window_images / max(elapsed, 1e-9)  # per member for an ensemble
        eta = (num_steps - done) * config.batch_size / max(images_per_s, 1e-9)
        _log(f'step {done}/{num_steps} epoch {done / steps_per_epoch:.2f} | loss {describe(host_metrics["loss"])} '
             f'| acc {np.mean(host_metrics["accuracy"]):.3f} | {images_per_s:.1f} img/s | ETA {_format_duration(eta)}')
        metrics_writer.write(split='train', step=done, epoch=done / steps_per_epoch,
                             images_per_s=images_per_s, **host_metrics)
        window_start, window_images = time.time(), 0

      if (config.eval_every_steps and done % config.eval_every_steps == 0) or done == num_steps:
        eval_metrics = run_eval()
        if routing_probe is not None:
          eval_metrics.update(routing_probe(state['params'], mesh, test_source))
        _log(f'step {done} test: {describe_test(eval_metrics["accuracy"], eval_metrics["error"])}')
        metrics_writer.write(split='test', step=done, epoch=done / steps_per_epoch, **eval_metrics)
        window_start, window_images = time.time(), 0  # evaluation is not training throughput
        reached_target = (target_accuracy and eval_metrics['accuracy'] >= target_accuracy
                          and done < num_steps)
      else:
        reached_target = False

      saved = done % config.checkpoint_every_steps == 0 or is_last or reached_target
      if saved:
        checked_save()
      if reached_target:
        _log(f'test accuracy reached {target_accuracy} at step {done}: stopping early')
        stopped_early = True
        last_step = num_steps = done
        break
      if not is_last and preempted(done):
        if not saved:
          checked_save()
        _log(f'preempted at step {done}: checkpoint saved')
        last_step = done
        break
  manager.wait_until_finished()
  manager.close()

  # --------------------------------------------------------------------------- results
  if last_step < num_steps:
    _log(f'stopped at step {last_step} of {num_steps}; run again to resume')
    return {'steps': last_step, 'completed': False}
  if train_metrics is None:  # resumed a finished run: evaluate the restored parameters
    eval_metrics = run_eval()
    final_train_loss = previous.get('final_train_loss')
  else:
    final_train_loss = np.asarray(train_metrics['loss']).tolist()
  results = {
      'experiment': config.experiment,
      'test_accuracy': eval_metrics['accuracy'],
      'test_error': eval_metrics['error'],
      'test_digit_accuracy': eval_metrics['digit_accuracy'],
      'test_loss': eval_metrics['loss'],
      'num_params': num_params,
      'steps': num_steps,
      'epochs': num_steps / steps_per_epoch,
      'num_train_examples': train.num_examples,
      'num_test_examples': test.num_examples,
      'final_train_loss': final_train_loss,
      # A finished run evaluated again keeps the wall time of its training.
      'wall_time_s': (previous.get('wall_time_s') if train_metrics is None and previous.get('completed')
                      else None) or time.time() - start_time,
      'backend': jax.default_backend(),
      'completed': True,
      'stopped_early': stopped_early,
      'members': members,
      'config': config.to_dict(),
  }
  if sharding.is_main_process():
    with open(os.path.join(workdir, 'results.json'), 'w') as f:
      json.dump(results, f, indent=2, default=str)
  _log(f'test {describe_test(results["test_accuracy"], results["test_error"])} after {num_steps} steps; '
       f'results in {os.path.join(workdir, "results.json")}')
  return results
