"""The capsule explorer's model side and JSON API: answers equal the model's own
encode/decode, MNIST-style preprocessing of drawings, image files converted as predict
converts them, bad requests answered with a 4xx,
the shipped model, and one-line start-up errors."""
import base64
import collections
import concurrent.futures
import io
import json
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from PIL import Image

from capsjax import train
from capsjax.app import trained
from capsjax.data.sources import load_dataset
from capsjax.data.pipeline import preprocess
from capsjax.app.explorer import __main__ as explorer_main
from capsjax.app.explorer import server as server_module
from capsjax.app.explorer.backend import Explorer, RequestError, mnist_preprocess, to_pixels
from capsjax.app.export import MAX_SHIPPED_FILE_BYTES
from capsjax.app.explorer.server import make_server
from capsjax.models import build_model
from capsjax.app import predict as predict_command
from capsjax.app.predict import Predictor
from capsjax.data.images import fit_like_mnist
from capsjax.errors import CapsjaxError
from capsjax.experiments import multimnist as multimnist_experiment
import documented
from helpers import tiny_config

# Compares formulations / the model's own answers at float32 tolerances (see conftest).
pytestmark = pytest.mark.float32_matmuls


@pytest.fixture(scope='module')
def trained_workdir(mnist_dir, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('explorer') / 'run')
  train.train_and_evaluate(tiny_config(mnist_dir, num_steps=4), workdir)
  return workdir


@pytest.fixture(scope='module')
def explorer(trained_workdir):
  return Explorer.from_workdir(trained_workdir, num_images=50)


@pytest.fixture(scope='module')
def url(explorer):
  server = make_server(explorer, '127.0.0.1', 0)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield f'http://127.0.0.1:{server.server_address[1]}'
  server.shutdown()
  server.server_close()


def call(url, path, body=None, raw=None):
  """(status, parsed JSON or bytes) of one request; errors are answers too."""
  data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
  request = urllib.request.Request(url + path, data=data, headers={'Content-Type': 'application/json'})
  try:
    with urllib.request.urlopen(request, timeout=30) as response:
      status, payload, kind = response.status, response.read(), response.headers['Content-Type']
  except urllib.error.HTTPError as e:
    status, payload, kind = e.code, e.read(), e.headers['Content-Type']
  return status, json.loads(payload) if kind == 'application/json' else payload


def model_decode(explorer, vector, cls):
  capsules = np.zeros((1, explorer.num_classes, explorer.dim), np.float32)
  capsules[0, cls] = vector
  mask = jax.nn.one_hot(jnp.array([cls]), explorer.num_classes)
  decode = jax.jit(lambda p, c, m: explorer.model.apply({'params': p}, c, m, method='decode'))
  return np.asarray(decode(explorer.params, jnp.asarray(capsules), mask))[0, ..., 0]


# ------------------------------------------------------------------------- preprocessing

def test_drawing_is_fitted_into_20x20_and_centred_by_mass():
  drawing = np.zeros((280, 280), np.uint8)
  drawing[10:110, 200:250] = 255          # a 100 × 50 bar in the top-right corner
  image = mnist_preprocess(drawing)
  assert image.shape == (28, 28) and image.dtype == np.float32
  assert 0.0 <= image.min() and image.max() <= 1.0
  # The same bar photographed as ink on paper (uneven light, grain, a speck of dust, a shadow
  # far from it, and a notebook's ruled line), as predict lays out a photo for an MNIST model:
  # alike, in its own polarity (the paper stays white), none of them in the digit's box.
  rng = np.random.default_rng(0)
  photo = 200 + np.linspace(0, 30, 280)[None] - (drawing > 0) * 150 + rng.normal(0, 6, drawing.shape)
  photo[250:254, 20:24] = 40
  photo[:, :100] -= 80
  photo[60:62] -= 60   # across the bar: one blot with it, were it ink
  on_paper = fit_like_mnist(np.clip(photo, 0, 255).astype(np.uint8))
  assert on_paper.dtype == np.uint8 and on_paper[0, 0] == on_paper[-1, -1] == 255
  for fitted in (image, (255 - on_paper) / 255.0):
    rows, cols = np.nonzero(fitted > 0.5)
    assert rows.max() - rows.min() + 1 == 20       # the longer side fills the 20-pixel box
    assert cols.max() - cols.min() + 1 == 10       # aspect ratio kept
    mass = fitted.sum()
    centre = [(fitted.sum(axis=1) @ np.arange(28)) / mass, (fitted.sum(axis=0) @ np.arange(28)) / mass]
    np.testing.assert_allclose(centre, [13.5, 13.5], atol=0.5)   # integer placement
  np.testing.assert_array_equal(fit_like_mnist(np.full((50, 40), 230, np.uint8)), np.full((28, 28), 230))  # no ink


