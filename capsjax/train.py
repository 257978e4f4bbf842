"""The one training loop: `train_and_evaluate(config, workdir)`.

Set-up (workdir, data, model, jitted steps, restored state), then
`for step: state, metrics = train_step(state, step)` followed by the hooks of
`capsjax.hooks` (divergence guard, progress, evaluation, early stop, preemption,
checkpoints), then results. A single run and a vmapped ensemble share this path: the
`RunSteps` below hides which one it is. Every device of every process trains
data-parallel on one `data` mesh (see capsjax.sharding); only process 0 writes files.
"""
import collections
import contextlib
import dataclasses
import functools
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import ml_collections
import numpy as np

from capsjax import assemble, console, formulations, memory, reports, runtime, sharding, sizing, steps
from capsjax import checkpoints as ckpt
from capsjax import hooks as hooks_lib
from capsjax import workdir as workdir_lib
from capsjax.data.pipeline import Pipeline
from capsjax.errors import CapsjaxError, CheckpointError, ConfigError, RunStopped
from capsjax.events import EventWriter
from capsjax.experiment import PROGRAMS, RunSettings
from capsjax.ensembles import member_knobs
from capsjax.models import count_params
from capsjax.runtime import StopRequests


@dataclasses.dataclass(frozen=True)
class RunResult:
  """A finished run: what every program composes runs from (an unfinished run raises
  capsjax.errors.RunStopped instead, so no program reads results that do not exist).
  Errors and accuracies are floats, or per-member lists for an ensemble; `results` is
  results.json as written (item access reads it: result['test_error']).

  Example:
    `result` from train_and_evaluate's example.

    >>> result['test_error'] == result.test_error, result.num_params > 0
    (True, True)
  """
  steps: int
  num_params: int
  test_error: Any
  test_accuracy: Any
  final_train_loss: Any
  wall_time_s: float
  stopped_early: bool
  members: Optional[List[Dict[str, Any]]]
  validation_error: Any
  selected_by_validation: Optional[Dict[str, Any]]
  results: Dict[str, Any]

  @classmethod
  def from_results(cls, results: Dict[str, Any]) -> 'RunResult':
    return cls(steps=results['steps'], num_params=results['num_params'], test_error=results['test_error'],
               test_accuracy=results['test_accuracy'], final_train_loss=results.get('final_train_loss'),
               wall_time_s=results.get('wall_time_s', 0.0), stopped_early=bool(results.get('stopped_early')),
               members=results.get('members'), validation_error=results.get('validation_error'),
               selected_by_validation=results.get('selected_by_validation'), results=results)

  def __getitem__(self, key: str) -> Any:
    return self.results[key]


def _log(message: str) -> None:
  if sharding.is_main_process():   # one console for a multi-host run
    print(message, flush=True)


@dataclasses.dataclass
class RunSteps:
  """The jitted train step and evaluation of one run or one vmapped ensemble (not an
  experiment program: those are capsjax.app.programs.PROGRAMS, which compose runs)."""
  # The jitted step and, for step n, its arguments (state, data source, global host batch
  # [, knobs]): apart so that a benchmark can lower, compile and time the very program.
  jitted_step: Callable[..., Any]
  step_arguments: Callable[[Any, int], tuple]
  evaluate: Callable[[Any], Dict[str, Any]]  # params → test metrics
  validate: Optional[Callable[[Any], Dict[str, Any]]]   # params → validation metrics
  evaluations: List[Any]               # capsjax.evaluators.Evaluation: config.evals that apply
  make_state: Callable[[], Any]        # the fresh state (allocated when first asked for)
  members: Optional[List[Dict[str, Any]]]
  # abstract state → {what: (estimated peak bytes per device, the setting that lowers it)}
  # (capsjax.memory): traced, nothing allocated
  memory_estimates: Optional[Callable[[Any], Dict[str, Tuple[int, str]]]] = None
  mesh: Optional[jax.sharding.Mesh] = None   # where the jitted step keeps the state (replicated)
  # abstract state → {'training': the train step lowered, 'evaluation': an evaluation batch
  # lowered} for the mesh's devices, nothing placed: what capsjax.app.plan compiles for a target
  lower: Optional[Callable[[Any], Dict[str, Any]]] = None

  @functools.cached_property
  def abstract_state(self):
    return jax.eval_shape(self.make_state)

  @functools.cached_property
  def initial_state(self):
    """The fresh state, replicated on the mesh as the jitted step returns it: placed
    otherwise (one device, uncommitted), the step's second call compiled it again
    (10 s for the zoo smoke's model, inside the zoo's first timed sample)."""
    return self.place(self.make_state())

  def place(self, state):
    """`state` (fresh, or restored from a checkpoint) replicated on the mesh, where the
    jitted step keeps it."""
    return state if self.mesh is None else sharding.replicate(sharding.to_host(state), self.mesh)

  def train_step(self, state, step: int):
    """(state, step) → (state, metrics); the state is donated."""
    return self.jitted_step(*self.step_arguments(state, step))


