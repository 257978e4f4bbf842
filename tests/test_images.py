"""Your own images: an image folder of real digit scans that are not MNIST (scikit-learn's
copy of the UCI optical digits, 8×8 from 43 writers, written as PNG files) trains with
images_smoke, then `capsjax.app.predict` names their classes; a TFDS builder other than the
five is downloaded from a local HTTP server serving files in its own format, prepared
and trained; bad images are one line each."""
import functools
import http.server
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from PIL import ExifTags, Image

from capsjax.data import images as image_files
from capsjax.data.sources import DataSpec, describe_source, load_dataset
from capsjax.errors import DataError
import documented
from helpers import EVALUATORS_OFF_FLAGS, SPEEDY_CONV_FLAG

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_DIGITS = 1500   # of scikit-learn's 1 797; the other 297 are the test split


def _run(*args, timeout=600):
  return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope='module')
def digit_folder(tmp_path_factory):
  """DIR/train/CLASS/NNNN.png and DIR/test/CLASS/NNNN.png: the UCI digits as 8×8 grey PNGs."""
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  digits = load_digits()
  root = tmp_path_factory.mktemp('uci_digits')
  for i, (image, label) in enumerate(zip(digits.images, digits.target)):
    folder = root / ('train' if i < TRAIN_DIGITS else 'test') / str(label)
    folder.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.uint8(np.clip(image * 16, 0, 255))).save(folder / f'{i:04d}.png')
  return root


@pytest.fixture(scope='module')
def trained(digit_folder, tmp_path_factory):
  workdir = tmp_path_factory.mktemp('images') / 'w'
  result = _run('run.py', '--experiment=images_smoke', f'--config.data_dir={digit_folder}', '--config.image_size=28',
                f'--workdir={workdir}', '--config.num_epochs=4')
  return workdir, result


def test_image_folder_of_real_digits_trains_and_records_its_classes(trained):
  workdir, result = trained
  assert result.returncode == 0, result.stderr[-3000:]
  results = json.loads((workdir / 'results.json').read_text())
  assert results['num_train_examples'] == TRAIN_DIGITS and results['num_test_examples'] == 1797 - TRAIN_DIGITS
  assert results['class_names'] == [str(d) for d in range(10)]
  assert results['config']['model']['input_shape'] == [28, 28, 1]   # 8×8 scans resized, grey from the files
  assert results['test_accuracy'] > 0.8, results['test_accuracy']   # 92.6 % after 6 epochs (docs/results.md)


def test_events_hold_the_curves_and_reconstructions(trained):
  workdir, result = trained
  assert result.returncode == 0
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  events = event_accumulator.EventAccumulator(str(workdir), size_guidance={'scalars': 0, 'images': 0})
  events.Reload()
  tags = events.Tags()
  assert {'train/loss', 'train/learning_rate', 'train/images_per_s', 'test/error'} <= set(tags['scalars'])
  losses = [event.value for event in events.Scalars('train/loss')]
  logged = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert losses == pytest.approx([row['loss'] for row in logged if row['split'] == 'train'], rel=1e-6)
  rate = events.Scalars('train/learning_rate')[-1]
  assert rate.value == pytest.approx(1e-3 * 0.96 ** (rate.step / 200), rel=1e-5)   # images_smoke's decay
  test_error = events.Scalars('test/error')[-1].value
  assert test_error == pytest.approx(json.loads((workdir / 'results.json').read_text())['test_error'], rel=1e-6)
  image = events.Images('test/reconstructions/0')[-1]
  assert (image.height, image.width) == (28, 2 * 28 + 2)   # input | reconstruction


