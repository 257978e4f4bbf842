"""Experiment programs outside the training loop: tables, figures, sweeps and robustness
studies that compose `capsjax.train.train_and_evaluate` runs and read their workdirs.

`PROGRAMS`: config.program → the function(config, workdir) that runs it (the experiment
config names it: `capsjax --experiment=ablation` runs the ablation program). A program
registers itself with `@register_program(name)` in its own module; capsjax.launch
imports the built-in ones. An inner run that stops
(a signal, --config.stop_at_step) raises capsjax.errors.RunStopped through the program:
the command exits 75 and the same command resumes every run where it stopped.
"""
from capsjax import train
from capsjax.registry import Registry

PROGRAMS = Registry('program')


def register_program(name: str):
  return PROGRAMS.register(name)


PROGRAMS.register('train', train.train_and_evaluate)
