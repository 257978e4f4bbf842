"""What the experiment programs share: comparison-model configs, image grids and figure
saving (markdown tables: capsjax.reports)."""
from typing import Optional, Tuple

import ml_collections
import numpy as np


def with_model_of(config, key: str) -> ml_collections.ConfigDict:
  """config with the model and loss of config[key] (a comparison model such as a CNN
  baseline): the same data, optimiser and schedule; experiment named EXPERIMENT_KEY."""
  derived = ml_collections.ConfigDict(config.to_dict())
  derived.experiment = f'{config.experiment}_{key}'
  derived.model = ml_collections.ConfigDict(config[key].model.to_dict())
  derived.loss = ml_collections.ConfigDict(config[key].loss.to_dict())
  return derived




# ----------------------------------------------------------------------------- figures

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
