"""The helpers every experiment program shares: markdown tables and image grids."""
import numpy as np

from capsjax.app.plots import image_grid, pyplot
from capsjax.reports import markdown_table


def test_markdown_table_aligns_columns():
  assert markdown_table([('name', 'l'), ('error (%)', 'r')], [('CapsNet', '0.25'), ('CNN', 0.39)]) == [
      '| name | error (%) |', '| --- | ---: |', '| CapsNet | 0.25 |', '| CNN | 0.39 |']


def test_image_grid_draws_grey_and_rgb_cells(tmp_path):
  grey = np.zeros((2, 3, 8, 8, 1), np.float32)
  grey[0, 1, 2:6, 2:6, 0] = 1.0
  image_grid(str(tmp_path / 'grey.png'), grey, titles=[['a', 'b', 'c'], ['', '', '']],
             title_colors=[['black', 'red', 'black'], ['black'] * 3], row_labels=['in', 'out'], dpi=50)
  rgb = np.zeros((1, 2, 8, 8, 3), np.float32)
  rgb[0, 0, ..., 0] = 1.0   # one red cell
  image_grid(str(tmp_path / 'rgb.png'), rgb, suptitle='overlay', dpi=50)
  grey_png = pyplot().imread(str(tmp_path / 'grey.png'))
  rgb_png = pyplot().imread(str(tmp_path / 'rgb.png'))
  # 3 × 2 cells of 1.1 inches at 50 dpi (tight layout keeps the figure size).
  assert grey_png.shape[:2] == (110, 165)
  red = (rgb_png[..., 0] > 0.9) & (rgb_png[..., 1] < 0.1) & (rgb_png[..., 2] < 0.1)
  assert red.sum() > 100   # the red cell is drawn in colour, not as grey
  black = (grey_png[..., :3] < 0.1).all(-1)
  assert black.sum() > 1000   # the six (mostly black) image cells are drawn