def test_predict_names_the_classes_of_files(trained, digit_folder, tmp_path):
  workdir, result = trained
  assert result.returncode == 0
  files = sorted(str(path) for path in (digit_folder / 'test').glob('*/*.png'))[::30]   # 10 files, 8×8 PNGs
  rgb = tmp_path / 'big_rgb.png'   # another size and colour: converted as training converted
  Image.open(files[0]).convert('RGB').resize((40, 40)).save(rgb)
  blank = tmp_path / 'blank.png'   # classified, and said to be blank
  Image.new('L', (8, 8)).save(blank)
  # README's command: its two files stand for these 11.
  readme = documented.command(r'^capsjax-predict ').args({'workdirs/mine': str(workdir)})
  assert readme[1:] == ['photo.png', 'scan.jpg']
  predicted = _run('-m', 'capsjax.app.predict', readme[0], '--json', f'--reconstruct={tmp_path}/rec', *files, str(rgb),
                   str(blank))
  assert predicted.returncode == 0, predicted.stderr[-3000:]
  rows = [json.loads(line) for line in predicted.stdout.splitlines()]
  assert [row['file'] for row in rows] == files + [str(rgb), str(blank)]
  assert f'{blank}: a blank image (every pixel within 16 of 255 levels of the others): its class below means nothing' in (
      predicted.stderr.splitlines())
  correct = [row['class'] == os.path.basename(os.path.dirname(row['file'])) for row in rows[:-2]]
  assert sum(correct) >= 8, rows
  assert all(set(row['activations']) == {str(d) for d in range(10)} for row in rows)
  assert all(0 <= value <= 1 for row in rows for value in row['activations'].values())
  from capsjax.app.predict import written_by_predict  # pylint: disable=g-import-not-at-top
  assert written_by_predict(str(tmp_path / 'rec' / 'big_rgb.png'))   # a later call may replace it
  pair = np.asarray(Image.open(tmp_path / 'rec' / 'big_rgb.png'))
  assert pair.shape == (112, 232)   # grey input | reconstruction, 28 × 58 scaled ×4 (nearest)
  np.testing.assert_array_equal(pair[::4, ::4], pair[3::4, 3::4])   # whole-pixel blocks
  wrote = [line for line in predicted.stderr.splitlines() if line.startswith('wrote ')]   # (stdout is JSON)
  assert wrote[-2] == f'wrote {tmp_path}/rec/big_rgb.png: {rgb} | its reconstruction, 232×112 px'
  assert len(set(line.split(':')[0] for line in wrote)) == 12   # a distinct PNG per input


def test_reconstruction_names_tell_the_inputs_apart():
  from capsjax.app.predict import _png_names  # pylint: disable=g-import-not-at-top
  assert _png_names(['a/x.png', 'b/x.png', 'c/y.png', 'a/x.png', '/p/q/a/z.jpg', '/p/r/a/z.jpg']) == [
      'a_x.png', 'b_x.png', 'y.png', 'a_x-2.png', 'q_a_z.png', 'r_a_z.png']


def test_predict_function_agrees_with_files(trained, digit_folder, monkeypatch):
  from capsjax.app.predict import Predictor  # pylint: disable=g-import-not-at-top
  workdir, result = trained
  assert result.returncode == 0
  path = sorted((digit_folder / 'test' / '3').glob('*.png'))[0]
  predictor = Predictor.from_workdir(str(workdir))
  from_file = predictor.predict(predictor.read_files([str(path)]))[0]
  from_array = predictor.predict([np.asarray(Image.open(path)) / 255.0])[0]   # floats in [0, 1], [h, w]
  assert from_file['class'] == from_array['class']
  assert from_file['activations'] == pytest.approx(from_array['activations'], abs=2e-2)
  # The explorer starts on such a run: every test input there is (fewer than its default 1 000).
  # It decodes the test images it shows and not one training image.
  from capsjax.data.sources import image_folder  # pylint: disable=g-import-not-at-top
  from capsjax.app.explorer.backend import Explorer  # pylint: disable=g-import-not-at-top
  decoded, read_image = [], image_folder.image_files.read_image
  monkeypatch.setattr(image_folder.image_files, 'read_image', lambda path, *a: decoded.append(path) or read_image(path, *a))
  explorer = Explorer.from_workdir(str(workdir))
  assert len(explorer.labels) == 1797 - TRAIN_DIGITS and explorer.info()['class_names'] == [str(d) for d in range(10)]
  assert len(decoded) == 1797 - TRAIN_DIGITS and all(os.sep + 'test' + os.sep in path for path in decoded)