def recipe_groups(members) -> tuple:
  """The member indices of each recipe, in the recipes' order (empty without recipes)."""
  if not members or 'recipe' not in members[0]:
    return ()
  names = list(dict.fromkeys(member['recipe'] for member in members))
  return tuple(tuple(k for k, member in enumerate(members) if member['recipe'] == name) for name in names)


def build_program(config, model, train: Pipeline, test: Pipeline, mesh,
                  validation: Optional[Pipeline] = None) -> RunSteps:
  total_steps = assemble.total_steps(config, train.num_examples)
  optimizer = assemble.optimizer(config, total_steps)
  objective = assemble.objective(config)
  members = assemble.members(config)
  ensemble = members is not None
  knobs = sharding.replicate(member_knobs(members), mesh) if ensemble else None
  # Recipe members: each its own schedule, weight decay, EMA decay (capsjax.ensembles).
  per_member = steps.member_optimizer(config.optimizer, config.grad_clip_norm,
                                      total_steps) if ensemble and 'recipe' in members[0] else None
  train_step = steps.make_train_step(objective, model, optimizer, train, config.seed, ensemble, mesh,
                                     config.ema_decay, per_member)
  shifts = config.eval_shift_averaging
  groups = recipe_groups(members)
  eval_step = steps.make_eval_step(objective, model, test, ensemble, shifts, groups)
  train_source = sharding.replicate(train.source, mesh)
  test_source = sharding.replicate(test.source, mesh)
  rows = sharding.process_rows(config.batch_size)   # this process reads only these rows
  seeds = [member['seed'] for member in members] if ensemble else [None]

  def host_batch(step):
    parts = [train.host_batch(step, seed, rows) for seed in seeds]
    if not ensemble:
      return sharding.global_batch(mesh, parts[0], config.batch_size)
    stacked = tuple(np.stack(arrays) for arrays in zip(*parts))  # [members, rows, ...]
    return sharding.global_batch(mesh, stacked, config.batch_size, leading_axes=1)

  def step_arguments(state, step):
    return (state, train_source, host_batch(step)) + ((knobs,) if ensemble else ())

  def evaluate(params, should_stop=None):
    return steps.evaluate(eval_step, params, test, config.eval_batch_size, knobs, mesh, test_source, should_stop)

  validate = None
  if validation is not None:
    validation_step = steps.make_eval_step(objective, model, validation, ensemble, shifts, groups)
    validation_source = sharding.replicate(validation.source, mesh)
    validate = lambda params, should_stop=None: steps.evaluate(
        validation_step, params, validation, config.eval_batch_size, knobs, mesh, validation_source, should_stop)

  evaluations = assemble.evaluations(config, model, test, test_source, mesh, knobs)

  def memory_estimates(abstract_state):
    """Peak bytes per device of a training step and of an evaluation batch, from their
    traces: the batch-dependent part is split over the mesh's devices."""
    state_bytes = sum(memory.array_bytes(leaf) for leaf in jax.tree.leaves(abstract_state))
    per_device = lambda total: state_bytes + (total - state_bytes) // mesh.size
    host_batch, weights = next(steps.eval_batches(test, config.eval_batch_size, mesh))
    eval_args = (abstract_state['params'], test_source, host_batch, weights, knobs)
    return {f'training at batch_size={config.batch_size}': (
                per_device(memory.traced_peak_bytes(train_step, *step_arguments(abstract_state, 0))),
                'lower config.batch_size or the model\'s size'),
            f'evaluation at eval_batch_size={config.eval_batch_size}': (
                per_device(memory.traced_peak_bytes(eval_step, *eval_args)), 'lower config.eval_batch_size')}

  def lower(abstract_state):
    """The training step and an evaluation batch lowered as the run calls them (its
    shardings and donation), from shapes alone (on a compile-only mesh nothing is placed)."""
    state = sharding.replicate(abstract_state, mesh)
    host_batch, weights = next(steps.eval_batches(test, config.eval_batch_size, mesh))
    return {'training': train_step.lower(*step_arguments(state, 0)),
            'evaluation': eval_step.lower(state['params'], test_source, host_batch, weights, knobs)}

  return RunSteps(train_step, step_arguments, evaluate, validate, evaluations,
                 lambda: assemble.initial_state(config, model, optimizer), members,
                 memory_estimates, mesh, lower)


