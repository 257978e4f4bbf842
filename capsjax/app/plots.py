"""Plotting helpers below the programs and the explorer: matplotlib on the file-only Agg
backend, image grids, and figure 4's capsule perturbations."""
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

PERTURBATIONS = np.round(np.arange(-0.25, 0.2501, 0.05), 2)   # 11 values, 0 in the middle



def pyplot():
  """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def save_figure(figure, path: str, dpi: int = 120, tight: bool = True) -> None:
  if tight:
    figure.tight_layout()
  figure.savefig(path, dpi=dpi)
  pyplot().close(figure)


def image_grid(path: str, images, titles=None, title_colors=None, row_labels=None,
               suptitle: Optional[str] = None, cell: Tuple[float, float] = (1.1, 1.1),
               fontsize: int = 8, suptitle_fontsize: Optional[int] = None, dpi: int = 120,
               tight: bool = True) -> None:
  """Saves a grid of images [rows, cols, h, w] (grey, 0–1) or [rows, cols, h, w, 3] (RGB)
  to `path`; `titles`/`title_colors`/`row_labels` are per cell / per row (None: none)."""
  images = np.asarray(images)
  rows, cols = images.shape[:2]
  plt = pyplot()
  figure, axes = plt.subplots(rows, cols, figsize=(cols * cell[0], rows * cell[1]), squeeze=False)
  for r in range(rows):
    for c in range(cols):
      axis = axes[r, c]
      image = images[r, c]
      if image.ndim == 3 and image.shape[-1] == 1:
        image = image[..., 0]
      axis.imshow(image, cmap='gray' if image.ndim == 2 else None, vmin=0, vmax=1)
      axis.set_xticks([])
      axis.set_yticks([])
      if titles is not None and titles[r][c]:
        color = title_colors[r][c] if title_colors is not None else 'black'
        axis.set_title(titles[r][c], fontsize=fontsize, color=color)
    if row_labels is not None:
      axes[r, 0].set_ylabel(row_labels[r], fontsize=fontsize)
  if suptitle:
    figure.suptitle(suptitle, fontsize=suptitle_fontsize or fontsize + 1)
  save_figure(figure, path, dpi, tight)


def decode_class(model, params, capsules, classes):
  """Reconstructions [n, h, w, c] from the capsule of `classes` [n] (all others masked)."""
  mask = jax.nn.one_hot(classes, capsules.shape[1])
  return np.asarray(model.apply({'params': params}, jnp.asarray(capsules), mask, method='decode'))


def perturb(capsule: np.ndarray, deltas=PERTURBATIONS) -> np.ndarray:
  """[dim] → [dim, len(deltas), dim]: row d adds each delta to dimension d only."""
  dim = capsule.shape[-1]
  offsets = np.eye(dim)[:, None, :] * np.asarray(deltas)[None, :, None]   # [dim, deltas, dim]
  return capsule[None, None, :] + offsets


def draw_perturbations(model, params, capsule, label, path, name=None):
  """Figure 4 for one digit capsule [dim] of class `label`."""
  grid = perturb(capsule)                                         # [dim, deltas, dim]
  dim, steps = grid.shape[:2]
  # Only the label's capsule reaches the decoder (the others are masked out).
  full = np.zeros((dim * steps, model.num_classes, dim), np.float32)   # [dim·deltas, classes, dim]
  full[:, label] = grid.reshape(dim * steps, dim)
  outputs = decode_class(model, params, full, np.full(dim * steps, label)).reshape(
      (dim, steps) + tuple(model.input_shape))
  titles = [[f'{delta:+.2f}' for delta in PERTURBATIONS]] + [[''] * steps] * (dim - 1)
  image_grid(path, outputs, titles, row_labels=[str(d) for d in range(dim)], cell=(0.7, 0.7), fontsize=7,
             suptitle=f'class {name or label}: dimension (rows) × perturbation (columns)', dpi=100, tight=False)
