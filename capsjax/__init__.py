"""capsjax: Dynamic Routing Between Capsules (Sabour, Frosst, Hinton 2017) in JAX/Flax.

The public API, what a researcher composes (each name documented with its shapes and a
runnable example; tests/test_api.py runs every example):

- capsules and routing (pure functions of arrays): `squash`, `vector_norm`,
  `coupling_coefficients`, `dynamic_routing` (Procedure 1), `route` (any registered
  routing by name) and what it returns, `RoutingResult`; `routing_logit_changes`,
  `register_routing` and the registry `ROUTINGS`;
- losses (per example): `margin_loss`, `reconstruction_loss`, `capsnet_loss`;
- Flax linen layers: `PrimaryCaps`, `CapsuleLayer`, `Decoder`, and how they compute,
  `Formulation`; models: `CapsNet`, `BaselineCNN`, `build_model`, `model_config`,
  `capsule_lengths`, the registry `MODELS`;
- objectives (a model's loss and metrics for a batch): `make_objective`, `OBJECTIVES`;
- training: `base_config`, the evaluators `EVALUATORS` and `register_evaluator`,
  `train_and_evaluate` → `RunResult` (the experiments' configs
  are the package `capsjax.experiments`, e.g. `capsjax.experiments.mnist.get_config()`);
  `plan_run`: the run's steps compiled for a TPU slice that is not here (capsjax-plan);
- trained models: `load_trained`, `TrainedModel`, `Predictor`, and `export` (one file that
  runs outside capsjax: ONNX, StableHLO, a TensorFlow SavedModel);
- data: `load_dataset`, `register_source` and the registry `SOURCES`;
- checking a config: `validate(config)` (what every entry runs first) and what it raises,
  `ConfigError` (one line: the key, the value, what is allowed: the line the command prints);
  `ArgumentError`, a function's argument refused (an array's shape or dtype; also a
  ValueError); `CapsjaxError`, the base of every refusal of input (data, workdirs,
  checkpoints too).

Names load on first use: `import capsjax` itself imports no JAX, so the commands
(`capsjax`, `capsjax-predict`, …) report a bad flag before anything heavy loads.
"""
import importlib as _importlib

from capsjax.console import guard_known_miscompiles as _guard_known_miscompiles
from capsjax.console import quiet_libtpu_environment as _quiet_libtpu_environment

__version__ = '0.4.0'

# With the `tpu` extra (capsjax-plan) on a machine without TPUs, libtpu prints a start-up
# error banner when JAX starts its backends; its environment, set before that happens
# (JAX starts them lazily: `import jax; import capsjax` is early enough), keeps it quiet.
_quiet_libtpu_environment()
# A jaxlib with a known silent CPU miscompile (capsjax.console.KNOWN_MISCOMPILES): the XLA
# flag that avoids it, set before JAX starts its backend; a run's header says so.
_guard_known_miscompiles()

# Exported name → the module that defines it (one definition; this file only points).
_EXPORTS = {
    'squash': 'routing', 'vector_norm': 'routing', 'coupling_coefficients': 'routing',
    'dynamic_routing': 'routing', 'route': 'routing', 'routing_logit_changes': 'routing',
    'register_routing': 'routing', 'ROUTINGS': 'routing', 'RoutingResult': 'routing',
    'margin_loss': 'losses', 'reconstruction_loss': 'losses', 'capsnet_loss': 'losses',
    'PrimaryCaps': 'layers', 'CapsuleLayer': 'layers', 'Decoder': 'layers', 'Formulation': 'formulations',
    'CapsNet': 'models', 'BaselineCNN': 'models', 'build_model': 'models', 'model_config': 'models', 'capsule_lengths': 'models',
    'MODELS': 'models',
    'make_objective': 'objectives', 'OBJECTIVES': 'objectives',
    'base_config': 'defaults', 'EVALUATORS': 'evaluators', 'register_evaluator': 'evaluators',
    'train_and_evaluate': 'train', 'RunResult': 'reports', 'plan_run': 'app.plan',
    'load_trained': 'app.trained', 'TrainedModel': 'app.trained', 'Predictor': 'app.predict', 'export': 'app.serving',
    'load_dataset': 'data.sources', 'register_source': 'data.sources', 'SOURCES': 'data.sources',
    'validate': 'validation', 'ConfigError': 'errors', 'ArgumentError': 'errors', 'CapsjaxError': 'errors',
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
  if name in _EXPORTS:
    value = getattr(_importlib.import_module(f'{__name__}.{_EXPORTS[name]}'), name)
    globals()[name] = value   # later lookups skip this function
    return value
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
  return sorted(list(globals()) + __all__)