# Steps dispatched but not yet computed: enough to keep the device busy while the host
# prepares the next batch, few enough that a stop is acted on at once.
RUN_AHEAD_STEPS = 2


def default_hooks(settings: RunSettings, run: hooks_lib.Run, checkpoints, requests, multi_process: bool,
                  evaluations=(), validate=None, validation_rows=(), ensemble: bool = False):
  """(the hooks in order, the evaluator among them), wired through `run` (its divergence
  check and evaluation schedule). `validation_rows`: metrics.jsonl rows from before this
  invocation (a resumed run's best validation step keeps its checkpoint)."""
  guard = hooks_lib.DivergenceGuard(checkpoints)
  # Last in the order (it saves where anyone asked to stop), and first at evaluation steps.
  checkpointer = hooks_lib.Checkpointer(checkpoints, settings.checkpoint_every_steps,
                                        0.0 if multi_process else settings.checkpoint_every_secs)
  evaluator = hooks_lib.Evaluator(settings.eval_every_steps, evaluations, validate=validate,
                                  before=checkpointer.save_before_evaluation,
                                  should_stop=None if multi_process else (lambda: requests.raised))
  run.check = guard.check
  run.stop_requested_as = lambda: hooks_lib.stop_reason(requests.signal_name)
  run.evaluations_left = lambda step: evaluator.remaining(step, run.num_steps)
  hooks = [guard, hooks_lib.ProgressLogger(settings.log_every_steps, settings.log_every_seconds), evaluator]
  if validate is not None:
    hooks.append(hooks_lib.KeepBestCheckpoint(checkpoints, validation_rows))
  if settings.stop_at_test_accuracy and not ensemble:
    hooks.append(hooks_lib.EarlyStop(settings.stop_at_test_accuracy))
  hooks.append(hooks_lib.Preemption(requests, checkpoints, multi_process))
  hooks.append(checkpointer)
  return hooks, evaluator


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       stop_at_step: Optional[int] = None) -> RunResult:
  """Trains `config`'s model, evaluating periodically; resumes from workdir's checkpoint.

  Returns the finished run's RunResult. `stop_at_step` (or config.stop_at_step) ends this
  invocation early (after checkpointing), as a preemption would, by raising RunStopped;
  calling again with the same workdir continues the same run. SIGTERM or Ctrl-C (or, on
  several processes, JAX's preemption notice) does the same at the next step. The workdir
  gets config.json, metrics.jsonl, checkpoints and, at the end, results.json.

  Example:
    `mnist_dir`: a folder of the MNIST IDX files, else TFDS downloads MNIST; `workdir`: a new
    folder.

    >>> from capsjax.experiments import mnist_smoke
    >>> config = mnist_smoke.get_config()
    >>> config.data_dir = mnist_dir
    >>> config.num_steps, config.num_train_examples, config.num_test_examples = 12, 768, 256
    >>> config.evals.routing_diagnostics.enabled = False   # an evaluator: off, its programs go uncompiled
    >>> result = capsjax.train_and_evaluate(config, workdir)   # doctest: +ELLIPSIS
    mnist_smoke: reading the data...
    >>> result.steps, 0.0 <= result.test_error <= 1.0
    (12, True)
  """
  absolute = os.path.abspath(os.path.expanduser(workdir))
  created = not os.path.exists(absolute)
  previous = workdir_lib.read_results(absolute)
  newest = ckpt.newest_step_on_disk(os.path.join(absolute, 'checkpoints'))
  settings = RunSettings.of(config)
  run_status(absolute, settings.reevaluate, previous, newest)   # refuses before the workdir is touched
  workdir = workdir_lib.prepare(workdir)
  is_writer = sharding.is_main_process()
  if _answered_from_files(workdir, config, settings.reevaluate, previous, newest):   # no data read, nothing compiled
    return _complete(workdir, previous)
  try:
    _log(f'{settings.experiment}: reading the data ({config.dataset}) and tracing the model…')
    config = assemble.resolve_data(config)   # the data's shape and classes where the config leaves them open
    recorded = (workdir_lib.read_config(workdir).to_dict()
                if os.path.isfile(os.path.join(workdir, workdir_lib.CONFIG_FILE)) else None)
    config, chosen = assemble.choose_model(config, recorded)
    if chosen:
      _log(chosen)
    for line in formulations.slow_choices(config.model):   # an explicit choice measured slow here
      _log(line)
    with workdir_lib.Lock(workdir) if is_writer else contextlib.nullcontext():
      changed = workdir_lib.bind_config(workdir, config, settings.allow_config_change)
      if changed:
        _log(f'continuing {workdir} with a changed config: {"; ".join(changed)}')
      return _train(config, settings, workdir, stop_at_step or settings.stop_at_step or None, is_writer)
  except CapsjaxError:
    if created and is_writer:   # a start that failed leaves no workdir behind
      workdir_lib.discard_unbound(workdir)
    raise



