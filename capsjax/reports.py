"""What a finished run reports beyond its last evaluation: the test error at the best
validation evaluation (never at the best test one), mean ± std over the seeds of an
ensemble, and the markdown tables the programs and `table.md` are made of."""
import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class RunResult:
  """A finished run: what every program composes runs from (an unfinished run raises
  capsjax.errors.RunStopped instead, so no program reads results that do not exist).
  Errors and accuracies are floats, or per-member lists for an ensemble; `results` is
  results.json as written (item access reads it: result['test_error']).

  Example:
    `result` from train_and_evaluate's example.

    >>> result['test_error'] == result.test_error, result.num_params > 0
    (True, True)
  """
  steps: int
  num_params: int
  test_error: Any
  test_accuracy: Any
  final_train_loss: Any
  wall_time_s: float
  stopped_early: bool
  members: Optional[List[Dict[str, Any]]]
  validation_error: Any
  selected_by_validation: Optional[Dict[str, Any]]
  results: Dict[str, Any]

  @classmethod
  def from_results(cls, results: Dict[str, Any]) -> 'RunResult':
    return cls(steps=results['steps'], num_params=results['num_params'], test_error=results['test_error'],
               test_accuracy=results['test_accuracy'], final_train_loss=results.get('final_train_loss'),
               wall_time_s=results.get('wall_time_s', 0.0), stopped_early=bool(results.get('stopped_early')),
               members=results.get('members'), validation_error=results.get('validation_error'),
               selected_by_validation=results.get('selected_by_validation'), results=results)

  def __getitem__(self, key: str) -> Any:
    return self.results[key]


def describe_values(values, ensemble: bool) -> str:
  """A float, or an ensemble's list of floats, for the console."""
  return ' '.join(f'{v:.4f}' for v in values) if ensemble else f'{values:.4f}'


def describe_test(metrics: Dict[str, Any], ensemble: bool, labels_per_example: int = 1) -> str:
  """An evaluation's metrics (a run's, or an ensemble's per member) for the console. With
  several labels per example (MultiMNIST's pairs) the accuracy is the pair's (all labels
  among the top k scores, the paper's measure) and the per-digit accuracy stands beside it."""
  k = labels_per_example
  accuracy = 'accuracy' if k == 1 else f'pair accuracy (all {k} among the top {k})'
  digits = (f'; per-digit accuracy {describe_values(metrics["digit_accuracy"], ensemble)}'
            if labels_per_example > 1 and 'digit_accuracy' in metrics else '')
  if not ensemble:
    average = (f'; moving average: accuracy {metrics["ema_accuracy"]:.4f} (error {100 * metrics["ema_error"]:.2f}%)'
               if 'ema_accuracy' in metrics else '')
    shifted = (f'; shift-averaged error {100 * metrics["shift_averaged_error"]:.2f}%'
               if 'shift_averaged_error' in metrics else '')
    return f'{accuracy} {metrics["accuracy"]:.4f} (error {100 * metrics["error"]:.2f}%){digits}{average}{shifted}'
  combined = (f', summed as one ensemble {metrics["ensemble_accuracy"]:.4f}'
              if 'ensemble_accuracy' in metrics else '')
  shifted = (f'; shift-averaged error per member {describe_values(metrics["shift_averaged_error"], True)}'
             if 'shift_averaged_error' in metrics else '')
  return f'{accuracy} per member {describe_values(metrics["accuracy"], True)}{combined}{digits}{shifted}'


def markdown_table(columns: Sequence[Tuple[str, str]], rows: Sequence[Sequence[Any]]) -> List[str]:
  """Lines of a markdown table; `columns` are (header, 'l' or 'r' alignment)."""
  lines = ['| ' + ' | '.join(header for header, _ in columns) + ' |',
           '| ' + ' | '.join('---:' if align == 'r' else '---' for _, align in columns) + ' |']
  lines += ['| ' + ' | '.join(str(cell) for cell in row) + ' |' for row in rows]
  return lines


def mean_std(values: Sequence[float]) -> Tuple[float, float]:
  """Mean and sample standard deviation (ddof 1; 0 for one value)."""
  values = np.asarray(values, np.float64)
  return float(values.mean()), float(values.std(ddof=1)) if len(values) > 1 else 0.0


def best_validation_steps(steps: Sequence[int], errors: Sequence[Any]):
  """The step of the lowest validation error (the earliest on ties): one step for a
  single run (`errors` scalars), a list of one per member for an ensemble (`errors` lists)."""
  order = np.argsort(np.asarray(steps), kind='stable')
  steps = [steps[i] for i in order]
  errors = np.asarray([errors[i] for i in order], np.float64)   # [evals] or [evals, members]
  best = np.argmin(errors, axis=0)                              # the first minimum
  return steps[int(best)] if errors.ndim == 1 else [steps[int(b)] for b in best]