def test_drawing_errors_are_request_errors():
  with pytest.raises(RequestError, match='empty'):
    mnist_preprocess(np.zeros((100, 100), np.uint8))
  with pytest.raises(RequestError, match='2-D grey image'):
    mnist_preprocess(np.zeros((100, 100, 3), np.uint8))


# ------------------------------------------------------------------------- API = model

def test_example_is_the_model_encoding_of_the_test_image(explorer, url, mnist_dir):
  status, answer = call(url, '/api/example?index=7')
  assert status == 200
  test = load_dataset('mnist', 'test', mnist_dir).take(50)
  image = preprocess(jnp.asarray(test.images[7:8]))
  encode = jax.jit(lambda p, x: explorer.model.apply({'params': p}, x, method='encode'))   # (op by op: slower)
  capsules = np.asarray(encode(explorer.params, image))[0]
  np.testing.assert_allclose(answer['capsules'], capsules, atol=1e-5)
  np.testing.assert_allclose(answer['lengths'], np.linalg.norm(capsules, axis=-1), atol=1e-5)
  assert answer['prediction'] == [int(np.argmax(np.linalg.norm(capsules, axis=-1)))]
  assert answer['label'] == int(test.labels[7])
  assert answer['image'] == to_pixels(np.asarray(image)[0, ..., 0]).ravel().tolist()


def test_decode_is_the_model_decoder_of_the_perturbed_vector(explorer, url):
  _, example = call(url, '/api/example?index=3')
  cls = 5
  vector = np.asarray(example['capsules'][cls], np.float32)
  vector[2] += 0.2
  status, answer = call(url, '/api/decode', {'vectors': [vector.tolist()], 'classes': [cls]})
  assert status == 200
  expected = to_pixels(model_decode(explorer, vector, cls)).ravel()
  shown = np.asarray(answer['pixels'][0])
  assert np.max(np.abs(shown.astype(int) - expected)) <= 1   # rounding of nearly equal floats
  assert np.mean(shown == expected) > 0.99


def test_grid_is_a_png(url):
  _, example = call(url, '/api/example?index=0')
  status, png = call(url, '/api/grid', {'vector': example['capsules'][1], 'class': 1})
  assert status == 200 and png[:8] == b'\x89PNG\r\n\x1a\n' and len(png) > 10000


def test_info_lists_misclassified_inputs(explorer, url):
  status, info = call(url, '/api/info')
  assert status == 200 and info['mode'] == 'mnist' and info['can_draw']
  assert info['num_examples'] == 50 and len(info['labels']) == 50
  assert info['model'] == f'{explorer.source} at step 4 of 4 (finished)'   # which checkpoint this is
  wrong = [i for i in range(50) if explorer.predictions[i, 0] != explorer.labels[i]]
  assert info['misclassified'] == wrong


def test_drawing_is_encoded(url):
  drawing = np.zeros((140, 140), np.uint8)
  drawing[20:120, 65:75] = 255   # a "1"
  body = {'width': 140, 'height': 140, 'pixels': base64.b64encode(drawing.tobytes()).decode()}
  status, answer = call(url, '/api/encode', body)
  assert status == 200 and len(answer['image']) == 784 and len(answer['prediction']) == 1
  assert answer['image'] == to_pixels(mnist_preprocess(drawing)).ravel().tolist()


