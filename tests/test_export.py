"""capsjax-export --format=onnx|stablehlo|savedmodel: files equal to capsjax's own outputs,
checked on real MNIST test digits with ONNX Runtime alone (no JAX in that process), the
StableHLO file reloaded and the SavedModel loaded by TensorFlow; an own-images model (3
channels, 64 px) too; bad input one line; README's serving snippet without JAX."""
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest
from PIL import Image

from capsjax.app import serving
from capsjax.app import export
from capsjax.app.predict import Predictor
from capsjax.app.trained import TrainedModel
from capsjax.data.sources import load_dataset
import documented
from helpers import tiny_config

# Looked up, not imported: jax2onnx and ONNX Runtime take 1.2 s to import, which every test
# worker would pay at collection (the tests that convert import them).
pytestmark = [
    pytest.mark.skipif(not all(importlib.util.find_spec(name) for name in ('jax2onnx', 'onnxruntime')),
                       reason="the export extra installs jax2onnx and onnxruntime: pip install 'capsjax[export]'"),
    # jax2onnx 0.12.5's own use of a deprecated JAX name, met when a test first imports it.
    pytest.mark.filterwarnings('ignore:jax.core.DropVar is deprecated:DeprecationWarning'),
    # Compiling many small programs is this module's time: XLA's cheap compilation (conftest.py).
    pytest.mark.compile_bound]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# TensorFlow 2.21, the newest, reads the StableHLO that jax 0.10.2 writes into a SavedModel,
# not what jax 0.12.0.1 writes (measured; the export refuses it in one line).
SAVEDMODEL_RUNS = tuple(int(part) for part in jax.__version__.split('.')[:2]) < (0, 12)


def tf_version() -> str:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.__version__
# Measured (2026-11-27, Zen 3): the exported files' activations within 7.5e-9 of capsjax's
# for this test's model, 1.3e-7 for the shipped one (float32 rounding of the same operations
# in another order; docs/results.md); classes equal.
TOLERANCE = 2e-6
# ONNX Runtime in a process that cannot import JAX: what a service without capsjax runs.
ORT_ALONE = '''
import sys
sys.modules['jax'] = None   # any import of JAX fails here
import numpy as np, onnxruntime
session = onnxruntime.InferenceSession(sys.argv[1])
images = np.load(sys.argv[2])
outputs = [session.run(None, {'images': images[:1]}), session.run(None, {'images': images})]
empty = session.run(None, {'images': images[:0]})   # 0 images: empty outputs (ONNX Runtime's Einsum once died)
assert [value.shape[0] for value in empty] == [0, 0, 0], [value.shape for value in empty]
np.savez(sys.argv[3], **{f'{batch}_{i}': value for batch, run in zip(('one', 'all'), outputs)
                         for i, value in enumerate(run)})
'''


@pytest.fixture(scope='module')
def mnist_run(mnist_dir, tmp_path_factory):
  from capsjax import train  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path_factory.mktemp('export') / 'run')
  train.train_and_evaluate(tiny_config(mnist_dir, num_steps=2), workdir)
  return workdir


def _onnx_alone(path, images, tmp_path):
  np.save(tmp_path / 'images.npy', images)
  subprocess.run([sys.executable, '-c', ORT_ALONE, path, str(tmp_path / 'images.npy'), str(tmp_path / 'out.npz')],
                 check=True, timeout=120)
  with np.load(tmp_path / 'out.npz') as out:
    return [out[f'one_{i}'] for i in range(3)], [out[f'all_{i}'] for i in range(3)]


def _agree(outputs, predicted, images):
  activations, capsules, reconstructions = outputs
  assert activations.shape == (len(images), 10) and capsules.shape[:2] == (len(images), 10)
  np.testing.assert_allclose(activations, [list(r['activations'].values()) for r in predicted], atol=TOLERANCE)
  assert list(np.argmax(activations, -1)) == [r['class_index'] for r in predicted]
  np.testing.assert_allclose(reconstructions, [r['reconstruction'] for r in predicted], atol=TOLERANCE)


