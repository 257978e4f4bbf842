"""The default data path for real: TFDS's own MNIST builder downloads (from a local HTTP
server standing in for the internet, serving the real files), prepares with TensorFlow,
and the trainer reads it back; offline it fails within seconds with one line."""
import functools
import json
import http.server
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from capsjax.data.sources import load_dataset, load_idx_split, load_tfds_split, tfds_builder
from capsjax.data.sources import tfds_builders
from capsjax.data.rows import ImageRows
from capsjax.errors import DataError
from helpers import SPEEDY_CONV_FLAG

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs run.py with TFDS's MNIST download URL pointed elsewhere; nothing else is patched.
RUN_WITH_URL = '''
import runpy, sys
from tensorflow_datasets.image_classification import mnist
mnist.MNIST.URL = sys.argv.pop(1)
sys.argv[0] = {run_py!r}
runpy.run_path({run_py!r}, run_name='__main__')
'''.format(run_py=os.path.join(ROOT, 'run.py'))


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
  def log_message(self, *args):
    pass


@pytest.fixture(scope='module')
def mnist_server(mnist_dir):
  handler = functools.partial(_QuietHandler, directory=mnist_dir)
  server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  yield f'http://127.0.0.1:{server.server_address[1]}/'
  server.shutdown()


def _run(url, *args, timeout=600):
  return subprocess.run([sys.executable, '-c', RUN_WITH_URL, url, *args], capture_output=True, text=True,
                        timeout=timeout)


@pytest.fixture(scope='module')
def prepared(mnist_server, tmp_path_factory):
  """The README command on a fresh TFDS folder: download, prepare, train (a few steps)."""
  tfds_dir = tmp_path_factory.mktemp('tensorflow_datasets')
  workdir = tmp_path_factory.mktemp('run') / 'w'
  result = _run(mnist_server, '--experiment=mnist_smoke', f'--workdir={workdir}', f'--config.tfds_data_dir={tfds_dir}',
                '--config.num_steps=3', '--config.num_test_examples=500', '--config.model.conv1_channels=16',
                '--config.model.primary_types=4', SPEEDY_CONV_FLAG)
  return tfds_dir, workdir, result


def test_readme_command_downloads_prepares_and_trains(prepared):
  tfds_dir, workdir, result = prepared
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'TFDS: downloading and preparing mnist' in result.stdout
  assert os.path.isdir(os.path.join(tfds_dir, 'mnist'))
  assert 'step 3/3' in result.stdout and 'img/s' in result.stdout and 'ETA' in result.stdout
  results = json.loads((workdir / 'results.json').read_text())
  assert results['steps'] == 3 and results['config']['num_steps'] == 3 and results['num_test_examples'] == 500


def test_prepared_tfds_data_equals_the_idx_files(prepared, mnist_dir):
  tfds_dir, _, result = prepared
  assert result.returncode == 0
  for split in ('train', 'test'):
    from_tfds = load_dataset('mnist', split, tfds_data_dir=str(tfds_dir))   # the trainer's own call
    from_idx = load_idx_split(mnist_dir, split)
    assert from_tfds.images.shape == from_idx.images.shape and from_tfds.images.dtype == np.uint8
    # TFDS shuffles examples when preparing: compare the sets of (image, label) pairs.
    key = lambda d: sorted(zip(map(bytes, d.images.reshape(len(d), -1)), d.labels.tolist()))
    assert key(from_tfds) == key(from_idx)


def test_prepared_tfds_data_is_read_by_rows_on_demand(prepared):
  # What each process of a multi-host run does (config.host_images='rows').
  tfds_dir, _, result = prepared
  assert result.returncode == 0
  whole = load_dataset('mnist', 'test', tfds_data_dir=str(tfds_dir))
  lazy = load_dataset('mnist', 'test', tfds_data_dir=str(tfds_dir), on_demand=True)
  assert isinstance(lazy.images, ImageRows) and lazy.images.shape == whole.images.shape
  np.testing.assert_array_equal(lazy.labels, whole.labels)   # read without decoding images
  ids = np.array([9999, 0, 4321, 17])
  np.testing.assert_array_equal(lazy.images[ids], whole.images[ids])
  assert lazy.images.rows_read == 4


