"""The routing zoo: every routing algorithm on the same CapsNet, data order and seeds.

`run(config, workdir)` trains, for each name in config.routing_zoo.routings, config's
model with `model.routing=NAME` (and that routing's options from
config.routing_zoo.options) over config.routing_zoo.seeds as one vmapped program, in
workdir/NAME, with a held-out validation split (config.validation_examples). It then
writes routing.md and routing.json (per routing: parameters, test error at the end and at
the best validation evaluation, mean ± std over the seeds; and, measured after every
routing has trained, training and inference images/s in interleaved rounds: median and
range; the routing diagnostics of the last evaluation, capsjax.diagnostics, mean over the
seeds) and routing_test_error.png (test error over steps, mean over the seeds) and
routing_diagnostics.png (one panel per diagnostic, one line per routing).
"""
import json
import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from capsjax import experiment, runtime, sharding, train, validation
from capsjax.app.trained import load_trained, select_member
from capsjax.errors import ConfigError
from capsjax.keys import key, int_at_least, registered_tuple, distinct_seeds
from capsjax.app.plots import pyplot, save_figure
from capsjax.reports import markdown_table, mean_std
from capsjax.routing import ROUTINGS, routing_option_defaults
from capsjax.workdir import MetricsLog
from capsjax.app.programs import not_a_command, register_program

KEYS = (
    # routing_zoo: the routing zoo: every routing algorithm on the same CapsNet
    key('routing_zoo.routings', ('dynamic', 'em', 'self_attention', 'inverted_dot_product', 'self_routing',
                                 'variational_bayes', 'uniform', 'max_pooling'), registered_tuple(ROUTINGS.names, 'routing names'),
        'the routing algorithms the zoo trains, each over routing_zoo.seeds', in_base=False),
    key('routing_zoo.seeds', (0, 1, 2), distinct_seeds(allow_empty=False), 'the seeds of each routing (one '
        'vmapped program per routing)', in_base=False),
    # Checked as each member's model.routing_options is (capsjax.validation).
    key('routing_zoo.options', {}, None, 'per routing name, its options over its model.routing_options section '
        '(a dict: routing name → its options)', in_base=False),
    # Speed, measured after training in interleaved rounds (every routing once per round): the
    # median and range per routing, so that the machine's load cannot reorder them.
    key('routing_zoo.speed_rounds', 5, int_at_least(1), 'interleaved rounds of the speed measurement (every '
        'routing once per round)', in_base=False),
    key('routing_zoo.speed_steps', 5, int_at_least(1), 'training steps per timed sample of the speed measurement',
        in_base=False),
)


def routing_config(config, name: str) -> ml_collections.ConfigDict:
  """config's run with routing `name` (its options) over the zoo's seeds."""
  member = ml_collections.ConfigDict(config.to_dict())
  del member['routing_zoo']
  member.program = 'train'
  member.experiment = f'{config.experiment}/{name}'
  member.model.routing = name
  sections = (config.model.get('routing_options') or ml_collections.ConfigDict()).to_dict()
  own = {**sections.get(name, {}), **dict(config.routing_zoo.options.get(name, {}))}
  # Its own section is read; the other routings' (set for their own members) stay at their
  # defaults here, as a model of this routing reads none of them.
  sections = {section: routing_option_defaults(section) for section in sections if section in ROUTINGS}
  sections[name] = own
  member.model.routing_options = ml_collections.ConfigDict(sections)
  member.ensemble = ml_collections.ConfigDict(dict(seeds=tuple(config.routing_zoo.seeds)))
  return member


def _routings(config) -> Tuple[str, ...]:
  found, routings = validation.lookup(config, 'routing_zoo.routings')
  return tuple(routings) if found and routings else ()


def model_as_checked(config, model):
  """The model as the base config's check sees it: the sections of the routings the zoo
  trains beside model.routing are their members' (checked there), at their defaults here
  (capsjax.validation asks each registered section's module)."""
  sections = model.get('routing_options')
  others = [name for name in _routings(config) if name != model.get('routing') and name in ROUTINGS]
  if not others or not hasattr(sections, 'keys') or not any(name in sections for name in others):
    return model
  checked = ml_collections.ConfigDict(model.to_dict())
  for name in others:
    if name in checked.routing_options:
      checked.routing_options[name] = routing_option_defaults(name)
  return checked


