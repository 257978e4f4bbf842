"""Evaluators: what an evaluation measures beside the test (and validation) metrics, named
in the config as big_vision's `config.evals` are: `config.evals.NAME` holds `enabled`,
`every_steps` (its own cadence) and the evaluator's options.

An evaluator is one function registered with `@register_evaluator(name)`:
`(context, **options)` → None where it does not apply to the run (a model without
routing logits, an ensemble, …), else `params → {field: value}`: fields added to the
evaluation's `test` row of metrics.jsonl (and TensorBoard), or with `images=True`
`params → uint8 images [n, h, w, c]` written to TensorBoard under `test/NAME`. Its keyword
options with defaults are its config keys, their rules and help lines `Annotated` with
capsjax.keys.About (one declaration each, as a routing's options are).

`Evaluator`, the training loop's hook that evaluates (when, what: test, validation, the
moving average and the due evaluators, and what a stop request in it does), closes the module.

The built-in ones: `routing_probe` (appendix A's convergence: mean |Δb| and |Δc| per
iteration), `routing_diagnostics` (coupling entropy and movement, consistency, capsule
activity, accuracy for r = 1 … iterations), `reconstructions` (test inputs beside their
reconstructions).
"""
import contextlib
import dataclasses
import time
from typing import Annotated, Any, Callable, Dict, List, Optional

import jax
import numpy as np

from capsjax import console, diagnostics, sharding, steps
from capsjax.hooks import Hook, Run
from capsjax.steps import EvaluationInterrupted
from capsjax.data.images import side_by_side
from capsjax.keys import About, Key, annotated_keys, boolean, int_at_least, int_in
from capsjax.models import MODELS
from capsjax.registry import Registry
from capsjax.routing import MAX_ROUTING_ITERATIONS, ROUTINGS


@dataclasses.dataclass(frozen=True)
class EvalContext:
  """What an evaluator is built from: the run's model and test pipeline as the training
  loop evaluates them."""
  model: Any                 # the Flax module (config.model built)
  family: str                # config.model.name (MODELS)
  has_decoder: bool
  pipeline: Any              # the test Pipeline
  source: Any                # its source, placed on the mesh
  mesh: Any
  knobs: Any                 # the ensemble's traced knobs, or None
  ensemble: bool
  batch_size: int            # config.eval_batch_size


# config.evals.NAME → the function (context, **options) → evaluation or None. What callers
# ask of an evaluator:
#   images   its evaluation returns uint8 images (TensorBoard) instead of metrics fields
EVALUATORS = Registry('evaluator', images=False, doc="""The evaluators by name (`config.evals.NAME`): each
entry's value is the function (context, **options) → None where it does not apply, else
params → metrics fields (or images, `images=True`).

Example:
  >>> capsjax.EVALUATORS.names()
  ('routing_probe', 'routing_diagnostics', 'reconstructions')
""")


def register_evaluator(name: str, **capabilities):
  """Function decorator: `config.evals.NAME` runs this evaluator at evaluations (its keyword
  options with defaults become `config.evals.NAME.OPTION`; see capsjax.evaluators).

  Example:
    The mean length of the class capsules of the first test batch, every 1 000 steps.

    >>> @capsjax.register_evaluator('mean_length')
    ... def mean_length(context, *, examples: int = 100):
    ...   images = jnp.zeros((examples,) + tuple(context.model.input_shape))
    ...   lengths = lambda params: context.model.apply({'params': params}, images)['lengths']
    ...   return lambda params: {'mean_length': float(lengths(params).mean())}
    >>> config = capsjax.base_config()
    >>> config.evals.mean_length.to_dict()
    {'enabled': True, 'every_steps': 0, 'examples': 100}
    >>> config.evals.mean_length.every_steps = 1000
    >>> capsjax.EVALUATORS.unregister('mean_length')
  """
  return EVALUATORS.register(name, **capabilities)


