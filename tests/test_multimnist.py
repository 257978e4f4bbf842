"""MultiMNIST: generator invariants, export, top-2 evaluation, a short training that learns."""
import json
import os
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from capsjax import console, objectives, train
from capsjax.app import cli
from capsjax.app import multimnist as multimnist_export
from capsjax.app.programs import segmentation
from capsjax.data import multimnist
from capsjax.data.sources import load_idx_split
from capsjax.models import build_model, count_params
from capsjax.experiments import multimnist as multimnist_config
from capsjax.experiments import multimnist_baseline
import documented
from helpers import evaluators_off


@pytest.fixture(scope='module')
def mnist_test_split(mnist_dir):
  return load_idx_split(mnist_dir, 'test')


@pytest.fixture(scope='module')
def generated(mnist_test_split):
  source = multimnist.make_source(mnist_test_split.images, mnist_test_split.labels)
  images, labels, digits = multimnist.generate(source, 0, jnp.arange(512))
  return mnist_test_split, source, np.asarray(images), np.asarray(labels), np.asarray(digits)


def _box(digit):
  rows, cols = np.nonzero(digit)
  return rows.min(), rows.max(), cols.min(), cols.max()


def test_shapes_range_classes_and_clipping(generated):
  _, _, images, labels, digits = generated
  assert images.shape == (512, 36, 36, 1) and labels.shape == (512, 2) and digits.shape == (512, 2, 36, 36, 1)
  assert images.min() >= 0 and images.max() <= 1
  assert np.all(labels[:, 0] != labels[:, 1])
  np.testing.assert_allclose(images, np.minimum(digits[:, 0] + digits[:, 1], 1.0), atol=1e-7)
  assert np.any(digits[:, 0] + digits[:, 1] > 1.0)  # clipping happens in practice
  assert len(set(map(tuple, labels))) > 40  # many of the 90 ordered pairs appear


def test_digits_come_from_the_same_split_with_bounded_shifts(generated):
  split, _, _, labels, digits = generated
  # The first digit of example n is source digit n (mod N): locate it inside the canvas.
  offsets = []
  for n in range(64):
    source = split.images[n, ..., 0].astype(np.float32) / 255.0
    found = [(dy, dx) for dy in range(9) for dx in range(9)
             if np.allclose(digits[n, 0, dy:dy + 28, dx:dx + 28, 0], source, atol=1e-6)
             and np.isclose(digits[n, 0].sum(), source.sum(), atol=1e-3)]
    assert found, f'example {n}: first digit is not source digit {n} shifted by ≤ 4 px'
    offsets.append(found[0])
    assert labels[n, 0] == split.labels[n]
  shifts = np.array(offsets) - 4
  assert shifts.min() == -4 and shifts.max() == 4
  # Each second digit is some test-split digit of its label, shifted by ≤ 4 px.
  test_digits = split.images[..., 0].astype(np.float32) / 255.0
  for n in range(16):
    r0, r1, c0, c1 = _box(digits[n, 1, ..., 0])
    candidates = test_digits[split.labels == labels[n, 1]]
    match = False
    for dy in range(9):
      for dx in range(9):
        window = digits[n, 1, dy:dy + 28, dx:dx + 28, 0]
        if np.isclose(window.sum(), digits[n, 1].sum(), atol=1e-3):
          match |= bool(np.any(np.all(np.abs(candidates - window) < 1e-6, axis=(1, 2))))
    assert match, f'example {n}: second digit is not a shifted test digit of class {labels[n, 1]}'


def test_validation_pairs_are_overlays_of_the_held_out_training_digits_only():
  """validation_examples on MultiMNIST: the last N training digits are held out and the
  validation pairs are made of them alone (training never sees one)."""
  from capsjax import assemble  # pylint: disable=g-import-not-at-top
  from capsjax.data.sources import Dataset  # pylint: disable=g-import-not-at-top
  config = multimnist_config.get_config()
  config.validation_examples, config.num_test_examples, config.batch_size = 20, 64, 16
  rng = np.random.default_rng(0)
  digits = Dataset(rng.integers(0, 256, (120, 28, 28, 1), np.uint8), np.arange(120) % 10)
  train_part, held_out = assemble.split_validation(config, digits)
  info = type('Info', (), {'num_classes': 10})()
  _, test, validation = assemble.task(config).pipelines(info, train_part, digits, held_out)
  assert validation is not None and validation.num_examples == test.num_examples == 64
  (indices,), _ = next(validation.eval_batches(64))
  batch = validation.device_batch(validation.source, (indices,), None)
  held = held_out.images.astype(np.float32) / 255.0
  trained_on = train_part.images.astype(np.float32) / 255.0
  digits_placed = np.asarray(batch['digits'])   # [pairs, 2, 36, 36, 1]: each digit on its own
  for n in range(8):
    for placed in digits_placed[n]:
      windows = [placed[dy:dy + 28, dx:dx + 28] for dy in range(9) for dx in range(9)
                 if np.isclose(placed[dy:dy + 28, dx:dx + 28].sum(), placed.sum(), atol=1e-3)]
      assert any(np.allclose(w, d, atol=1e-6) for w in windows for d in held), n
      assert not any(np.allclose(w, d, atol=1e-6) for w in windows for d in trained_on), n