PROGRAMS.register('train', train_and_evaluate)


def _train(config, settings: RunSettings, workdir: str, stop_at_step: Optional[int], is_writer: bool) -> RunResult:
  mesh = sharding.data_mesh()
  sharding.check_batch_size(config.batch_size, mesh)
  train, test, validation = assemble.splits(config)
  num_steps = assemble.total_steps(config, train.num_examples)
  if config.warmup_steps >= num_steps > 0:   # a length in epochs, known from the data
    raise ConfigError(f'config.warmup_steps={config.warmup_steps}: allowed below the run\'s {num_steps} steps '
                      f'({config.num_epochs} epochs of {train.num_examples} examples): the run would end inside '
                      'the warm-up, below the configured learning rate')
  model = assemble.model(config)
  program = build_program(config, model, train, test, mesh, validation)
  members = program.members
  num_params = count_params(program.abstract_state['params']) // (len(members) if members else 1)
  memory_estimates = program.memory_estimates(program.abstract_state)
  available = memory.available_bytes()
  if settings.check_memory:   # before the state is allocated or a step compiled
    memory.check_fits(memory_estimates, available)
  multi_process = jax.process_count() > 1

  with ckpt.Checkpoints(workdir, settings.keep_checkpoints) as checkpoints, \
       StopRequests(install=not multi_process) as requests:
    state, progress = checkpoints.restore_newest_intact(program.initial_state, _log)
    if state is not program.initial_state:   # restored (the fresh state is placed already)
      state = program.place(state)
    first_step = ckpt.step_of(state)
    previous = workdir_lib.read_results(workdir)
    # As restored: the newest checkpoint may have been unreadable and an older one taken.
    status = run_status(workdir, settings.reevaluate, previous, first_step, num_steps, restored=True)
    if status == 'finished':
      return _complete(workdir, previous)
    if status == 'reevaluate' and previous.get('stopped_early'):
      num_steps = first_step   # a run that stopped early is finished
    metrics_log = workdir_lib.MetricsLog(workdir, is_writer, EventWriter(workdir))
    metrics_log.truncate_after(first_step)   # rows after the checkpoint are trained again
    run = hooks_lib.Run(
        state=state, first_step=first_step,
        last_step=min(num_steps, stop_at_step or num_steps), num_steps=num_steps,
        steps_per_epoch=train.num_examples // config.batch_size, batch_size=config.batch_size,
        num_members=len(members) if members else None, metrics=metrics_log, log=_log,
        evaluate=program.evaluate, wall_time_before=progress.get('wall_time_s', 0.0),
        learning_rate=assemble.schedule(config, num_steps),
        eval_examples=test.num_examples + (validation.num_examples if validation is not None else 0))
    if first_step:
      _log(f'resumed from checkpoint at step {first_step}')
    _log(f'{settings.experiment}: {num_params:,} parameters, {train.num_examples} train / {test.num_examples} test '
         f'examples, {num_steps} steps of {config.batch_size} ({run.epoch(num_steps):.2f} epochs)'
         + (f', {len(members)} members in one vmapped program' if members else '')
         + f'; {describe_devices()}; {memory.describe(memory_estimates, available)}')
    hooks, evaluator = default_hooks(settings, run, checkpoints, requests, multi_process, program.evaluations,
                                     program.validate, metrics_log.read() if program.validate else (),
                                     ensemble=members is not None)
    if first_step < run.last_step:
      _log('compiling the training step…')

    train_metrics = None
    record_config = (lambda: workdir_lib.record_config(workdir, config)) if is_writer else (lambda: None)
    if first_step >= run.last_step:
      record_config()   # nothing to train: the restore has shown that the config fits
    in_flight = collections.deque()
    for step in range(first_step, run.last_step):
      # The first call compiles: XLA's slow-compile banners stay out of the run's output
      # (the first progress line says how long it took).
      with console.xla_alarms_dropped() if step == first_step else contextlib.nullcontext():
        run.state, train_metrics = program.train_step(run.state, step)
      # The host runs at most RUN_AHEAD_STEPS steps ahead of the device: a stop request
      # (Ctrl-C, SIGTERM) is acted on at the next step, not after a queue of them.
      in_flight.append(jax.tree.leaves(train_metrics)[0])
      if len(in_flight) > RUN_AHEAD_STEPS:
        jax.block_until_ready(in_flight.popleft())
      if step == first_step:   # data, model and checkpoint fit: now the config binds the workdir
        record_config()
        requests.arm()   # compiled: from here a Ctrl-C saves after the step
      for hook in hooks:
        hook(run, step + 1, train_metrics)
      if run.stop_reason:
        break
    for hook in hooks:
      hook.end(run)
    metrics_log.close()

  done = run.stopped_at or run.last_step
  if run.stop_reason == 'early':
    run.num_steps = done
  # (A stop request during the last evaluation leaves the run unevaluated: not complete.)
  if done < run.num_steps or (run.stop_reason in hooks_lib.SIGNAL_STOPS and run.last_eval_step != done):
    stopped = RunStopped(done, run.num_steps, run.stop_reason or 'stop_at_step')
    _log(str(stopped))
    raise stopped
  if run.last_eval_step != done:   # resumed a finished run: evaluate the restored parameters
    evaluator.record(run, done)
    if run.last_eval_step != done:   # a stop request ended that evaluation: nothing to report
      stopped = RunStopped(done, run.num_steps, run.stop_reason or 'interrupted')
      _log(str(stopped))
      raise stopped
  results = _results(config, run, train_metrics, previous, num_params, members,
                     train.num_examples, test.num_examples)
  if 'ensemble_error' in run.last_eval:
    results['ensemble_test_error'] = run.last_eval['ensemble_error']
  for name in ('shift_averaged_error', 'shift_averaged_ensemble_error', 'shift_averaged_recipe_ensemble_error'):
    if name in run.last_eval:   # config.eval_shift_averaging
      results[f'test_{name}'] = run.last_eval[name]
    if validation is not None and name in run.last_validation:
      results[f'validation_{name}'] = run.last_validation[name]
  if 'recipe_ensemble_error' in run.last_eval:   # each recipe's seeds summed as one classifier
    results['recipe_ensemble_test_error'] = run.last_eval['recipe_ensemble_error']
    if validation is not None:
      results['recipe_ensemble_validation_error'] = run.last_validation['recipe_ensemble_error']
  if members and 'recipe' in members[0]:   # beside the honest columns; never used to choose
    results['best_test_evaluation_error'] = reports.best_test_errors(metrics_log.read())
  if 'ema_error' in run.last_eval:   # the parameters' moving average, evaluated beside them
    results['ema_test_error'] = run.last_eval['ema_error']
  if validation is not None and 'ema_error' in run.last_validation:
    results['ema_validation_error'] = run.last_validation['ema_error']
  if validation is not None:
    results.update(validation_error=run.last_validation['error'],
                   num_validation_examples=validation.num_examples,
                   selected_by_validation=reports.select_by_validation(metrics_log.read()))
  if is_writer:
    workdir_lib.write_json(os.path.join(workdir, 'results.json'), results)
    with open(os.path.join(workdir, 'table.md'), 'w') as f:
      f.write(reports.results_table(results))
  _log(f'test {run.describe_test(run.last_eval)} after {run.num_steps} steps; '
       f'results in {os.path.join(workdir, "results.json")}')
  return RunResult.from_results(results)