# Every evaluator's own keys, before its options.
SCHEDULE = {
    'enabled': Key('enabled', True, boolean(), 'run this evaluator at evaluations'),
    'every_steps': Key('every_steps', 0, int_at_least(0), 'at the evaluations of steps that are multiples of this '
                       'and the last (0: at every evaluation)'),
}


def evaluator_keys(name: str) -> Dict[str, Key]:
  """config.evals.NAME's keys: `enabled`, `every_steps` and the evaluator's options."""
  return {**SCHEDULE, **annotated_keys(EVALUATORS.get(name))}


def evals_config() -> Dict[str, Dict[str, Any]]:
  """config.evals at its defaults: a section per registered evaluator."""
  return {name: {key.name: key.default for key in evaluator_keys(name).values()} for name in EVALUATORS}


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """A built evaluator: its name, cadence and params → fields (or images)."""
  name: str
  every_steps: int
  evaluate: Callable[[Any], Any]
  images: bool

  def due(self, step: int, num_steps: int) -> bool:
    return not self.every_steps or step % self.every_steps == 0 or step == num_steps


def build(evals, context: EvalContext) -> List[Evaluation]:
  """The enabled evaluators of `evals` (config.evals: name → its section) that apply to the
  run, in the registry's order."""
  built = []
  for name in EVALUATORS:
    # A section the config lacks (an evaluator registered after it was made) at its defaults.
    section = {**evals_config()[name], **dict((evals or {}).get(name) or {})}
    if not section['enabled']:
      continue
    options = {key: value for key, value in section.items() if key not in SCHEDULE}
    evaluate = EVALUATORS.get(name)(context, **options)
    if evaluate is not None:
      built.append(Evaluation(name, int(section['every_steps']), evaluate, EVALUATORS[name].images))
  return built


@register_evaluator('routing_probe')
def routing_probe(context: EvalContext, *,
                  iterations: Annotated[int, About(int_in(1, MAX_ROUTING_ITERATIONS),
                                                   'routing iterations of the convergence probe')] = 6,
                  examples: Annotated[int, About(int_at_least(1), 'test images it routes')] = 100):
  """Routing convergence (appendix A): mean |Δb| and |Δc| per routing iteration, for a single
  run of a family and routing that expose routing logits."""
  if context.ensemble or not MODELS[context.family].routing_probe:
    return None
  if not ROUTINGS[context.model.routing].returns_logits:
    return None
  probe = steps.make_routing_probe(context.model, context.pipeline, iterations, examples, context.batch_size)
  return lambda params: probe(params, context.mesh, context.source)


@register_evaluator('routing_diagnostics')
def routing_diagnostics(context: EvalContext, *,
                        examples: Annotated[int, About(int_at_least(0), 'the first test images read (0: the '
                                                       'whole split)')] = 1000,
                        iterations: Annotated[int, About(int_in(0, MAX_ROUTING_ITERATIONS), 'the test-time sweep: '
                                                         'accuracy for r = 1 … this (0: none)')] = 5):
  """capsjax.diagnostics: coupling entropy and movement, per-class consistency, capsule
  activity, accuracy by routing iterations (one value per member for an ensemble)."""
  if not MODELS[context.family].routing_probe:
    return None
  diagnose = diagnostics.make_routing_diagnostics(context.model, context.pipeline, examples, context.batch_size,
                                                  iterations, context.ensemble)
  return lambda params: diagnose(params, context.mesh, context.source, context.knobs)


