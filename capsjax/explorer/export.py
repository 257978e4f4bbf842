"""Export a trained run as the explorer's shipped model.

  python -m capsjax.explorer.export --workdir=W [--out=capsjax/explorer/assets] [--num_images=1000]

Writes the run's config, its parameters as float16 (no optimiser state) and the first
--num_images test images of its dataset: the files `python -m capsjax.explorer` serves
when it is given no --workdir. BUILD.md has the command that made the shipped files.
"""
import os
import sys

from capsjax import cli
from capsjax.data.sources import load_dataset
from capsjax.explorer.backend import ASSETS, export
from capsjax.workdir import read_config

MAX_SHIPPED_BYTES = 6 << 20


@cli.main_wrapper
def main(argv=None):
  parser = cli.ArgumentParser(prog='capsjax.explorer.export', description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', required=True, type=cli.existing_workdir)
  parser.add_argument('--out', default=ASSETS, help='output folder (default: the package assets)')
  parser.add_argument('--num_images', type=cli.int_at_least(1), default=1000)
  parser.add_argument('--member', type=cli.int_at_least(0), default=None)
  args = parser.parse_args(argv)
  config = read_config(args.workdir)
  test = load_dataset(config.dataset, 'test', config.data_dir, config.tfds_data_dir).take(args.num_images)
  summary = export(args.workdir, args.out, test.images, test.labels, args.member)
  total = sum(summary['bytes'].values())
  print(f'{summary["num_params"]:,} parameters and {len(test)} test images: '
        f'{total / 2**20:.2f} MiB in {os.path.abspath(args.out)}')
  if total > MAX_SHIPPED_BYTES:
    print(f'warning: above the {MAX_SHIPPED_BYTES >> 20} MiB the package may ship', file=sys.stderr)
  return 0


if __name__ == '__main__':
  cli.run_program(main)