def _results(config, run: hooks_lib.Run, train_metrics, previous: Dict[str, Any], num_params: int,
             members, num_train: int, num_test: int) -> Dict[str, Any]:
  """results.json of a finished run. `train_metrics` is None when this invocation trained
  nothing (a finished run evaluated again): the earlier invocation's values stand."""
  trained_now = train_metrics is not None
  return {
      'experiment': config.experiment,
      'dataset': config.dataset,
      'class_names': list(config.get('class_names') or ()),
      'test_accuracy': run.last_eval['accuracy'],
      'test_error': run.last_eval['error'],
      'test_digit_accuracy': run.last_eval['digit_accuracy'],
      'test_loss': run.last_eval['loss'],
      'num_params': num_params,
      'steps': run.num_steps,
      'epochs': run.epoch(run.num_steps),
      'num_train_examples': num_train,
      'num_test_examples': num_test,
      'final_train_loss': (np.asarray(train_metrics['loss']).tolist() if trained_now
                           else previous.get('final_train_loss')),
      # Training time over every invocation.
      'wall_time_s': run.wall_time() if trained_now else previous.get('wall_time_s', run.wall_time()),
      'backend': jax.default_backend(),
      'devices': {'count': jax.device_count(), 'kind': jax.devices()[0].device_kind,
                  'processes': jax.process_count()},
      'completed': True,
      'stopped_early': run.stop_reason == 'early' or bool(previous.get('stopped_early') and not trained_now),
      'members': members,
      # Over the seeds of each setting (members differing only in seed), sample std.
      'test_error_by_setting': [{k: g[k] for k in ('recipe', 'routing_iterations', 'reconstruction_weight', 'seeds',
                                                   'mean', 'std') if k in g}
                                for g in reports.seed_groups(members, run.last_eval['error'])] if members else None,
      'config': config.to_dict(),
  }


