"""The run's own keys, typed: `RunSettings` (the top level of the config) and the programs a
config may name (`PROGRAMS`).

`RunSettings` is the run's section of the config schema, declared as data the way the
model keys are: each field's type is `Annotated` with its rule and help (capsjax.keys),
its default the key's default; `capsjax.defaults` collects its `KEYS` with the other
sections'. How long and how often (logging, evaluation, checkpoints), when to stop, what
to do with a workdir that holds a run already, and which program runs.
"""
import dataclasses
import math
from typing import Annotated

from capsjax.keys import About, annotated_keys, boolean, int_at_least, int_in, number_in, registered, text
from capsjax.registry import Registry

# config.program → the function(config, workdir) that runs the experiment: the training
# loop (capsjax.train registers it as `train`), or a program of capsjax.app.programs that
# composes it.
PROGRAMS = Registry('program', doc="""The programs by name (`config.program`): each entry's value is the
function (config, workdir) that runs an experiment; `train` is `train_and_evaluate`.""")

# The training loop's program name (capsjax.train registers train_and_evaluate under it):
# allowed before that module is imported, so that the library's check of a config does not
# depend on what the caller imported first.
TRAINING_LOOP = 'train'


def program_names():
  """The names config.program allows: the training loop's and every registered program's."""
  return (TRAINING_LOOP,) + tuple(name for name in PROGRAMS.names() if name != TRAINING_LOOP)


# An upper bound that only stops mistakes: an evaluation batch of 10⁹ images asked for
# 730 GiB after the training steps (batches beyond a test set are padding anyway).
MAX_EVAL_BATCH_SIZE = 65536


@dataclasses.dataclass(frozen=True)
class RunSettings:
  """The run's keys (top level of the config), typed.

  Example:
    >>> settings = capsjax.settings.RunSettings.of(capsjax.base_config())
    >>> settings.eval_every_steps, settings.keep_checkpoints, settings.program
    (468, 3, 'train')
  """
  experiment: Annotated[str, About(text('a name'), 'the experiment name written into results (set by '
                                   'experiments/NAME.py)')] = 'mnist'
  program: Annotated[str, About(registered(program_names), 'what runs: train, or an experiment program that '
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
