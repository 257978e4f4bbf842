"""Section 5.2: CapsNet vs a CNN on affine-transformed digits, after training both on
expanded MNIST to the same test accuracy.

`run(config, workdir)` trains CapsNet (config) and the CNN (config.cnn) with
`train.train_and_evaluate`, each stopping early at config.stop_at_test_accuracy on the
expanded-MNIST test digits, then evaluates both on the generated affine test set (and on
the real affNIST files in config.affnist.mat_dir, if given), and writes affnist.md,
affnist.json and affine_examples.png.
"""
import json
import math
import os
from typing import Any, Dict

import numpy as np

from capsjax import assemble, steps, train
from capsjax.app.trained import load_trained
from capsjax.app.plots import image_grid
from capsjax.app.programs.common import with_model_of
from capsjax.reports import markdown_table
from capsjax.data import affine
from capsjax.data.sources import Dataset
from capsjax.keys import Across, boolean, key, int_at_least, number_in, positive_number, text, seed_value
from capsjax.data.affine import AFFINE_RANGES
from capsjax.app.programs import not_a_command, register_program

KEYS = (
    # affnist: the affine test set (section 5.2): MNIST test digits under random affine maps
    key('affnist.test_seed', 3, seed_value(), 'seed of the fixed affine test transformations', in_base=False),
    key('affnist.ranges.rotation_degrees', AFFINE_RANGES['rotation_degrees'], number_in(0, 180),
        'affine test digits: rotation up to ± this many degrees', in_base=False),
    key('affnist.ranges.shear', AFFINE_RANGES['shear'], number_in(0, math.inf), 'affine test digits: shear factor up '
        'to ± this', in_base=False),
    key('affnist.ranges.scale_min', AFFINE_RANGES['scale_min'], positive_number(), 'affine test digits: smallest '
        'scale', in_base=False),
    key('affnist.ranges.scale_max', AFFINE_RANGES['scale_max'], positive_number(), 'affine test digits: largest '
        'scale (>= scale_min)', in_base=False),
    key('affnist.mat_dir', '', text('a folder, or empty'), 'a folder of the real affNIST .mat files to test on too '
        '(empty: generated affine digits only)', in_base=False),
    key('affnist.num_examples', 0, int_at_least(0), 'affine test digits (0: the whole MNIST test set)', in_base=False),
    key('cnn.enabled', True, boolean(), 'also train the comparison CNN (cnn.model, cnn.loss)', in_base=False),
)

def _scale_problem(scale_min, scale_max):
  if scale_min > scale_max:   # (drawn from the reversed range, silently)
    return f'config.affnist.ranges.scale_min={scale_min}: allowed at most scale_max={scale_max}'
  return None


# The rule across these keys (capsjax.keys.Across), checked by validation.
RULES = (Across(('affnist.ranges.scale_min', 'affnist.ranges.scale_max'), _scale_problem),)

# Each run (a workdir name): its label and the paper's expanded MNIST and affNIST accuracies (%).
RUNS = {'capsnet': ('CapsNet', (99.23, 79.0)), 'cnn': ('CNN', (99.22, 66.0))}


def evaluate_on(config, workdir: str, pipeline) -> Dict[str, Any]:
  """Accuracy of the trained run in `workdir` on another test pipeline."""
  _, model, params = load_trained(workdir)
  eval_step = steps.make_eval_step(assemble.objective(config), model, pipeline)
  return steps.evaluate(eval_step, params, pipeline, config.eval_batch_size)


def draw_examples(pipeline, path: str, rows: int = 4, columns: int = 8) -> None:
  host_batch, _ = next(iter(pipeline.eval_batches(rows * columns)))
  batch = pipeline.device_batch(pipeline.source, host_batch, None)
  images, labels = np.asarray(batch['images']), np.asarray(batch['labels'])
  image_grid(path, images.reshape((rows, columns) + images.shape[1:]),
             titles=labels.reshape(rows, columns).astype(str).tolist(),
             suptitle='affine test digits (40×40)', cell=(1.1, 1.15), dpi=100)


@register_program('affnist')
def run(config, workdir: str) -> Dict[str, Any]:
  os.makedirs(workdir, exist_ok=True)
  runs = {'capsnet': config, 'cnn': with_model_of(config, 'cnn')}
  affine_test = assemble.affine_test_pipeline(config)   # (before the trainings: a count above the data's is said now)
  real_test = None
  if config.affnist.mat_dir:
    images, labels = affine.load_affnist_dir(config.affnist.mat_dir)
    real_test = assemble.pipeline(config, Dataset(images, labels), False)
  rows = {}
  for name, run_config in runs.items():
    run_dir = os.path.join(workdir, name)
    trained = train.train_and_evaluate(run_config, run_dir)
    rows[name] = {
        'num_params': trained.num_params, 'steps': trained.steps,
        'stopped_early': trained.stopped_early,
        'reached_target': trained.test_accuracy >= config.stop_at_test_accuracy,
        'expanded_test_accuracy': trained.test_accuracy,
        'affine_test_accuracy': evaluate_on(run_config, run_dir, affine_test)['accuracy'],
    }
    if real_test is not None:
      rows[name]['affnist_test_accuracy'] = evaluate_on(run_config, run_dir, real_test)['accuracy']
  summary = {'rows': rows, 'target_accuracy': config.stop_at_test_accuracy,
             'affine_ranges': dict(config.affnist.ranges), 'affine_test_examples': affine_test.num_examples,
             'affine_test_seed': config.affnist.test_seed, 'affnist_mat_dir': config.affnist.mat_dir or None}
  with open(os.path.join(workdir, 'affnist.json'), 'w') as f:
    json.dump(summary, f, indent=2)
  table = render_table(config, summary)
  with open(os.path.join(workdir, 'affnist.md'), 'w') as f:
    f.write(table)
  draw_examples(affine_test, os.path.join(workdir, 'affine_examples.png'))
  print(table, flush=True)
  return summary


def render_table(config, summary) -> str:
  ranges = summary['affine_ranges']
  real = any('affnist_test_accuracy' in row for row in summary['rows'].values())
  lines = [f'# Robustness to affine transformations, `{config.experiment}`', '',
           f'Trained on expanded MNIST (digit at a random position on 40×40), stopped at the first '
           f'evaluation with ≥ {100 * summary["target_accuracy"]:.2f} % expanded-MNIST test accuracy. '
           f'Affine test: {summary["affine_test_examples"]} MNIST test digits, rotation ±{ranges["rotation_degrees"]}°, '
           f'shear ±{ranges["shear"]}, x and y scale {ranges["scale_min"]}–{ranges["scale_max"]} independently, '
           f'random translation inside the canvas (seed {summary["affine_test_seed"]}).', '']
  columns = ([('model', 'l'), ('parameters', 'r'), ('steps', 'r'), ('reached target', 'l'),
              ('expanded MNIST (%)', 'r'), ('affine test (%)', 'r')]
             + ([('affNIST (%)', 'r')] if real else []) + [('paper: expanded / affNIST (%)', 'r')])
  cells = []
  for name, row in summary['rows'].items():
    label, paper = RUNS[name]
    cells.append([label, f'{row["num_params"]:,}', row['steps'],
                  'yes' if row['reached_target'] else 'no', f'{100 * row["expanded_test_accuracy"]:.2f}',
                  f'{100 * row["affine_test_accuracy"]:.2f}']
                 + ([f'{100 * row["affnist_test_accuracy"]:.2f}'] if real else []) + [f'{paper[0]} / {paper[1]}'])
  lines += markdown_table(columns, cells)
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  not_a_command('affnist')