def test_an_image_file_is_converted_as_predict_converts_it(explorer, url, trained_workdir, tmp_path, monkeypatch,
                                                           capsys):
  # A test image as a PNG file encodes as the test image itself; a larger colour photo of
  # it as predict converts that file.
  _, example = call(url, '/api/example?index=7')
  digit = np.asarray(example['image'], np.uint8).reshape(28, 28)
  png = io.BytesIO()
  Image.fromarray(digit).save(png, format='PNG')
  status, answer = call(url, '/api/encode_file', raw=png.getvalue())
  assert status == 200 and 'label' not in answer and not (answer['inverted'] or answer['blank'] or answer['fitted'])
  np.testing.assert_allclose(answer['capsules'], example['capsules'], atol=1e-5)
  assert answer['image'] == example['image'] and answer['prediction'] == example['prediction']
  # The same digit as ink on paper (a scan, a photo of a page): inverted first, as predict
  # does, and said so; a white page holds no ink, and says that.
  for pixels, inverted, blank in ((255 - digit, True, False), (np.full_like(digit, 255), True, True)):
    on_paper = io.BytesIO()
    Image.fromarray(pixels).save(on_paper, format='PNG')
    status, answer_on_paper = call(url, '/api/encode_file', raw=on_paper.getvalue())
    assert status == 200 and (answer_on_paper['inverted'], answer_on_paper['blank']) == (inverted, blank)
    if not blank:
      assert answer_on_paper['image'] == example['image'] and answer_on_paper['prediction'] == example['prediction']
  photo = io.BytesIO()
  Image.fromarray(np.stack([digit] * 3, -1)).resize((84, 70), Image.BILINEAR).save(photo, format='JPEG')
  predictor = Predictor(explorer.trained)
  expected = predictor.convert(np.asarray(Image.open(io.BytesIO(photo.getvalue()))))
  status, answer = call(url, '/api/encode_file', raw=photo.getvalue())
  assert status == 200 and answer['image'] == expected[..., 0].ravel().tolist() and answer['fitted']
  assert answer['prediction'] == [predictor.predict(expected[None])[0]['class_index']]
  # A file of another size than 28×28, for this MNIST run: laid out as MNIST's digits (its
  # ink fitted into 20×20 and centred by mass), which capsjax-predict says (in this process).
  (tmp_path / 'photo.jpg').write_bytes(photo.getvalue())
  Image.fromarray(255 - np.asarray(Image.open(tmp_path / 'photo.jpg'))).save(tmp_path / 'paper.png')   # ink on paper
  monkeypatch.setattr(Predictor, 'from_workdir', classmethod(lambda cls, *args: predictor))
  assert predict_command.main([str(tmp_path / 'photo.jpg'), str(tmp_path / 'paper.png'),
                               f'--workdir={trained_workdir}']) == 0
  laid_out = "84×70, laid out as MNIST's digits are (its ink fitted into 20×20 and centred by mass in 28×28)"
  said = [line for line in capsys.readouterr().err.splitlines()[1:] if 'no class is confident' not in line]
  assert said == [   # one line a file, after the model's (and whether a class is confident: this small run's are not)
      f'{tmp_path}/photo.jpg: {laid_out} before classifying',
      f"{tmp_path}/paper.png: dark on a light ground, where {trained_workdir}'s images are light strokes on black: "
      f'{laid_out} and inverted before classifying']
  assert predictor.predict([np.asarray(Image.open(tmp_path / 'photo.jpg'))])[0]['fitted']
  assert not predictor.predict([expected])[0]['fitted']   # 28×28: taken as it is
  # Ink on paper (dark on light, MNIST's opposite): inverted first, and said so; a blank
  # page (white: inverted to black) or a nearly uniform grey is blank, a faint digit is not.
  faint = (expected // 8).astype(np.uint8)   # 0–31: a digit of 31 levels
  ink, plain, page, grey, dim = predictor.predict(np.stack(
      [255 - expected, expected, np.full_like(expected, 255), (90 + (expected > 0) * 16).astype(np.uint8), faint]))
  assert ink['inverted'] and not plain['inverted'] and ink['activations'] == plain['activations']
  assert [r['blank'] for r in (ink, plain, page, grey, dim)] == [False, False, True, True, False]
  # Integers of 0–255 in any dtype are the pixels; floats of 0–255 or integers past 255 are
  # refused (clipped to [0, 1], floats of 0–255 once became a black-and-white image).
  np.testing.assert_array_equal(predictor.convert(digit.astype(np.int64)), predictor.convert(digit))
  np.testing.assert_array_equal(predictor.convert(digit > 127), predictor.convert(np.where(digit > 127, 255, 0)))
  for image, line in ((digit.astype(np.float32), r'image: float pixel values must be in \[0, 1\], got \[0, 255\] '
                                                 r'\(floats of 0–255: divide by 255, or pass uint8\)'),
                      (digit.astype(np.int64) * 2, r'image: integer pixel values must be in \[0, 255\], got \[0, 510\]$'),
                      (digit / 127.5 - 1, r'image: float pixel values must be in \[0, 1\], got \[-1, ')):
    with pytest.raises(CapsjaxError, match=line):
      predictor.convert(image)
  assert predictor.predict([]) == []
  with pytest.raises(CapsjaxError, match=r'^predict: 1 names for 2 images$'):
    predictor.predict([digit, digit], names=['a'])
  with pytest.raises(CapsjaxError, match=re.escape("classify takes uint8 images [n, 28, 28, 1] (the run's shape; "
                                                   'predict converts others), got (2, 28, 28) uint8')):
    predictor.classify(np.stack([digit, digit]))
  with pytest.raises(CapsjaxError, match=r'got \(1, 28, 28, 1\) float32$'):
    predictor.classify(expected[None].astype(np.float32))
  with pytest.raises(CapsjaxError, match=re.escape("read_files takes a list of paths, got one path: "
                                                   "read_files(['digit.png'])")):
    predictor.read_files('digit.png')


@pytest.mark.parametrize('path, body, raw, status, message', [
    ('/api/encode_file', None, b'GIF89a but not really', 400, 'the file: not an image'),
    ('/api/example?index=50', None, None, 400, 'out of range'),
    ('/api/example?index=-1', None, None, 400, 'out of range'),
    ('/api/example?index=x', None, None, 400, 'must be an integer'),
    ('/api/example?index=%EF%BC%95', None, None, 400, 'ASCII digits'),      # a fullwidth 5
    ('/api/example?index=%D9%A5', None, None, 400, 'ASCII digits'),         # an Arabic-Indic 5
    ('/api/example?index=5%C2%A0', None, None, 400, 'ASCII digits'),        # 5 and a no-break space
    ('/api/example', None, None, 400, 'missing'),
    ('/api/decode', {'vectors': [[0.1] * 15], 'classes': [1]}, None, 400, '16 numbers'),
    ('/api/decode', {'vectors': [['a'] * 16], 'classes': [1]}, None, 400, '16 numbers'),
    ('/api/decode', {'vectors': [[0.1] * 16], 'classes': [10]}, None, 400, 'out of range'),
    ('/api/decode', {'vectors': [[0.1] * 16, [0.1] * 16], 'classes': [1, 2]}, None, 400, '1 to 1'),
    ('/api/decode', {'vectors': 3, 'classes': [1]}, None, 400, 'must be lists'),
    ('/api/decode', [1, 2], None, 400, 'JSON object'),
    ('/api/decode', None, b'{"vectors": [[NaN', 400, 'not valid JSON'),
    ('/api/decode', None, b'{"vectors": [[NaN, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]], "classes": [1]}',
     400, 'finite'),
    ('/api/encode', {'width': 28, 'height': 28, 'pixels': base64.b64encode(b'\0' * 100).decode()},
     None, 400, '100 bytes'),
    ('/api/encode', {'width': 28, 'height': 28, 'pixels': '!!'}, None, 400, 'base64'),
    ('/api/encode', {'width': 0, 'height': 28, 'pixels': ''}, None, 400, 'integers'),
    ('/api/encode', {'width': 10, 'height': 10, 'pixels': base64.b64encode(b'\xff' * 100).decode()},
     None, 400, 'at least 20'),
    ('/api/grid', {'vector': [0.0] * 16, 'class': 'one'}, None, 400, 'integer'),
    ('/api/nothing', {}, None, 404, 'no such'),
    ('/static/../backend.py', None, None, 404, 'no such'),
])
def test_bad_requests_get_a_clear_4xx_and_the_server_keeps_serving(url, path, body, raw, status, message):
  got, answer = call(url, path, body, raw)
  assert got == status and message in answer['error']
  assert call(url, '/api/example?index=0')[0] == 200


# ------------------------------------------------------------------------- MultiMNIST mode

def test_multimnist_mode_decodes_the_two_capsules_separately():
  config = multimnist_experiment.get_config()
  config.model.conv1_channels, config.model.primary_types = 8, 2
  config.model.decoder_hidden = (16, 32)
  model = build_model(**config.model)
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 36, 36, 1)))['params']
  images = np.random.default_rng(0).uniform(size=(4, 36, 36, 1)).astype(np.float32)
  labels = np.array([[1, 2], [3, 4], [5, 6], [7, 8]])
  explorer = Explorer(trained.TrainedModel(config, model, params, 'test'), images, labels)
  info = explorer.info()
  assert info['mode'] == 'multimnist' and not info['can_draw'] and info['image_shape'] == [36, 36]
  assert not info['can_open_files']
  with pytest.raises(RequestError, match='two overlapping digits'):
    explorer.encode_file(b'\x89PNG')
  example = explorer.example(2)
  assert example['label'] == [5, 6] and len(example['prediction']) == 2
  vectors = [example['capsules'][c] for c in example['prediction']]
  pixels = explorer.reconstruct(vectors, example['prediction'])['pixels']
  for vector, cls, shown in zip(vectors, example['prediction'], pixels):
    assert np.max(np.abs(np.asarray(shown) - to_pixels(model_decode(explorer, vector, cls)).ravel())) <= 1
  with pytest.raises(RequestError, match='28×28'):
    explorer.encode_drawing(np.ones((28, 28), np.uint8))