def test_same_index_same_example_and_seed_matters(generated):
  _, source, images, labels, _ = generated
  again, again_labels, _ = multimnist.generate(source, 0, jnp.array([300, 5, 77]))
  np.testing.assert_array_equal(again, images[[300, 5, 77]])
  np.testing.assert_array_equal(again_labels, labels[[300, 5, 77]])
  other, _, _ = multimnist.generate(source, 1, jnp.array([300, 5, 77]))
  assert not np.array_equal(other, images[[300, 5, 77]])
  # Variants of one source digit (index + N) share the first digit but not the pair.
  n = source.size
  variant_images, variant_labels, _ = multimnist.generate(source, 0, jnp.array([5, 5 + n, 5 + 999 * n]))
  assert np.all(variant_labels[:, 0] == labels[5, 0])
  assert not np.array_equal(variant_images[0], variant_images[1])


def test_bounding_box_overlap_is_reported(generated):
  *_, digits = generated
  overlap = multimnist.bounding_box_overlap(digits)
  print(f'\nmean bounding-box overlap (intersection / smaller box): {100 * overlap.mean():.1f} %'
        ' (the paper says 80 % on average)')
  assert 0.5 < overlap.mean() < 0.95
  one = np.zeros((1, 2, 36, 36))
  one[0, 0, 0:10, 0:10] = 1
  one[0, 1, 5:15, 0:10] = 1
  np.testing.assert_allclose(multimnist.bounding_box_overlap(one), [0.5])


def test_export_writes_the_documented_file(mnist_dir, tmp_path, capsys):
  out = tmp_path / 'mm.npz'
  # README's command, 20 pairs instead of 1 000.
  readme = documented.command(r'^capsjax-multimnist ').args({'/path/to/mnist': mnist_dir, 'pairs.npz': str(out)})
  multimnist_export.main([*readme, '--num=20'])
  data = np.load(out)
  assert data['images'].shape == (20, 36, 36) and data['images'].dtype == np.float32
  assert data['labels'].shape == (20, 2) and np.issubdtype(data['labels'].dtype, np.integer)
  assert data['digits'].shape == (20, 2, 36, 36)
  np.testing.assert_allclose(data['images'], np.minimum(data['digits'].sum(1), 1.0), atol=1e-7)
  # The file is not replaced without --force; a folder (it wrote FOLDER.npz beside it) and an
  # empty --out are refused: each before the data is read.
  for out_flag, message in [(f'--out={out}', f'--out: {out} exists: give another path, or --force to replace it'),
                            (f'--out={tmp_path}', f'--out={tmp_path} is a folder: give the .npz file to write'),
                            ('--out=', '--out is empty')]:
    with pytest.raises(SystemExit) as exited:
      multimnist_export.main([f'--data_dir={mnist_dir}', out_flag])
    assert exited.value.code == 2 and capsys.readouterr().err.startswith(f'error: capsjax-multimnist: {message}')
  assert sorted(os.listdir(tmp_path)) == ['mm.npz']
  multimnist_export.main([*readme, '--num=20', '--seed=1', '--force'])   # (the program compiled above)
  assert not np.array_equal(np.load(out)['images'], data['images'])


@pytest.mark.parametrize('argv,message', [
    (['--seed', str(2 ** 31)], '--seed: 2147483648 is above the maximum 2147483647'),
    (['--start', str(2 ** 31 - 10), '--num', '20'], '--start 2147483638 + --num 20: the last index is above 2147483647'),
    (['--seed', '-1'], '--seed: -1 is below the minimum 0'),
])
def test_export_ranges_are_checked_in_one_line(argv, message, tmp_path, capsys):
  with pytest.raises(SystemExit) as exited:
    multimnist_export.main([*argv, '--out', str(tmp_path / 'x.npz')])
  assert exited.value.code == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith('error: capsjax-multimnist: ') and message in err and '\n' not in err


def test_top2_evaluation_on_hand_built_lengths():
  lengths = jnp.array([[0.9, 0.8, 0.1, 0.0],    # predicts {0, 1}
                       [0.9, 0.1, 0.8, 0.0],    # predicts {0, 2}
                       [0.1, 0.2, 0.3, 0.9]])   # predicts {3, 2}
  labels = jnp.array([[1, 0], [0, 1], [2, 1]])
  pairs, digits = objectives.top_k_correct(lengths, labels)
  np.testing.assert_array_equal(pairs, [1, 0, 0])
  np.testing.assert_allclose(digits, [1, 0.5, 0.5])
  single, _ = objectives.top_k_correct(lengths, jnp.array([0, 2, 3]))
  np.testing.assert_array_equal(single, [1, 0, 1])


def test_paper_parameter_counts():
  capsnet = build_model(**multimnist_config.get_config().model)
  baseline = build_model(**multimnist_baseline.get_config().model)
  shapes = lambda m: __import__('jax').eval_shape(
      lambda: m.init(__import__('jax').random.key(0), jnp.zeros((1, 36, 36, 1))))['params']
  assert count_params(shapes(capsnet)) == 11_361_808     # paper: 11.36M
  assert count_params(shapes(baseline)) == 24_563_978    # paper: 24.56M


