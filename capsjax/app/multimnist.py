"""`capsjax-multimnist` (python -m capsjax.app.multimnist): MultiMNIST examples (section
6.1, generated as training generates them) exported for inspection:

  capsjax-multimnist --data_dir=DIR --split=test --num=N --out=FILE.npz [--force]
  (images [N,36,36] float32, labels [N,2], digits [N,2,36,36])

An existing FILE.npz is replaced only with --force (as capsjax-export's --out), and only
once the new one is complete.
"""
import os

import jax.numpy as jnp
import numpy as np

from capsjax.app import cli
from capsjax.data.multimnist import bounding_box_overlap, generate, make_source


@cli.main_wrapper
def main(argv=None):
  from capsjax.data.sources import load_idx_split, load_tfds_split  # pylint: disable=g-import-not-at-top

  parser = cli.ArgumentParser(prog='capsjax-multimnist',
                              description='Export MultiMNIST examples to an .npz file.')
  parser.add_argument('--data_dir', default='', help='folder of MNIST IDX files (default: TFDS)')
  parser.add_argument('--split', default='test', choices=['train', 'test'])
  int32_max = 2 ** 31 - 1   # seeds and example indices are int32 on the device
  parser.add_argument('--num', type=cli.int_in(1, 10 ** 7), default=1000)
  parser.add_argument('--start', type=cli.int_in(0, int32_max), default=0, help='first example index')
  parser.add_argument('--seed', type=cli.int_in(0, int32_max), default=0)
  parser.add_argument('--out', required=True, help='output .npz file (the suffix is added if missing)')
  parser.add_argument('--force', action='store_true', help='replace an existing --out')
  args = parser.parse_args(argv)
  if args.start + args.num - 1 > int32_max:
    parser.error(f'--start {args.start} + --num {args.num}: the last index is above {int32_max}')
  if not args.out.strip():
    cli.fail('capsjax-multimnist: --out is empty: give the .npz file to write')
  if args.out.endswith(os.sep) or os.path.isdir(os.path.expanduser(args.out)):   # (it wrote FOLDER.npz beside it)
    cli.fail(f'capsjax-multimnist: --out={args.out} is a folder: give the .npz file to write')
  out = os.path.abspath(os.path.expanduser(args.out))
  out = out if out.endswith('.npz') else out + '.npz'   # what np.savez_compressed writes
  if not os.path.isdir(os.path.dirname(out)):
    cli.fail(f'capsjax-multimnist: --out: the folder {os.path.dirname(out)} does not exist')
  if os.path.lexists(out) and not (args.force and os.path.isfile(out)):
    cli.fail(f'capsjax-multimnist: --out: {out} exists: give another path, or --force to replace it'
             if os.path.isfile(out) else f'capsjax-multimnist: --out: {out} exists and is not a file')
  if args.data_dir:
    split = load_idx_split(os.path.expanduser(args.data_dir), args.split)
  else:
    split = load_tfds_split('mnist', args.split, offline_hint='--data_dir=DIR with the IDX files')
  source = make_source(split.images, split.labels)
  images, labels, digits = generate(source, args.seed, jnp.arange(args.start, args.start + args.num))
  partial = f'{out}.partial'   # renamed when complete: a stop midway leaves no half-written file
  try:
    with open(partial, 'wb') as f:
      np.savez_compressed(f, images=np.asarray(images[..., 0], np.float32),
                          labels=np.asarray(labels, np.int64), digits=np.asarray(digits[..., 0], np.float32))
    os.replace(partial, out)
  finally:
    if os.path.exists(partial):
      os.remove(partial)
  overlap = bounding_box_overlap(np.asarray(digits[..., 0]))
  print(f'wrote {args.num} examples to {out}; mean bounding-box overlap {100 * overlap.mean():.1f} %')
  return 0


if __name__ == '__main__':
  cli.run_program(main)
