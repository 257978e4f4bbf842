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

from capsjax import losses
from capsjax.data.pipeline import make_pipelines
from capsjax.errors import CheckpointError, ConfigError, NaNLossError
from capsjax.models import build_model, capsule_lengths, count_params

State = Dict[str, Any]


# ----------------------------------------------------------------------------- setup

def _log(message: str) -> None:
  print(message, flush=True)


class MetricsWriter:
  """Appends one JSON object per line to workdir/metrics.jsonl."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, 'metrics.jsonl')

  def write(self, **record) -> None:
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


def init_state(config, model, optimizer) -> State:
  dummy = jnp.zeros((1,) + tuple(config.model.input_shape), jnp.float32)
  params = model.init(jax.random.key(config.seed), dummy)['params']
  return {'params': params, 'opt_state': optimizer.init(params), 'step': jnp.zeros((), jnp.int32)}


# ----------------------------------------------------------------------------- steps

def objective(config, model, params, batch, train: bool):
  """Per-example loss [batch] and class scores [batch, classes] for config.loss.name.

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
    if not train:
      lengths = capsule_lengths(model.apply(variables, images, method='encode'))
      return losses.margin_loss(lengths, targets, **margin_kwargs), lengths, {}
    per_label = labels if labels.ndim == 2 else labels[:, None]                 # [batch, k]
    reconstruction_targets = batch['digits'] if 'digits' in batch else images[:, None]  # [batch, k, h, w, c]
    outputs = model.apply(variables, images, jax.nn.one_hot(per_label, num_classes))
    total, parts = losses.capsnet_loss(
        outputs['lengths'], targets, outputs.get('reconstructions'), reconstruction_targets,
        loss_config.reconstruction_weight, **margin_kwargs)
    return total, outputs['lengths'], parts
  rngs = {'dropout': jax.random.fold_in(jax.random.key(config.seed), batch['step'])} if train else None
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


def make_train_step(config, model, optimizer, pipeline):
  base_key = jax.random.key(config.seed)

  def train_step(state: State, source, host_batch):
    step_key = jax.random.fold_in(base_key, state['step'])
    batch = pipeline.device_batch(source, host_batch, step_key)
    batch['step'] = state['step']

    def loss_fn(params):
      per_example, scores, parts = objective(config, model, params, batch, train=True)
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

  # The old state is dead after the step: donating it lets XLA update parameters in place.
  return jax.jit(train_step, donate_argnums=(0,))


def make_eval_step(config, model, pipeline):
  """Sums over one padded batch: correct examples, correct digits, loss, count."""

  def eval_step(params, source, host_batch, weights):
    batch = pipeline.device_batch(source, host_batch, None)
    per_example, scores, _ = objective(config, model, params, batch, train=False)
    correct, digits_correct = top_k_correct(scores, batch['labels'])
    return {'correct': jnp.sum(correct * weights), 'digits_correct': jnp.sum(digits_correct * weights),
            'loss': jnp.sum(per_example * weights), 'count': jnp.sum(weights)}

  return jax.jit(eval_step)


def evaluate(eval_step, params, pipeline, batch_size: int) -> Dict[str, float]:
  """Accuracy (all labels right), per-digit accuracy and mean loss over the test set."""
  totals = None
  for host_batch, weights in pipeline.eval_batches(batch_size):
    sums = eval_step(params, pipeline.source, host_batch, weights)
    totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
  totals = jax.device_get(totals)
  count = float(totals['count'])
  accuracy = float(totals['correct']) / count
  return {'accuracy': accuracy, 'error': 1.0 - accuracy,
          'digit_accuracy': float(totals['digits_correct']) / count,
          'loss': float(totals['loss']) / count}


# ----------------------------------------------------------------------------- checkpoints

def make_checkpoint_manager(config, workdir: str) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=config.keep_checkpoints, create=True)
  return ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), 'checkpoints'), options=options)


def save_checkpoint(manager: ocp.CheckpointManager, state: State) -> None:
  # A host copy first: the device buffers are donated to the next step while orbax writes.
  host_state = jax.tree.map(np.array, jax.device_get(state))
  manager.save(int(host_state['step']), args=ocp.args.StandardSave(host_state))


def restore_checkpoint(manager: ocp.CheckpointManager, state: State) -> State:
  """The latest checkpoint in the workdir, or `state` unchanged when there is none."""
  step = manager.latest_step()
  if step is None:
    return state
  abstract = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), jax.device_get(state))
  try:
    restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
  except Exception as e:  # orbax raises many types for unreadable / mismatched files.
    raise CheckpointError(
        f'cannot restore checkpoint step {step} in {manager.directory} '
        f'({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}); '
        f'it was left in place: move it away to start afresh') from None
  return jax.tree.map(jnp.asarray, restored)