def test_bad_images_are_one_line_each(digit_folder, tmp_path, capsys):
  text = tmp_path / 'notes.png'
  text.write_text('not an image')
  too_small = _run('run.py', '--experiment=images_smoke', f'--config.data_dir={digit_folder}', f'--workdir={tmp_path}/w',
                   timeout=120)
  lines = too_small.stderr.strip().splitlines()
  assert too_small.returncode == 2 and len(lines) == 1 and 'images of 8×8 are too small' in lines[0], too_small.stderr
  assert '--config.image_size=N with N >= 17' in too_small.stderr
  # capsjax-predict's main in this process (its own process: test_launch.py), each refusal
  # before the model loads; a reconstruction is never written over its input
  # (`--reconstruct=.` beside the image replaced it).
  from capsjax.app import predict  # pylint: disable=g-import-not-at-top
  digit = sorted((digit_folder / 'test' / '3').glob('*.png'))[0]
  given = tmp_path / 'digit.png'
  given.write_bytes(digit.read_bytes())
  theirs = tmp_path / 'theirs'   # a folder of the user's own files: one has the name a PNG would get
  theirs.mkdir()
  (theirs / 'digit.png').write_bytes(digit.read_bytes())
  for arguments, expected in (([str(text)], 'notes.png: not an image'),
                              ([str(tmp_path / 'missing.png')], 'missing.png: no such file'),
                              ([f'--reconstruct={text}', str(digit)], 'notes.png is a file, not a folder'),
                              ([str(given), f'--reconstruct={tmp_path}'],
                               f'capsjax-predict: --reconstruct={tmp_path} would write {given} over the input file '
                               f'{given}: give another folder'),
                              ([str(given), f'--reconstruct={theirs}'],
                               f'would replace {theirs}/digit.png, which capsjax-predict did not write')):
    with pytest.raises(SystemExit) as exited:
      predict.main(arguments)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(lines) == 1 and expected in lines[0], (arguments, lines)
  assert given.read_bytes() == digit.read_bytes() == (theirs / 'digit.png').read_bytes()
  assert not os.path.exists(tmp_path / 'w')   # a failed start leaves no workdir
  # The parameter table of a data-shaped experiment takes the data's shape and classes.
  summary = _run('run.py', '--experiment=images_smoke', f'--config.data_dir={digit_folder}', '--config.image_size=28',
                 '--summary', timeout=120)
  assert summary.returncode == 0 and summary.stdout.strip().splitlines()[-1].startswith('num_params='), summary.stderr
  assert any(line.startswith('digit_caps/weights') and ', 10, ' in line for line in summary.stdout.splitlines())


def test_folder_source_describes_itself_and_reads_rows_on_demand(digit_folder, tmp_path):
  info = describe_source(DataSpec('image_folder', str(digit_folder), image_size=20))
  assert info.image_shape == (20, 20, 1) and info.class_names == tuple('0123456789')
  whole = load_dataset('image_folder', 'test', str(digit_folder), image_size=20)
  lazy = load_dataset('image_folder', 'test', str(digit_folder), image_size=20, on_demand=True)
  np.testing.assert_array_equal(whole.labels, lazy.labels)
  rows = np.array([5, 0, 200])
  np.testing.assert_array_equal(lazy.images[rows], whole.images[rows])
  assert lazy.images.rows_read == 3
  # Labels follow the class folders; the order is tfds.ImageFolder's fixed shuffle.
  assert set(whole.labels.tolist()) == set(range(10)) and whole.labels[:10].tolist() != sorted(whole.labels[:10])
  # Mixed sizes need image_size; RGB anywhere makes every image RGB.
  mixed = tmp_path / 'mixed'
  for split, size, mode in (('train', 20, 'L'), ('test', 24, 'RGB')):
    for label in ('a', 'b'):
      (mixed / split / label).mkdir(parents=True)
      Image.new(mode, (size, size)).save(mixed / split / label / 'x.png')
  with pytest.raises(DataError, match=r'have 2 sizes \(20×20, 24×24\): pass --config.image_size=N'):
    describe_source(DataSpec('image_folder', str(mixed)))
  assert describe_source(DataSpec('image_folder', str(mixed), image_size=17)).image_shape == (17, 17, 3)


