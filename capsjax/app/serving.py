"""A trained CapsNet as one file that runs outside capsjax: ONNX (through jax2onnx; ONNX
Runtime, and any ONNX runtime, reads it), StableHLO (`jax.export`, serialized; a JAX
within JAX's compatibility window, 6 months after the writing JAX and 3 weeks before it,
reloads it with `jax.export.deserialize`, on the platforms it was lowered for), or a
TensorFlow SavedModel folder (jax2tf, with the TensorFlow that TFDS already brings:
`tf.saved_model.load`, TF Serving; its signature `serving_default`).

The file holds the inference function with the parameters as constants:
  images   uint8 [batch, height, width, channels], 0–255: the run's image shape (what a PNG
           decodes to; the file does the run's preprocessing itself), the batch dynamic;
  outputs  `activations` [batch, classes] (the class capsules' lengths under Procedure 1,
           the routing's activations otherwise: the predicted class is their argmax),
           `capsules` [batch, classes, dim] (the class capsule vectors) and, with
           `reconstructions=True`, `reconstructions` [batch, height, width, channels] in
           [0, 1]: the decoder's image of the predicted class.
Every file computes with one formulation, `EXPORT_FORMULATION` (formulations compute the
same values; this one converts cleanly): XLA's convolution as its plain primitive, the
routing loop as straight-line code on û (routed without û, a broadcast product failed in
ONNX Runtime's buffer reuse), float32.

Every file says who wrote it (`provenance`: the capsjax, jax and jaxlib versions, the UTC
date, the model): ONNX in its metadata (`capsjax_provenance`), a SavedModel in
`assets.extra/capsjax_provenance.json`, a StableHLO file beside it (`FILE.json`: JAX's
serialization has no field for it), so that a file JAX no longer loads says which JAX wrote it.
"""
import contextlib
import datetime
import errno
import io
import json
import logging
import os
import re
import shutil
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from capsjax.errors import CapsjaxError, ConfigError

FORMATS = ('explorer', 'onnx', 'stablehlo', 'savedmodel')
SUFFIXES = {'onnx': '.onnx', 'stablehlo': '.stablehlo', 'savedmodel': '_savedmodel'}
EXPORT_FORMULATION = {'conv_impl': 'xla', 'routing_loop': 'unrolled', 'dtype': 'float32', 'member_convs': 'grouped',
                      'prediction_vectors': 'multiply_adds'}
# The platforms a StableHLO file is lowered for (a JAX on any of them can call it).
LOWERED_FOR = ('cpu', 'cuda', 'tpu')
EXTRA = "pip install 'capsjax[export]'"
OUTPUT_NAMES = ('activations', 'capsules', 'reconstructions')
PROVENANCE = 'capsjax_provenance'   # the ONNX metadata key, the SavedModel's asset file name
# JAX's promise for a serialized StableHLO file (jax.export's documentation).
STABLEHLO_WINDOW = 'a JAX released up to 6 months after the one that wrote it, or up to 3 weeks before it'
# The jax2onnx plugin trees a capsjax model converts with: JAX's primitives and Flax's.
ONNX_PLUGIN_TREES = ('jax', 'flax')


class ExportError(CapsjaxError):
  """A model that cannot be exported as asked (one line: what, and what to do instead)."""