def _zoo_sections_problems(config) -> List[str]:
  """model.routing_options.NAME of a routing the zoo trains, checked as its member's own
  section (the options it takes, the values their rules allow)."""
  sections = config.model.get('routing_options')
  problems = []
  for name in _routings(config):
    if name == config.model.get('routing') or name not in ROUTINGS or not hasattr(sections, 'keys') \
        or name not in sections or not hasattr(sections[name], 'items'):
      continue
    problems.extend(line for line in _member_problems(config, name, sections[name])
                    if f'routing_options.{name}.' in line)
  return problems


def _member_problems(config, name: str, options) -> List[str]:
  """The problems of config.model as the zoo's member of routing `name` with `options`
  (its own section) sees it."""
  member = config.model.to_dict()
  member.update(routing=name, routing_options={name: dict(options)})
  return validation.model_problems(ml_collections.ConfigDict(member), 'model.')


def _zoo_options_problems(config, zoo_options) -> List[str]:
  """routing_zoo.options checked as each member's model.routing_options is: a routing the
  zoo trains, options it takes, values the model's rules allow."""
  if not hasattr(zoo_options, 'keys'):
    return [f'config.routing_zoo.options={zoo_options!r}: allowed a dict: routing name → its options']
  problems = []
  routings = _routings(config)
  for name, options in zoo_options.items():
    where = f'config.routing_zoo.options.{name}'
    if name not in routings:
      problems.append(f'{where}: {name!r} is not among routing_zoo.routings ({", ".join(routings)})')
      continue
    if not hasattr(options, 'keys'):
      problems.append(f'{where}={options!r}: allowed a dict of the routing\'s options')
      continue
    problems.extend(line.replace(f'config.model.routing_options.{name}.', f'{where}.')
                    for line in _member_problems(config, name, options))
  return problems


def config_problems(config) -> List[str]:
  """routing_zoo.options and the routing sections of the members, each checked as the
  member's own model (capsjax.validation runs it: this module registered its section)."""
  found, zoo_options = validation.lookup(config, 'routing_zoo.options')
  if not found or zoo_options is None or 'model' not in config:
    return []
  return _zoo_options_problems(config, zoo_options) + _zoo_sections_problems(config)


def training_timer(config, name: str, steps: int) -> Callable[[], float]:
  """A timed sample of routing `name`'s training program (its members vmapped, as trained;
  compiled here): `steps` steps from a fresh state → images/s over every member."""
  member = routing_config(config, name)
  program = experiment.start(member, sharding.data_mesh()).steps   # as train_and_evaluate starts it
  carried = {'state': program.initial_state, 'step': 0}

  def run(count):
    for _ in range(count):
      carried['state'], _ = program.train_step(carried['state'], carried['step'])
      carried['step'] += 1
    jax.block_until_ready(carried['state'])

  run(1)   # compiled
  images = steps * member.batch_size * len(config.routing_zoo.seeds)

  def sample():
    start = time.perf_counter()
    run(steps)
    return images / (time.perf_counter() - start)
  return sample


def inference_timer(workdir: str, batch_size: int) -> Callable[[], float]:
  """A timed sample of test-time forward passes (class activations) of the trained member
  0 on a batch of `batch_size` zeros (compiled here) → images/s."""
  config, model, params = load_trained(workdir)
  params = select_member(params, 0, workdir, bool(config.ensemble))
  forward = jax.jit(lambda p, x: model.apply({'params': p}, x, method='classify')[1])
  images = jnp.zeros((batch_size,) + tuple(config.model.input_shape), jnp.float32)
  forward(params, images).block_until_ready()

  def sample():
    start = time.perf_counter()
    forward(params, images).block_until_ready()
    return batch_size / (time.perf_counter() - start)
  return sample


def interleaved(samplers: Dict[str, Callable[[], float]], rounds: int) -> Dict[str, Dict[str, float]]:
  """Each sampler called once per round, in turn, the order rotated every round: a change
  of the machine's load falls on every name alike. {name: {median, min, max}} of its
  samples."""
  names = list(samplers)
  samples = {name: [] for name in names}
  for round_index in range(rounds):
    shift = round_index % len(names)
    for name in names[shift:] + names[:shift]:
      samples[name].append(samplers[name]())
  return {name: {'median': float(np.median(values)), 'min': float(np.min(values)), 'max': float(np.max(values))}
          for name, values in samples.items()}


def test_rows(rows):
  """The test rows of metrics.jsonl in step order, the last one per step (a run evaluated
  again, `--config.reevaluate=True`, appends a newer row for its last step)."""
  by_step = {row['step']: row for row in rows if row.get('split') == 'test'}
  return [by_step[step] for step in sorted(by_step)]


