"""How an MNIST model reads photos of digits: MNIST digits (test's; train's to choose the
layout's constants), each enlarged 1.5–3× and
placed at random on a larger page (light strokes on black, or ink on paper with uneven light
and grain), classified by `capsjax.app.predict.Predictor` as predict reads such a file (laid
out as MNIST's digits: capsjax.data.images.fit_like_mnist) and as it read them before
(stretched to 28×28 by capsjax.data.images.to_array, then inverted where on paper).

  python benchmarks/digit_photos.py --data_dir=../shared/data/mnist [--workdir=W] [--num_images=500]
      [--specks=3] [--vignette=60] [--shadow=80] [--ruled=60] [--split=train --ink_fraction=0.4]

Prints one line per page kind: the accuracy of each conversion over the same photos.
Without --workdir: the shipped model.
"""
import argparse

import numpy as np
from PIL import Image

PAGE_HEIGHT, PAGE_WIDTH = 120, 90


def digit_photo(digit: np.ndarray, on_paper: bool, rng: np.random.Generator, specks: int = 0,
                vignette: float = 0.0, shadow: float = 0.0, ruled: float = 0.0) -> np.ndarray:
  """An MNIST digit uint8 [28, 28] enlarged 1.5–3× at a random place of a 120×90 page: light
  on black, or ink on paper (200–230 across the page, strokes 150 darker, grain σ 6), with
  `specks` 3×3 blots of full ink anywhere on the page (dust), and the page's corners
  `vignette` levels darker than its centre (a lens's fall-off, growing with the squared
  distance), and a sharp-edged shadow `shadow` levels dark over a random 20–70 columns from
  the left (a hand's or the phone's), and a notebook's ruled lines `ruled` levels darker than
  the paper (2 px every 24 px)."""
  side = int(28 * rng.uniform(1.5, 3.0))
  page = np.zeros((PAGE_HEIGHT, PAGE_WIDTH), np.float32)
  top, left = rng.integers(0, PAGE_HEIGHT - side + 1), rng.integers(0, PAGE_WIDTH - side + 1)
  page[top:top + side, left:left + side] = np.asarray(Image.fromarray(digit).resize((side, side), Image.BILINEAR))
  if on_paper:
    page = 200 + np.linspace(0, 30, PAGE_WIDTH)[None] - page * (150 / 255) + rng.normal(0, 6, page.shape)
  for _ in range(specks):
    top, left = rng.integers(0, PAGE_HEIGHT - 2), rng.integers(0, PAGE_WIDTH - 2)
    page[top:top + 3, left:left + 3] = 50 if on_paper else 255
  rows, cols = np.mgrid[0:PAGE_HEIGHT, 0:PAGE_WIDTH]
  distance = ((rows - PAGE_HEIGHT / 2) / (PAGE_HEIGHT / 2)) ** 2 + ((cols - PAGE_WIDTH / 2) / (PAGE_WIDTH / 2)) ** 2
  page = page - vignette * distance / 2   # [h, w]: 0 at the centre, `vignette` at the corners
  page[:, :rng.integers(20, 70)] -= shadow
  if on_paper:
    page[np.arange(PAGE_HEIGHT) % 24 < 2] -= ruled
  return np.clip(page, 0, 255).astype(np.uint8)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--data_dir', required=True, help="MNIST's IDX files (or a TFDS data dir)")
  parser.add_argument('--workdir', default=None, help='an MNIST run (default: the shipped model)')
  parser.add_argument('--num_images', type=int, default=500)
  parser.add_argument('--specks', type=int, default=0, help='3×3 blots of ink (dust) on each page')
  parser.add_argument('--vignette', type=float, default=0.0, help="how many levels darker the pages' corners are")
  parser.add_argument('--shadow', type=float, default=0.0, help='how many levels dark a shadow over the left is')
  parser.add_argument('--ruled', type=float, default=0.0, help="how many levels darker a notebook's ruled lines are")
  parser.add_argument('--split', default='test', choices=('train', 'test'),
                      help="whose digits: choose the layout's constants on train's, report on test's")
  parser.add_argument('--ink_fraction', type=float, default=None,
                      help='capsjax.data.images.INK_FRACTION for this run (default: as it is)')
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args()
  import capsjax  # pylint: disable=g-import-not-at-top
  from capsjax.app.predict import Predictor  # pylint: disable=g-import-not-at-top
  from capsjax.data import images  # pylint: disable=g-import-not-at-top
  if args.ink_fraction is not None:
    images.INK_FRACTION = args.ink_fraction
  predictor = Predictor.shipped() if args.workdir is None else Predictor.from_workdir(args.workdir)
  if not predictor.mnist_layout:
    raise SystemExit(f'error: {predictor.source} is not an MNIST model')
  split = capsjax.load_dataset('mnist', args.split, data_dir=args.data_dir)
  digits, labels = split.images[:args.num_images, ..., 0], np.asarray(split.labels[:args.num_images])
  rng = np.random.default_rng(args.seed)
  print(f'model: {predictor.trained.describe()}; {len(digits)} {args.split} digits on {PAGE_HEIGHT}×{PAGE_WIDTH} '
        f'pages, {args.specks} specks each, corners {args.vignette:g} levels darker, a shadow of {args.shadow:g}, '
        f'ruled lines {args.ruled:g} darker; INK_FRACTION {images.INK_FRACTION:g}')
  for on_paper in (False, True):
    photos = [digit_photo(digit, on_paper, rng, args.specks, args.vignette, args.shadow, args.ruled) for digit in digits]
    laid_out = [r['class_index'] for r in predictor.predict(photos)]
    stretched = np.stack([images.to_array(Image.fromarray(photo), (28, 28, 1)) for photo in photos])
    stretched_classes = [r['class_index'] for r in predictor.predict(stretched)]   # polarity checked as before
    print(f'{"ink on paper" if on_paper else "light on black"}: laid out as MNIST '
          f'{np.mean(np.array(laid_out) == labels):.1%}, stretched to 28×28 '
          f'{np.mean(np.array(stretched_classes) == labels):.1%}')


if __name__ == '__main__':
  main()
