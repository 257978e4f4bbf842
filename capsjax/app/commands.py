"""The installed commands (setup.cfg's console scripts), each the `python -m` entry it names:

  capsjax               train and evaluate an experiment   (python -m capsjax, python run.py)
  capsjax-predict       classify image files               (python -m capsjax.app.predict)
  capsjax-explorer      serve the capsule explorer         (python -m capsjax.app.explorer)
  capsjax-export        export a run for predict/explorer  (python -m capsjax.app.export)
  capsjax-figures       the paper's figures of a run       (python -m capsjax.app.programs.figures)
  capsjax-segmentation  MultiMNIST segmentation figures    (python -m capsjax.app.programs.segmentation)
  capsjax-multimnist    export MultiMNIST examples         (python -m capsjax.app.multimnist)
  capsjax-plan          plan a TPU or GPU run without them (python -m capsjax.app.plan)

Each imports its module only when it runs, so a command's bad flag is reported before
JAX (or anything else heavy) is imported.
"""
import importlib
from typing import NoReturn

from capsjax.app import cli


def _command(module_name: str):
  """The console-script function that runs `module_name`'s main as a program."""
  def run() -> NoReturn:
    cli.run_program(importlib.import_module(module_name).main)   # each main is a cli.main_wrapper
  run.__name__ = run.__qualname__ = module_name.rsplit('.', 1)[-1]
  return run


def train() -> NoReturn:
  from capsjax.app import launch  # pylint: disable=g-import-not-at-top
  launch.entry_point()


def plan() -> NoReturn:
  from capsjax.app import plan as plan_lib  # pylint: disable=g-import-not-at-top
  plan_lib.entry_point()


predict = _command('capsjax.app.predict')
explorer = _command('capsjax.app.explorer.__main__')
export = _command('capsjax.app.export')
figures = _command('capsjax.app.programs.figures')
segmentation = _command('capsjax.app.programs.segmentation')
multimnist = _command('capsjax.app.multimnist')
