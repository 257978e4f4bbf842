"""Hyper-parameter sweep: one training per variant of the base config, then a table of
what helped.

config.sweep.variants is a tuple of strings 'NAME: key=value, key=value' (keys are
config paths such as learning_rate, lr_decay_steps, batch_size, max_shift,
model.routing_iterations; values are Python literals). The first variant is the
reference. `run(config, workdir)` trains each variant in workdir/NAME (resumable) with
`train.train_and_evaluate` and writes sweep.md, sweep.json and sweep.png.
"""
import ast
import json
import os
from typing import Any, Dict, List, Tuple

import ml_collections

from capsjax import train, validation
from capsjax.errors import ConfigError
from capsjax.programs.common import markdown_table, pyplot, save_figure


def parse_variant(spec: str) -> Tuple[str, Dict[str, Any]]:
  """'name: a=1, b.c=2e-3' → ('name', {'a': 1, 'b.c': 0.002})."""
  name, _, assignments = spec.partition(':')
  name = name.strip()
  if not name or not name.replace('_', '').replace('-', '').replace('.', '').isalnum():
    raise ConfigError(f'sweep variant {spec!r}: the name before ":" must be a plain word')
  overrides = {}
  for assignment in filter(None, (a.strip() for a in assignments.split(','))):
    key, equals, value = assignment.partition('=')
    if not equals:
      raise ConfigError(f'sweep variant {name!r}: expected key=value, got {assignment!r}')
    try:
      overrides[key.strip()] = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
      raise ConfigError(f'sweep variant {name!r}: {value.strip()!r} is not a Python literal') from None
  return name, overrides


def variant_config(config, overrides: Dict[str, Any]) -> ml_collections.ConfigDict:
  variant = ml_collections.ConfigDict(config.to_dict())
  variant.program = 'train'
  for key, value in overrides.items():
    *parents, leaf = key.split('.')
    node = variant
    for parent in parents:
      node = node[parent] if parent in node else None
      if node is None:
        raise ConfigError(f'sweep override {key!r}: no such config key')
    if leaf not in node:
      raise ConfigError(f'sweep override {key!r}: no such config key')
    try:
      node[leaf] = type(node[leaf])(value) if isinstance(node[leaf], float) else value
    except (TypeError, ValueError) as e:
      raise ConfigError(f'sweep override {key}={value!r}: {e}') from None
  return variant


def render_table(config, rows: List[Dict[str, Any]]) -> str:
  reference = rows[0]
  lines = [f'# Hyper-parameter sweep, `{config.experiment}`', '',
           f'Each row trains the base config with the listed overrides; Δ is the change in test '
           f'error against `{reference["name"]}` (negative = better). One run per variant: judge a '
           f'Δ against the spread between variants that change only `seed`.', '']
  cells = []
  for row in rows:
    overrides = ', '.join(f'{k}={v}' for k, v in row['overrides'].items()) or '(base)'
    delta = 100 * (row['test_error'] - reference['test_error'])
    cells.append((row['name'], overrides, f'{100 * row["test_error"]:.2f}', f'{delta:+.2f}',
                  f'{row["final_train_loss"]:.4f}', f'{row["wall_time_s"]:.0f}'))
  lines += markdown_table([('variant', 'l'), ('overrides', 'l'), ('test error (%)', 'r'), ('Δ (points)', 'r'),
                           ('final train loss', 'r'), ('wall time (s)', 'r')], cells)
  best = min(rows, key=lambda r: r['test_error'])
  lines += ['', f'Best: `{best["name"]}` at {100 * best["test_error"]:.2f} % test error.']
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


def run(config, workdir: str) -> Dict[str, Any]:
  variants = [parse_variant(spec) for spec in config.sweep.variants]
  if not variants:
    raise ConfigError('config.sweep.variants is empty')
  names = [name for name, _ in variants]
  if len(set(names)) != len(names):
    raise ConfigError(f'sweep variant names repeat: {names}')
  configs = [variant_config(config, overrides) for _, overrides in variants]  # validate all first
  for name, variant in zip(names, configs):
    try:
      validation.validate(variant)
    except ConfigError as e:
      raise ConfigError(f'sweep variant {name!r}: {e}') from None
  os.makedirs(workdir, exist_ok=True)
  rows = []
  for (name, overrides), variant in zip(variants, configs):
    results = train.train_and_evaluate(variant, os.path.join(workdir, name))
    rows.append(dict(name=name, overrides=overrides, test_error=results['test_error'],
                     test_accuracy=results['test_accuracy'], final_train_loss=results['final_train_loss'] or float('nan'),
                     wall_time_s=results['wall_time_s'], steps=results['steps']))
  table = render_table(config, rows)
  with open(os.path.join(workdir, 'sweep.md'), 'w') as f:
    f.write(table)
  with open(os.path.join(workdir, 'sweep.json'), 'w') as f:
    json.dump(rows, f, indent=2)
  plot(rows, os.path.join(workdir, 'sweep.png'))
  print(table, flush=True)
  return {'rows': rows}