def test_conversion_is_one_function_for_files_and_arrays(tmp_path):
  grey = np.arange(64, dtype=np.uint8).reshape(8, 8) * 4
  Image.fromarray(grey).save(tmp_path / 'g.png')
  from_file = image_files.read_image(str(tmp_path / 'g.png'), (16, 16, 3))
  from_array = image_files.to_array(Image.fromarray(grey), (16, 16, 3))
  np.testing.assert_array_equal(from_file, from_array)
  assert from_file.shape == (16, 16, 3) and np.all(from_file[..., 0] == from_file[..., 2])   # grey → RGB
  resized = image_files.resize_array(grey[None, :, :, None], 16)
  np.testing.assert_array_equal(resized[0], image_files.to_array(Image.fromarray(grey), (16, 16, 1)))


def test_a_photo_stored_on_its_side_is_read_upright_everywhere(tmp_path):
  # A phone stores a photo held upright on its side with EXIF orientation 6 ("turn 90°
  # clockwise to show"), which viewers apply and Pillow does not: training, predict and the
  # explorer read it as viewers show it, and a folder's size scan sees its upright size.
  from capsjax.data.sources.image_folder import scan_image_folder  # pylint: disable=g-import-not-at-top
  upright = np.zeros((20, 12), np.uint8)                 # [height, width]: a "1", taller than wide
  upright[3:17, 5:8] = 255
  turned = Image.fromarray(upright).transpose(Image.Transpose.ROTATE_90)   # as the sensor stores it: 20 wide
  exif = Image.Exif()
  exif[ExifTags.Base.Orientation] = 6
  for name, options in (('photo.jpg', dict(quality=100)), ('photo.png', {})):
    turned.save(tmp_path / name, exif=exif.tobytes(), **options)
    with image_files.open_image(str(tmp_path / name)) as image:
      assert image.size == (20, 12) and image_files.upright_size(image) == (12, 20)
    read = image_files.read_image(str(tmp_path / name), (20, 12, 1))[..., 0]
    assert np.abs(read.astype(int) - upright).max() <= 8, name   # (JPEG's rounding)
  root = _write_folder(tmp_path / 'data', {'train': ['a', 'b'], 'test': ['a', 'b']},
                       image=lambda i: Image.new('L', (12, 20), 40 * i))
  turned.save(root / 'train' / 'a' / 'phone.jpg', exif=exif.tobytes())
  assert scan_image_folder(str(root)).sizes == {(12, 20)}   # one size: no --config.image_size needed


# ----------------------------------------------------------------------------- another TFDS builder

# TFDS's cmaterdb builder (handwritten Bangla numerals; 32×32 RGB; npz files of `images`
# and `labels`) with its download URLs pointed at a local server; nothing else patched.
RUN_WITH_CMATERDB_URL = '''
import runpy, sys
from tensorflow_datasets.image_classification import cmaterdb
base = sys.argv.pop(1)
cmaterdb._CMATERDB_TRAINING_URL = base + '{{type}}-numerals/training-images.npz'
cmaterdb._CMATERDB_TESTING_URL = base + '{{type}}-numerals/testing-images.npz'
sys.argv[0] = {run_py!r}
runpy.run_path({run_py!r}, run_name='__main__')
'''.format(run_py=os.path.join(ROOT, 'run.py'))


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
  def log_message(self, *args):
    pass