def test_short_training_beats_chance(mnist_dir, tmp_path, capsys, monkeypatch):
  config = multimnist_config.get_config()
  config.data_dir = mnist_dir
  config.model.conv1_channels = 32
  config.model.primary_types = 8
  config.model.formulation.conv_impl = 'xla'   # at 36×36, faster than space_to_depth (docs/results.md)
  config.batch_size = 32
  config.num_steps = 120
  config.lr_decay_steps = 2000
  config.num_test_examples = 500
  config.eval_every_steps = 0
  config.log_every_steps = 50
  config.checkpoint_every_steps = 1000
  evaluators_off(config)   # asserted elsewhere (a suite-time trim)
  results = train.train_and_evaluate(config, str(tmp_path))
  # Chance for an unordered pair of different digits is 1/45 ≈ 2 %, for each digit of
  # the pair 2/10; what this length reaches: docs/results.md, "MultiMNIST".
  assert results['test_accuracy'] > 0.12, results
  assert results['test_digit_accuracy'] > 0.4, results
  assert json.loads((tmp_path / 'results.json').read_text())['config']['task'] == 'multimnist'
  said = capsys.readouterr().out   # the console names the pair accuracy (the paper's) and the per-digit one
  assert 'test: pair accuracy (all 2 among the top 2) ' in said and '; per-digit accuracy ' in said
  # Figure 5 and the segmentation IoU from the trained run.
  monkeypatch.setattr(console, 'PROGRESS_DELAY_S', 0)   # bars even for quick work
  readme = documented.command(r'^capsjax-segmentation ').args({'workdirs/multimnist': str(tmp_path)})
  segmentation.main([*readme, '--num', '100', '--rows', '4'])   # README's command, 100 pairs
  said = capsys.readouterr()   # what it does first, then a bar with the count
  assert said.out.startswith(f'segmentation of {tmp_path}: loading the trained model…\nmodel: {tmp_path} at step')
  assert '; generating 100 test pairs (--num; the run was evaluated on 500)…' in said.out
  assert 'reconstructing: 100%' in said.err and '100/100' in said.err
  report = json.loads((tmp_path / 'segmentation.json').read_text())
  assert report['num_examples'] == 100 and 0.0 < report['mean_iou'] < 1.0
  assert (tmp_path / 'multimnist_reconstructions.png').read_bytes()[:4] == b'\x89PNG'
  with pytest.raises(SystemExit):   # (1 000 took 100 s to draw, too wide to read)
    segmentation.main([*readme, '--rows', '65'])
  assert capsys.readouterr().err.endswith('--rows: 65 is above the maximum 64\n')
  with pytest.raises(SystemExit):   # a member of an ensemble run (multimnist_two_recipes's)
    segmentation.main([*readme, '--member=1'])
  assert capsys.readouterr().err.endswith(f'--member=1: {tmp_path} holds a single run, not an ensemble\n')
  # No pair right (a short run): no IoU where the pair is right (once NaN and NumPy's warning).
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    assert segmentation.iou_report(np.full((3, 2), 0.5), np.zeros((0, 2)), 0.1) == {
        'num_examples': 3, 'threshold': 0.1, 'mean_iou': 0.5, 'mean_iou_when_pair_correct': None, 'pair_accuracy': 0.0}


def test_mask_iou_hand_computed():
  predicted = np.zeros((2, 4, 4), bool)
  true = np.zeros((2, 4, 4), bool)
  predicted[0, :2, :2] = True      # 4 pixels
  true[0, :2, :1] = True           # 2 pixels inside them → IoU 2/4
  true[1, 0, 0] = True             # nothing predicted → IoU 0
  np.testing.assert_allclose(segmentation.mask_iou(predicted, true), [0.5, 0.0])


def test_baseline_cnn_trains_with_sigmoid_loss(mnist_dir, tmp_path, capsys):
  config = multimnist_baseline.get_config()
  config.data_dir = mnist_dir
  config.model.conv_channels = (16, 16)
  config.model.dense = (64,)
  config.model.formulation.conv_impl = 'xla'   # 16 features: 2.5x faster than patches (docs/results.md)
  config.batch_size = 32
  config.num_steps = 150
  config.num_test_examples = 300
  config.eval_every_steps = 0
  config.log_every_steps = 50
  config.checkpoint_every_steps = 1000
  results = train.train_and_evaluate(config, str(tmp_path))
  assert results['test_digit_accuracy'] > 0.3, results
  with pytest.raises(SystemExit) as exited:   # no capsules to segment: one line, exit 2
    cli.main_wrapper(segmentation.main)(['--workdir', str(tmp_path)])
  assert exited.value.code == 2
  assert capsys.readouterr().err.strip() == (
      f'error: {tmp_path} holds a cnn model without capsules to reconstruct; segmentation needs a '
      'CapsNet with its decoder (e.g. --experiment=multimnist)')