def provenance(trained) -> Dict[str, str]:
  """Who wrote an exported file of `trained`: {'capsjax', 'jax', 'jaxlib': versions,
  'exported': the UTC date (YYYY-MM-DD), 'source': the model (TrainedModel.describe())}."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top
  from capsjax import __version__  # pylint: disable=g-import-not-at-top
  return {'capsjax': __version__, 'jax': jax.__version__, 'jaxlib': jaxlib.__version__,
          'exported': datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d'),
          'source': trained.describe()}


def read_provenance(path: str, format_name: Optional[str] = None) -> Optional[Dict[str, str]]:
  """The provenance written with the exported file at `path` (None: a file written before
  capsjax 0.3, or a StableHLO file whose `.json` did not travel with it)."""
  format_name = format_name or file_format(path)
  try:
    if format_name == 'onnx':
      import onnx  # pylint: disable=g-import-not-at-top
      entries = {entry.key: entry.value for entry in onnx.load(path, load_external_data=False).metadata_props}
      return json.loads(entries[PROVENANCE]) if PROVENANCE in entries else None
    beside = (os.path.join(path, 'assets.extra', f'{PROVENANCE}.json') if format_name == 'savedmodel'
              else f'{path}.json')
    with open(beside, encoding='utf-8') as f:
      return json.load(f)
  except (OSError, ValueError, ImportError):
    return None


def written_by(found: Optional[Dict[str, str]]) -> str:
  """'capsjax 0.3.0 with jax 0.10.2 (jaxlib 0.10.2) on 2026-12-02', or that it is not known."""
  if not found:
    return 'an unknown JAX (no provenance with the file)'
  return (f'capsjax {found.get("capsjax", "?")} with jax {found.get("jax", "?")} (jaxlib {found.get("jaxlib", "?")})'
          f' on {found.get("exported", "?")}')


def inference_function(trained, reconstructions: bool = False) -> Tuple[Callable[..., Any], Tuple[str, ...]]:
  """(images uint8 [batch, h, w, c] → outputs, their names) of `trained` (a TrainedModel
  of a capsule family), its parameters closed over, built with EXPORT_FORMULATION."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  from capsjax import assemble  # pylint: disable=g-import-not-at-top
  from capsjax.data import augment  # pylint: disable=g-import-not-at-top
  from capsjax.models import longest_capsule_mask  # pylint: disable=g-import-not-at-top
  trained.require_one_model('the export')
  if not trained.family.capsules:
    raise ExportError(f'{trained.source} holds a {trained.config.model.name!r} model: the ONNX and StableHLO '
                      'exports are of capsule networks (their capsules are outputs)')
  if not trained.task.single_images:
    raise ExportError(f'{trained.source} holds a {trained.config.task} run: the export classifies one object '
                      'per image')
  if reconstructions and not trained.has_decoder:
    raise ExportError(f'{trained.source}: the model has no decoder, so no --reconstructions')
  config = ml_collections.ConfigDict(trained.config.to_dict())
  if 'formulation' in config.model:
    config.model.formulation.update(EXPORT_FORMULATION)
  model, params, preprocessing = assemble.model(config, 'cpu'), trained.params, trained.info.preprocessing

  def infer(images):   # uint8 [batch, h, w, c]
    inputs, _ = augment.prepare(images, preprocessing)
    variables = {'params': params}
    capsules, activations = model.apply(variables, inputs, method='classify')   # [b, classes, dim], [b, classes]
    if not reconstructions:
      return activations, capsules
    decoded = model.apply(variables, capsules, longest_capsule_mask(activations), method='decode')
    return activations, capsules, decoded
  return infer, OUTPUT_NAMES[:3 if reconstructions else 2]