def error_curve(rows):
  """(steps, test error mean over members) of the test rows."""
  test = test_rows(rows)
  return [row['step'] for row in test], [float(np.mean(row['error'])) for row in test]


# The diagnostics the zoo reports (capsjax.diagnostics' metrics fields) and their panels.
DIAGNOSTICS = (('routing_coupling_entropy', 'coupling entropy (1 = uniform)'),
               ('routing_coupling_movement', 'coupling movement, first → last iteration'),
               ('routing_consistency_gap', 'consistency: same class − other classes'),
               ('primary_capsules_inactive', 'share of primary capsules never ≥ 0.1'))


def _seed_mean(value):
  """The mean over the members of a metrics field (None where absent)."""
  if value is None or (isinstance(value, list) and any(v is None for v in value)):
    return None
  return float(np.mean(value))


def diagnostics_of(row: Dict[str, Any]) -> Dict[str, Any]:
  """The zoo's diagnostics from one test row of metrics.jsonl: seed means, None where the
  routing has no couplings; the iteration sweep as a list over r (seed means)."""
  values = {field: _seed_mean(row.get(field)) for field, _ in DIAGNOSTICS if field in row}
  same, other = _seed_mean(row.get('routing_consistency_same_class')), _seed_mean(row.get('routing_consistency_other_class'))
  values['routing_consistency_same_class'], values['routing_consistency_other_class'] = same, other
  values['routing_consistency_gap'] = None if same is None or other is None else same - other
  values['class_capsules_inactive'] = _seed_mean(row.get('class_capsules_inactive'))
  sweep = row.get('accuracy_by_routing_iterations')
  if sweep is not None:
    sweep = np.asarray(sweep, np.float64)
    values['accuracy_by_routing_iterations'] = (sweep.mean(axis=0) if sweep.ndim == 2 else sweep).tolist()
  return values


def diagnostics_curves(metrics) -> Dict[str, Any]:
  """{'steps': [...], field: [seed means per test row]} of the zoo's diagnostics."""
  test = [row for row in test_rows(metrics) if 'primary_capsules_inactive' in row]
  curves = {'steps': [row['step'] for row in test]}
  for row in test:
    for field, value in diagnostics_of(row).items():
      if field != 'accuracy_by_routing_iterations':
        curves.setdefault(field, []).append(value)
  return curves


def _number(value, digits: int = 3) -> str:
  return 'absent' if value is None else f'{value:.{digits}f}'


def _percent(values) -> str:
  mean, std = mean_std([100.0 * v for v in values])
  return f'{mean:.2f} ± {std:.2f}' if len(values) > 1 else f'{mean:.2f}'


# Baselines every routing is compared with in the zoo's table, where they ran.
BASELINES = ('uniform', 'dynamic')


def difference(errors, baseline_errors) -> Tuple[float, Optional[bool]]:
  """(mean difference in percentage points, whether it exceeds twice its standard error
  sqrt(s_a²/n_a + s_b²/n_b) over the seeds; None with fewer than 2 seeds a side)."""
  a, b = 100.0 * np.asarray(errors, np.float64), 100.0 * np.asarray(baseline_errors, np.float64)
  delta = float(a.mean() - b.mean())
  if len(a) < 2 or len(b) < 2:
    return delta, None
  standard_error = float(np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b)))
  return delta, abs(delta) > 2 * standard_error


def _difference(row, baseline_row) -> str:
  if baseline_row is None or row is baseline_row:
    return '-'
  delta, beyond = difference(_selected_errors(row), _selected_errors(baseline_row))
  return f'{delta:+.2f}' + (' *' if beyond else '')


def _selected_errors(row):
  return row['test_error_at_best_validation'] or row['test_error']


def _speed(measured: Dict[str, float]) -> str:
  return f'{measured["median"]:.0f} ({measured["min"]:.0f}–{measured["max"]:.0f})'


def _options_used(config, name: str) -> str:
  """The options routing `name` trained with that differ from its defaults, 'KEY=VALUE, …'."""
  if name not in ROUTINGS:
    return ''
  defaults = routing_option_defaults(name)
  own = routing_config(config, name).model.routing_options.get(name) or {}
  return ', '.join(f'{key}={value!r}' for key, value in sorted(dict(own).items()) if defaults.get(key) != value)