# ------------------------------------------------------------------------- shipped model

def test_shipped_model_is_the_paper_model_and_classifies_its_test_sample():
  sizes = {name: os.path.getsize(os.path.join(trained.SHIPPED, name))
           for name in ('params.npz', 'config.json', 'test_sample.npz')}
  assert max(sizes.values()) <= MAX_SHIPPED_FILE_BYTES
  explorer = Explorer.shipped()
  # The paper-size model (docs/results.md, "The capsule explorer"): 99.4 % of its sample.
  assert explorer.config.experiment == 'mnist_official' and len(explorer.labels) >= 500
  assert not explorer.config.ensemble and explorer.config.seed == 0   # one model: seed 0 of the run's three
  assert explorer.config.model.conv1_channels == 256 and explorer.config.model.primary_types == 32
  accuracy = np.mean(explorer.predictions[:, 0] == explorer.labels)
  assert accuracy > 0.99, accuracy
  # Photos of its digits (each 2–3× larger, somewhere on a 120×90 page: ink on paper, uneven
  # light, grain), opened as files: laid out as MNIST's digits, then read right. (Stretched
  # to 28×28 instead, 8 % of 500 such photos were: docs/results.md.)
  rng = np.random.default_rng(0)
  read_right = []
  for digit, label in zip(to_pixels(explorer.images[:20, ..., 0]), explorer.labels[:20]):
    side = int(28 * rng.uniform(2, 3))
    page = np.zeros((120, 90), np.float32)
    top, left = rng.integers(0, 120 - side), rng.integers(0, 90 - side)
    page[top:top + side, left:left + side] = np.asarray(Image.fromarray(digit).resize((side, side), Image.BILINEAR))
    page = 200 + np.linspace(0, 30, 90)[None] - page * (150 / 255) + rng.normal(0, 6, page.shape)
    photo = io.BytesIO()
    Image.fromarray(np.clip(page, 0, 255).astype(np.uint8)).save(photo, format='PNG')
    answer = explorer.encode_file(photo.getvalue())
    assert answer['inverted'] and not answer['blank']
    read_right.append(answer['prediction'] == [label])
  assert np.mean(read_right) >= 0.95, read_right


