"""Hyper-parameter sweep: one training per variant of the base config, then a table of
what helped.

config.sweep.variants is a tuple of strings 'NAME: key=value, key=value' (keys are
config paths such as learning_rate, lr_decay_steps, batch_size, max_shift,
model.routing_iterations; values are Python literals). The first variant is the
reference. `run(config, workdir)` trains each variant in workdir/NAME (resumable) with
`train.train_and_evaluate` and writes sweep.md, sweep.json and sweep.png.

A variant may be an ensemble of seeds (config.ensemble.seeds): its row is the mean ± std
over them. With config.validation_examples, variants are ranked by validation error and
the test error is reported beside it; without, the table says the ranking is on the test
set and is for reading, not for choosing.
"""
import json
import os
from typing import Any, Dict, List

import ml_collections
import numpy as np

from capsjax import reports, train, validation
from capsjax.assemble import overridden
from capsjax.ensembles import parse_variant
from capsjax.errors import ConfigError
from capsjax.keys import Rule, key
from capsjax.app.plots import pyplot, save_figure
from capsjax.reports import markdown_table, mean_std
from capsjax.runtime import PROCESS_KEYS
from capsjax.app.programs import not_a_command, register_program


KEYS = (
    # sweep: the sweep program: one run per variant
    key('sweep.variants', (), Rule(lambda v: isinstance(v, (tuple, list)) and all(isinstance(x, str) for x in v),
                                   'a tuple of override strings'),
        'the sweep: one run per variant, KEY=VALUE overrides separated by commas', in_base=False),
)


# What one command sets for every variant: which program and experiment it is, and how
# its processes start.
SWEEP_WIDE_KEYS = ('program', 'experiment') + PROCESS_KEYS


def variant_config(config, overrides: Dict[str, Any]) -> ml_collections.ConfigDict:
  """The config of one sweep variant: the base with its overrides, trained as one run."""
  variant = overridden(config, overrides, 'sweep override')
  variant.program = 'train'
  return variant


def config_problems(config) -> List[str]:
  """Each sweep variant checked as the config it trains (one line per rule broken, naming
  the variant): a bad variant is refused before the first one trains (capsjax.validation
  runs it: this module registered its section)."""
  found, variants = validation.lookup(config, 'sweep.variants')
  if not found or not variants:
    return []
  try:
    parsed = [parse_variant(spec) for spec in variants]
  except ConfigError as e:
    return [str(e)]
  names = [name for name, _ in parsed]
  if len(set(names)) != len(names):
    return [f'config.sweep.variants: variant names repeat: {names}']
  problems = []
  for name, overrides in parsed:
    fixed = [key for key in overrides if key in SWEEP_WIDE_KEYS or key.startswith('sweep.')]
    if fixed:   # (distributed=True in a variant was silently ignored)
      problems.append(f'sweep variant {name!r}: {fixed[0]} is the same for every variant of a sweep; ' + (
          f'set --config.{fixed[0]} for the whole sweep' if fixed[0] in PROCESS_KEYS else
          "each variant trains under the sweep's own --experiment"))
      continue
    try:
      variant = variant_config(config, overrides)
    except ConfigError as e:
      problems.append(f'sweep variant {name!r}: {e}')
      continue
    variant.sweep.variants = ()   # the variant trains alone
    problems += [f'sweep variant {name!r}: {line}' for line in validation.problems_of(variant)]
  return problems


def summarize_run(name: str, overrides: Dict[str, Any], result: reports.RunResult) -> Dict[str, Any]:
  """One sweep row from a finished run: errors as mean ± std over its seeds."""
  listed = lambda value: value if isinstance(value, list) else [value]
  test_error, test_std = mean_std(listed(result.test_error))
  row = dict(name=name, overrides=overrides, test_error=test_error, test_error_std=test_std,
             seeds=len(listed(result.test_error)), wall_time_s=result.wall_time_s, steps=result.steps,
             final_train_loss=float(np.mean(listed(result.final_train_loss or float('nan')))))
  if result.validation_error is not None:
    row['validation_error'], row['validation_error_std'] = mean_std(listed(result.validation_error))
  for split in ('validation', 'test'):   # config.ema_decay: the moving average, evaluated beside
    if f'ema_{split}_error' in result.results:
      row[f'ema_{split}_error'] = mean_std(listed(result.results[f'ema_{split}_error']))[0]
  return row


