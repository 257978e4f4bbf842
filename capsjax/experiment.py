"""A run built once from a validated config: `build(config, mesh, platform)` → `Experiment`.

What the training loop and the planner take (neither reads the config again): the run's
own settings, its splits, its model (the formulation chosen for the platform), its length
and schedule, and its jitted steps (`RunSteps`, built by `build_program` from
capsjax.assemble's typed pieces: a single run and a vmapped ensemble alike).

`RunSettings` is the run's section of the config schema, declared as data the way the
model keys are: each field's type is `Annotated` with its rule and help (capsjax.keys),
its default the key's default; `capsjax.defaults` collects its `KEYS` with the other
sections'. How long and how often (logging, evaluation, checkpoints), when to stop, what
to do with a workdir that holds a run already, and which program runs (`PROGRAMS`).
"""
import dataclasses
import functools
import math
from typing import Annotated, Any, Callable, Dict, List, Optional, Tuple

import jax
import numpy as np

from capsjax import assemble, memory, sharding, steps
from capsjax.data.pipeline import Pipeline
from capsjax.ensembles import member_knobs
from capsjax.keys import About, annotated_keys, boolean, int_at_least, int_in, number_in, registered, text
from capsjax.registry import Registry

# config.program → the function(config, workdir) that runs the experiment: the training
# loop (capsjax.train registers it as `train`), or a program of capsjax.app.programs that
# composes it.
PROGRAMS = Registry('program', doc="""The programs by name (`config.program`): each entry's value is the
function (config, workdir) that runs an experiment; `train` is `train_and_evaluate`.""")

# An upper bound that only stops mistakes: an evaluation batch of 10⁹ images asked for
# 730 GiB after the training steps (batches beyond a test set are padding anyway).
MAX_EVAL_BATCH_SIZE = 65536


@dataclasses.dataclass(frozen=True)
class RunSettings:
  """The run's keys (top level of the config), typed.

  Example:
    >>> settings = capsjax.experiment.RunSettings.of(capsjax.base_config())
    >>> settings.eval_every_steps, settings.keep_checkpoints, settings.program
    (468, 3, 'train')
  """
  experiment: Annotated[str, About(text('a name'), 'the experiment name written into results (set by '
                                   'experiments/NAME.py)')] = 'mnist'
  program: Annotated[str, About(registered(PROGRAMS.names), 'what runs: train, or an experiment program that '
                                'calls the training loop itself (capsjax.app.programs)')] = 'train'
  log_every_steps: Annotated[int, About(int_at_least(1), 'a progress line and a metrics.jsonl row every N '
                                        'steps')] = 50
  log_every_seconds: Annotated[float, About(number_in(0, 86400), 'a progress line and a metrics.jsonl row at '
                                            'least this often as well (a slow run shows its speed early; 0: every '
                                            'log_every_steps steps only)')] = 15.0
  eval_every_steps: Annotated[int, About(int_at_least(0), 'evaluate every N steps (0: only at the end; 468: one '
                                         'epoch of 60 000 // 128)')] = 468
  eval_batch_size: Annotated[int, About(int_in(1, MAX_EVAL_BATCH_SIZE), 'examples per evaluation batch')] = 500
  eval_shift_averaging: Annotated[int, About(int_in(0, 4), 'also evaluate with class scores averaged over each '
                                             'image shifted by every (dy, dx) within ± this many pixels (0: off): '
                                             'shift_averaged_error on validation and test, never used to '
                                             'choose')] = 0
  checkpoint_every_steps: Annotated[int, About(int_at_least(1), 'save a checkpoint every N steps')] = 468
  keep_checkpoints: Annotated[int, About(int_at_least(1), 'checkpoints kept in the workdir')] = 3
  checkpoint_every_secs: Annotated[float, About(number_in(0, math.inf), 'also save every N seconds of wall time '
                                                '(0: off)')] = 600.0
  stop_at_step: Annotated[int, About(int_at_least(0), 'save and stop at this step, resumable, as a preemption '
                                     'would (0: run to the end)')] = 0
  stop_at_test_accuracy: Annotated[float, About(number_in(0, 1), 'the run is complete at the first evaluation '
                                                'reaching this test accuracy (affNIST; 0: off)')] = 0.0
  reevaluate: Annotated[bool, About(boolean(), 'running a finished workdir evaluates it again (otherwise it says '
                                    'it is complete and exits at once)')] = False
  # The run's peak memory is estimated before compiling (capsjax.memory) and shown in the header.
  check_memory: Annotated[bool, About(boolean(), 'refuse a run whose estimated peak memory exceeds the memory '
                                      'available, with one line (False: try anyway)')] = True
  allow_config_change: Annotated[bool, About(boolean(), 'continue a workdir that holds another config (never '
                                             'across parameter shapes); a workdir is otherwise bound to the '
                                             'config it was started with')] = False

  @classmethod
  def of(cls, config) -> 'RunSettings':
    """The settings `config` (validated) holds."""
    return cls(**{field.name: config[field.name] for field in dataclasses.fields(cls)})


