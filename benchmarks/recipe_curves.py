"""Test and validation error of several recipes against images seen and against wall clock,
from their runs' metrics.jsonl (seeds vmapped: the mean over members, the band their range).

  python benchmarks/recipe_curves.py --out docs/figures/mnist_two_epoch_recipes.png \
      paper=benchmarks/results/h100-2026-11-25/two_epochs_paper \
      mnist_fast=benchmarks/results/h100-2026-11-25/two_epochs_fast

Wall clock is rebuilt from the logged rates (each logged stretch of steps at its images/s,
plus each evaluation's seconds): metrics.jsonl keeps no timestamps.
"""
import argparse
import json
import os

import numpy as np

from capsjax.app import plots


def curves(run_dir):
  """{split: (images seen, seconds, errors [evaluations, members])} of one run."""
  rows = [json.loads(line) for line in open(os.path.join(run_dir, 'metrics.jsonl'))]
  batch = json.load(open(os.path.join(run_dir, 'config.json')))['batch_size']
  seconds, last_step, out = 0.0, 0, {}
  for row in rows:
    if row['split'] == 'train':
      seconds += (row['step'] - last_step) * batch / row['images_per_s']
      last_step = row['step']
    elif row['split'] in ('test', 'validation'):
      images, times, errors = out.setdefault(row['split'], ([], [], []))
      images.append(row['step'] * batch)
      times.append(seconds)   # both splits at the training time of their step
      errors.append(100 * (1 - np.atleast_1d(row['accuracy'])))
      seconds += row.get('eval_seconds') or 0.0   # on the test row: both evaluations
  return {split: tuple(np.asarray(v) for v in values) for split, values in out.items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('runs', nargs='+', help='NAME=RUN_DIR (a directory with metrics.jsonl and config.json)')
  parser.add_argument('--out', required=True, help='the figure (.png)')
  args = parser.parse_args()
  plt = plots.pyplot()
  figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
  for index, spec in enumerate(args.runs):
    name, _, run_dir = spec.partition('=')
    color = f'C{index}'
    for split, style in (('test', '-'), ('validation', '--')):
      images, times, errors = curves(run_dir)[split]
      for axis, x in zip(axes, (images, times)):
        axis.plot(x, errors.mean(axis=1), style, color=color, label=f'{name} {split}')
        axis.fill_between(x, errors.min(axis=1), errors.max(axis=1), color=color, alpha=0.12)
  axes[0].set_xlabel('training images seen')
  axes[1].set_xlabel('seconds (from the logged rates, evaluations included)')
  axes[0].set_ylabel('error (%), mean of the seeds; band: their range')
  for axis in axes:
    axis.set_yscale('log')
    axis.yaxis.set_major_formatter(plt.matplotlib.ticker.FormatStrFormatter('%g'))
    axis.yaxis.set_minor_formatter(plt.matplotlib.ticker.FormatStrFormatter('%g'))
    axis.grid(True, which='both', alpha=0.3)
  axes[0].legend()
  plots.save_figure(figure, args.out)
  print(args.out)


if __name__ == '__main__':
  main()
