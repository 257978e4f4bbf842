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
import os
from typing import Any, Dict, Optional

import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np

from capsjax import console, evaluators, memory, reports, runtime, sharding, stored_config, validation
from capsjax import checkpoints as ckpt
from capsjax import experiment as experiment_lib
from capsjax import hooks as hooks_lib
from capsjax import workdir as workdir_lib
from capsjax.errors import RunStopped
from capsjax.events import EventWriter
from capsjax.settings import PROGRAMS, TRAINING_LOOP, RunSettings
from capsjax.models import count_params
from capsjax.reports import RunResult
from capsjax.runtime import StopRequests


def _log(message: str) -> None:
  if sharding.is_main_process():   # one console for a multi-host run
    print(message, flush=True)


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
  evaluator = evaluators.Evaluator(settings.eval_every_steps, evaluations, validate=validate,
                                  before=checkpointer.save_before_evaluation,
                                  should_stop=None if multi_process else (lambda: requests.raised),
                                  every_seconds=settings.log_every_seconds)
  run.check = guard.check
  run.stop_requested_as = lambda: runtime.stop_reason(requests.signal_name)
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

  Returns the finished run's RunResult; a bad value raises capsjax.ConfigError (the command's
  line) before anything is read or written. `stop_at_step` (or config.stop_at_step) ends this
  invocation early (after checkpointing), as a preemption would, by raising RunStopped;
  calling again with the same workdir continues the same run, as SIGTERM or Ctrl-C (or JAX's
  preemption notice) do at the next step. The workdir gets config.json, metrics.jsonl,
  checkpoints and, at the end, results.json.

  Example (`mnist_dir`: a folder of the MNIST IDX files, else TFDS; `workdir`: a new folder):

    >>> from capsjax.experiments import mnist_smoke
    >>> config = mnist_smoke.get_config()
    >>> config.data_dir = mnist_dir
    >>> config.num_steps, config.num_train_examples, config.num_test_examples = 4, 256, 256
    >>> config.evals.routing_diagnostics.enabled = False   # an evaluator: off, its programs go uncompiled
    >>> result = capsjax.train_and_evaluate(config, workdir)   # doctest: +ELLIPSIS
    mnist_smoke: reading the data...
    >>> result.steps, 0.0 <= result.test_error <= 1.0
    (4, True)
  """
  workdir = validation.check_training_call(config, workdir, stop_at_step)   # before the workdir is touched
  absolute = os.path.abspath(os.path.expanduser(workdir))
  created = not os.path.exists(absolute)
  previous = workdir_lib.read_results(absolute)
  newest = ckpt.newest_step_on_disk(os.path.join(absolute, 'checkpoints'))
  settings = RunSettings.of(config)
  workdir_lib.run_status(absolute, settings.reevaluate, previous, newest)   # refuses before the workdir is touched
  workdir = workdir_lib.prepare(workdir)
  is_writer = sharding.is_main_process()
  if stored_config.answered_from_files(workdir, config, settings.reevaluate, previous, newest):   # no data read, nothing compiled
    return _complete(workdir, previous)
  try:
    _log(f'{settings.experiment}: reading the data ({config.dataset}) and tracing the model…')
    recorded = (stored_config.read_config(workdir).to_dict()
                if os.path.isfile(os.path.join(workdir, workdir_lib.CONFIG_FILE)) else None)
    with workdir_lib.Lock(workdir) if is_writer else contextlib.nullcontext():
      # Bound before the data is read: a resumed run whose config changed is refused at once.
      changed = stored_config.bind_config(workdir, config, settings.allow_config_change)
      if changed:
        _log(f'continuing {workdir} with a changed config: {"; ".join(changed)}')
      built = experiment_lib.start(config, sharding.data_mesh(), recorded=recorded, settings=settings)
      for line in filter(None, (built.model_choice,) + built.notes):   # what 'auto' chose; a slow formulation
        _log(line)
      return _train(built, workdir, stop_at_step or settings.stop_at_step or None, is_writer)
  except BaseException:   # a refusal, a bug's traceback, Ctrl-C before the first step
    if created and is_writer:   # a start that failed leaves no workdir behind (what it bound stays)
      workdir_lib.discard_unbound(workdir)
    raise


PROGRAMS.register(TRAINING_LOOP, train_and_evaluate)


def _train(built: experiment_lib.Experiment, workdir: str, stop_at_step: Optional[int],
           is_writer: bool) -> RunResult:
  """The loop over `built` (its config only recorded: config.json, results.json)."""
  settings, program, train, test, validation = built.settings, built.steps, built.train, built.test, built.validation
  num_steps = built.num_steps
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
    status = workdir_lib.run_status(workdir, settings.reevaluate, previous, first_step, num_steps, restored=True)
    if status == 'finished':
      return _complete(workdir, previous)
    if status == 'reevaluate' and previous.get('stopped_early'):
      num_steps = first_step   # a run that stopped early is finished
    metrics_log = workdir_lib.MetricsLog(workdir, is_writer, EventWriter(workdir))
    metrics_log.truncate_after(first_step)   # rows after the checkpoint are trained again
    run = hooks_lib.Run(
        state=state, first_step=first_step,
        last_step=min(num_steps, stop_at_step or num_steps), num_steps=num_steps,
        steps_per_epoch=train.num_examples // built.batch_size, batch_size=built.batch_size,
        num_members=len(members) if members else None, metrics=metrics_log, log=_log,
        evaluate=program.evaluate, wall_time_before=progress.get('wall_time_s', 0.0),
        learning_rate=None if built.learning_rate is None else jax.jit(built.learning_rate),   # op by op: 12 programs
        describe=lambda metrics: reports.describe_test(metrics, members is not None, built.labels_per_example),
        eval_examples=test.num_examples + (validation.num_examples if validation is not None else 0))
    if first_step:
      _log(f'resumed from checkpoint at step {first_step}')
    _log(f'{settings.experiment}: {num_params:,} parameters, {train.num_examples} train / {test.num_examples} test '
         f'examples, {num_steps} steps of {built.batch_size} ({run.epoch(num_steps):.2f} epochs)'
         + (f', {len(members)} members in one vmapped program' if members else '')
         + f'; {runtime.describe_devices()}; {memory.describe(memory_estimates, available)}')
    rows = metrics_log.read()
    hooks, evaluator = default_hooks(settings, run, checkpoints, requests, multi_process, program.evaluations,
                                     program.validate, rows if program.validate else (),
                                     ensemble=members is not None)
    if _evaluation_missing(rows, first_step, evaluator.due(first_step, num_steps) and first_step > 0):
      for hook in hooks:
        hook.resumed(run, first_step)
    if console.miscompile_guard and jax.default_backend() == 'cpu':
      _log(f'jaxlib {jax.lib.__version__} on a CPU: its YNNPACK reduce fusions, which can sum wrongly (JAX issue '
           f'39103), are off ({console.miscompile_guard} in XLA_FLAGS)')
    record_config = (lambda: stored_config.record_config(workdir, built.recorded)) if is_writer else (lambda: None)
    train_metrics = _steps(run, program.train_step, hooks, requests, record_config)
    for hook in hooks:
      hook.end(run)
    metrics_log.close()

  done = run.stopped_at or run.last_step
  if run.stop_reason == 'early':
    run.num_steps = done
  status = workdir_lib.end_status(done, run.num_steps, run.stop_reason, run.last_eval_step)
  if status == 'unevaluated':   # a finished run resumed: its restored parameters evaluated now
    evaluator.record(run, done)
    status = workdir_lib.end_status(done, run.num_steps, run.stop_reason, run.last_eval_step)
  if status == 'stopped':
    stopped = RunStopped(done, run.num_steps, run.stop_reason or 'stop_at_step')
    _log(str(stopped))
    raise stopped
  results = reports.run_results(run, built.recorded, train_metrics, previous, num_params, members,
                                (train.num_examples, test.num_examples,
                                 validation.num_examples if validation is not None else None), metrics_log.read())
  if is_writer:
    workdir_lib.write_json(os.path.join(workdir, 'results.json'), results)
    with open(os.path.join(workdir, 'table.md'), 'w') as f:
      f.write(reports.results_table(results))
  _log(f'test {run.describe(run.last_eval)} after {run.num_steps} steps; '
       f'results in {os.path.join(workdir, "results.json")}')
  return RunResult.from_results(results)


def _steps(run: hooks_lib.Run, train_step, hooks, requests: StopRequests, record_config) -> Any:
  """The training steps from run.first_step to run.last_step (none once a stop is asked),
  each followed by every hook; the last step's metrics (None: no step). The config is
  recorded once the first step has run (data, model and checkpoint fit) or at once when
  nothing is left to train."""
  first_step, train_metrics = run.first_step, None
  if first_step >= run.last_step:
    record_config()   # nothing to train: the restore has shown that the config fits
  elif not run.stop_reason:
    _log('compiling the training step…')
  in_flight = collections.deque()
  for step in range(first_step, run.last_step if not run.stop_reason else first_step):
    # The first call compiles: XLA's slow-compile banners stay out (the first progress line times it).
    with console.xla_alarms_dropped() if step == first_step else contextlib.nullcontext():
      run.state, train_metrics = train_step(run.state, step)
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
  return train_metrics


def _evaluation_missing(rows, step: int, due: bool) -> bool:
  """Whether the evaluation due at the restored `step` has no test row in metrics.jsonl (a
  stop request ended it). Every process takes process 0's answer: the evaluation is collective."""
  missing = due and not any(row.get('split') == 'test' and row.get('step') == step for row in rows)
  if jax.process_count() > 1:
    missing = bool(multihost_utils.broadcast_one_to_all(np.asarray(missing)))
  return missing


def _complete(workdir: str, results: Dict[str, Any]) -> RunResult:
  _log(f'{workdir} is complete ({results["steps"]} steps): results in {os.path.join(workdir, "results.json")}; '
       '--config.reevaluate=True evaluates it again')
  return RunResult.from_results(results)
