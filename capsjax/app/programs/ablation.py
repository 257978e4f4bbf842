"""Table 1 (routing × reconstruction, mean ± std over seeds) from two vmapped ensembles.

`run(config, workdir)` trains config's CapsNet ensemble in workdir/capsnet and, if
config.baseline.enabled, the baseline CNN over the same seeds in workdir/baseline, both
with `train.train_and_evaluate` (one jitted, vmapped program each), then writes
table1.md, table1.json and training_loss_routing.png (the appendix's training loss with
1 vs 3 routing iterations).
"""
import json
import os
from typing import Any, Dict, List

import ml_collections
import numpy as np

from capsjax import train
from capsjax.app.plots import pyplot, save_figure
from capsjax.app.programs.common import with_model_of
from capsjax.reports import markdown_table, mean_std, seed_groups
from capsjax.errors import ConfigError
from capsjax.keys import boolean, key
from capsjax.app.programs import not_a_command, register_program

# The paper's Table 1, MNIST test error in % (mean ± std of 3 trials where given).
PAPER_TABLE1 = {
    'baseline': '0.39', (1, False): '0.34 ± 0.032', (1, True): '0.29 ± 0.011',
    (3, False): '0.35 ± 0.036', (3, True): '0.25 ± 0.005',
}


KEYS = (
    key('baseline.enabled', True, boolean(), 'also train the baseline CNN (baseline.model, baseline.loss) over the '
        'same seeds', in_base=False),
)


def baseline_config(config) -> ml_collections.ConfigDict:
  """The baseline CNN run: config's data and optimiser, the baseline's model and loss, seeds only."""
  baseline = with_model_of(config, 'baseline')
  baseline.ensemble = ml_collections.ConfigDict(dict(seeds=tuple(config.ensemble.seeds)))
  return baseline


def summarize(members: List[Dict[str, Any]], errors: List[float]) -> List[Dict[str, Any]]:
  """Rows grouped by (routing iterations, reconstruction on/off): errors in %, mean ± std
  (the sample standard deviation over seeds, ddof = 1; 0 for one seed)."""
  return [dict(routing_iterations=group['routing_iterations'], reconstruction=group['reconstruction_weight'] > 0,
               errors_percent=[100.0 * v for v in group['values']], mean=100.0 * group['mean'],
               std=100.0 * group['std'])
          for group in seed_groups(members, errors)]


def _row(method, routing, reconstruction, values, mean, std, paper):
  spread = f' ± {std:.3f}' if len(values) > 1 else ''
  return (method, routing, reconstruction, f'{mean:.2f}{spread}', ', '.join(f'{v:.2f}' for v in values), paper)


def render_table(config, rows, baseline_errors) -> str:
  lines = [f'# Table 1: MNIST test error (%), `{config.experiment}`', '',
           f'{len(config.ensemble.seeds)} seeds per row ({", ".join(map(str, config.ensemble.seeds))}); '
           f'mean ± sample std. Training: {config.num_steps or config.num_epochs} '
           f'{"steps" if config.num_steps else "epochs"} of batch {config.batch_size} on '
           f'{config.num_train_examples or "all"} training images; test on '
           f'{config.num_test_examples or "all"} test images.', '']
  rows_out = []
  if baseline_errors is not None:
    values = [100.0 * e for e in baseline_errors]
    rows_out.append(_row('Baseline CNN', '-', '-', values, *mean_std(values), PAPER_TABLE1['baseline']))
  for row in rows:
    rows_out.append(_row('CapsNet', row['routing_iterations'], 'yes' if row['reconstruction'] else 'no',
                      row['errors_percent'], row['mean'], row['std'],
                         PAPER_TABLE1.get((row['routing_iterations'], row['reconstruction']), '-')))
  lines += markdown_table([('method', 'l'), ('routing', 'r'), ('reconstruction', 'l'), ('test error (%)', 'r'),
                           ('per seed', 'l'), ('paper', 'r')], rows_out)
  return '\n'.join(lines) + '\n'


def training_loss_curves(workdir: str, members):
  """{(routing iterations, reconstruction): (steps, margin loss, mean over seeds)}.

  The margin loss, not the total: the total of reconstruction-on members also holds
  0.0005 × the reconstruction error, which would hide the effect of routing.
  """
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  records = [r for r in records if r['split'] == 'train']
  steps = np.asarray([r['step'] for r in records])
  losses = np.asarray([r['margin_loss'] for r in records])   # [records, members]
  curves = {}
  for setting in sorted({(m['routing_iterations'], m['reconstruction_weight'] > 0) for m in members}):
    chosen = [i for i, m in enumerate(members)
              if (m['routing_iterations'], m['reconstruction_weight'] > 0) == setting]
    curves[setting] = (steps, losses[:, chosen].mean(axis=1))
  return curves


def plot_training_loss(curves, path: str) -> None:
  figure, axis = pyplot().subplots(figsize=(6, 4))
  for (iterations, reconstruction), (steps, values) in curves.items():
    axis.plot(steps, values, label=f'{iterations} routing iteration{"s" if iterations > 1 else ""}, '
                                   f'reconstruction {"on" if reconstruction else "off"}')
  axis.set_xlabel('training step')
  axis.set_ylabel('training margin loss (mean over seeds)')
  axis.set_yscale('log')
  axis.legend()
  axis.set_title('CapsNet training loss: 1 vs 3 routing iterations')
  save_figure(figure, path)


@register_program('ablation')
def run(config, workdir: str) -> Dict[str, Any]:
  if not config.ensemble:
    raise ConfigError('the ablation needs config.ensemble (seeds, routing_iterations, reconstruction_weights)')
  os.makedirs(workdir, exist_ok=True)
  capsnet_dir = os.path.join(workdir, 'capsnet')
  capsnet = train.train_and_evaluate(config, capsnet_dir)
  baseline_errors = None
  if 'baseline' in config and config.baseline.enabled:
    baseline = train.train_and_evaluate(baseline_config(config), os.path.join(workdir, 'baseline'))
    baseline_errors = baseline.test_error
  members = capsnet.members
  rows = summarize(members, capsnet.test_error)
  table = render_table(config, rows, baseline_errors)
  with open(os.path.join(workdir, 'table1.md'), 'w') as f:
    f.write(table)
  summary = {'rows': rows, 'baseline_errors_percent': None if baseline_errors is None else
             [100.0 * e for e in baseline_errors], 'members': members,
             'capsnet_num_params': capsnet.num_params,
             'baseline_num_params': None if baseline_errors is None else baseline.num_params}
  with open(os.path.join(workdir, 'table1.json'), 'w') as f:
    json.dump(summary, f, indent=2)
  plot_training_loss(training_loss_curves(capsnet_dir, members),
                     os.path.join(workdir, 'training_loss_routing.png'))
  print(table, flush=True)
  return summary


if __name__ == '__main__':
  not_a_command('ablation')