def test_a_trained_model_exports_to_files_that_compute_what_capsjax_computes(mnist_run, mnist_dir, tmp_path,
                                                                             monkeypatch, capsys):
  images = np.asarray(load_dataset('mnist', 'test', data_dir=mnist_dir).images[:7])   # an odd batch
  trained = TrainedModel.from_workdir(mnist_run)
  predicted = Predictor(trained).predict(images)
  onnx_path = str(tmp_path / 'model.onnx')
  assert export.main(['--format=onnx', f'--workdir={mnist_run}', f'--out={onnx_path}', '--reconstructions']) == 0
  one, everything = _onnx_alone(onnx_path, images, tmp_path)
  _agree(everything, predicted, images)
  _agree(one, predicted[:1], images[:1])   # batch 1: the same file, its batch dynamic
  import onnx  # pylint: disable=g-import-not-at-top
  metadata = {p.key: p.value for p in onnx.load(onnx_path).metadata_props}
  assert json.loads(metadata['capsjax_classes']) == [str(k) for k in range(10)]
  # Each format says who wrote it (ONNX metadata, StableHLO's FILE.json, SavedModel's asset).
  import capsjax  # pylint: disable=g-import-not-at-top
  written = json.loads(metadata['capsjax_provenance'])
  assert {k: written[k] for k in ('capsjax', 'jax', 'jaxlib')} == {
      'capsjax': capsjax.__version__, 'jax': jax.__version__, 'jaxlib': jax.lib.__version__}
  assert re.fullmatch(r'\d{4}-\d\d-\d\d', written['exported']) and written['source'] == trained.describe()
  # Converted with JAX's and Flax's plugins alone (the files agree above): Equinox's, which
  # build example modules as they import, were never imported.
  assert 'jax2onnx.plugins.jax.lax.add' in sys.modules and not any(
      name.startswith('jax2onnx.plugins.equinox') for name in sys.modules)
  # README's and docs/serving.md's commands for a run (with the reconstructions this test
  # compares): README's writes mnist.stablehlo in the current folder, serving.md's names it.
  readme = documented.command(r'^capsjax-export --format=stablehlo --workdir=workdirs/mnist$').args(
      {'workdirs/mnist': mnist_run})
  serving_md = documented.command(r'^capsjax-export --format=stablehlo --workdir=workdirs/mnist --out=').args(
      {'workdirs/mnist': mnist_run})
  assert serving_md == [*readme, '--out=mnist.stablehlo']
  monkeypatch.chdir(tmp_path)
  assert export.main([*readme, '--reconstructions']) == 0
  stablehlo_path = str(tmp_path / 'mnist.stablehlo')
  said = capsys.readouterr().out
  assert 'mnist.stablehlo (' in said and '→ activations, capsules, reconstructions' in said, said
  assert '; lowered for cpu, cuda, tpu' in said, said
  assert f'written by capsjax {capsjax.__version__} with jax {jax.__version__}' in said, said
  assert serving.read_provenance(stablehlo_path) == json.load(open(f'{stablehlo_path}.json'))
  assert serving.read_provenance(stablehlo_path)['jax'] == jax.__version__
  _agree(serving.run_file(stablehlo_path, images), predicted, images)
  # From Python (load_trained's tuple: capsjax.export's example), the format by the suffix.
  with pytest.raises(capsjax.ConfigError, match=r"^export: 'model.bin' has none of the suffixes \.onnx, "
                                                r"\.stablehlo, _savedmodel: give format="):
    capsjax.export(mnist_run, 'model.bin')
  reloaded = jax.export.deserialize(bytearray(open(stablehlo_path, 'rb').read()))
  assert reloaded.platforms == ('cpu', 'cuda', 'tpu') and str(reloaded.in_avals[0]) == 'uint8[batch,28,28,1]'
  _agree([np.asarray(v) for v in reloaded.call(images[:1])], predicted[:1], images[:1])
  savedmodel_path = str(tmp_path / 'model_savedmodel')   # jax2tf, with the TensorFlow TFDS brings
  savedmodel = [*documented.command(r'^capsjax-export --format=savedmodel ').args(
      {'workdirs/mnist': mnist_run, 'mnist_savedmodel': savedmodel_path}), '--reconstructions']
  if SAVEDMODEL_RUNS:
    assert export.main(savedmodel) == 0
    _agree(serving.run_file(savedmodel_path, images), predicted, images)
    assert serving.read_provenance(savedmodel_path)['capsjax'] == capsjax.__version__
  else:   # one line naming both versions and what works; nothing left behind
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
      export.main(savedmodel)
    errors = capsys.readouterr().err
    assert exited.value.code == 2 and errors.startswith(
        f'error: --format=savedmodel: TensorFlow {tf_version()} cannot run the StableHLO that jax {jax.__version__} '
        'writes (') and len(errors.strip().splitlines()) == 1, errors
    assert not os.path.exists(savedmodel_path) and not [p for p in os.listdir(tmp_path) if 'partial' in p]
    savedmodel_path = None
  _documented_blocks_run(onnx_path, stablehlo_path, savedmodel_path, images[0], tmp_path / 'documented')
  # A routing with a JAX primitive jax2onnx has no plugin for (a user's own primitive): one
  # line naming the primitive and the format that exports every model; nothing written.
  from jax.extend.core import Primitive  # pylint: disable=g-import-not-at-top
  from jax.interpreters import mlir  # pylint: disable=g-import-not-at-top
  from capsjax.routing import ROUTINGS  # pylint: disable=g-import-not-at-top
  halve = Primitive('test_halve')
  halve.def_impl(lambda x: x / 2)
  halve.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
  mlir.register_lowering(halve, mlir.lower_fun(lambda x: x / 2, multiple_results=False))

  def halved_mean(prediction_vectors, input_activations):
    del input_activations
    parents = capsjax.squash(halve.bind(prediction_vectors.mean(axis=1)))   # [batch, out, dim]
    return parents, capsjax.vector_norm(parents)
  capsjax.register_routing('test_halved_mean', iterative=False)(halved_mean)
  try:
    other = dataclasses.replace(trained, config=ml_collections.ConfigDict(trained.config.to_dict()))
    other.config.model.routing = 'test_halved_mean'
    with pytest.raises(serving.ExportError, match=r"^ONNX: jax2onnx [\d.]+ cannot convert the JAX primitive test_halve "
                                                  rf"\(routing 'test_halved_mean', jax {jax.__version__}\); "
                                                  r"--format=stablehlo"):
      serving.write_file(other, 'onnx', str(tmp_path / 'halved.onnx'))
  finally:
    ROUTINGS.unregister('test_halved_mean')
  # Bad input: one line each, exit 2, nothing written (the command's main, in this process).
  recorded = json.load(open(os.path.join(mnist_run, 'config.json')))
  untrained = tmp_path / 'untrained'   # a run's config.json, no checkpoint yet
  os.makedirs(untrained)
  json.dump(recorded, open(untrained / 'config.json', 'w'))
  ensemble = tmp_path / 'ensemble'   # the config of a 3-member ensemble (checked before any checkpoint)
  os.makedirs(ensemble)
  recorded['ensemble'] = {'seeds': [0, 1, 2]}
  json.dump(recorded, open(ensemble / 'config.json', 'w'))
  for arguments, line in [
      (['--format=onnx', f'--out={onnx_path}'], f'error: --out={onnx_path} exists: give another path, or --force'),
      (['--format=stablehlo', '--member=1'], 'error: --member and --step choose within a --workdir'),
      (['--format=onnx', f'--workdir={tmp_path}', f'--out={tmp_path}/x.onnx'], 'error: '),
      (['--format=onnx', f'--out={tmp_path}/no/x.onnx'], f'error: --out={tmp_path}/no/x.onnx: the folder'),
      (['--format=onnx', f'--workdir={untrained}', f'--out={tmp_path}/u.onnx'], 'error: '),
      (['--format=stablehlo', f'--workdir={ensemble}', f'--out={tmp_path}/e.stablehlo'],
       f'error: {ensemble} holds an ensemble of 3 models: name the one to export with --member=K (0 to 2)'),
      (['--format=onnx', '--force'], "error: --format=onnx needs the jax2onnx converter: pip install 'capsjax[export]'"),
      (['--format=onnx', '--out='], 'error: --out is empty: give the path to write'),
      (['--format=onnx', '--num_images=3'], 'error: --num_images is for --format=explorer'),
      ([f'--workdir={mnist_run}', f'--out={mnist_run}'], f'error: --out={mnist_run} holds checkpoints, '),
      # --evaluate reads the test split before the conversion, from the flag its error names
      (['--format=stablehlo', '--evaluate', f'--out={tmp_path}/d.stablehlo', f'--config.data_dir={tmp_path}/no'],
       f'error: data directory {tmp_path}/no does not exist')]:
    with monkeypatch.context() as patched:
      if '--force' in arguments:   # the converter missing
        patched.setitem(sys.modules, 'jax2onnx', None)
      capsys.readouterr()
      with pytest.raises(SystemExit) as exited:
        export.main(arguments)
    errors = capsys.readouterr().err
    assert exited.value.code == 2 and errors.startswith(line), (arguments, errors)
    assert len(errors.strip().splitlines()) == 1, errors
  # docs/results.md's export of a run for the explorer (its --out the package's assets unless given).
  results = documented.command(r'^capsjax-export --workdir=/tmp/runs/explorer$').args({'/tmp/runs/explorer': mnist_run})
  assert export.main([*results, f'--out={tmp_path}/explorer', '--num_images=20']) == 0
  assert {'params.npz', 'test_sample.npz', 'config.json'} <= set(os.listdir(tmp_path / 'explorer'))
  assert sorted(os.listdir(tmp_path)) == sorted(
      ['documented', 'ensemble', 'explorer', 'images.npy', 'mnist.stablehlo', 'mnist.stablehlo.json', 'model.onnx',
       'out.npz', 'untrained'] + (['model_savedmodel'] if SAVEDMODEL_RUNS else []))


