"""A run built once from a validated config: `start(config, mesh)` → `Experiment` (the data
resolved, the model chosen, then built), the one call that starts a run.

What the training loop and the planner take (neither reads the config again): the run's
own settings, its splits, its model (the formulation chosen for the platform), its length
and schedule, and its jitted steps (`RunSteps`, built here by `build_program` from
capsjax.assemble's typed pieces and capsjax.steps' jitted computations: a run or a vmapped
ensemble).

The run's own keys (`RunSettings`, `PROGRAMS`) are declared in capsjax.settings; the config
is checked (capsjax.validation, by the callers) before anything is built.
"""
import dataclasses
import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import numpy as np

from capsjax import assemble, evaluators, memory, sharding, steps
from capsjax.data.pipeline import Pipeline
from capsjax.data.tasks import TASKS
from capsjax.settings import RunSettings


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


@dataclasses.dataclass(frozen=True)
class Experiment:
  """A run built once from a validated config: what the training loop and the planner
  take (neither reads the config again for it). `steps`: the jitted step, evaluation,
  state and memory estimates of one run or one vmapped ensemble; `recorded`: the config as
  a plain dict, which the loop writes into the workdir and never reads."""
  settings: RunSettings
  model: Any
  train: Pipeline
  test: Pipeline
  validation: Optional[Pipeline]
  num_steps: int                             # the whole run's length
  batch_size: int
  learning_rate: Callable[[int], Any]        # the schedule: step → rate (a list: one per recipe member)
  steps: RunSteps
  recorded: Dict[str, Any]                   # the config as config.json and results.json record it
  notes: Tuple[str, ...] = ()                # an explicit formulation measured slow on the platform
  labels_per_example: int = 1                # 2: MultiMNIST's pairs (accuracy: both among the top 2)
  model_choice: Optional[str] = None         # what start chose for the model's 'auto' keys, and why


def start(config, mesh, *, platform: str = '', loader=None, recorded: Optional[Dict[str, Any]] = None,
          available: Optional[float] = None, settings: Optional[RunSettings] = None,
          resolved: bool = False) -> Experiment:
  """A run started from its validated config, the one call every entry makes (training,
  capsjax-plan, the routing zoo): what the data says fills what the config leaves open
  (assemble.resolve_data: shape, classes); the model's 'auto' keys are chosen for the batch
  within `available` bytes per device (assemble.choose_model; a resumed run's `recorded`
  config keeps its choices); then the run is built on `mesh`, whose devices are
  `platform`'s ('' : JAX's default backend): splits (read by `loader`, default the
  config's source), the model (its formulation chosen for the platform), the training and
  its steps. The choice's line is the Experiment's `model_choice`; `settings`: the run's
  own settings where the caller has read them already. `resolved`: the config's data is
  resolved and its model chosen already (capsjax-plan's search for the largest batch
  builds one run per batch from one resolved config)."""
  chosen = None
  if not resolved:
    config = assemble.resolve_data(config)
    config, chosen = assemble.choose_model(config, recorded, available=available, platform=platform)
  sharding.check_batch_size(config.batch_size, mesh)
  (train, test, validation), model, training, notes = assemble.run(config, platform, loader)
  return Experiment(settings or RunSettings.of(config), model, train, test, validation, training.num_steps,
                    training.batch_size, training.schedule,
                    build_program(training, model, train, test, mesh, validation), config.to_dict(), notes,
                    TASKS[config.task].labels_per_example, chosen)


def build_program(training, model, train: Pipeline, test: Pipeline, mesh,
                  validation: Optional[Pipeline] = None) -> RunSteps:
  """The jitted steps of `training` (capsjax.assemble.Training: a run, or a vmapped
  ensemble of its members) for `model` on `mesh`, over the pipelines; nothing here reads a
  config."""
  objective, members = training.objective, training.members
  ensemble = members is not None
  batch_size, eval_batch_size = training.batch_size, training.eval_batch_size
  test_source = sharding.replicate(test.source, mesh)
  knobs = sharding.replicate(steps.member_knobs(members), mesh) if ensemble else None
  evaluations = evaluators.build(training.evals, evaluators.EvalContext(
      model, training.family, training.has_decoder, test, test_source, mesh, knobs, ensemble, eval_batch_size))
  train_step = steps.make_train_step(objective, model, training.optimizer, train, training.seed, ensemble, mesh,
                               training.ema_decay, training.member_optimizer)
  seeds = [member['seed'] for member in members] if ensemble else [None]
  make_state = lambda: steps.initial_state(model, training.optimizer, training.input_shape, training.seed,
                                           seeds if ensemble else None, ema=training.averaged)
  shifts, groups = training.shift_averaging, steps.recipe_groups(members)
  summed = ensemble and steps.seeds_alone(members)
  eval_step = steps.make_eval_step(objective, model, test, ensemble, shifts, groups, summed)
  train_source = sharding.replicate(train.source, mesh)
  rows = sharding.process_rows(batch_size)   # this process reads only these rows

  def host_batch(step):
    parts = [train.host_batch(step, seed, rows) for seed in seeds]
    if not ensemble:
      return sharding.global_batch(mesh, parts[0], batch_size)
    stacked = tuple(np.stack(arrays) for arrays in zip(*parts))  # [members, rows, ...]
    return sharding.global_batch(mesh, stacked, batch_size, leading_axes=1)

  def step_arguments(state, step):
    return (state, train_source, host_batch(step)) + ((knobs,) if ensemble else ())

  def evaluate_test(params, should_stop=None, on_batch=None):
    return steps.evaluate(eval_step, params, test, eval_batch_size, knobs, mesh, test_source, should_stop, on_batch)

  validate = None
  if validation is not None:
    validation_step = steps.make_eval_step(objective, model, validation, ensemble, shifts, groups, summed)
    validation_source = sharding.replicate(validation.source, mesh)
    validate = lambda params, should_stop=None, on_batch=None: steps.evaluate(
        validation_step, params, validation, eval_batch_size, knobs, mesh, validation_source, should_stop, on_batch)

  def memory_estimates(abstract_state):
    """Peak bytes per device of a training step and of an evaluation batch, from their
    traces: the batch-dependent part is split over the mesh's devices."""
    state_bytes = sum(memory.array_bytes(leaf) for leaf in jax.tree.leaves(abstract_state))
    per_device = lambda total: state_bytes + (total - state_bytes) // mesh.size
    host_batch, weights = next(steps.eval_batches(test, eval_batch_size, mesh))
    eval_args = (abstract_state['params'], test_source, host_batch, weights, knobs)
    return {f'training at batch_size={batch_size}': (
                per_device(memory.traced_peak_bytes(train_step, *step_arguments(abstract_state, 0))),
                'lower config.batch_size or the model\'s size'),
            f'evaluation at eval_batch_size={eval_batch_size}': (
                per_device(memory.traced_peak_bytes(eval_step, *eval_args)), 'lower config.eval_batch_size')}

  def lower(abstract_state):
    """The training step and an evaluation batch lowered as the run calls them (its
    shardings and donation), from shapes alone (on a compile-only mesh nothing is placed)."""
    state = sharding.replicate(abstract_state, mesh)
    host_batch, weights = next(steps.eval_batches(test, eval_batch_size, mesh))
    return {'training': train_step.lower(*step_arguments(state, 0)),
            'evaluation': eval_step.lower(state['params'], test_source, host_batch, weights, knobs)}

  return RunSteps(train_step, step_arguments, evaluate_test, validate, evaluations,
                  make_state, members, memory_estimates, mesh, lower)