def render_table(config, rows: List[Dict[str, Any]]) -> str:
  reference = rows[0]
  validated = all('validation_error' in row for row in rows)
  key = 'validation_error' if validated else 'test_error'
  seeds = rows[0]['seeds']
  lines = [f'# Hyper-parameter sweep, `{config.experiment}`', '',
           'Each row trains the base config with the listed overrides'
           + (f', {seeds} seeds each (mean ± sample std)' if seeds > 1 else ', one seed each') +
           f'; Δ is the change against `{reference["name"]}` (negative = better). Judge a Δ against the '
           f'spread between seeds.', '']
  if validated:
    lines += [f'Ranked by validation error ({config.validation_examples} held-out training images); '
              'the test error is reported, never used to choose.', '']
  else:
    lines += ['No validation split (config.validation_examples = 0): the ranking below is on the '
              'test set, for reading only; choose with --config.validation_examples=N.', '']
  spread = lambda row, name: f' ± {100 * row[name + "_std"]:.3f}' if row['seeds'] > 1 else ''
  cells = []
  for row in rows:
    overrides = ', '.join(f'{k}={v}' for k, v in row['overrides'].items()) or '(base)'
    delta = 100 * (row[key] - reference[key])
    cell = [row['name'], overrides]
    if validated:
      cell.append(f'{100 * row["validation_error"]:.3f}{spread(row, "validation_error")}')
    cell += [f'{100 * row["test_error"]:.3f}{spread(row, "test_error")}', f'{delta:+.3f}',
             f'{row["final_train_loss"]:.4f}', f'{row["wall_time_s"]:.0f}']
    cells.append(cell)
  columns = [('variant', 'l'), ('overrides', 'l')]
  if validated:
    columns.append(('validation error (%)', 'r'))
  columns += [('test error (%)', 'r'), (f'Δ {"validation" if validated else "test"} (points)', 'r'),
              ('final train loss', 'r'), ('wall time (s)', 'r')]
  lines += markdown_table(columns, cells)
  best = min(rows, key=lambda r: r[key])
  lines += ['', f'Lowest {key.replace("_", " ")}: `{best["name"]}` at {100 * best[key]:.3f} % '
            f'(test error {100 * best["test_error"]:.3f} %).']
  for row in rows:
    if f'ema_{key}' in row:
      lines += ['', f'`{row["name"]}`\'s moving average of the parameters: {key.replace("_", " ")} '
                f'{100 * row[f"ema_{key}"]:.3f} %' + (f', test error {100 * row["ema_test_error"]:.3f} %'
                                                      if key != 'test_error' and 'ema_test_error' in row else '')
                + '.']
  return '\n'.join(lines) + '\n'


def plot(rows, path: str) -> None:
  figure, axis = pyplot().subplots(figsize=(max(5, len(rows) * 0.9), 3.5))
  names = [r['name'] for r in rows]
  errors = [100 * r['test_error'] for r in rows]
  axis.bar(names, errors, color=['gray'] + ['tab:blue'] * (len(rows) - 1))
  axis.axhline(errors[0], color='gray', linestyle='--', linewidth=1)
  axis.set_ylabel('test error (%)')
  axis.tick_params(axis='x', rotation=45)
  save_figure(figure, path)


@register_program('sweep')
def run(config, workdir: str) -> Dict[str, Any]:
  # Each variant was checked as the config it trains with the sweep's own (capsjax.validation).
  variants = [parse_variant(spec) for spec in config.sweep.variants]
  if not variants:
    raise ConfigError('config.sweep.variants is empty')
  configs = [variant_config(config, overrides) for _, overrides in variants]
  os.makedirs(workdir, exist_ok=True)
  rows = []
  for (name, overrides), variant in zip(variants, configs):
    results = train.train_and_evaluate(variant, os.path.join(workdir, name))
    rows.append(summarize_run(name, overrides, results))
  table = render_table(config, rows)
  with open(os.path.join(workdir, 'sweep.md'), 'w') as f:
    f.write(table)
  with open(os.path.join(workdir, 'sweep.json'), 'w') as f:
    json.dump(rows, f, indent=2)
  plot(rows, os.path.join(workdir, 'sweep.png'))
  print(table, flush=True)
  return {'rows': rows}


if __name__ == '__main__':
  not_a_command('sweep')
