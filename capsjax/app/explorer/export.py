"""Export a trained run as the explorer's (and predict's) shipped model.

  python -m capsjax.app.explorer.export --workdir=W [--out=capsjax/app/explorer/assets]
      [--step=best|latest|N] [--member=K] [--num_images=1000] [--evaluate]

Writes the run's config, its parameters as float16 (no optimiser state) and the first
--num_images test images of its dataset: the files `python -m capsjax.app.explorer` and
`python -m capsjax.app.predict` use when they are given no --workdir.

Which parameters: --step=best (the default) takes the checkpoint of the best validation
evaluation (results.json's `selected_by_validation`; the training loop keeps that
checkpoint), and of an ensemble the member with the lowest validation error there, unless
--member names one; a run without a validation split gives its latest checkpoint.
--step=latest, or a step number, takes that checkpoint. --evaluate then counts the test
error of the float16 parameters as written (read back; on the run's test split).
docs/results.md has the command that made the shipped files.
"""
import argparse
import os
import sys

import numpy as np

from capsjax import console
from capsjax.app import cli

# What the package ships, and what one file may be to come back from a lent device.
MAX_SHIPPED_FILE_BYTES = 16 << 20


def step_argument(text: str) -> str:
  if text in ('best', 'latest') or (text.isdigit() and int(text) > 0):
    return text
  raise argparse.ArgumentTypeError(f"{text!r}: expected best, latest or a step number")


@cli.main_wrapper
def main(argv=None):
  parser = cli.ArgumentParser(prog='capsjax-export', description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', required=True, type=cli.existing_workdir)
  parser.add_argument('--out', default=None, help='output folder (default: the package assets)')
  parser.add_argument('--num_images', type=cli.int_at_least(1), default=1000)
  parser.add_argument('--member', type=cli.int_at_least(0), default=None,
                      help='ensemble member (default: the best on validation; with --step=latest, the last)')
  parser.add_argument('--step', type=step_argument, default='best',
                      help='best (validation-selected, the default), latest, or a step number')
  parser.add_argument('--evaluate', action='store_true',
                      help='count the test error of the float16 parameters as written')
  args = parser.parse_args(argv)
  from capsjax.data.sources import load_dataset  # pylint: disable=g-import-not-at-top
  from capsjax.app.trained import SHIPPED, choose_checkpoint, export  # pylint: disable=g-import-not-at-top
  from capsjax.workdir import read_config  # pylint: disable=g-import-not-at-top
  out = args.out or SHIPPED
  config = read_config(args.workdir)
  step, member, why = choose_checkpoint(args.workdir, args.step, args.member)
  console.say(f'exporting {args.workdir}: {why}; reading the test images…')
  test = load_dataset(config.dataset, 'test', config.data_dir, config.tfds_data_dir)
  sample = test.take(args.num_images)
  summary = export(args.workdir, out, np.asarray(sample.images), np.asarray(sample.labels), member, step)
  total = sum(summary['bytes'].values())
  print(f'{why}: {summary["num_params"]:,} parameters and {len(sample)} test images, '
        f'{total / 2**20:.2f} MiB in {os.path.abspath(out)}')
  for name, size in summary['bytes'].items():
    if size > MAX_SHIPPED_FILE_BYTES:
      print(f'warning: {name} is {size / 2**20:.2f} MiB, above the {MAX_SHIPPED_FILE_BYTES >> 20} MiB a shipped '
            'file (and one file back from a lent device) may be', file=sys.stderr)
  if args.evaluate:
    from capsjax.app.predict import Predictor  # pylint: disable=g-import-not-at-top
    from capsjax.app.trained import TrainedModel  # pylint: disable=g-import-not-at-top
    predictor = Predictor(TrainedModel.exported(out))
    if config.get('num_test_examples'):   # the run's test split, as its evaluations counted
      test = test.take(min(config.num_test_examples, len(test)))
    wrong = int(np.sum(predictor.classify(test.images, 'evaluating the float16 parameters')
                       != np.asarray(test.labels)))
    print(f'test error of the float16 parameters as written: {100 * wrong / len(test):.2f} % '
          f'({wrong} of {len(test)} test images)')
  return 0


if __name__ == '__main__':
  cli.run_program(main)
