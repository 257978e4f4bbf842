"""The concerns of the training loop, one small object each (after flax's periodic actions
and big_vision's evaluators).

The loop calls every hook after every step as `hook(run, step, metrics)` (`step`: the
steps done so far, `metrics`: the step's device metrics) and `hook.end(run)` once after
the last step. A hook stops the run with `run.request_stop(reason)` or by raising a
CapsjaxError. Order matters and is fixed by `train.default_hooks`: the divergence guard
first, the checkpointer last (it saves at the step where anyone asked to stop).

Hooks hold no references to each other: what one needs of another goes through the Run
(`run.check()`: the divergence check before any output or save; `run.evaluations_left`,
`run.last_eval_seconds`, `run.eval_seconds_total`: the evaluation schedule and its cost,
for the ETA and the throughput window), wired by train.default_hooks. The hook that
evaluates, `Evaluator`, is capsjax.evaluators', beside the evaluations it runs.
"""
import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from capsjax import console, reports, sharding
from capsjax.checkpoints import Checkpoints
from capsjax.errors import NaNLossError
from capsjax.runtime import SIGNAL_STOPS, StopRequests, stop_reason


@dataclasses.dataclass
class Run:
  """What the hooks see of a run. `state` is the current (device) training state."""
  state: Any
  first_step: int
  last_step: int                  # this invocation ends here (a stop_at_step or the end)
  num_steps: int                  # the whole run's length
  steps_per_epoch: int
  batch_size: int
  num_members: Optional[int]      # None for a single run
  metrics: Any                    # capsjax.workdir.MetricsLog: write(**row), images(step, tag, images)
  log: Callable[[str], None]
  evaluate: Callable[[Any], Dict[str, Any]]   # params → test metrics
  wall_time_before: float = 0.0   # training seconds of earlier invocations
  started: float = dataclasses.field(default_factory=time.time)
  stop_reason: Optional[str] = None
  stopped_at: Optional[int] = None
  last_eval: Optional[Dict[str, Any]] = None
  last_eval_step: Optional[int] = None
  last_validation: Optional[Dict[str, Any]] = None
  learning_rate: Optional[Callable[[int], Any]] = None   # the schedule: step → rate (recipe members: a list)
  describe: Callable[[Dict[str, Any]], str] = lambda m: reports.describe_test(m, False)   # metrics → console
  # Raises on divergence found so far (the DivergenceGuard's check); before output or saves.
  check: Callable[[], None] = lambda: None
  # Evaluations after a step up to the end of the run (the Evaluator's schedule).
  evaluations_left: Callable[[int], int] = lambda step: 0
  last_eval_seconds: Optional[float] = None   # how long the last evaluation took
  eval_examples: int = 0                      # examples one evaluation reads (test + validation)
  eval_seconds_total: float = 0.0             # evaluation time of this invocation
  # The stop reason of a request that arrives during an evaluation (stop_reason of its signal).
  stop_requested_as: Callable[[], str] = lambda: 'preempted'

  def request_stop(self, reason: str, step: int) -> None:
    if self.stop_reason is None:
      self.stop_reason, self.stopped_at = reason, step

  def wall_time(self) -> float:
    return self.wall_time_before + time.time() - self.started

  def epoch(self, step: int) -> float:
    return step / self.steps_per_epoch


class Hook:
  def __call__(self, run: Run, step: int, metrics: Dict[str, Any]) -> None:
    pass

  def resumed(self, run: Run, step: int) -> None:
    """Once, before a resumed run trains on from `step`, when the evaluation due at `step`
    has no row (a stop request ended it): the hooks that act on an evaluation act now, so that
    what the run selects does not depend on when it was stopped."""

  def end(self, run: Run) -> None:
    pass