def test_export_round_trips_the_parameters(trained_workdir, explorer, tmp_path):
  images = np.zeros((3, 28, 28, 1), np.uint8)
  recorded = open(os.path.join(trained_workdir, 'config.json')).read()
  (tmp_path / 'a_file').touch()
  for directory, refusal in [   # a run's record is never replaced by an export's; nor are other files
      (trained_workdir, f"--out={trained_workdir} holds checkpoints, .* \\(a run's workdir: its config.json would "
                        'be replaced\\); give a new or empty folder, or one an export wrote'),
      (str(tmp_path / 'a_file'), f'--out={tmp_path}/a_file is a file, not a folder'),
      (str(tmp_path), f'--out={tmp_path} holds a_file \\(entries an export does not write\\)'), ('', '--out is empty')]:
    with pytest.raises(CapsjaxError, match=f'^{refusal}'):
      trained.write_explorer_model(trained_workdir, directory, images, np.arange(3))
  assert open(os.path.join(trained_workdir, 'config.json')).read() == recorded
  os.remove(tmp_path / 'a_file')
  trained.write_explorer_model(trained_workdir, str(tmp_path), images, np.arange(3))
  trained.write_explorer_model(trained_workdir, str(tmp_path), images[:2], np.arange(2))   # over an earlier export
  assert sorted(os.listdir(tmp_path)) == ['config.json', 'params.npz', 'test_sample.npz']
  config, params = trained.read_explorer_model(str(tmp_path))
  # The export is a --workdir of its own (predict, the explorer, figures): one model, no
  # checkpoints (once: "no checkpoint in W/checkpoints").
  as_workdir = trained.TrainedModel.from_workdir(str(tmp_path), data={'data_dir': '/data'})
  assert as_workdir.step is None and as_workdir.config.data_dir == '/data'
  jax.tree.map(np.testing.assert_array_equal, as_workdir.params, params)
  with pytest.raises(CapsjaxError, match='holds an exported model \\(one model, no checkpoints\\): --member and --step'):
    trained.TrainedModel.from_workdir(str(tmp_path), member=0)
  with pytest.raises(CapsjaxError, match="holds an exported model \\(capsjax-export's files"):
    trained.load_trained(str(tmp_path))
  from capsjax import workdir  # pylint: disable=g-import-not-at-top
  with pytest.raises(CapsjaxError, match=r'holds an exported model \(params.npz, test_sample.npz, config.json: '
                                         r"capsjax-export's files\), not a run; use another --workdir$"):
    workdir.prepare(str(tmp_path))   # training there (once: "holds a run with another config")
  assert isinstance(config, ml_collections.ConfigDict) and config.model.conv1_channels == 16
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4), params,
               jax.tree.map(np.asarray, explorer.params))   # float16 storage
  # An export written before model.formulation (its options then flat model keys) reads the same.
  old = json.loads((tmp_path / 'config.json').read_text())
  old['model'].update(old['model'].pop('formulation'))
  (tmp_path / 'config.json').write_text(json.dumps(old))
  assert trained.read_explorer_model(str(tmp_path))[0].model.to_dict() == config.model.to_dict()


