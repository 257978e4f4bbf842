"""A run built once from a validated config: `build(config, mesh, platform)` → `Experiment`.

What the training loop and the planner take (neither reads the config again): the run's
own settings, its splits, its model (the formulation chosen for the platform), its length
and schedule, and its jitted steps (capsjax.steps.RunSteps, built by
`steps.build_program` from capsjax.assemble's typed pieces: a run or a vmapped ensemble).

`RunSettings` is the run's section of the config schema, declared as data the way the
model keys are: each field's type is `Annotated` with its rule and help (capsjax.keys),
its default the key's default; `capsjax.defaults` collects its `KEYS` with the other
sections'. How long and how often (logging, evaluation, checkpoints), when to stop, what
to do with a workdir that holds a run already, and which program runs (`PROGRAMS`).
"""
import dataclasses
import math
from typing import Annotated, Any, Callable, Dict, Optional, Tuple

from capsjax import assemble, sharding, steps
from capsjax.data.pipeline import Pipeline
from capsjax.data.tasks import TASKS
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
  steps: steps.RunSteps
  recorded: Dict[str, Any]                   # the config as config.json and results.json record it
  notes: Tuple[str, ...] = ()                # an explicit formulation measured slow on the platform
  labels_per_example: int = 1                # 2: MultiMNIST's pairs (accuracy: both among the top 2)


def build(config, mesh, platform: str = '', loader=None) -> Experiment:
  """`config` (validated, its data resolved: assemble.resolve_data) built on `mesh`, whose
  devices are `platform`'s ('' : JAX's default backend): splits (read by `loader`, default
  the config's source), the model (its formulation chosen for the platform), the training
  and its steps. The config is read here and in capsjax.assemble, once."""
  sharding.check_batch_size(config.batch_size, mesh)
  settings = RunSettings.of(config)
  (train, test, validation), model, training, notes = assemble.run(config, platform, loader)
  return Experiment(settings, model, train, test, validation, training.num_steps, training.batch_size,
                    training.schedule, steps.build_program(training, model, train, test, mesh, validation),
                    config.to_dict(), notes, TASKS[config.task].labels_per_example)