# The run's keys (capsjax.defaults collects them with the other sections' KEYS).
KEYS = tuple(annotated_keys(RunSettings).values())


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


def build_program(training: assemble.Training, model, train: Pipeline, test: Pipeline, mesh,
                  validation: Optional[Pipeline] = None) -> RunSteps:
  """The jitted steps of `training` (a run, or a vmapped ensemble of its members) for
  `model` on `mesh`, over the pipelines; nothing here reads a config."""
  objective, members = training.objective, training.members
  ensemble = members is not None
  knobs = sharding.replicate(member_knobs(members), mesh) if ensemble else None
  train_step = steps.make_train_step(objective, model, training.optimizer, train, training.seed, ensemble, mesh,
                                     training.ema_decay, training.member_optimizer)
  shifts, groups = training.shift_averaging, recipe_groups(members)
  eval_step = steps.make_eval_step(objective, model, test, ensemble, shifts, groups)
  train_source = sharding.replicate(train.source, mesh)
  test_source = sharding.replicate(test.source, mesh)
  batch_size, eval_batch_size = training.batch_size, training.eval_batch_size
  rows = sharding.process_rows(batch_size)   # this process reads only these rows
  seeds = [member['seed'] for member in members] if ensemble else [None]

  def host_batch(step):
    parts = [train.host_batch(step, seed, rows) for seed in seeds]
    if not ensemble:
      return sharding.global_batch(mesh, parts[0], batch_size)
    stacked = tuple(np.stack(arrays) for arrays in zip(*parts))  # [members, rows, ...]
    return sharding.global_batch(mesh, stacked, batch_size, leading_axes=1)

  def step_arguments(state, step):
    return (state, train_source, host_batch(step)) + ((knobs,) if ensemble else ())

  def evaluate(params, should_stop=None):
    return steps.evaluate(eval_step, params, test, eval_batch_size, knobs, mesh, test_source, should_stop)

  validate = None
  if validation is not None:
    validation_step = steps.make_eval_step(objective, model, validation, ensemble, shifts, groups)
    validation_source = sharding.replicate(validation.source, mesh)
    validate = lambda params, should_stop=None: steps.evaluate(
        validation_step, params, validation, eval_batch_size, knobs, mesh, validation_source, should_stop)

  evaluations = training.evaluations(model, test, test_source, mesh, knobs)

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

  return RunSteps(train_step, step_arguments, evaluate, validate, evaluations,
                 lambda: training.make_state(model), members,
                 memory_estimates, mesh, lower)


@dataclasses.dataclass(frozen=True)
class Experiment:
  """A run built once from a validated config: what the training loop and the planner
  take (neither reads the config again for it). `steps`: the jitted step, evaluation,
  state and memory estimates of one run or one vmapped ensemble."""
  settings: RunSettings
  model: Any
  train: Pipeline
  test: Pipeline
  validation: Optional[Pipeline]
  num_steps: int                             # the whole run's length
  batch_size: int
  learning_rate: Callable[[int], float]      # the schedule: step → rate
  steps: RunSteps
  notes: Tuple[str, ...] = ()                # an explicit formulation measured slow on the platform


def build(config, mesh, platform: str = '', loader=None) -> Experiment:
  """`config` (validated, its data resolved: assemble.resolve_data) built on `mesh`, whose
  devices are `platform`'s ('' : JAX's default backend): splits (read by `loader`, default
  the config's source), the model (its formulation chosen for the platform), the training
  and its steps. The config is read here and in capsjax.assemble, once."""
  sharding.check_batch_size(config.batch_size, mesh)
  settings = RunSettings.of(config)
  (train, test, validation), model, training, notes = assemble.run(config, platform, loader)
  return Experiment(settings, model, train, test, validation, training.num_steps, training.batch_size,
                    training.schedule, build_program(training, model, train, test, mesh, validation), notes)