# ------------------------------------------------------------------------- start-up errors

@pytest.mark.parametrize('argv, message', [
    (['--workdir', '/nonexistent/run'], 'is not a directory'),
    (['--port', 'eighty'], 'not an integer'),
    (['--port', '70000'], 'above 65535'),
    (['--member', '1'], '--member needs --workdir'),
    (['--member', 'all'], "'all' (a seed ensemble's members summed) is capsjax-predict's; this command takes one"),
])
def test_bad_flags_are_one_line(argv, message, capsys):
  with pytest.raises(SystemExit) as exited:
    explorer_main.main(argv)
  assert exited.value.code == 2
  error = capsys.readouterr().err.strip()
  assert message in error and len(error.splitlines()) == 1


def test_unreadable_workdir_is_one_line(tmp_path, capsys):
  with pytest.raises(SystemExit) as exited:
    explorer_main.main(['--workdir', str(tmp_path)])
  assert exited.value.code == 2
  error = capsys.readouterr().err.strip()
  assert 'no config.json' in error and len(error.splitlines()) == 1


def test_port_in_use_is_one_line(capsys):
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as taken:
    taken.bind(('127.0.0.1', 0))
    taken.listen()
    with pytest.raises(SystemExit) as exited:
      explorer_main.main(['--port', str(taken.getsockname()[1])])
  assert exited.value.code == 2
  error = capsys.readouterr().err.strip()
  assert 'the port is in use (choose another --port' in error and len(error.splitlines()) == 1
  assert 'loading the model' not in capsys.readouterr().out   # found before the model loads