def test_another_tfds_builder_downloads_prepares_and_trains(mnist_dir, tmp_path):
  # The builder's own format, made from real MNIST digits: 32×32 RGB (padded, grey in
  # all three channels), 1 000 training and 300 test images.
  from capsjax.data.sources import load_idx_split  # pylint: disable=g-import-not-at-top
  served = tmp_path / 'served' / 'bangla-numerals'
  served.mkdir(parents=True)
  for split, name, count in (('train', 'training', 1000), ('test', 'testing', 300)):
    digits = load_idx_split(mnist_dir, split).take(count)
    images = np.repeat(np.pad(digits.images, ((0, 0), (2, 2), (2, 2), (0, 0))), 3, axis=-1)
    np.savez(served / f'{name}-images.npz', images=images, labels=digits.labels)
  handler = functools.partial(_QuietHandler, directory=str(tmp_path / 'served'))
  server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    result = _run('-c', RUN_WITH_CMATERDB_URL, f'http://127.0.0.1:{server.server_address[1]}/',
                  '--experiment=images_smoke', '--config.dataset=cmaterdb/bangla',
                  f'--config.tfds_data_dir={tmp_path}/tfds', f'--workdir={tmp_path}/w', '--config.num_steps=3',
                  '--config.model.conv1_channels=16', '--config.model.primary_types=4', SPEEDY_CONV_FLAG,
                  *EVALUATORS_OFF_FLAGS)   # a fast convolution, no evaluators: compiles faster here
  finally:
    server.shutdown()
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'TFDS: downloading and preparing cmaterdb/bangla' in result.stdout
  results = json.loads((tmp_path / 'w' / 'results.json').read_text())
  assert results['num_train_examples'] == 1000 and results['num_test_examples'] == 300
  assert results['config']['model']['input_shape'] == [32, 32, 3] and results['class_names'] == list('0123456789')
  assert results['steps'] == 3 and np.isfinite(results['test_error'])