def _complete(workdir: str, results: Dict[str, Any]) -> RunResult:
  _log(f'{workdir} is complete ({results["steps"]} steps): results in {os.path.join(workdir, "results.json")}; '
       '--config.reevaluate=True evaluates it again')
  return RunResult.from_results(results)


def _reevaluation_refused(workdir: str, previous: Dict[str, Any], found: str) -> str:
  return (f'--config.reevaluate=True: {workdir} finished at step {previous.get("steps")} but {found}, so its '
          'final parameters cannot be evaluated again (training on would overwrite results.json); '
          'nothing was changed')


def run_status(workdir: str, reevaluate: bool, previous: Dict[str, Any], step: Optional[int],
               num_steps: Optional[int] = None, restored: bool = False) -> str:
  """What the run in `workdir` is: 'fresh' (no checkpoint), 'resume' (train on from `step`),
  'finished' (its results.json stands) or 'reevaluate' (finished, and `reevaluate`, the
  run's setting, asks for its final parameters to be evaluated again).

  `previous`: its results.json ({} if none); `step`: its newest checkpoint's step (None:
  none), on disk or as `restored`; `num_steps`: the run's length (None: the length it ran
  to). CheckpointError where re-evaluation is asked of a finished run whose final
  checkpoint is gone: training on from an older one would overwrite its results."""
  completed = bool(previous.get('completed'))
  at_final_step = completed and step == previous.get('steps')
  if reevaluate and completed and not at_final_step:
    found = (f'restored step {step}' if restored else 'it has no checkpoint' if step is None
             else f'its newest checkpoint is of step {step}')
    raise CheckpointError(_reevaluation_refused(workdir, previous, found))
  if at_final_step and (num_steps is None or step >= num_steps or previous.get('stopped_early')):
    return 'reevaluate' if reevaluate else 'finished'
  return 'resume' if step else 'fresh'


def _answered_from_files(workdir: str, config, reevaluate: bool, previous: Dict[str, Any],
                         newest: Optional[int]) -> bool:
  """Whether the run is finished for this same config (run_status, at the length this
  config gives) as its files say, so that nothing need be read or compiled. Keys the data
  fills in (an open model.input_shape / num_classes, class_names) are not compared."""
  if not previous.get('completed') or jax.process_count() > 1 or newest != previous.get('steps'):
    return False
  saved = workdir_lib.read_config(workdir).to_dict()
  open_keys = {key for key, is_open in (('model.input_shape', not tuple(config.model.get('input_shape', (1,)))),
                                         ('model.num_classes', config.model.get('num_classes') == 0),
                                         ('class_names', not tuple(config.get('class_names', ('',)))))
               if is_open} | {f'model.{key}' for key in sizing.open_keys(config.model)}
  if any(line.split(':')[0] not in open_keys for line in workdir_lib.config_differences(saved, config)):
    return False
  if not config.num_steps and 'num_train_examples' not in previous:
    return False
  length = assemble.total_steps(config, previous.get('num_train_examples', 0))
  return run_status(workdir, reevaluate, previous, newest, length) == 'finished'


def describe_devices() -> str:
  """'8 × TPU v4 devices (cpu backend), 2 processes'-style: what the run trains on."""
  processes = jax.process_count()
  return (f'{jax.device_count()} × {runtime.device_name()} ({jax.default_backend()})'
          + (f' over {processes} processes' if processes > 1 else ''))