def render(config, rows) -> str:
  seeds = ', '.join(map(str, config.routing_zoo.seeds))
  zoo = config.routing_zoo
  lines = [f'# Routing algorithms on the same CapsNet, `{config.experiment}`', '',
           f'Seeds {seeds} (one vmapped program per routing, the same data order); '
           f'{config.num_steps or config.num_epochs} {"steps" if config.num_steps else "epochs"} of batch '
           f'{config.batch_size} on {config.num_train_examples or "all"} training images, '
           f'{config.validation_examples} held out for validation; test on '
           f'{config.num_test_examples or "all"} test images; {config.model.routing_iterations} routing '
           'iterations where a routing iterates. Test error in %, mean ± sample std over the seeds; '
           '"at best validation": each seed\'s test error at its lowest validation error.', '']
  used = [f'`{row["routing"]}` {options}' for row in rows for options in [_options_used(config, row['routing'])]
          if options]
  if used:
    lines[-2] += ' Routing options other than their defaults: ' + '; '.join(used) + '.'
  baselines = {name: next((row for row in rows if row['routing'] == name), None) for name in BASELINES}
  compared = [name for name in BASELINES if baselines[name] is not None]
  if compared:   # lines[-2]: the paragraph above (lines[-1] is the blank line after it)
    lines[-2] += (' "vs NAME": the difference of the means at best validation in percentage points, '
                  '* where it exceeds twice its standard error over the seeds (sqrt(s²/n + s²/n)).')
  table = [(row['routing'], f'{row["num_params"]:,}', _percent(row['test_error']),
            _percent(row['test_error_at_best_validation']) if row['test_error_at_best_validation'] else '-')
           + tuple(_difference(row, baselines[name]) for name in compared)
           for row in rows]
  lines += markdown_table([('routing', 'l'), ('parameters', 'r'), ('test error (%)', 'r'),
                           ('at best validation (%)', 'r')] + [(f'vs {name}', 'r') for name in compared], table)
  lines += ['', '## Speed', '',
            f'Measured after every routing had trained, on {runtime.device_name()} '
            f'({jax.default_backend()}), {time.strftime("%Y-%m-%d")}: {zoo.speed_rounds} interleaved rounds '
            '(each routing once per round, the order rotated), so that the machine\'s load falls on every '
            'routing alike; median (min–max) of the rounds. Training: '
            f'{zoo.speed_steps} steps of {config.batch_size} × {len(config.routing_zoo.seeds)} members per '
            f'sample; inference: one model, a batch of {config.eval_batch_size}.', '']
  lines += markdown_table([('routing', 'l'), ('train images/s', 'r'), ('infer images/s', 'r')],
                          [(row['routing'], _speed(row['train_speed']), _speed(row['infer_speed'])) for row in rows])
  if any(row.get('diagnostics') for row in rows):
    sweep = max((len(row['diagnostics'].get('accuracy_by_routing_iterations') or []) for row in rows), default=0)
    lines += ['', '## Routing diagnostics', '',
              f'At the last evaluation, on the first {config.evals.routing_diagnostics.examples or "all"} test images, '
              'mean over the seeds (capsjax.diagnostics): coupling entropy over the parents / log(parents) '
              '(1 = uniform); movement = total-variation distance between the first and the last '
              "iteration's couplings per child; consistency = mean cosine similarity of two images' "
              'couplings (deviations from uniform) for the same class / different classes; inactive = the '
              "share of capsules whose activation (the length; EM's and VB's a_j for class capsules) "
              'never reached 0.1. "absent": the routing has no couplings. '
              f'Test accuracy (%) with r = 1 … {sweep} routing iterations at test time, for iterative routings.', '']
    header = [('routing', 'l'), ('entropy', 'r'), ('movement', 'r'), ('consistency same / other', 'r'),
              ('inactive primary / class', 'r'), ('accuracy by r (%)', 'l')]
    table = []
    for row in rows:
      d = row.get('diagnostics') or {}
      accuracies = d.get('accuracy_by_routing_iterations')
      table.append((row['routing'], _number(d.get('routing_coupling_entropy')),
                    _number(d.get('routing_coupling_movement')),
                    f'{_number(d.get("routing_consistency_same_class"))} / '
                    f'{_number(d.get("routing_consistency_other_class"))}',
                    f'{_number(d.get("primary_capsules_inactive"), 2)} / {_number(d.get("class_capsules_inactive"), 2)}',
                    ', '.join(f'{100 * a:.1f}' for a in accuracies) if accuracies else '-'))
    lines += markdown_table(header, table)
  return '\n'.join(lines) + '\n'