def test_files_that_would_blow_up_or_block_are_refused_in_one_line(tmp_path):
  import struct  # pylint: disable=g-import-not-at-top
  import zlib  # pylint: disable=g-import-not-at-top
  from capsjax.data.images import open_image  # pylint: disable=g-import-not-at-top
  from capsjax.errors import DataError  # pylint: disable=g-import-not-at-top

  def chunk(kind, data):
    return struct.pack('>I', len(data)) + kind + data + struct.pack('>I', zlib.crc32(kind + data) & 0xffffffff)
  header = struct.pack('>IIBBBBB', 100000, 100000, 8, 0, 0, 0, 0)   # claims 10⁵ × 10⁵ grey pixels
  (tmp_path / 'bomb.png').write_bytes(b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', header) + chunk(b'IEND', b''))
  with pytest.raises(DataError, match=r'bomb.png: too large to decode safely \(Image size \(10000000000 pixels\)'):
    open_image(str(tmp_path / 'bomb.png'))
  os.mkfifo(tmp_path / 'pipe.png')   # reading it would wait for a writer forever
  with pytest.raises(DataError, match='pipe.png: not a regular file'):
    open_image(str(tmp_path / 'pipe.png'))


def _write_folder(root, classes_by_split, image=lambda i: Image.new('L', (20, 20), i % 255)):
  for split, classes in classes_by_split.items():
    for label in classes:
      (root / split / label).mkdir(parents=True, exist_ok=True)
      for i in range(3):
        image(i).save(root / split / label / f'{i}.png')
  return root


@pytest.mark.parametrize('layout, message', [
    ({'train': ['cat'], 'test': ['cat']}, "train holds one class, 'cat' (a classifier needs at least two)"),
    ({'train': ['cat', 'dog'], 'test': ['dog']}, "test holds one class, 'dog'"),
    ({'train': ['cat', 'dog'], 'test': ['cat', 'owl']}, "has classes that"),
])
def test_a_folder_without_two_classes_in_each_split_is_one_line_before_compiling(tmp_path, layout, message):
  folder = _write_folder(tmp_path / 'data', layout)
  result = _run('run.py', '--experiment=images_smoke', f'--config.data_dir={folder}', f'--workdir={tmp_path}/w',
                timeout=120)
  assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
  assert result.stderr.strip().splitlines() == [result.stderr.strip()] and result.stderr.startswith('error: ')
  assert message in result.stderr and 'DIR/train/CLASS/' in result.stderr
  assert 'compiling' not in result.stdout and not os.path.exists(tmp_path / 'w')


def test_a_split_folder_given_for_the_data_dir_points_to_its_parent(tmp_path):
  from capsjax.data.sources import load_dataset  # pylint: disable=g-import-not-at-top
  from capsjax.errors import DataError  # pylint: disable=g-import-not-at-top
  folder = _write_folder(tmp_path / 'data', {'train': ['cat', 'dog'], 'test': ['cat', 'dog']})
  with pytest.raises(DataError, match=f'has no train or test folder: .*; did you mean its parent, '
                                      f'--config.data_dir={folder}\\?$'):
    load_dataset('image_folder', 'train', data_dir=str(folder / 'train'))


def test_a_class_folder_s_sub_folders_are_read_as_that_class(tmp_path):
  # Real collections (Tux Paint's stamps) sort a class into sub-folders: DIR/train/animals/mammals/x.png.
  from capsjax.data.sources.image_folder import scan_image_folder  # pylint: disable=g-import-not-at-top
  from capsjax.errors import DataError  # pylint: disable=g-import-not-at-top
  root = _write_folder(tmp_path / 'data', {'train': ['animals/mammals', 'animals/birds/small', 'plants'],
                                           'test': ['animals', 'plants/.ipynb_checkpoints', 'plants']})
  scan = scan_image_folder(str(root))
  assert scan.class_names == ('animals', 'plants')
  trained = sorted(os.path.relpath(path, root) for path, label in scan.files['train'] if label == 'animals')
  assert trained == sorted(f'train/animals/{sub}/{i}.png' for sub in ('mammals', 'birds/small') for i in range(3))
  assert len(scan.files['test']) == 6   # the hidden folder left out
  root = _write_folder(tmp_path / 'other', {'train': ['cat', 'dog'], 'test': ['cat', 'owl/young']})
  with pytest.raises(DataError, match=r"lacks \(images found below each class folder: 'owl': 3 in test, 0 in train\)"):
    scan_image_folder(str(root))


def _transparent_images():
  """A palette PNG with a transparent entry (as optimised emoji and icons are) and an RGBA
  PNG, 4×4: the left column opaque red, the rest transparent over a stored green."""
  palette = Image.new('P', (4, 4), 1)
  palette.putpalette([255, 0, 0, 0, 200, 0] + [0] * 762)   # 0: red, 1: green (transparent)
  for row in range(4):
    palette.putpixel((0, row), 0)
  palette.info['transparency'] = 1
  rgba = np.zeros((4, 4, 4), np.uint8)
  rgba[..., 1] = 200                                        # green under alpha 0
  rgba[:, 0] = (255, 0, 0, 255)
  return palette, Image.fromarray(rgba, 'RGBA')


@pytest.mark.parametrize('background, level', [('white', 255), ('black', 0)])
def test_transparent_pngs_are_composited_onto_the_background_without_a_warning(tmp_path, background, level):
  palette, rgba = _transparent_images()
  root = tmp_path / 'icons'
  for split in ('train', 'test'):
    for label, image in (('palette', palette), ('rgba', rgba)):
      (root / split / label).mkdir(parents=True)
      for i in range(2):
        image.save(root / split / label / f'{i}.png')
  assert Image.open(root / 'train' / 'palette' / '0.png').mode == 'P'   # saved with its tRNS entry
  spec = DataSpec('image_folder', str(root), background=background)
  import warnings  # pylint: disable=g-import-not-at-top
  with warnings.catch_warnings():
    warnings.simplefilter('error')   # Pillow's per-image palette warning would fail here
    info = describe_source(spec)
    split = load_dataset('image_folder', 'train', data_dir=str(root))
    from capsjax.data.sources import open_source  # pylint: disable=g-import-not-at-top
    split = open_source(spec).load('train')
  assert info.image_shape == (4, 4, 3) and info.background == background
  for image in split.images:
    np.testing.assert_array_equal(image[:, 0], [[255, 0, 0]] * 4)          # opaque: as stored
    np.testing.assert_array_equal(image[:, 1:], np.full((4, 3, 3), level))  # transparent: the background
  # predict and the explorer convert a file with the same function and the run's background.
  np.testing.assert_array_equal(image_files.read_image(str(root / 'test' / 'rgba' / '0.png'), (4, 4, 3), background),
                                split.images[0])
  half = Image.fromarray(np.dstack([np.full((1, 1, 3), 100, np.uint8), np.full((1, 1, 1), 128, np.uint8)]), 'RGBA')
  blended = image_files.to_array(half, (1, 1, 1), background=background)[0, 0, 0]
  assert abs(int(blended) - round(100 * 128 / 255 + level * 127 / 255)) <= 1   # partly transparent: blended


def test_a_long_folder_read_prints_progress_lines_into_a_log(tmp_path, monkeypatch, capfd):
  """Not a terminal (a log file): tqdm's redraws become lines of their own, one every few
  seconds (here every 0 s) while the images are scanned and decoded."""
  from capsjax import console  # pylint: disable=g-import-not-at-top
  folder = _write_folder(tmp_path / 'data', {'train': ['a', 'b'], 'test': ['a', 'b']})
  monkeypatch.setattr(console, 'PROGRESS_DELAY_S', 0.0)
  monkeypatch.setattr(console, 'LOG_PROGRESS_INTERVAL_S', 0.0)
  load_dataset('image_folder', 'train', data_dir=str(folder))
  err = capfd.readouterr().err
  assert '\r' not in err
  lines = err.splitlines()
  assert any(line.startswith(f'scanning {folder}/train') and '6/6' in line for line in lines), lines
  decoding = [line for line in lines if line.startswith(f'decoding {folder}/train')]
  assert len(decoding) >= 2 and decoding[-1].split('|')[-1].strip().startswith('6/6'), lines
  assert [line.split('|')[-1].split()[0] for line in decoding].count('6/6') == 1, lines   # finished: one line


def test_predict_says_when_no_class_is_confident_or_a_digit_fills_the_frame(mnist_dir, tmp_path, capsys):
  """MNIST's shipped model on a frame-filling 28×28 digit (an upscaled scan: it once got 3 of
  10 such right, every activation ≤ 0.32, and said nothing) and on MNIST's own."""
  from capsjax.app import predict   # pylint: disable=g-import-not-at-top
  digits = np.asarray(load_dataset('mnist', 'test', data_dir=mnist_dir).images[:20])[..., 0]
  filled = np.stack([np.asarray(Image.fromarray(digit[4:24, 4:24]).resize((28, 28))) for digit in digits])
  predictor = predict.Predictor.shipped()
  assert predictor.unlike_training_layout(filled[..., None]).all()
  assert not predictor.unlike_training_layout(digits[..., None]).any()
  results = predictor.predict(np.concatenate([digits[:1], filled[:1]])[..., None])
  assert [(r['confident'], r['unlike_training']) for r in results] == [(True, False), (results[1]['confident'], True)]
  Image.fromarray(filled[0]).save(tmp_path / 'filled.png')
  Image.fromarray(np.full((28, 28), 0, np.uint8)).save(tmp_path / 'empty.png')
  predict.main([str(tmp_path / 'filled.png'), str(tmp_path / 'empty.png')])
  said = capsys.readouterr().err
  assert f"{tmp_path / 'filled.png'}: its ink fills the 28×28 frame, where MNIST's digits lie in a 20×20 box" in said
  assert 'empty.png: its ink' not in said and 'empty.png: no class is confident' not in said   # blank: said once
