"""Experiment programs outside the training loop: tables, figures, sweeps and robustness
studies that compose `capsjax.train.train_and_evaluate` runs and read their workdirs.

`PROGRAMS`: config.program → the function(config, workdir) that runs it (the experiment
config names it: `capsjax --experiment=ablation` runs the ablation program). A program
registers itself with `@register_program(name)` in its own module; capsjax.app.launch
imports the built-in ones. An inner run that stops
(a signal, --config.stop_at_step) raises capsjax.errors.RunStopped through the program:
the command exits 75 and the same command resumes every run where it stopped.
"""
import sys

from capsjax import defaults
from capsjax.settings import PROGRAMS


def register_program(name: str):
  """Registers the decorated function(config, workdir) as program `name`, and its module's
  section (its `KEYS`, `RULES`, `config_problems`, `model_as_checked`) with capsjax.validation."""
  def register(function):
    module = sys.modules[function.__module__]
    if hasattr(module, 'KEYS'):
      defaults.register_section(module)
    return PROGRAMS.register(name)(function)
  return register


# The experiments that run each built-in program (what `python -m capsjax.app.programs.NAME`,
# no command since programs became configs, points to).
EXPERIMENTS_OF = {'ablation': ('ablation', 'ablation_smoke'), 'affnist': ('affnist', 'affnist_smoke'),
                  'routing_zoo': ('routing_zoo', 'routing_zoo_cpu', 'routing_zoo_smoke'),
                  'sweep': ('sweep_smoke', 'recipes', 'recipe_search', 'transforms_smoke')}


def not_a_command(name: str) -> None:
  """Ends `python -m capsjax.app.programs.NAME` with one line naming the command that runs it."""
  from capsjax.app import cli  # pylint: disable=g-import-not-at-top
  experiments = EXPERIMENTS_OF[name]
  cli.fail(f'python -m capsjax.app.programs.{name} is not a command: the {name} program runs as an experiment, '
           f'capsjax --experiment={experiments[0]} --workdir=W (or python run.py …; experiments running it: '
           f'{", ".join(experiments)})')
