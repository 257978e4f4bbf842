"""A run built once from a validated config: `build(config, mesh, platform)` → `Experiment`.

What the training loop and the planner take (neither reads the config again): the run's
own settings, its splits, its model (the formulation chosen for the platform), its length
and schedule, and its jitted steps (capsjax.steps.RunSteps, built by
`steps.build_program` from capsjax.assemble's typed pieces: a run or a vmapped ensemble).

The run's own keys (`RunSettings`, `PROGRAMS`) are declared in capsjax.settings; the config
is checked (capsjax.validation, by the callers) before anything is built.
"""
import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

from capsjax import assemble, sharding, steps
from capsjax.data.pipeline import Pipeline
from capsjax.data.tasks import TASKS
from capsjax.settings import RunSettings


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
  and its steps. The config is read here and in capsjax.assemble, once; it is checked
  before (capsjax.validate: train_and_evaluate and plan_run run it first)."""
  sharding.check_batch_size(config.batch_size, mesh)
  settings = RunSettings.of(config)
  (train, test, validation), model, training, notes = assemble.run(config, platform, loader)
  return Experiment(settings, model, train, test, validation, training.num_steps, training.batch_size,
                    training.schedule, steps.build_program(training, model, train, test, mesh, validation),
                    config.to_dict(), notes, TASKS[config.task].labels_per_example)
