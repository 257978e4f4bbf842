"""Experiment programs outside the training loop: tables, figures, sweeps and robustness
studies that compose `capsjax.train.train_and_evaluate` runs and read their workdirs.

`PROGRAMS`: config.program → the function(config, workdir) that runs it, with its
capability `default_experiment` (what `python -m capsjax.programs.NAME` runs without
--experiment). A program registers itself with `@register_program(name, ...)` in its own
module; capsjax.launch imports the built-in ones. An inner run that stops
(a signal, --config.stop_at_step) raises capsjax.errors.RunStopped through the program:
the command exits 75 and the same command resumes every run where it stopped.
"""
from capsjax import train
from capsjax.registry import Registry

PROGRAMS = Registry('program', default_experiment=None)


def register_program(name: str, default_experiment=None):
  return PROGRAMS.register(name, default_experiment=default_experiment)


PROGRAMS.register('train', train.train_and_evaluate)