def input_spec(trained):
  """The images' abstract value: uint8 [batch, *the run's image shape], batch symbolic."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  batch, = jax.export.symbolic_shape('batch')
  return jax.ShapeDtypeStruct((batch,) + tuple(trained.info.image_shape), jnp.uint8)


def import_onnx_plugins() -> bool:
  """Imports jax2onnx's plugins for ONNX_PLUGIN_TREES alone and marks its plugins imported;
  False (nothing marked) where jax2onnx's plugin system differs from the one this reads.

  A first conversion imports every module of jax2onnx's plugin tree, and the Equinox
  plugins build example modules as they are imported: most of an export's time
  (docs/results.md, "Exported models"). jax2onnx has no public way to choose plugins, so this
  reads its plugin_system; where that has changed, jax2onnx imports them all, as before.
  (A later jax2onnx conversion of an Equinox model in the same process converts without
  its Equinox plugins: through JAX's primitives.)"""
  import pathlib  # pylint: disable=g-import-not-at-top
  try:
    from jax2onnx.plugins import plugin_system  # pylint: disable=g-import-not-at-top
    if plugin_system._already_imported_plugins:  # pylint: disable=protected-access
      return True
    root = pathlib.Path(plugin_system.__file__).parent
    for tree in ONNX_PLUGIN_TREES:
      plugin_system._import_tree(root / tree, f'jax2onnx.plugins.{tree}')  # pylint: disable=protected-access
  except (ImportError, AttributeError, TypeError):
    return False
  plugin_system._already_imported_plugins = True  # pylint: disable=protected-access
  return True


def _onnx_proto(trained, reconstructions: bool, written: Dict[str, str]):
  try:
    import jax2onnx  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ExportError(f'--format=onnx needs the jax2onnx converter: {EXTRA}') from None
  infer, names = inference_function(trained, reconstructions)
  infer = _empty_batch_guarded(infer)
  chatter = io.StringIO()   # jax2onnx prints its plugins' debugging lines; kept for a failure
  quiet = [logging.getLogger(name) for name in ('jax2onnx', 'onnx_ir')]
  levels = [logger.level for logger in quiet]
  try:
    for logger in quiet:
      logger.setLevel(logging.ERROR)
    with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
      import_onnx_plugins()
      proto = jax2onnx.to_onnx(infer, [input_spec(trained)], model_name='capsnet', input_names=['images'],
                               output_names=list(names))
  except NotImplementedError as error:
    import importlib.metadata  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top
    primitive = re.search(r"primitive '([^']+)'", str(error))
    raise ExportError(f'ONNX: jax2onnx {importlib.metadata.version("jax2onnx")} cannot convert the JAX primitive '
                      f'{primitive.group(1) if primitive else error!s} (routing '
                      f'{trained.config.model.get("routing")!r}, jax {jax.__version__}); --format=stablehlo exports '
                      'every model') from None
  finally:
    for logger, level in zip(quiet, levels):
      logger.setLevel(level)
  metadata = {'capsjax_classes': json.dumps(list(trained.info.class_names)),
              'capsjax_images': f'uint8 [batch, {", ".join(map(str, trained.info.image_shape))}], 0-255',
              'capsjax_formulation': json.dumps(EXPORT_FORMULATION), 'capsjax_source': trained.describe(),
              PROVENANCE: json.dumps(written)}
  for key, value in metadata.items():
    entry = proto.metadata_props.add()
    entry.key, entry.value = key, value
  _drop_unused_initializers(proto.graph)
  return proto


def _empty_batch_guarded(infer):
  """`infer` behind a branch on the batch size: 0 images give empty outputs without running
  the model (ONNX Runtime 1.32's Einsum kills its process with SIGFPE on an empty batch)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def guarded(images):   # uint8 [batch, h, w, c]
    batch = images.shape[0]   # symbolic
    def empty(images):
      one = jax.eval_shape(infer, jax.ShapeDtypeStruct((1,) + images.shape[1:], images.dtype))
      return tuple(jnp.zeros((batch,) + output.shape[1:], output.dtype) for output in one)
    return jax.lax.cond(jnp.asarray(batch) == 0, empty, infer, images)
  return guarded


def _subgraphs(node) -> list:
  """The graphs an ONNX node holds as attributes (an If's branches, a Loop's body)."""
  import onnx  # pylint: disable=g-import-not-at-top
  return [graph for attribute in node.attribute
          for graph in ([attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else []) + list(attribute.graphs)]


def _used_names(graph, names: set) -> set:
  """The value names that `graph`'s nodes (and those of its subgraphs) read, and its outputs."""
  for node in graph.node:
    names.update(node.input)
    for subgraph in _subgraphs(node):
      _used_names(subgraph, names)
  names.update(output.name for output in graph.output)
  return names


def _drop_unused_initializers(graph) -> None:
  """Removes the initializers no node reads, in `graph` and in each branch's subgraph
  (jax2onnx leaves a branch's constants in the main graph too; ONNX Runtime then prints a
  warning for each one at every session start)."""
  used = _used_names(graph, set())
  kept = [initializer for initializer in graph.initializer if initializer.name in used]
  del graph.initializer[:]
  graph.initializer.extend(kept)
  for node in graph.node:
    for subgraph in _subgraphs(node):
      _drop_unused_initializers(subgraph)


def _stablehlo_bytes(trained, reconstructions: bool) -> bytes:
  import jax  # pylint: disable=g-import-not-at-top
  infer, _ = inference_function(trained, reconstructions)
  exported = jax.export.export(jax.jit(infer), platforms=LOWERED_FOR)(input_spec(trained))
  return bytes(exported.serialize())


def _write_savedmodel(trained, reconstructions: bool, folder: str, written: Dict[str, str]) -> None:
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')   # TensorFlow's start-up lines
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from jax.experimental import jax2tf  # pylint: disable=g-import-not-at-top
  except ImportError as error:
    raise ExportError(f'--format=savedmodel needs TensorFlow and jax2tf ({error})') from None
  infer, names = inference_function(trained, reconstructions)
  shape = ', '.join(map(str, trained.info.image_shape))
  converted = jax2tf.convert(infer, polymorphic_shapes=[f'(batch, {shape})'], with_gradient=False)
  module = tf.Module()
  module.serve = tf.function(lambda images: dict(zip(names, converted(images))), autograph=False,
                             input_signature=[tf.TensorSpec([None, *trained.info.image_shape], tf.uint8,
                                                            name='images')])
  try:
    tf.saved_model.save(module, folder, signatures={'serving_default': module.serve})
    _check_tensorflow_runs(folder, trained, tf)
    os.makedirs(os.path.join(folder, 'assets.extra'), exist_ok=True)   # TF Serving's folder of extra files
    with open(os.path.join(folder, 'assets.extra', f'{PROVENANCE}.json'), 'w', encoding='utf-8') as f:
      json.dump(written, f, indent=1)
  except tf.errors.OpError as error:   # a full or read-only disk: TensorFlow's own error types
    reason = next((os.strerror(code) for code in (errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT)
                   if os.strerror(code).lower() in str(error.message).lower()), None)
    raise OSError(errno.EIO, reason or f'{type(error).__name__}: {str(error.message).splitlines()[0][:200]}'
                  ) from None


def _check_tensorflow_runs(folder: str, trained, tf) -> None:
  """Runs the written SavedModel on one image: TensorFlow reads the StableHLO that jax2tf
  embeds only up to its own StableHLO version (TensorFlow 2.21 cannot read what jax
  0.12.0.1 writes: measured), and the file would fail only where it is served."""
  import jax  # pylint: disable=g-import-not-at-top
  from capsjax.console import xla_alarms_dropped  # pylint: disable=g-import-not-at-top
  serve = tf.saved_model.load(folder).signatures['serving_default']
  try:
    with xla_alarms_dropped(all_if_failed=True):   # TensorFlow's C++ log of the failure: the line below says it
      serve(images=tf.zeros([1, *trained.info.image_shape], tf.uint8))
  except tf.errors.OpError as error:
    if 'deserialize' not in str(error.message):
      raise
    reason = next((line.split('error: ')[-1] for line in str(error.message).splitlines() if 'error: ' in line),
                  'cannot deserialize the computation')
    raise ExportError(f'--format=savedmodel: TensorFlow {tf.__version__} cannot run the StableHLO that jax '
                      f'{jax.__version__} writes ({reason.strip()[:160]}); jax 0.10.2 writes SavedModels that '
                      'TensorFlow 2.21 runs, and --format=onnx or stablehlo export with this JAX') from None


def default_path(trained, format_name: str) -> str:
  return f'{trained.config.experiment.replace("/", "_")}{SUFFIXES[format_name]}'


def check_output(path: str, force: bool, format_name: str) -> None:
  """One line for an output path that cannot be written (before anything is converted); of
  a StableHLO file, its provenance `PATH.json` too."""
  folder = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(folder):
    raise ExportError(f'--out={path}: the folder {folder} does not exist')
  if os.path.isdir(path) and not path.endswith(SUFFIXES['savedmodel']):
    raise ExportError(f'--out={path} is a folder: give the file to write')
  for written in (path, f'{path}.json') if format_name == 'stablehlo' else (path,):
    if os.path.exists(written) and not force:
      raise ExportError(f'--out={path}{"" if written == path else f": {written}"} exists: give another path, or '
                        '--force to replace it')


def write_file(trained, format_name: str, path: str, reconstructions: bool = False, force: bool = False) -> Dict[str, Any]:
  """Writes `trained` as one `format_name` file at `path` (a partial file never stays: it
  is written beside and renamed when complete). Returns {'bytes', 'outputs', ...}."""
  if format_name not in SUFFIXES:
    raise ConfigError(f'--format={format_name!r}: allowed one of {", ".join(FORMATS)}')
  check_output(path, force, format_name)
  written = provenance(trained)   # one record for the file, its metadata and the summary
  from capsjax.app.cli import removed_if_stopped  # pylint: disable=g-import-not-at-top
  # A hidden name of its own beside `path` (never a user's file), removed if the export fails
  # or a signal ends the command.
  folder, name = os.path.split(os.path.abspath(path))
  partial = os.path.join(folder, f'.{name}.{os.getpid()}.partial')
  partial_provenance = os.path.join(folder, f'.{name}.json.{os.getpid()}.partial')   # a StableHLO file's
  try:
    with removed_if_stopped(partial), removed_if_stopped(partial_provenance):
      if format_name == 'savedmodel':   # a folder, written beside and renamed
        _write_savedmodel(trained, reconstructions, partial, written)
        if os.path.exists(path):
          shutil.rmtree(path)
        os.replace(partial, path)
        size = sum(os.path.getsize(os.path.join(top, file)) for top, _, files in os.walk(path) for file in files)
      else:
        content = (_onnx_proto(trained, reconstructions, written).SerializeToString() if format_name == 'onnx'
                   else _stablehlo_bytes(trained, reconstructions))
        with open(partial, 'wb') as f:
          f.write(content)
        if format_name == 'stablehlo':   # its provenance beside it, in place before the file
          with open(partial_provenance, 'w', encoding='utf-8') as f:
            json.dump(written, f, indent=1)
          os.replace(partial_provenance, f'{path}.json')
        os.replace(partial, path)
        size = len(content)
  except OSError as error:
    raise ExportError(f'{path}: cannot write ({error.strerror or error})') from None
  finally:
    for leftover in (partial, partial_provenance):
      if os.path.isdir(leftover):
        shutil.rmtree(leftover)
      elif os.path.exists(leftover):
        os.remove(leftover)
  names = OUTPUT_NAMES[:3 if reconstructions else 2]
  return {'bytes': size, 'outputs': names, 'formulation': dict(EXPORT_FORMULATION),
          'platforms': LOWERED_FOR if format_name == 'stablehlo' else None,
          'provenance': written}


def export(model, path: str, format: Optional[str] = None, *, reconstructions: bool = False,  # pylint: disable=redefined-builtin
           force: bool = False, member: Optional[int] = None, step: Optional[int] = None) -> Dict[str, Any]:
  """Writes a trained model as one file that runs outside capsjax (what `capsjax-export`
  writes): `format` 'onnx', 'stablehlo' or 'savedmodel' (default: by `path`'s suffix,
  `.onnx`, `.stablehlo`, `_savedmodel`). `model`: a TrainedModel, a run's workdir
  (`member` and `step` choose within it, as the command's flags do) or load_trained's
  (config, model, params). Returns what was written: {'bytes', 'outputs', 'formulation',
  'platforms', 'provenance'}. An existing `path` is replaced only with `force`.

  Example:
    `workdir` as in load_trained's example.

    >>> written = capsjax.export(capsjax.load_trained(workdir), workdir + '.stablehlo')   # or the workdir
    >>> written['outputs'], written['platforms']
    (('activations', 'capsules'), ('cpu', 'cuda', 'tpu'))
    >>> written['provenance']['source'], written['provenance']['jax'] == jax.__version__
    ('a model in memory (mnist_smoke)', True)
  """
  if format is None:
    found = [name for name, suffix in SUFFIXES.items() if os.fspath(path).endswith(suffix)]
    if not found:
      raise ConfigError(f'export: {path!r} has none of the suffixes {", ".join(SUFFIXES.values())}: give '
                        f'format= ({", ".join(SUFFIXES)})')
    format = found[0]
  from capsjax.app.trained import TrainedModel  # pylint: disable=g-import-not-at-top
  return write_file(TrainedModel.of(model, member, step), format, os.fspath(path), reconstructions, force)


def file_format(path: str) -> str:
  """The format of an exported file, by what it is ('savedmodel': a folder) or its suffix."""
  if os.path.isdir(path):
    return 'savedmodel'
  return 'onnx' if path.endswith(SUFFIXES['onnx']) else 'stablehlo'


def run_file(path: str, images: np.ndarray, batch_size: int = 256, format_name: Optional[str] = None
             ) -> Tuple[np.ndarray, ...]:
  """The outputs of the exported file at `path` for uint8 images [n, h, w, c], in batches:
  ONNX through ONNX Runtime, StableHLO through jax.export.deserialize, a SavedModel folder
  through TensorFlow. `format_name`: the file's format (the command's --format; default:
  `file_format(path)`)."""
  format_name = format_name or file_format(path)
  if format_name == 'savedmodel':
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    serve = tf.saved_model.load(path).signatures['serving_default']
    call = lambda chunk: [serve(images=tf.constant(chunk))[name].numpy() for name in OUTPUT_NAMES
                          if name in serve.structured_outputs]
  elif format_name == 'onnx':
    try:
      import onnxruntime  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise ExportError(f'running an ONNX file needs onnxruntime: {EXTRA}') from None
    session = onnxruntime.InferenceSession(path, providers=['CPUExecutionProvider'])
    call = lambda chunk: session.run(None, {'images': chunk})
  else:
    exported = load_stablehlo(path)
    # (JAX's symbolic batch is at least 1: for no images, the outputs' shapes)
    call = lambda chunk: ([np.asarray(value) for value in _called(exported, path, chunk)] if len(chunk) else
                          [np.zeros((0,) + tuple(aval.shape[1:]), aval.dtype) for aval in exported.out_avals])
  parts = [call(np.ascontiguousarray(images[start:start + batch_size]))
           for start in range(0, max(len(images), 1), batch_size)]   # no images: one empty call
  return tuple(np.concatenate([part[index] for part in parts]) for index in range(len(parts[0])))


def load_stablehlo(path: str):
  """The `jax.export.Exported` of the StableHLO file at `path`; a file this JAX cannot load
  (outside JAX's compatibility window, or not a StableHLO file) is an ExportError naming the
  JAX that wrote it (its provenance) and what to do."""
  import jax  # pylint: disable=g-import-not-at-top
  from capsjax.console import xla_alarms_dropped  # pylint: disable=g-import-not-at-top
  with open(path, 'rb') as f:
    content = bytearray(f.read())
  try:
    with xla_alarms_dropped(all_if_failed=True):
      exported = jax.export.deserialize(content)
  except Exception as error:  # pylint: disable=broad-except  (JAX's deserializer raises many types)
    raise _unloadable(path, error) from None
  lowest, highest = (jax.export.minimum_supported_calling_convention_version,
                     jax.export.maximum_supported_calling_convention_version)
  if not lowest <= exported.calling_convention_version <= highest:
    raise _unloadable(path, f'calling convention {exported.calling_convention_version}, this JAX reads '
                            f'{lowest}-{highest}')
  return exported


def _called(exported, path: str, images: np.ndarray):
  """exported.call(images); a module this JAX cannot compile is an ExportError as in
  load_stablehlo (images the file does not take are refused first, naming what it takes)."""
  expected = exported.in_avals[0]
  if images.shape[1:] != tuple(expected.shape[1:]) or images.dtype != expected.dtype:
    raise ExportError(f'{path} takes {expected.dtype} [batch, {", ".join(map(str, expected.shape[1:]))}] images, '
                      f'got {images.dtype} {list(images.shape)}')
  from capsjax.console import xla_alarms_dropped  # pylint: disable=g-import-not-at-top
  try:
    with xla_alarms_dropped(all_if_failed=True):
      return exported.call(images)
  except Exception as error:  # pylint: disable=broad-except  (MLIR's and XLA's errors have no common type)
    raise _unloadable(path, error) from None


def _unloadable(path: str, error) -> ExportError:
  import jax  # pylint: disable=g-import-not-at-top
  reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
  return ExportError(f'{path}: jax {jax.__version__} cannot load it ({reason}); it was written by '
                     f'{written_by(read_provenance(path, "stablehlo"))}, and a StableHLO file loads in '
                     f'{STABLEHLO_WINDOW}: export it again with this JAX (capsjax-export --format=stablehlo)')


def describe(summary: Dict[str, Any], path: str, trained) -> Sequence[str]:
  """The lines the command prints for a written file."""
  shape = ', '.join(map(str, trained.info.image_shape))
  lines = [f'wrote {path} ({summary["bytes"] / 2**20:.1f} MiB): images uint8 [batch, {shape}] (0-255) → '
           + ', '.join(summary['outputs']),
           'formulation: ' + ', '.join(f'{k}={v}' for k, v in summary['formulation'].items())
           + (f'; lowered for {", ".join(summary["platforms"])}' if summary['platforms'] else ''),
           f'classes (the index of each activation): {", ".join(trained.info.class_names)}',
           f'written by {written_by(summary["provenance"])}'
           + (f' ({path}.json); loads in {STABLEHLO_WINDOW}' if summary['platforms'] else '')]
  return lines