def test_prepared_data_is_reused_without_network(prepared, tmp_path):
  # Reading rows on demand, as each process of a multi-host run does.
  tfds_dir, _, _ = prepared
  result = _run('http://127.0.0.1:9/', '--experiment=mnist_smoke', f'--workdir={tmp_path}/w',
                f'--config.tfds_data_dir={tfds_dir}', '--config.num_steps=1', '--config.num_test_examples=100',
                '--config.model.conv1_channels=16', '--config.model.primary_types=4', '--config.host_images=rows',
                SPEEDY_CONV_FLAG)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'downloading' not in result.stdout


def test_a_decoded_split_is_kept_and_read_back_until_its_prepared_files_change(prepared, monkeypatch):
  tfds_dir, _, result = prepared
  assert result.returncode == 0
  decoded = []
  stacked = tfds_builders._stacked
  monkeypatch.setattr(tfds_builders, '_stacked', lambda *a: decoded.append(1) or stacked(*a))
  folder = tfds_builder('mnist', str(tfds_dir)).data_dir
  copies = lambda: sorted(f for f in os.listdir(folder) if f.startswith('capsjax-decoded-test-'))
  assert len(copies()) == 1   # the README command's run decoded the test split and kept it
  kept = load_tfds_split('mnist', 'test', str(tfds_dir))
  assert not decoded and kept.images.shape == (10000, 28, 28, 1) and kept.images.dtype == np.uint8
  # A copy cut short (a full disk, a killed writer elsewhere): decoded again and rewritten.
  copy = os.path.join(folder, copies()[0])
  size = os.path.getsize(copy)
  os.truncate(copy, size // 2)
  mended = load_tfds_split('mnist', 'test', str(tfds_dir))
  assert len(decoded) == 10000 and os.path.getsize(copy) == size   # every row, once
  np.testing.assert_array_equal(mended.images, kept.images)
  decoded.clear()
  # Prepared again (a newer file): decoded again, the same examples, the old copy replaced.
  test_file = os.path.join(folder, 'mnist-test.array_record-00000-of-00001')
  stat = os.stat(test_file)
  os.utime(test_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
  before = copies()
  again = load_tfds_split('mnist', 'test', str(tfds_dir))
  assert len(decoded) == 10000   # every row, once
  np.testing.assert_array_equal(again.images, kept.images)
  np.testing.assert_array_equal(again.labels, kept.labels)
  assert len(copies()) == 1 and copies() != before
  # A folder it cannot write to: the data all the same, nothing left behind.
  def full_disk(*args, **kwargs):
    raise OSError(28, 'No space left on device')
  monkeypatch.setattr(np, 'savez', full_disk)
  os.utime(test_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))
  unkept = load_tfds_split('mnist', 'test', str(tfds_dir))
  np.testing.assert_array_equal(unkept.images, kept.images)
  assert copies() == [name for name in copies() if name.endswith('.npz')] and len(copies()) == 1
  assert not [f for f in os.listdir(folder) if f.endswith('.tmp')]


@pytest.mark.parametrize('url', ['http://127.0.0.1:9/', 'http://capsjax-offline.invalid/'])
def test_offline_fails_fast_with_one_line(url, tmp_path):
  result = _run(url, '--experiment=mnist', f'--workdir={tmp_path}/w', f'--config.tfds_data_dir={tmp_path}/tfds',
                timeout=120)
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: TFDS cannot download mnist'), result.stderr
  assert '--config.data_dir=DIR' in lines[0]   # (a hang: the 120 s timeout)


def test_unknown_tfds_dataset_is_one_error(tmp_path):
  with pytest.raises(DataError, match="TFDS has no dataset 'no_such_dataset'"):
    load_tfds_split('no_such_dataset', 'test', str(tmp_path))
