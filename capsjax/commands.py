"""The installed commands (setup.cfg's console scripts), each the `python -m` entry it names:

  capsjax               train and evaluate an experiment   (python -m capsjax, python run.py)
  capsjax-predict       classify image files               (python -m capsjax.predict)
  capsjax-explorer      serve the capsule explorer         (python -m capsjax.explorer)
  capsjax-export        export a run for predict/explorer  (python -m capsjax.explorer.export)
  capsjax-figures       the paper's figures of a run       (python -m capsjax.programs.figures)
  capsjax-segmentation  MultiMNIST segmentation figures    (python -m capsjax.programs.segmentation)
  capsjax-multimnist    export MultiMNIST examples         (python -m capsjax.data.multimnist)

Each imports its module only when it runs, so a command's bad flag is reported before
JAX (or anything else heavy) is imported.
"""
import importlib
from typing import NoReturn

from capsjax import cli


def _run(module_name: str) -> NoReturn:
  module = importlib.import_module(module_name)
  cli.run_program(module.main)   # each main is a cli.main_wrapper


def train() -> NoReturn:
  from capsjax import launch  # pylint: disable=g-import-not-at-top
  launch.entry_point()


def predict() -> NoReturn:
  _run('capsjax.predict')


def explorer() -> NoReturn:
  _run('capsjax.explorer.__main__')


def export() -> NoReturn:
  _run('capsjax.explorer.export')


def figures() -> NoReturn:
  _run('capsjax.programs.figures')


def segmentation() -> NoReturn:
  _run('capsjax.programs.segmentation')


def multimnist() -> NoReturn:
  _run('capsjax.data.multimnist')