def test_an_address_not_of_this_machine_is_a_host_problem(capsys):
  with pytest.raises(SystemExit) as exited:
    explorer_main.main(['--host', '192.0.2.1', '--port', '0'])   # TEST-NET-1: never this machine's
  assert exited.value.code == 2
  error = capsys.readouterr().err.strip()
  assert error == 'error: cannot listen on 192.0.2.1:0: not an address of this machine (check --host)'


# ------------------------------------------------------------------------- the server under load

def _raw(url, data: bytes, timeout=10.0) -> bytes:
  """Everything the server sends back on one connection for `data`, until it closes."""
  host, port = url.split('//')[1].split(':')
  with socket.create_connection((host, int(port)), timeout=timeout) as connection:
    connection.sendall(data)
    chunks = []
    while True:
      chunk = connection.recv(65536)
      if not chunk:
        return b''.join(chunks)
      chunks.append(chunk)


def test_other_sites_cannot_call_the_api(url):
  port = url.rsplit(':', 1)[1]
  for headers, expected in (({'Host': f'evil.example:{port}'}, 403), ({'Origin': 'http://evil.example'}, 403),
                            ({'Origin': f'http://127.0.0.1:{port}'}, 200), ({'Host': f'localhost:{port}'}, 200)):
    request = urllib.request.Request(url + '/api/info', headers=headers)
    try:
      with urllib.request.urlopen(request, timeout=30) as response:
        status = response.status
    except urllib.error.HTTPError as e:
      status = e.code
    assert status == expected, headers


def test_hostile_values_are_400_not_500(url):
  host = url.split('//')[1]
  answer = _raw(url, f'GET /static/a\x00b.js HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n'.encode())
  assert answer.startswith(b'HTTP/1.1 400'), answer[:100]
  assert call(url, '/api/example?index=' + '9' * 400)[0] == 400
  status, answer = call(url, '/api/decode', raw=b'[' * 100_000 + b']' * 100_000)
  assert status == 400 and 'nests too deep' in answer['error']


def test_a_refused_body_closes_the_connection(url):
  # The body would be a second request if the server kept reading the connection.
  hidden = b'GET /api/info HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n'
  head = (f'POST /api/decode HTTP/1.1\r\nHost: {url.split("//")[1]}\r\n'
          f'Content-Length: {server_module.MAX_BODY_BYTES + 1}\r\n\r\n').encode()
  answers = _raw(url, head + hidden)
  assert answers.startswith(b'HTTP/1.1 400') and answers.count(b'HTTP/1.1') == 1


def _served(explorer, monkeypatch, **limits):
  """A fresh server with `limits` (module constants) changed; its address URL."""
  for name, value in limits.items():
    monkeypatch.setattr(server_module, name, value)
  server = make_server(explorer, '127.0.0.1', 0)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  return server, f'http://127.0.0.1:{server.server_address[1]}'


def test_image_files_are_read_a_few_at_a_time_and_each_is_answered(explorer, monkeypatch):
  server, address = _served(explorer, monkeypatch, MAX_FILES_AT_ONCE=1)
  png = io.BytesIO()
  Image.fromarray(np.zeros((28, 28), np.uint8)).save(png, format='PNG')
  try:
    server.file_slots.acquire()   # a file being read: the next ones wait for it
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
      waiting = [pool.submit(call, address, '/api/encode_file', None, png.getvalue()) for _ in range(3)]
      time.sleep(0.5)
      assert not any(future.done() for future in waiting)
      assert call(address, '/api/info')[0] == 200   # the other routes are not held up
      server.file_slots.release()
      assert [future.result(timeout=30)[0] for future in waiting] == [200] * 3
  finally:
    server.shutdown()
    server.server_close()


def test_a_burst_of_new_connections_queues_and_every_request_is_answered(explorer, monkeypatch):
  # 200 requests from 100 threads, each on a new connection, at a server of 8 threads.
  server, address = _served(explorer, monkeypatch, MAX_CONNECTIONS=8)
  try:
    with concurrent.futures.ThreadPoolExecutor(100) as pool:
      statuses = list(pool.map(lambda _: call(address, '/api/info')[0], range(200)))
    assert statuses == [200] * 200, collections.Counter(statuses)
  finally:
    server.shutdown()
    server.server_close()