class DivergenceGuard(Hook):
  """Stops the run at the first step whose loss or update norm is not finite, or once the
  loss has stayed above STUCK_FACTOR × its first value for STUCK_STEPS steps in a row (a
  learning rate far too large saturates every capsule: finite, and learning nothing).

  The values stay on the device until `check()` (called by the progress logger and
  before every checkpoint): no host synchronisation per step, and never a saved
  parameter from after a non-finite step.
  """
  STUCK_FACTOR = 2.0
  STUCK_STEPS = 200

  def __init__(self, checkpoints: Optional[Checkpoints] = None):
    self.checkpoints = checkpoints
    self.pending: List[Any] = []
    self.first_loss: Optional[np.ndarray] = None   # per member: this invocation's first step
    self.stuck: Optional[np.ndarray] = None        # steps in a row above STUCK_FACTOR × first_loss

  def __call__(self, run, step, metrics):
    self.pending.append((step - 1, metrics['loss'].sum() + metrics['update_norm'].sum(), metrics['loss']))

  def _kept(self, which: str) -> str:
    last = None
    if self.checkpoints is not None:
      self.checkpoints.wait()
      last = self.checkpoints.latest_step()
    return (f'{which}: step {last} in {self.checkpoints.directory}' if last is not None
            else 'no checkpoint was written yet')

  def check(self) -> None:
    if not self.pending:
      return
    steps, values, losses = zip(*self.pending)
    self.pending = []
    values, losses = sharding.to_host((list(values), list(losses)))
    values = np.asarray(values, np.float64)
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
      raise NaNLossError(f'training diverged: non-finite loss or update at step {steps[bad[0]]}; '
                         f'stopped ({self._kept("last good checkpoint")})')
    for step, loss in zip(steps, losses):
      loss = np.atleast_1d(np.asarray(loss, np.float64))    # [members] or [1]
      if self.first_loss is None:
        self.first_loss, self.stuck = loss, np.zeros(loss.shape, int)
      self.stuck = np.where(loss > self.STUCK_FACTOR * self.first_loss, self.stuck + 1, 0)
      if np.any(self.stuck >= self.STUCK_STEPS):
        member = int(np.argmax(self.stuck >= self.STUCK_STEPS))
        which = f' (member {member})' if loss.size > 1 else ''
        raise NaNLossError(
            f'training diverged{which}: the loss stayed above {self.STUCK_FACTOR:g} × its first value '
            f'({self.first_loss[member]:.4g}) for {self.STUCK_STEPS} steps, now {loss[member]:.4g} at step {step}; '
            f'stopped ({self._kept("last checkpoint")}; a smaller learning_rate?)')

  def end(self, run):
    self.check()


class ProgressLogger(Hook):
  """A console line and a `train` row in metrics.jsonl every `every_steps` steps (and when
  `every_seconds` have passed since the last one), after the first step (which includes
  compilation) and at the last step of the invocation."""

  def __init__(self, every_steps: int, every_seconds: float = 0.0):
    self.every_steps = every_steps
    self.every_seconds = every_seconds   # and at least this often (0: steps only)
    self.window_start = time.time()
    self.window_steps = 0
    self.window_eval_seconds = 0.0   # run.eval_seconds_total when the window started

  def eta(self, run, step: int, images_per_s: float) -> str:
    """Training still to do at `images_per_s`, plus the evaluations still to come at the
    last one's duration; before the first, each at the time training takes for as many
    images (`run.eval_examples`: an upper estimate, a forward pass costs less)."""
    seconds = (run.num_steps - step) * run.batch_size / images_per_s
    each = run.last_eval_seconds if run.last_eval_seconds is not None else run.eval_examples / images_per_s
    return console.format_duration(seconds + run.evaluations_left(step) * each)

  def restart_window(self, run) -> None:
    self.window_start, self.window_steps = time.time(), 0
    self.window_eval_seconds = run.eval_seconds_total

  def __call__(self, run, step, metrics):
    self.window_steps += 1
    first = step == run.first_step + 1
    overdue = bool(self.every_seconds) and time.time() - self.window_start >= self.every_seconds
    if not (first or step % self.every_steps == 0 or step == run.last_step or overdue):
      return
    run.check()
    host = {k: np.asarray(v).tolist() for k, v in sharding.to_host(metrics).items()}
    # Evaluation time is not training throughput.
    evaluating = run.eval_seconds_total - self.window_eval_seconds
    elapsed = max(time.time() - self.window_start - evaluating, 1e-9)
    images_per_s = self.window_steps * run.batch_size / elapsed   # per member for an ensemble
    if first and step % self.every_steps and step != run.last_step:
      speed = f'first step (with compilation) {elapsed:.1f}s'   # console only
    else:
      speed = f'{images_per_s:.1f} img/s | ETA {self.eta(run, step, images_per_s)}'
      rate = {} if run.learning_rate is None else {'learning_rate': np.asarray(run.learning_rate(step)).tolist()}
      run.metrics.write(split='train', step=step, epoch=run.epoch(step), images_per_s=images_per_s, **rate, **host)
    loss = reports.describe_values(host['loss'], run.num_members is not None)
    run.log(f'step {step}/{run.num_steps} epoch {run.epoch(step):.2f} | loss {loss} '
            f'| acc {np.mean(host["accuracy"]):.3f} | {speed}')
    self.restart_window(run)


