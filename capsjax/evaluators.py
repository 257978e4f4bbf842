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

The built-in ones: `routing_probe` (appendix A's convergence: mean |Δb| and |Δc| per
iteration), `routing_diagnostics` (coupling entropy and movement, consistency, capsule
activity, accuracy for r = 1 … iterations), `reconstructions` (test inputs beside their
reconstructions).
"""
import dataclasses
from typing import Annotated, Any, Callable, Dict, List

import jax
import numpy as np

from capsjax import diagnostics, steps
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

