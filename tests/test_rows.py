"""Images read on demand (config.host_images='rows'): each process of a multi-host run
reads only its rows of every batch, and gets exactly what a whole-split load gives."""
import numpy as np
import pytest

from capsjax.data import pipeline, rows
from capsjax.data.sources import Dataset, load_idx_split
from capsjax.errors import DataError
from capsjax.experiments import mnist
from helpers import write_idx_split


class _RecordingRows(rows.ImageRows):
  """ImageRows over an array that records every row id read."""

  def __init__(self, images):
    self.ids_read = []
    self.calls = 0

    def read(ids):
      self.ids_read.extend(ids.tolist())
      self.calls += 1
      return images[ids]

    super().__init__(read, images.shape[1:], num_rows=len(images))


def _images(n, seed=0):
  return np.random.default_rng(seed).integers(0, 256, (n, 6, 5, 2), dtype=np.uint8)


def test_image_rows_read_only_what_is_indexed(monkeypatch):
  images = _images(50)
  lazy = _RecordingRows(images)
  assert lazy.shape == (50, 6, 5, 2) and lazy.dtype == np.uint8 and len(lazy) == 50
  view = lazy[10:40][5:]                      # slices read nothing
  assert lazy.ids_read == [] and view.shape == (25, 6, 5, 2)
  np.testing.assert_array_equal(view[np.array([0, 24, 3])], images[[15, 39, 18]])
  assert lazy.ids_read == [15, 39, 18] and view.rows_read == lazy.rows_read == 3
  np.testing.assert_array_equal(lazy[[7]], images[[7]])
  np.testing.assert_array_equal(np.stack(list(view)), images[15:40])   # iterated as an array is
  assert lazy[np.zeros(0, np.int64)].shape == (0, 6, 5, 2)
  monkeypatch.setattr(rows, 'CHUNK_ROWS', 8)    # a whole load reads in bounded chunks
  calls = lazy.calls
  np.testing.assert_array_equal(np.asarray(view), images[15:40])
  assert lazy.calls - calls == 4                # 25 rows in chunks of 8
  with pytest.raises(IndexError):
    lazy[np.zeros((2, 2), np.int64)]


def test_uncompressed_idx_is_read_by_rows_and_gzipped_whole(tmp_path):
  images = np.random.default_rng(1).integers(0, 256, (30, 28, 28), dtype=np.uint8)
  labels = np.arange(30, dtype=np.uint8) % 10
  for compress in (False, True):
    folder = tmp_path / str(compress)
    folder.mkdir()
    write_idx_split(folder, 'test', images, labels, compress)
    on_demand = load_idx_split(str(folder), 'test', on_demand=True)
    whole = load_idx_split(str(folder), 'test')
    assert isinstance(on_demand.images, rows.ImageRows) != compress
    assert on_demand.images.shape == whole.images.shape == (30, 28, 28, 1)
    np.testing.assert_array_equal(on_demand.images[np.array([29, 0, 4])], images[[29, 0, 4], ..., None])
    np.testing.assert_array_equal(np.asarray(on_demand.images), whole.images)
    np.testing.assert_array_equal(on_demand.labels, whole.labels)


def test_truncated_uncompressed_idx_is_one_clear_error(tmp_path):
  images = np.zeros((4, 28, 28), np.uint8)
  write_idx_split(tmp_path, 'test', images, np.zeros(4, np.uint8), compress=False)
  path = tmp_path / 't10k-images-idx3-ubyte'
  path.write_bytes(path.read_bytes()[:-5])
  with pytest.raises(DataError, match=r'declares shape \(4, 28, 28\)'):
    load_idx_split(str(tmp_path), 'test', on_demand=True)


def _pipeline(dataset, training, batch_size=32):
  return pipeline.dataset_pipeline(dataset, training, batch_size=batch_size, seed=mnist.get_config().seed)


def test_process_shares_of_training_batches_are_the_whole_batch(mnist_dir):
  test = load_idx_split(mnist_dir, 'test').take(1000)
  lazy = _RecordingRows(test.images)
  whole = _pipeline(test, True)
  on_demand = _pipeline(Dataset(lazy, test.labels), True)
  assert isinstance(on_demand.host_batch, pipeline.ReadAhead)
  shares = [slice(0, 16), slice(16, 32)]     # two processes' rows (sharding.process_rows)
  wanted = set()
  for step in (0, 1, 2, 31, 32):             # 31 → 32 crosses an epoch (31 steps of 32)
    full = whole.host_batch(step)
    for share in shares[1:]:                 # this "process" is the second one
      part = on_demand.host_batch(step, None, share)
      for got, expected in zip(part, full):
        np.testing.assert_array_equal(got, expected[share])
      for next_step in (step, step + 1):     # its own rows, possibly read ahead
        wanted.update(whole.host_batch(next_step)[2][share].tolist())
  assert set(lazy.ids_read) <= wanted        # never another process's rows


def test_process_shares_of_evaluation_batches_are_the_whole_batch(mnist_dir):
  test = load_idx_split(mnist_dir, 'test').take(100)   # 100 = 2 batches of 48 + 4
  lazy = _RecordingRows(test.images)
  whole = list(_pipeline(test, False).eval_batches(48))
  first, second = (list(_pipeline(Dataset(lazy, test.labels), False)
                        .eval_batches(48, share)) for share in (slice(0, 24), slice(24, 48)))
  assert len(whole) == len(first) == len(second) == 3
  for (full, full_weights), (a, a_weights), (b, b_weights) in zip(whole, first, second):
    np.testing.assert_array_equal(np.concatenate([a_weights, b_weights]), full_weights)
    for got_a, got_b, expected in zip(a, b, full):
      np.testing.assert_array_equal(np.concatenate([got_a, got_b]), expected)
  # Each process read its rows once, and nothing for the padding of the last batch.
  assert sorted(lazy.ids_read) == list(range(100))
  assert whole[-1][1].sum() == 4


def test_read_ahead_returns_what_the_function_returns_in_any_order():
  calls = []

  def host_batch(step, run_seed=None, rows=slice(None)):
    calls.append(step)
    return (np.arange(8)[rows] + 100 * step + (run_seed or 0),)

  ahead = pipeline.ReadAhead(host_batch)
  for step, seed, share in [(3, None, slice(0, 4)), (4, None, slice(0, 4)), (4, 1, slice(0, 4)),
                            (0, None, slice(4, 8)), (5, None, slice(0, 4)), (5, 1, slice(0, 4)),
                            (9, None, slice(None))]:
    np.testing.assert_array_equal(ahead(step, seed, share)[0], host_batch(step, seed, share)[0])


@pytest.mark.parametrize('mode,expected', [('auto', False), ('memory', False), ('rows', True)])
def test_host_images_mode_on_one_process(mode, expected):
  assert pipeline.images_on_demand(mode) == expected