@register_evaluator('reconstructions', images=True)
def reconstructions(context: EvalContext, *,
                    examples: Annotated[int, About(int_in(1, 64), 'test images shown')] = 8):
  """The first test inputs beside their reconstructions (masked by the most active capsule,
  as at test time), uint8 [n, h, 2w + 2, c]: a single run of a model with a decoder, on
  one process."""
  if context.ensemble or not context.has_decoder or jax.process_count() > 1:
    return None
  test = context.pipeline
  host_batch, weights = next(iter(test.eval_batches(examples)))
  batch = test.device_batch(test.source, host_batch, None)
  shown = np.asarray(batch.get('reconstruction_targets', batch['images']))[weights > 0]
  model = context.model
  rebuild = jax.jit(lambda params, images: model.apply({'params': params}, images)['reconstructions'])

  def pairs(params) -> np.ndarray:
    rebuilt = np.asarray(rebuild(params, batch['images']))[weights > 0]
    inputs = np.uint8(np.round(np.clip(shown, 0.0, 1.0) * 255))
    return np.stack([side_by_side(image, r) for image, r in zip(inputs, rebuilt)])
  return pairs


# ----------------------------------------------------------------------------- when a run evaluates

# An evaluation's progress bar waits for its batches at most this often (seconds).
PROGRESS_SYNC_S = 1.0


