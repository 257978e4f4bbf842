"""Expanded MNIST, affine test digits, the affNIST .mat reader, early stopping."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.io

from capsjax import train
from capsjax.data import affine
from capsjax import assemble
from capsjax.errors import ConfigError, DataError, RunStopped
from capsjax.experiments import affnist_smoke
from capsjax.validation import validate
from helpers import SPEEDY_CONV, evaluators_off, tiny_config


def _digit():
  image = np.zeros((28, 28, 1), np.float32)
  image[6:22, 10:18] = 1.0          # an 8×16 bar: ink box x 10..17, y 6..21
  return jnp.asarray(image)


def test_identity_and_pure_translation_warps_are_exact():
  canvas = affine.place(_digit(), 6, 6)
  np.testing.assert_array_equal(affine.warp(canvas, jnp.eye(2), jnp.zeros(2)), canvas)
  moved = affine.warp(canvas, jnp.eye(2), jnp.array([3.0, -2.0]))      # 3 px right, 2 px up
  np.testing.assert_array_equal(moved, affine.place(_digit(), 4, 9))


def test_rotation_by_90_degrees_turns_the_bar():
  canvas = affine.place(_digit(), 6, 6)
  turned = affine.warp(canvas, affine.affine_matrix(jnp.pi / 2, 0.0, 1.0, 1.0), jnp.zeros(2))
  x_min, x_max, y_min, y_max = np.asarray(affine.ink_box(turned, 0.5))
  assert (x_max - x_min, y_max - y_min) == (15, 7)    # 8 wide × 16 tall became 16 wide × 8 tall


def test_random_affine_keeps_the_digit_inside_and_respects_the_ranges():
  keys = affine.example_keys(0, jnp.arange(200))
  images, params = jax.vmap(lambda k: affine.random_affine(_digit(), k, affine.AFFINE_RANGES))(keys)
  params = np.asarray(params)
  assert np.all(np.abs(params[:, 0]) <= 20.0) and np.all(np.abs(params[:, 1]) <= 0.2)
  assert np.all((params[:, 2:4] >= 0.8) & (params[:, 2:4] <= 1.2))
  assert np.std(params[:, 4]) > 2.0                     # translations really vary
  # No ink is cut off at the canvas edge: the total ink scales with the map's area
  # factor det = scale_x · scale_y (up to bilinear resampling at the bar's edges).
  ratio = np.asarray(images.sum(axis=(1, 2, 3))) / float(_digit().sum())
  np.testing.assert_allclose(ratio, params[:, 2] * params[:, 3], rtol=0.05)
  again, _ = jax.vmap(lambda k: affine.random_affine(_digit(), k, affine.AFFINE_RANGES))(keys)
  np.testing.assert_array_equal(images, again)          # a function of (seed, index)


def test_expanded_and_affine_pipelines_are_40x40_and_fixed_per_index(mnist_dir):
  config = affnist_smoke.get_config()
  config.data_dir = mnist_dir
  config.num_train_examples = 256
  config.num_test_examples = 64
  train_pipe, test_pipe = assemble.pipelines(config)
  host, _ = next(iter(test_pipe.eval_batches(64)))
  first = test_pipe.device_batch(None, host, None)['images']
  second = test_pipe.device_batch(None, host, None)['images']
  assert first.shape == (64, 40, 40, 1)
  np.testing.assert_array_equal(first, second)
  # Placement preserves every pixel of the 28×28 digit.
  np.testing.assert_allclose(np.asarray(first).sum(axis=(1, 2, 3)),
                             np.asarray(host[0], np.float32).sum(axis=(1, 2, 3)) / 255.0, rtol=1e-5)
  batch = train_pipe.device_batch(None, train_pipe.host_batch(0), jax.random.key(0))
  assert batch['images'].shape == (config.batch_size, 40, 40, 1)
  affine_pipe = assemble.affine_test_pipeline(config)
  host, _ = next(iter(affine_pipe.eval_batches(16)))
  images = affine_pipe.device_batch(None, host, None)['images']
  assert images.shape == (16, 40, 40, 1) and float(images.max()) <= 1.0 + 1e-6
  # More affine test digits than MNIST's test split has (once: silently all of it), and a
  # reversed scale range (once: drawn from it), each one line before anything trains.
  config.affnist.num_examples = 20000
  with pytest.raises(ConfigError, match=r'^config.affnist.num_examples=20000: the data has 10000 test examples'):
    assemble.affine_test_pipeline(config)
  config.affnist.num_examples = 0
  config.affnist.ranges.update(scale_min=1.2, scale_max=0.8)
  with pytest.raises(ConfigError, match=r'^config.affnist.ranges.scale_min=1.2: allowed at most scale_max=0.8$'):
    validate(config)


def _write_affnist_mat(path, images, labels):
  # The structure of the real files: struct affNISTdata with image [1600, n], label_int [1, n].
  data = {'image': images.reshape(len(images), -1).T.astype(np.uint8),
          'label_int': labels.reshape(1, -1).astype(np.uint8),
          'label_one_of_n': np.eye(10, dtype=np.uint8)[labels].T}
  scipy.io.savemat(path, {'affNISTdata': data})


def test_affnist_mat_reader_round_trips_and_rejects_bad_files(tmp_path):
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (5, 40, 40), dtype=np.uint8)
  images[:, 0, :] = 0
  images[:, 0, 3] = 255     # a marked pixel: row 0, column 3 must stay there
  labels = np.array([3, 1, 4, 1, 5])
  os.makedirs(tmp_path / 'affnist')
  _write_affnist_mat(str(tmp_path / 'affnist' / '1.mat'), images[:3], labels[:3])
  _write_affnist_mat(str(tmp_path / 'affnist' / '2.mat'), images[3:], labels[3:])
  read_images, read_labels = affine.load_affnist_dir(str(tmp_path / 'affnist'))
  np.testing.assert_array_equal(read_images[..., 0], images)
  np.testing.assert_array_equal(read_labels, labels)
  bad = tmp_path / 'bad.mat'
  bad.write_bytes(b'not a matlab file at all')
  with pytest.raises(DataError, match='not a readable MATLAB file'):
    affine.load_affnist_mat(str(bad))
  scipy.io.savemat(str(tmp_path / 'other.mat'), {'x': np.zeros(3)})
  with pytest.raises(DataError, match='no affNISTdata'):
    affine.load_affnist_mat(str(tmp_path / 'other.mat'))
  with pytest.raises(DataError, match='does not exist'):
    affine.load_affnist_dir(str(tmp_path / 'missing'))


def test_training_stops_at_the_target_accuracy_and_stays_stopped(mnist_dir, tmp_path):
  config = tiny_config(mnist_dir, num_steps=40)
  config.eval_every_steps = 5
  config.stop_at_test_accuracy = 0.3      # reached well before 40 steps
  workdir = str(tmp_path / 'run')
  results = train.train_and_evaluate(config, workdir)
  assert results['stopped_early'] and results['steps'] < 40
  assert results['test_accuracy'] >= 0.3
  again = train.train_and_evaluate(config, workdir)      # a finished run stays finished
  assert again['steps'] == results['steps'] and again['stopped_early']
  assert again['test_accuracy'] == pytest.approx(results['test_accuracy'])


def test_affnist_command_reports_both_models_on_all_test_sets(mnist_dir, tmp_path):
  from capsjax.app.programs import affnist  # pylint: disable=g-import-not-at-top
  config = affnist_smoke.get_config()
  config.data_dir = mnist_dir
  config.num_train_examples, config.num_test_examples = 256, 64
  config.batch_size, config.num_steps = 32, 4
  config.eval_every_steps = config.checkpoint_every_steps = config.log_every_steps = 2
  config.model.conv1_channels, config.model.primary_types = 8, 2
  config.model.decoder_hidden = (16, 32)
  config.model.formulation.conv_impl = SPEEDY_CONV
  config.cnn.model.conv_channels, config.cnn.model.dense = (4, 4, 4), (16, 8)
  evaluators_off(config)   # asserted elsewhere (a suite-time trim)
  os.makedirs(tmp_path / 'mat')
  rng = np.random.default_rng(1)
  _write_affnist_mat(str(tmp_path / 'mat' / 'test.mat'),
                     rng.integers(0, 256, (20, 40, 40), dtype=np.uint8), rng.integers(0, 10, 20))
  config.affnist.mat_dir = str(tmp_path / 'mat')
  config.stop_at_step = 2   # an interrupted inner run: resumable, never a KeyError
  with pytest.raises(RunStopped, match='stopped at step 2 of 4'):
    affnist.run(config, str(tmp_path / 'out'))
  config.stop_at_step = 0
  summary = affnist.run(config, str(tmp_path / 'out'))
  assert set(summary['rows']) == {'capsnet', 'cnn'}
  for row in summary['rows'].values():
    for key in ('expanded_test_accuracy', 'affine_test_accuracy', 'affnist_test_accuracy'):
      assert 0.0 <= row[key] <= 1.0
  assert summary['rows']['capsnet']['num_params'] != summary['rows']['cnn']['num_params']
  with open(tmp_path / 'out' / 'affnist.md') as f:
    table = f.read()
  assert '| CapsNet |' in table and '| CNN |' in table and 'affNIST (%)' in table
  assert os.path.getsize(tmp_path / 'out' / 'affine_examples.png') > 1000