class KeepBestCheckpoint(Hook):
  """After each evaluation with a validation split: the checkpoint of the best validation
  step so far (per member of an ensemble; reports.best_validation_steps, the rule of
  results.json's `selected_by_validation`) is kept beside the latest ones, so that the
  validation-selected model can still be exported when the run ends. `rows`: the run's
  metrics.jsonl rows up to where this invocation starts (a resumed run)."""

  def __init__(self, checkpoints: Checkpoints, rows=()):
    self.checkpoints = checkpoints
    self.steps = [row['step'] for row in rows if row.get('split') == 'validation']
    self.errors = [row['error'] for row in rows if row.get('split') == 'validation']
    self._keep()

  def _keep(self) -> None:
    if self.steps:
      best = reports.best_validation_steps(self.steps, self.errors)
      self.checkpoints.keep_steps(best if isinstance(best, list) else [best])

  def __call__(self, run, step, metrics):
    if run.last_eval_step == step and run.last_validation is not None:
      self.steps.append(step)
      self.errors.append(run.last_validation['error'])
      self._keep()

  def resumed(self, run, step):
    self(run, step, None)


class EarlyStop(Hook):
  """Ends the run (as complete) at the first evaluation whose test accuracy reaches
  `target` (affNIST: both models stopped at the same accuracy)."""

  def __init__(self, target: float):
    self.target = target

  def __call__(self, run, step, metrics):
    if run.last_eval_step != step or step >= run.num_steps:
      return
    if run.last_eval['accuracy'] >= self.target:
      run.log(f'test accuracy reached {self.target} at step {step}: stopping early')
      run.request_stop('early', step)

  def resumed(self, run, step):
    self(run, step, None)


class Preemption(Hook):
  """Stops at the next step after SIGTERM / Ctrl-C (one process) or when JAX's preemption
  service says so (several processes: all stop at the same step)."""

  def __init__(self, requests: StopRequests, checkpoints: Checkpoints, multi_process: bool):
    self.requests = requests
    self.checkpoints = checkpoints
    self.multi_process = multi_process

  def __call__(self, run, step, metrics):
    if step >= run.last_step:
      return
    if self.checkpoints.reached_preemption(step) if self.multi_process else self.requests.raised:
      run.log(f'{self.requests.signal_name or "preemption notice"} at step {step}: saving a checkpoint and stopping')
      run.request_stop(stop_reason(self.requests.signal_name), step)


class Checkpointer(Hook):
  """Saves every `every_steps` steps, every `every_secs` seconds (one process; several
  processes must agree on the step), when the run stops and at its last step. Finds a
  failed background save at the next step."""

  def __init__(self, checkpoints: Checkpoints, every_steps: int, every_secs: float = 0.0,
               clock: Callable[[], float] = time.monotonic):
    self.checkpoints = checkpoints
    self.every_steps = every_steps
    self.every_secs = every_secs
    self.clock = clock
    self.last_save = clock()
    self.saved_step: Optional[int] = None

  def save(self, run: Run, step: int) -> None:
    run.check()   # never save parameters from after a non-finite step
    # num_steps: what a trained model is "step N of" when predict or the explorer load it.
    self.checkpoints.save(run.state, {'wall_time_s': run.wall_time(), 'num_steps': run.num_steps})
    self.last_save, self.saved_step = self.clock(), step

  def save_before_evaluation(self, run: Run, step: int) -> None:
    """The Evaluator's `before`: an evaluation that fails (out of memory, a bad batch)
    or is interrupted never loses the steps trained before it."""
    if step > run.first_step and self.saved_step != step:
      self.save(run, step)

  def __call__(self, run, step, metrics):
    self.checkpoints.check()
    due = (step % self.every_steps == 0 or step == run.last_step or run.stop_reason is not None
           or (self.every_secs and self.clock() - self.last_save >= self.every_secs))
    if due and self.saved_step != step:
      self.save(run, step)
    if run.stop_reason in SIGNAL_STOPS and run.stopped_at == step:
      run.log(f'{run.stop_reason} at step {step}: checkpoint saved')

  def end(self, run):
    self.checkpoints.wait()