def test_an_own_images_model_exports_and_agrees(tmp_path):
  """3 channels at 64 px from an image folder (its preprocessing inside the file)."""
  from capsjax import assemble  # pylint: disable=g-import-not-at-top
  from capsjax.experiments import images_smoke  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  for split in ('train', 'test'):
    for name in ('red', 'blue'):
      os.makedirs(tmp_path / 'photos' / split / name)
      for k in range(2):
        pixels = rng.integers(0, 256, (64, 64, 3), np.uint8)
        Image.fromarray(pixels).save(tmp_path / 'photos' / split / name / f'{k}.png')
  config = images_smoke.get_config()
  config.data_dir = str(tmp_path / 'photos')
  config.model.update(conv1_channels=8, primary_types=2, digit_dim=8, decoder_hidden=(16,))   # small: fast to convert
  config = assemble.resolve_data(config)
  config, _ = assemble.choose_model(config)
  assert tuple(config.model.input_shape) == (64, 64, 3)
  model = assemble.model(config)
  params = jax.jit(model.init)(jax.random.key(0), np.zeros((1, 64, 64, 3), np.float32))['params']
  trained = TrainedModel(config, model, params, 'an own-images model')
  images = rng.integers(0, 256, (3, 64, 64, 3), np.uint8)
  predicted = Predictor(trained).predict(images)
  path = str(tmp_path / 'photos.onnx')   # (the other formats: the test above)
  serving.write_file(trained, 'onnx', path)
  activations, capsules = serving.run_file(path, images)
  np.testing.assert_allclose(activations, [list(r['activations'].values()) for r in predicted], atol=TOLERANCE)
  assert capsules.shape == (3, 2, config.model.digit_dim)
  # No images: empty outputs from the model, the Predictor and the file (in ONNX Runtime: the test above).
  assert {name: value.shape for name, value in model.apply({'params': params}, np.zeros((0, 64, 64, 3))).items()
          if value is not None} == {'capsules': (0, 2, 8), 'lengths': (0, 2), 'activations': (0, 2),
                                    'reconstructions': (0, 64, 64, 3)}
  assert Predictor(trained).predict(images[:0]) == []
  stablehlo = str(tmp_path / 'photos.stablehlo')
  serving.write_file(trained, 'stablehlo', stablehlo)
  assert [value.shape for value in serving.run_file(stablehlo, images[:0])] == [(0, 2), (0, 2, 8)]


