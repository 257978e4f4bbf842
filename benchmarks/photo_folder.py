"""A two-class folder of real RGB photographs at any size, offline: crops of the two
photographs scikit-learn ships (`sklearn.datasets.load_sample_images`: a temple in China
and a flower, 427×640 each), each crop a random square of 128–256 px, flipped at random
and resized to N×N. Training crops come from the left 384 columns of each photograph and
test crops from the right 256, so no test pixel was seen in training.

  python benchmarks/photo_folder.py DIR --image_size=128 [--train_per_class=400 --test_per_class=100]

writes DIR/train/{china,flower}/NNNN.png and DIR/test/… (the `images` experiment's layout).
"""
import argparse
import os

import numpy as np
from PIL import Image

TRAIN_COLUMNS = 384   # of 640: the left part trains, the right part tests


def crops(photo: np.ndarray, count: int, image_size: int, rng: np.random.Generator) -> list:
  """`count` random squares of `photo` [h, w, 3] (128 px to its shorter side, at most 256),
  flipped at random, as image_size × image_size uint8 arrays."""
  height, width = photo.shape[:2]
  largest = min(height, width, 256)
  out = []
  for _ in range(count):
    side = int(rng.integers(min(128, largest), largest + 1))
    top, left = int(rng.integers(0, height - side + 1)), int(rng.integers(0, width - side + 1))
    crop = photo[top:top + side, left:left + side]
    if rng.random() < 0.5:
      crop = crop[:, ::-1]
    out.append(np.asarray(Image.fromarray(np.ascontiguousarray(crop)).resize((image_size, image_size),
                                                                           Image.BILINEAR)))
  return out


def write_photo_folder(root: str, image_size: int, train_per_class: int = 400, test_per_class: int = 100,
                       seed: int = 0) -> str:
  from sklearn.datasets import load_sample_images  # pylint: disable=g-import-not-at-top
  samples = load_sample_images()
  rng = np.random.default_rng(seed)
  for name, photo in zip(('china', 'flower'), samples.images):
    for split, part, count in (('train', photo[:, :TRAIN_COLUMNS], train_per_class),
                               ('test', photo[:, TRAIN_COLUMNS:], test_per_class)):
      folder = os.path.join(root, split, name)
      os.makedirs(folder, exist_ok=True)
      for i, image in enumerate(crops(part, count, image_size, rng)):
        Image.fromarray(image).save(os.path.join(folder, f'{i:04d}.png'))
  return root


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('root')
  parser.add_argument('--image_size', type=int, default=128)
  parser.add_argument('--train_per_class', type=int, default=400)
  parser.add_argument('--test_per_class', type=int, default=100)
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args()
  write_photo_folder(args.root, args.image_size, args.train_per_class, args.test_per_class, args.seed)
  print(f'{args.root}: {2 * args.train_per_class} training and {2 * args.test_per_class} test photos of '
        f'{args.image_size}×{args.image_size}×3')


if __name__ == '__main__':
  main()