class Evaluator(Hook):
  """Evaluates every `every_steps` steps (0: only at the end of the run) and at the last
  step of the run, writing a `test` row; `evaluations` (capsjax.evaluators.Evaluation,
  the config's `evals`) add their fields to the same row, or their images to TensorBoard,
  at the evaluations their own cadence makes due. `validate` (params → metrics on the
  held-out validation split) writes a `validation` row at the same steps."""

  def __init__(self, every_steps: int, evaluations=(),
               validate: Optional[Callable[[Any], Dict[str, Any]]] = None,
               before: Optional[Callable[[Run, int], None]] = None,
               should_stop: Optional[Callable[[], bool]] = None, every_seconds: float = 0.0):
    self.every_steps = every_steps
    self.every_seconds = every_seconds   # a progress line this often during an evaluation (0: none)
    self.evaluations = list(evaluations)
    self.validate = validate
    self.before = before   # called before each evaluation: the checkpointer saves there
    self.should_stop = should_stop   # a stop request ends an evaluation between its batches
    self.compiled = False       # whether an evaluation ran (and compiled) in this process
    self.last_seconds = 0.0     # how long the last evaluation took, compilation included

  def due(self, step: int, num_steps: int) -> bool:
    return bool(self.every_steps and step % self.every_steps == 0) or step == num_steps

  def remaining(self, step: int, num_steps: int) -> int:
    """Evaluations still to run from `step` to the end of the run, the one due at `step`
    included: a step's progress line is written before its evaluation (the ETA of the
    last line is that of the final evaluation)."""
    if step > num_steps:
      return 0
    first = max(step, 1)
    periodic = (num_steps // self.every_steps - (first - 1) // self.every_steps) if self.every_steps else 0
    final = not (self.every_steps and num_steps % self.every_steps == 0)
    return periodic + int(final)

  def evaluate(self, run: Run, step: int) -> Dict[str, Any]:
    """Test (and validation) metrics of the current parameters, announced on the console
    (an evaluation can take minutes) and timed (`last_seconds`, for the ETA)."""
    run.log(f'step {step}: evaluating' + (' (test and validation)' if self.validate is not None else '')
            + (f', ≈ {run.last_eval_seconds:.0f} s' if run.last_eval_seconds else '')
            + ('' if self.compiled else '; the first evaluation compiles its programs') + '…')
    start = time.time()
    # The first one compiles its programs: XLA's slow-compile banners stay out of the output.
    with console.xla_alarms_dropped() if not self.compiled else contextlib.nullcontext():
      metrics = self._metrics(run, step)
    run.last_eval, run.last_eval_step = metrics, step
    self.last_seconds = time.time() - start
    if self.compiled:   # the first one's compilations would make every later estimate too long
      run.last_eval_seconds = self.last_seconds
    self.compiled = True
    run.eval_seconds_total += self.last_seconds
    return metrics

  def _metrics(self, run: Run, step: int) -> Dict[str, Any]:
    """The test row's metrics (the EMA's and the evaluators' beside them); the validation's
    into `run.last_validation`."""
    params, average = run.state['params'], run.state.get('ema_params')   # config.ema_decay: evaluated beside them
    metrics = self._pass(run.evaluate, params, f'step {step}: evaluating test')
    if average is not None:
      metrics.update({f'ema_{k}': v for k, v in self._pass(run.evaluate, average, 'and its moving average').items()})
    for evaluation in self.evaluations:
      if not evaluation.images and evaluation.due(step, run.num_steps):
        metrics.update(evaluation.evaluate(params))
    if self.validate is not None:
      run.last_validation = self._pass(self.validate, params, f'step {step}: evaluating validation')
      if average is not None:
        run.last_validation.update(
            {f'ema_{k}': v for k, v in self._pass(self.validate, average, 'and its moving average').items()})
    return metrics

  def _pass(self, evaluate, params, what: str) -> Dict[str, Any]:
    """`evaluate(params)` over its split, ended by a stop request between batches, and its
    progress (console.progress: batches done and an ETA every `every_seconds` once it has
    taken 2 s, as the training's lines; a long evaluation once said nothing for a minute)."""
    stop = {} if self.should_stop is None else {'should_stop': self.should_stop}
    if not self.every_seconds:
      return evaluate(params, **stop)
    with console.progress(what=what, unit='batch', log_every_s=self.every_seconds,
                          disable=not sharding.is_main_process()) as bar:
      shown_at = [time.time()]
      def on_batch(done: int, total: Optional[int], wait: Callable[[], Any]) -> None:
        bar.total = total
        if time.time() - shown_at[0] < PROGRESS_SYNC_S and done != total:
          return   # (no host sync per batch: the batches stay queued on the device)
        wait()     # (dispatched is not computed: the bar counts what is done)
        bar.update(done - bar.n)
        shown_at[0] = time.time()
      return evaluate(params, on_batch=on_batch, **stop)

  def __call__(self, run, step, metrics):
    if not self.due(step, run.num_steps):
      return
    if self.before is not None:
      self.before(run, step)
    self.record(run, step)

  def resumed(self, run, step):
    run.log(f'step {step}: its evaluation was stopped before it ended; evaluating the restored checkpoint first')
    self.record(run, step)

  def record(self, run: Run, step: int) -> None:
    """Evaluates and writes the `test` (and `validation`) rows of `step` to the metrics
    log: at a due step, and when a finished run is evaluated again (its newer rows follow
    the old ones of that step; readers take the newest)."""
    try:
      results = self.evaluate(run, step)
    except EvaluationInterrupted:
      run.log(f'stop requested during the evaluation at step {step}: ended it (the checkpoint of step {step} '
              'is saved; run again to resume)')
      run.request_stop(run.stop_requested_as(), step)
      return
    took = f' ({self.last_seconds:.1f} s)'
    if self.validate is not None:
      run.log(f'step {step} validation: {run.describe(run.last_validation)}')
      run.metrics.write(split='validation', step=step, epoch=run.epoch(step), **run.last_validation)
    run.log(f'step {step} test: {run.describe(results)}{took}')
    for split, values in (('validation', run.last_validation if self.validate is not None else None),
                          ('test', results)):
      counts = np.atleast_1d((values or {}).get('non_finite_examples', 0))
      if np.any(counts):   # NaN scores read as length 0 once: "every class absent", and no word
        run.log(f'warning: step {step} {split}: {int(np.max(counts))} examples with NaN or infinite class scores '
                f'(counted wrong){" in a member" if counts.size > 1 else ""}: the parameters or inputs hold '
                'non-finite values')
    run.metrics.write(split='test', step=step, epoch=run.epoch(step), eval_seconds=self.last_seconds,
                      **results)
    for evaluation in self.evaluations:
      if evaluation.images and evaluation.due(step, run.num_steps):
        run.metrics.images(step, f'test/{evaluation.name}', evaluation.evaluate(run.state['params']))