def load_trained(workdir: str):
  """(config, model, params) of the run in `workdir`: its results.json config and latest checkpoint."""
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
  state = restore_checkpoint(manager, init_state(config, model, optimizer))
  manager.close()
  return config, model, state['params']


def check_losses(pending, manager) -> None:
  """Raises NaNLossError naming the first step whose loss (+ update norm) is not finite."""
  if not pending:
    return
  steps, values = zip(*pending)
  values = np.asarray(jax.device_get(list(values)), np.float64)
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

  `stop_at_step` ends this invocation early (after checkpointing), as a preemption would;
  calling again with the same workdir continues the same run.
  """
  os.makedirs(workdir, exist_ok=True)
  start_time = time.time()
  train, test = make_pipelines(config)
  num_steps = total_steps(config, train.num_examples)
  steps_per_epoch = train.num_examples // config.batch_size

  model = build_model(config.model)
  optimizer = make_optimizer(config)
  state = init_state(config, model, optimizer)
  num_params = count_params(state['params'])
  train_step = make_train_step(config, model, optimizer, train)
  eval_step = make_eval_step(config, model, test)

  manager = make_checkpoint_manager(config, workdir)
  state = restore_checkpoint(manager, state)
  first_step = int(state['step'])
  if first_step:
    _log(f'resumed from checkpoint at step {first_step}')
  metrics_writer = MetricsWriter(workdir)
  _log(f'{config.experiment}: {num_params:,} parameters, {train.num_examples} train / {test.num_examples} test '
       f'examples, {num_steps} steps of {config.batch_size} ({num_steps / steps_per_epoch:.2f} epochs)')

  last_step = num_steps if stop_at_step is None else min(num_steps, stop_at_step)
  unchecked_steps = []
  window_start, window_images = time.time(), 0
  train_metrics = None
  for step in range(first_step, last_step):
    state, train_metrics = train_step(state, train.source, train.host_batch(step))
    unchecked_steps.append((step, train_metrics['loss'] + train_metrics['update_norm']))
    window_images += config.batch_size
    done = step + 1
    is_last = done == last_step

    if done % config.log_every_steps == 0 or is_last:
      check_losses(unchecked_steps, manager)
      unchecked_steps = []
      host_metrics = {k: float(v) for k, v in jax.device_get(train_metrics).items()}
      elapsed = time.time() - window_start
      images_per_s = window_images / max(elapsed, 1e-9)
      eta = (num_steps - done) * config.batch_size / max(images_per_s, 1e-9)
      _log(f'step {done}/{num_steps} epoch {done / steps_per_epoch:.2f} | loss {host_metrics["loss"]:.4f} '
           f'| acc {host_metrics["accuracy"]:.3f} | {images_per_s:.1f} img/s | ETA {_format_duration(eta)}')
      metrics_writer.write(split='train', step=done, epoch=done / steps_per_epoch,
                           images_per_s=images_per_s, **host_metrics)
      window_start, window_images = time.time(), 0

    if (config.eval_every_steps and done % config.eval_every_steps == 0) or done == num_steps:
      eval_metrics = evaluate(eval_step, state['params'], test, config.eval_batch_size)
      _log(f'step {done} test: accuracy {eval_metrics["accuracy"]:.4f} error {100 * eval_metrics["error"]:.2f}%')
      metrics_writer.write(split='test', step=done, epoch=done / steps_per_epoch, **eval_metrics)
      window_start, window_images = time.time(), 0  # evaluation is not training throughput

    if done % config.checkpoint_every_steps == 0 or is_last:
      check_losses(unchecked_steps, manager)
      unchecked_steps = []
      save_checkpoint(manager, state)
  manager.wait_until_finished()
  manager.close()

  # --------------------------------------------------------------------------- results
  if last_step < num_steps:
    _log(f'stopped at step {last_step} of {num_steps}; run again to resume')
    return {'steps': last_step, 'completed': False}
  if train_metrics is None:  # resumed a finished run: evaluate the restored parameters
    eval_metrics = evaluate(eval_step, state['params'], test, config.eval_batch_size)
    final_train_loss = None
  else:
    final_train_loss = float(train_metrics['loss'])
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
      'wall_time_s': time.time() - start_time,
      'backend': jax.default_backend(),
      'completed': True,
      'config': config.to_dict(),
  }
  with open(os.path.join(workdir, 'results.json'), 'w') as f:
    json.dump(results, f, indent=2, default=str)
  _log(f'test accuracy {results["test_accuracy"]:.4f} (error {100 * results["test_error"]:.2f}%) '
       f'after {num_steps} steps; results in {os.path.join(workdir, "results.json")}')
  return results