def select_by_validation(rows: Sequence[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
  """The evaluation with the lowest validation error (the earliest on ties) and the test
  error at that same step, from metrics.jsonl rows; per member for an ensemble (lists).
  None when no step has both a validation and a test row."""
  validation = {row['step']: row for row in rows if row.get('split') == 'validation'}
  test = {row['step']: row for row in rows if row.get('split') == 'test'}
  steps = sorted(set(validation) & set(test))
  if not steps:
    return None
  chosen = best_validation_steps(steps, [validation[s]['error'] for s in steps])
  if not isinstance(chosen, list):
    return {'step': chosen, 'epoch': validation[chosen]['epoch'],
            'validation_error': validation[chosen]['error'], 'test_error': test[chosen]['error']}
  return {'step': chosen, 'epoch': [validation[s]['epoch'] for s in chosen],
          'validation_error': [validation[s]['error'][m] for m, s in enumerate(chosen)],
          'test_error': [test[s]['error'][m] for m, s in enumerate(chosen)]}


def best_test_errors(rows: Sequence[Dict[str, Any]]):
  """The lowest test error over a run's evaluations (per member for an ensemble): the
  protocol much of the literature reports. Shown beside the honest columns, never used to
  choose anything. None without test rows."""
  errors = [row['error'] for row in rows if row.get('split') == 'test']
  if not errors:
    return None
  best = np.min(np.asarray(errors, np.float64), axis=0)
  return best.tolist()


def seed_groups(members: Optional[List[Dict[str, Any]]], values) -> List[Dict[str, Any]]:
  """Per-member `values` grouped by everything but the seed (the recipe, or routing
  iterations and reconstruction weight): [{recipe (recipe members only),
  routing_iterations, reconstruction_weight, seeds, values, mean, std}], recipes in their
  config's order. A single run (members None) is one group of one."""
  if members is None:
    return [dict(routing_iterations=None, reconstruction_weight=None, seeds=[None],
                 values=[values], mean=float(values), std=0.0)]
  groups: Dict[Tuple[Any, ...], List[Tuple[int, float]]] = {}
  first: Dict[Tuple[Any, ...], Dict[str, Any]] = {}
  for member, value in zip(members, values):
    key = ((member['recipe'],) if 'recipe' in member else
           (member['routing_iterations'], member['reconstruction_weight']))
    groups.setdefault(key, []).append((member['seed'], float(value)))
    first.setdefault(key, member)
  out = []
  for key, pairs in (groups.items() if 'recipe' in members[0] else sorted(groups.items())):
    mean, std = mean_std([v for _, v in pairs])
    group = dict(routing_iterations=first[key]['routing_iterations'],
                 reconstruction_weight=first[key]['reconstruction_weight'],
                 seeds=[s for s, _ in pairs], values=[v for _, v in pairs], mean=mean, std=std)
    if 'recipe' in first[key]:
      group['recipe'] = first[key]['recipe']
    out.append(group)
  return out


def _percent(group: Dict[str, Any]) -> str:
  spread = f' ± {100 * group["std"]:.3f}' if len(group['values']) > 1 else ''
  return f'{100 * group["mean"]:.3f}{spread}'


def results_table(results: Dict[str, Any]) -> str:
  """table.md of a finished run: test error (%) at the end and, with a validation split,
  at the best validation evaluation; mean ± sample std over the seeds of each setting."""
  members = results['members']
  final = seed_groups(members, results['test_error'])
  selection = results.get('selected_by_validation')
  selected = seed_groups(members, selection['test_error']) if selection else None
  columns = [('setting', 'l'), ('seeds', 'l'), ('final test error (%)', 'r'), ('per seed', 'l')]
  if selected:
    columns += [('test error at best validation (%)', 'r'), ('per seed', 'l')]
  # Further columns where the run measured them (mean ± std over seeds; the seed ensemble
  # is one number per setting): each a different way to use the same trained models.
  extra = [(name, header) for name, header in (
      ('validation_error', 'final validation error (%)'), ('ema_test_error', 'EMA test error (%)'),
      ('test_shift_averaged_error', 'shift-averaged test error (%)'),
      ('recipe_ensemble_test_error', 'seed ensemble test error (%)'),
      ('best_test_evaluation_error', 'best test evaluation (%): the protocol the literature reports; never used '
                                     'to choose')) if results.get(name) is not None]
  columns += [(header, 'r') for _, header in extra]
  extra_groups = {name: (results[name] if name == 'recipe_ensemble_test_error' else seed_groups(members, results[name]))
                  for name, _ in extra}
  rows = []
  for k, group in enumerate(final):
    setting = ('the config' if group['routing_iterations'] is None else group.get('recipe') or
               f'routing {group["routing_iterations"]}, reconstruction × {group["reconstruction_weight"]:g}')
    row = [setting, ', '.join(str(s) for s in group['seeds'] if s is not None) or str(results['config']['seed']),
           _percent(group), ', '.join(f'{100 * v:.2f}' for v in group['values'])]
    if selected:
      row += [_percent(selected[k]), ', '.join(f'{100 * v:.2f}' for v in selected[k]['values'])]
    for name, _ in extra:
      value = extra_groups[name][k]
      row.append(f'{100 * value:.3f}' if name == 'recipe_ensemble_test_error' else _percent(value))
    rows.append(row)
  lines = [f'# `{results["experiment"]}`: test error', '',
           f'{results["steps"]} steps ({results["epochs"]:.1f} epochs) on {results["num_train_examples"]} '
           f'training images, tested on {results["num_test_examples"]}'
           + (f', validated on {results["num_validation_examples"]} held-out training images'
              if results.get('num_validation_examples') else '')
           + '. Mean ± sample std over seeds. Nothing here is selected on the test set.', '']
  lines += markdown_table(columns, rows)
  return '\n'.join(lines) + '\n'


def _logged_train_loss(rows: Sequence[Dict[str, Any]], step: int):
  """The training loss metrics.jsonl holds for `step` (None: no row): a run whose final
  evaluation was stopped trained its last step in an earlier invocation."""
  losses = [row['loss'] for row in rows if row.get('split') == 'train' and row.get('step') == step and 'loss' in row]
  return losses[-1] if losses else None


def run_results(run, record: Dict[str, Any], train_metrics, previous: Dict[str, Any], num_params: int,
                members: Optional[List[Dict[str, Any]]], counts: Tuple[int, int, Optional[int]],
                rows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
  """results.json of a finished run. `run`: the loop's capsjax.hooks.Run at its end (its
  last test and validation metrics); `record`: the config as a dict; `train_metrics`: the
  last step's, None when this invocation trained nothing (a finished run evaluated again:
  the earlier invocation's values stand); `counts`: train, test and validation examples
  (None: no validation split); `rows`: metrics.jsonl's."""
  trained_now = train_metrics is not None
  test, validation = run.last_eval, run.last_validation if counts[2] is not None else None
  results = {
      'experiment': record['experiment'],
      'dataset': record['dataset'],
      'class_names': list(record.get('class_names') or ()),
      'test_accuracy': test['accuracy'],
      'test_error': test['error'],
      'test_digit_accuracy': test['digit_accuracy'],
      'test_loss': test['loss'],
      'num_params': num_params,
      'steps': run.num_steps,
      'epochs': run.epoch(run.num_steps),
      'num_train_examples': counts[0],
      'num_test_examples': counts[1],
      'final_train_loss': (np.asarray(train_metrics['loss']).tolist() if trained_now
                           else previous.get('final_train_loss', _logged_train_loss(rows, run.num_steps))),
      # Training time over every invocation.
      'wall_time_s': run.wall_time() if trained_now else previous.get('wall_time_s', run.wall_time()),
      'backend': jax.default_backend(),
      'devices': {'count': jax.device_count(), 'kind': jax.devices()[0].device_kind,
                  'processes': jax.process_count()},
      'completed': True,
      'stopped_early': run.stop_reason == 'early' or bool(previous.get('stopped_early') and not trained_now),
      'members': members,
      # Over the seeds of each setting (members differing only in seed), sample std.
      'test_error_by_setting': [{k: g[k] for k in ('recipe', 'routing_iterations', 'reconstruction_weight', 'seeds',
                                                   'mean', 'std') if k in g}
                                for g in seed_groups(members, test['error'])] if members else None,
      'config': record,
  }
  if 'ensemble_error' in test:
    results['ensemble_test_error'] = test['ensemble_error']
  for name in ('shift_averaged_error', 'shift_averaged_ensemble_error', 'shift_averaged_recipe_ensemble_error'):
    if name in test:   # config.eval_shift_averaging
      results[f'test_{name}'] = test[name]
    if validation is not None and name in validation:
      results[f'validation_{name}'] = validation[name]
  if 'recipe_ensemble_error' in test:   # each recipe's seeds summed as one classifier
    results['recipe_ensemble_test_error'] = test['recipe_ensemble_error']
    if validation is not None:
      results['recipe_ensemble_validation_error'] = validation['recipe_ensemble_error']
  if members and 'recipe' in members[0]:   # beside the honest columns; never used to choose
    results['best_test_evaluation_error'] = best_test_errors(rows)
  if 'ema_error' in test:   # the parameters' moving average, evaluated beside them
    results['ema_test_error'] = test['ema_error']
  if validation is not None and 'ema_error' in validation:
    results['ema_validation_error'] = validation['ema_error']
  if validation is not None:
    results.update(validation_error=validation['error'], num_validation_examples=counts[2],
                   selected_by_validation=select_by_validation(rows))
  return results