def plot(curves, path: str) -> None:
  figure, axis = pyplot().subplots(figsize=(6, 4))
  for name, (steps, errors) in curves.items():
    axis.plot(steps, [100 * e for e in errors], marker='o', label=name)
  axis.set_xlabel('training step')
  axis.set_ylabel('test error (%), mean over seeds')
  axis.set_yscale('log')
  axis.legend()
  axis.set_title('Routing algorithms: test error over training')
  save_figure(figure, path)


def plot_diagnostics(curves: Dict[str, Dict[str, Any]], path: str) -> None:
  """One panel per diagnostic over the training steps, one line per routing (a routing
  without couplings has no line in the coupling panels)."""
  figure, axes = pyplot().subplots(1, len(DIAGNOSTICS), figsize=(4 * len(DIAGNOSTICS) + 1.5, 3.5))
  # One colour per routing in every panel, and one legend naming them all (a routing
  # without couplings draws only in the activity panel).
  colours = {name: f'C{index % 10}' for index, name in enumerate(curves)}
  handles = {}
  for axis, (field, title) in zip(axes, DIAGNOSTICS):
    for name, curve in curves.items():
      points = [(s, v) for s, v in zip(curve['steps'], curve.get(field, [])) if v is not None]
      if points:
        handles[name], = axis.plot(*zip(*points), marker='o', color=colours[name], label=name)
    axis.set_title(title, fontsize=9)
    axis.set_xlabel('training step')
  named = [name for name in curves if name in handles]
  figure.legend([handles[name] for name in named], named, loc='center right', fontsize=8)
  figure.tight_layout(rect=(0, 0, 1 - 1.5 / (4 * len(DIAGNOSTICS) + 1.5), 1))
  save_figure(figure, path, tight=False)


@register_program('routing_zoo')
def run(config, workdir: str) -> Dict[str, Any]:
  names = tuple(config.routing_zoo.routings)
  unknown = [name for name in names if name not in ROUTINGS]
  if unknown or not names:
    raise ConfigError(f'config.routing_zoo.routings={names!r}: allowed names of {", ".join(ROUTINGS)}')
  if not config.validation_examples:
    raise ConfigError('the routing zoo reports the test error at the best validation step: set '
                      'config.validation_examples > 0')
  os.makedirs(workdir, exist_ok=True)
  rows, curves, diagnostic_curves = [], {}, {}
  for name in names:
    run_dir = os.path.join(workdir, name)
    result = train.train_and_evaluate(routing_config(config, name), run_dir)   # RunStopped: resumable
    metrics = MetricsLog(run_dir).read()
    selected = result.selected_by_validation
    rows.append({'routing': name, 'num_params': result.num_params,
                 'test_error': list(np.atleast_1d(result.test_error)),
                 'test_error_at_best_validation': list(np.atleast_1d(selected['test_error'])) if selected else None})
    curves[name] = error_curve(metrics)
    last_test = test_rows(metrics)
    if last_test and 'primary_capsules_inactive' in last_test[-1]:   # config.evals.routing_diagnostics
      rows[-1]['diagnostics'] = diagnostics_of(last_test[-1])
      diagnostic_curves[name] = diagnostics_curves(metrics)
  zoo = config.routing_zoo
  training = interleaved({name: training_timer(config, name, zoo.speed_steps) for name in names}, zoo.speed_rounds)
  inference = interleaved({name: inference_timer(os.path.join(workdir, name), config.eval_batch_size)
                           for name in names}, zoo.speed_rounds)
  for row in rows:
    row.update(train_speed=training[row['routing']], infer_speed=inference[row['routing']],
               train_images_per_s=training[row['routing']]['median'],
               infer_images_per_s=inference[row['routing']]['median'])
  table = render(config, rows)
  with open(os.path.join(workdir, 'routing.md'), 'w') as f:
    f.write(table)
  summary = {'rows': rows, 'curves': {name: {'steps': s, 'test_error': e} for name, (s, e) in curves.items()},
             'diagnostic_curves': diagnostic_curves, 'completed': True}
  with open(os.path.join(workdir, 'routing.json'), 'w') as f:
    json.dump(summary, f, indent=2)
  plot(curves, os.path.join(workdir, 'routing_test_error.png'))
  if diagnostic_curves:
    plot_diagnostics(diagnostic_curves, os.path.join(workdir, 'routing_diagnostics.png'))
  print(table, flush=True)
  return summary


if __name__ == '__main__':
  not_a_command('routing_zoo')