def test_a_changed_jax2onnx_plugin_system_leaves_the_plugins_to_jax2onnx(monkeypatch):
  from jax2onnx.plugins import plugin_system  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(plugin_system, '_already_imported_plugins', False)
  monkeypatch.delattr(plugin_system, '_import_tree')   # what the shortcut reads, gone
  assert serving.import_onnx_plugins() is False
  assert plugin_system._already_imported_plugins is False   # jax2onnx imports them all itself  pylint: disable=protected-access


def _documented_blocks_run(onnx_path, stablehlo_path, savedmodel_path, digit, folder):
  """Every python block of docs/serving.md runs as written in a folder holding the files they
  name: ONNX Runtime's in a process that cannot import JAX."""
  import shutil  # pylint: disable=g-import-not-at-top
  os.makedirs(folder)
  # README's (and docs/serving.md's) export of the shipped model, as written, in that folder.
  readme = documented.command(r'^capsjax-export --format=onnx --out=mnist_official.onnx$').args()
  exported = subprocess.run([sys.executable, '-m', 'capsjax.app.export', *readme], cwd=folder,
                            capture_output=True, text=True, timeout=600)
  assert exported.returncode == 0 and os.path.getsize(folder / 'mnist_official.onnx') > 20e6, exported.stderr[-2000:]
  del onnx_path
  shutil.copy(stablehlo_path, folder / 'mnist.stablehlo')
  if savedmodel_path:
    shutil.copytree(savedmodel_path, folder / 'mnist_savedmodel')
  Image.fromarray(digit[..., 0]).save(folder / 'digit.png')
  blocks = [found.group(1) for found in re.finditer(r'^```python\n(.*?)^```', open(
      os.path.join(ROOT, 'docs', 'serving.md')).read(), re.S | re.M)]
  assert len(blocks) == 3 and sum('onnxruntime' in block for block in blocks) == 1
  for block in blocks:
    if 'mnist_savedmodel' in block and not savedmodel_path:
      continue
    code = ("import sys; sys.modules['jax'] = None\n" if 'onnxruntime' in block else '') + block
    result = subprocess.run([sys.executable, '-c', code], cwd=folder, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (block, result.stderr[-2000:])
    assert result.stdout.strip(), block


def _mounted_tmpfs(path, options):
  os.makedirs(path, exist_ok=True)
  result = subprocess.run(['mount', '-t', 'tmpfs', '-o', options, 'tmpfs', str(path)], capture_output=True, text=True)
  if result.returncode:
    pytest.skip(f'cannot mount a tmpfs here ({result.stderr.strip()})')


def test_a_full_or_read_only_disk_and_a_mismatched_suffix_are_one_line(mnist_run, tmp_path, capsys):
  """Every format to a full and to a read-only disk: one line, exit 2, nothing left behind
  (SavedModel once ended in TensorFlow's traceback); --evaluate runs the file as --format says,
  whatever its suffix; a user's own OUT.partial is never touched."""
  full, read_only = tmp_path / 'full', tmp_path / 'read_only'
  _mounted_tmpfs(full, 'size=256k')
  try:
    _mounted_tmpfs(read_only, 'ro,size=256k')
    try:
      for folder, reason in ((full, 'No space left on device'), (read_only, 'Read-only file system')):
        for format_name in ('savedmodel',):   # (ONNX and StableHLO: one OSError path, test_export's bad input)
          out = folder / f'model{serving.SUFFIXES[format_name]}'
          with pytest.raises(SystemExit) as exited:
            export.main([f'--format={format_name}', f'--workdir={mnist_run}', f'--out={out}'])
          errors = capsys.readouterr().err.strip().splitlines()
          assert exited.value.code == 2 and errors == [f'error: {out}: cannot write ({reason})'], errors
        assert os.listdir(folder) == []
    finally:
      subprocess.run(['umount', str(read_only)], check=False)
  finally:
    subprocess.run(['umount', str(full)], check=False)
  (tmp_path / 'model.bin.partial').write_text('mine')
  for format_name, out in (('stablehlo', 'model.onnx'), ('onnx', 'model.bin')):
    assert export.main([f'--format={format_name}', f'--workdir={mnist_run}', f'--out={tmp_path / out}',
                        '--evaluate']) == 0
    said = capsys.readouterr().out
    assert f'test error on 100 test images: {format_name} file ' in said and 'differ on 0' in said, said
  assert (tmp_path / 'model.bin.partial').read_text() == 'mine'
  assert sorted(os.listdir(tmp_path)) == ['full', 'model.bin', 'model.bin.partial', 'model.onnx', 'model.onnx.json',
                                         'read_only']


def test_a_stablehlo_file_this_jax_cannot_load_is_one_line_naming_the_jax_that_wrote_it(tmp_path):
  """A file outside JAX's window (its calling convention older than this JAX reads; its
  module unreadable): one line with the writer's versions from `FILE.json` and what to do."""
  exported = jax.export.export(jax.jit(lambda images: (images * 2,)))(
      jax.ShapeDtypeStruct((2, 28, 28, 1), np.uint8))
  old = {'capsjax': '0.1.0', 'jax': '0.4.30', 'jaxlib': '0.4.30', 'exported': '2024-06-18', 'source': 'a run'}
  expired = dataclasses.replace(
      exported, calling_convention_version=jax.export.minimum_supported_calling_convention_version - 1)
  damaged = dataclasses.replace(exported, mlir_module_serialized=b'not a StableHLO module')
  images = np.zeros((2, 28, 28, 1), np.uint8)
  for name, written, provenance, said in (
      ('expired', expired, old, 'capsjax 0.1.0 with jax 0.4.30 (jaxlib 0.4.30) on 2024-06-18'),
      ('damaged', damaged, None, 'an unknown JAX (no provenance with the file)')):
    path = tmp_path / f'{name}.stablehlo'
    path.write_bytes(written.serialize())
    if provenance:
      (tmp_path / f'{name}.stablehlo.json').write_text(json.dumps(provenance))
    with pytest.raises(serving.ExportError) as refused:
      serving.run_file(str(path), images)
    line = str(refused.value)
    assert line.startswith(f'{path}: jax {jax.__version__} cannot load it (') and '\n' not in line, line
    assert f'it was written by {said}, and a StableHLO file loads in {serving.STABLEHLO_WINDOW}: export it ' \
           'again with this JAX (capsjax-export --format=stablehlo)' in line, line
  path = tmp_path / 'fine.stablehlo'
  path.write_bytes(exported.serialize())
  np.testing.assert_array_equal(serving.run_file(str(path), images)[0], images * 2)
  with pytest.raises(serving.ExportError, match=r'fine.stablehlo takes uint8 \[batch, 28, 28, 1\] images, got '
                                                r'float32 \[2, 28, 28, 1\]$'):
    serving.run_file(str(path), images.astype(np.float32))