def test_slow_clients_meet_a_deadline_and_never_lock_out_a_normal_request(explorer, monkeypatch):
  server, address = _served(explorer, monkeypatch, HEAD_DEADLINE_S=4, IDLE_TIMEOUT_S=1)
  try:
    started = time.monotonic()
    slow = [socket.create_connection(server.server_address[:2]) for _ in range(40)]
    for connection in slow:
      connection.sendall(b'GET /api/info HTTP/1.1\r\n')
    idle = socket.create_connection(server.server_address[:2])   # sends nothing at all

    def trickle():   # a header line every 0.5 s: a timeout restarted by each line never ends
      while time.monotonic() - started < 8:
        for connection in slow:
          try:
            connection.sendall(b'X-Slow: 1\r\n')
          except OSError:
            pass
        time.sleep(0.5)
    threading.Thread(target=trickle, daemon=True).start()
    time.sleep(1.0)
    status, info = call(address, '/api/info')   # meanwhile, a normal request is served
    assert status == 200 and info['num_examples'] == 50
    assert time.monotonic() - started < 4, 'served while the slow clients were still connected'
    idle.settimeout(5)
    assert idle.recv(100) == b''   # closed after IDLE_TIMEOUT_S
    for connection in slow:        # every slow head is cut at its deadline, though it still trickles
      connection.settimeout(10)
      try:
        while connection.recv(4096):
          pass
      except ConnectionResetError:
        pass
    assert time.monotonic() - started < 7
  finally:
    server.shutdown()
    server.server_close()


def test_clients_that_leave_mid_answer_are_not_reported(explorer, monkeypatch, capfd):
  server, address = _served(explorer, monkeypatch)
  try:
    host = address.split('//')[1]
    for _ in range(30):   # ask for the figure, then reset the connection before the answer
      connection = socket.create_connection(server.server_address[:2])
      body = json.dumps({'vector': [0.1] * explorer.dim, 'class': 1}).encode()
      connection.sendall(f'POST /api/grid HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n\r\n'
                         .encode() + body)
      connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b'\x01\x00\x00\x00\x00\x00\x00\x00')
      connection.close()
    time.sleep(2)
    assert call(address, '/api/info')[0] == 200
    assert capfd.readouterr().err == ''   # no BrokenPipeError, no traceback
  finally:
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize('trained', [False, True], ids=['shipped', 'workdir'])
def test_command_serves_then_stops_on_ctrl_c_or_sigterm(trained, request):
  import signal  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  # README's two commands (the tutorial's is the second with its own workdir's name).
  if trained:
    workdir = request.getfixturevalue('trained_workdir')
    readme = documented.command(r'^capsjax-explorer --workdir=workdirs/mnist$').args({'workdirs/mnist': workdir})
    assert documented.command(r'^capsjax-explorer --workdir=W$').args({'W': workdir}) == readme
  else:
    readme = documented.command(r'^capsjax-explorer$').args()
  process = subprocess.Popen([sys.executable, '-u', '-m', 'capsjax.app.explorer', *readme, '--port', '0'],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    lines = [process.stdout.readline()]
    while 'http://' not in lines[-1] and lines[-1]:
      lines.append(process.stdout.readline())
    # What it is doing, stage by stage, then which model it serves and where.
    if trained:
      assert lines[0] == f'loading the model in {workdir}…\n' and lines[-1].startswith(
          f'capsule explorer for {workdir} (mnist, 1000 test inputs): http://'), lines
    else:
      assert lines == ['loading the shipped model…\n', 'model: the shipped model (exported from mnist_official)\n',
                       'compiling the decoder for the page…\n', lines[-1]]
    url = lines[-1].split('http://')[1].split('/')[0]
    status, info = call(f'http://{url}', '/api/info')
    assert status == 200 and info['experiment'] == ('mnist' if trained else 'mnist_official')
    # Ctrl-C, or a service manager's SIGTERM: the same quiet stop.
    process.send_signal(signal.SIGTERM if trained else signal.SIGINT)
    out, err = process.communicate(timeout=30)
  finally:
    process.kill()
  assert process.returncode == 0 and out.strip() == 'stopped'
  assert 'Traceback' not in err and 'Error' not in err
