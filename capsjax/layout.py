"""The config layout's history: which keys moved where, for reading what was written before.

capsjax.workdir upgrades a stored config (a workdir's, an export's) with these tables;
`moved_key` names where an old key lives now, for the one-line errors of the command line,
of validation and of a sweep's or a recipe's override. Imports nothing of capsjax but the
formulation's fields.
"""
import dataclasses
from typing import Optional

from capsjax import formulations

# Before model.routing_inputs (2026-11-26) each capsule-layer input was a flag of its own,
# named differently from the routing argument it enabled: flag → input.
ROUTING_INPUT_FLAGS = {'digit_bias': 'bias', 'learn_log_priors': 'log_priors', 'leaky_routing': 'leaky',
                       'stop_gradient_predictions': 'stop_gradient_predictions'}

# Before config.evals (2026-11-25) the evaluators' options were run-level keys:
# old key → (evaluator, its key, the value's translation).
FLAT_EVALUATOR_KEYS = {
    'routing_probe_iterations': ('routing_probe', 'iterations', lambda n: n or None),
    'routing_probe_examples': ('routing_probe', 'examples', lambda n: n),
    'routing_diagnostics': ('routing_diagnostics', 'enabled', bool),
    'routing_diagnostics_examples': ('routing_diagnostics', 'examples', lambda n: n),
    'routing_diagnostics_iterations': ('routing_diagnostics', 'iterations', lambda n: n),
}

# Before model.formulation (2026-11-26) a model's formulation options (Formulation's fields)
# were keys of the model section itself.
FORMULATION_KEYS = tuple(field.name for field in dataclasses.fields(formulations.Formulation))


def moved_key(dotted: str) -> Optional[str]:
  """Where a key that today's layout moved lives now, by its dotted name in a config of the
  old layout ('model.conv_impl' → 'model.formulation.conv_impl', 'routing_diagnostics' →
  'evals.routing_diagnostics.enabled'), or None."""
  *sections, leaf = dotted.split('.')
  if sections and sections[-1] == 'model' and leaf in FORMULATION_KEYS:
    return '.'.join(sections + ['formulation', leaf])
  if dotted in FLAT_EVALUATOR_KEYS:
    name, key, _ = FLAT_EVALUATOR_KEYS[dotted]
    return f'evals.{name}.{key}'
  return None


def moved_key_hint(dotted: str) -> str:
  """' (it is config.NEW now)' for a key that today's layout moved, else '' (the command's
  words and the library's: capsjax.app.launch, capsjax.validation)."""
  now = moved_key(dotted)
  if now is None:
    return ''
  off = '; 0 (off) is --config.evals.routing_probe.enabled=False' if dotted == 'routing_probe_iterations' else ''
  return f' (it is config.{now} now{off})'
