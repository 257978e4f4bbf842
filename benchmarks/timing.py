"""What the benchmark scripts share (run as `python benchmarks/NAME.py`): timing, FLOPs per
image from a CapsNet config's layer shapes, XLA's buffer sizes of a compiled program."""
import time

import jax
import numpy as np


def seconds_per_call(fn, args, steps: int) -> float:
  """Seconds per call of `fn(*args)` after one warm-up call (compilation)."""
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  for _ in range(steps):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / steps


def seconds_per_step(step, state, args, steps: int):
  """(seconds per call of `state, out = step(state, *args)`, the last state) after one
  warm-up call: the state is threaded through, as a step that donates it needs."""
  state, out = step(state, *args)
  jax.block_until_ready(out)
  start = time.perf_counter()
  for _ in range(steps):
    state, out = step(state, *args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / steps, state


def random_inputs(config, batch: int, input_shape: str = ''):
  """(config, images, labels) for timing `config`'s model at `batch`: with `input_shape`
  ('H,W,C', the `images` experiment's way) the model reads that shape and its 'auto' keys
  are chosen for it (capsjax.assemble.choose_model); random uint8 images of the shape the
  data stores, which the pipeline crops, resizes and jitters as it would real ones."""
  from capsjax import assemble  # pylint: disable=g-import-not-at-top
  from capsjax.data.datasets import dataset_info  # pylint: disable=g-import-not-at-top
  if input_shape:
    config.model.input_shape = tuple(int(side) for side in input_shape.split(','))
  config.model.num_classes = config.model.num_classes or 10   # `images` takes the data's; the peer has 10
  config.batch_size = batch
  image_shape = tuple(config.model.input_shape) if input_shape else dataset_info(config.dataset).image_shape
  config, _ = assemble.choose_model(config)
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (batch,) + image_shape).astype(np.uint8)
  labels = rng.integers(0, config.model.num_classes, batch).astype(np.int32)
  return config, images, labels


def is_paper_architecture(model_config) -> bool:
  """The layers `capsnet_flops` counts: no stem, a W per capsule pair, the dense decoder."""
  return (model_config.get('stem', 'none') == 'none' and model_config.get('transforms', 'per_capsule') == 'per_capsule'
          and model_config.get('decoder', 'dense') == 'dense')


def formulation_section(model_config):
  """A model config's formulation section (a model config recorded before model.formulation
  held its options itself)."""
  return model_config.get('formulation') or model_config


def conv_layers(model_config, batch: int = 128) -> dict:
  """{'conv1': ConvLayer, 'primary': ConvLayer} of the paper's layers at the config's shape."""
  from capsjax.formulations import ConvLayer  # pylint: disable=g-import-not-at-top
  height, width, channels = model_config.input_shape
  k1, k2, stride = model_config.conv1_kernel, model_config.primary_kernel, model_config.primary_stride
  inputs = formulation_section(model_config).get('conv_inputs', 'float32')
  conv1 = ConvLayer(height, width, channels, model_config.conv1_channels, k1, 1, inputs, batch)
  h1, w1 = conv1.output_size()
  primary = ConvLayer(h1, w1, model_config.conv1_channels, model_config.primary_types * model_config.primary_dim,
                      k2, stride, inputs, batch)
  return {'conv1': conv1, 'primary': primary}


def capsnet_flops(model_config, backend: str = '', batch: int = 128) -> dict:
  """Multiply-adds × 2 per image, from the layer shapes (elementwise ops not counted).

  'forward' / 'train' count the convolutions in the direct form (the paper's arithmetic,
  what the PyTorch peer computes); 'forward_performed' / 'train_performed' as the
  formulation `conv_impl` resolves to on `backend` computes them ('fourier' needs fewer:
  capsjax.formulations.ConvLayer.fourier_multiply_adds; 'space_to_depth' more, its zero
  taps; a backward counted as twice its forward, like a matmul's)."""
  from capsjax import formulations  # pylint: disable=g-import-not-at-top
  height, width, channels = model_config.input_shape
  layers = conv_layers(model_config, batch)
  h2, w2 = layers['primary'].output_size()
  in_caps = h2 * w2 * model_config.primary_types
  classes, dim = model_config.num_classes, model_config.digit_dim
  direct = {name: 2 * layer.direct_multiply_adds() for name, layer in layers.items()}
  performed = {}
  for name, layer in layers.items():
    impl = formulations.resolve('conv_impl', formulation_section(model_config).get('conv_impl', 'auto'), backend, layer)
    performed[name] = (2 * layer.fourier_multiply_adds() if impl == 'fourier' else
                       2 * layer.space_to_depth_multiply_adds() if impl == 'space_to_depth' else direct[name])
  predictions = 2 * in_caps * classes * dim * model_config.primary_dim
  routing = 2 * 2 * in_caps * classes * dim * model_config.routing_iterations  # s_j and û·v
  decoder = 0
  if model_config.use_decoder:
    widths = [classes * dim, *model_config.decoder_hidden, height * width * channels]
    decoder = sum(2 * a * b for a, b in zip(widths[:-1], widths[1:]))
  rest = predictions + routing + decoder
  figures = {}
  for suffix, convs in (('', direct), ('_performed', performed)):
    forward = convs['conv1'] + convs['primary'] + rest
    # Backward: two matmuls per forward matmul (input and weight gradients), except that
    # Conv1 needs no gradient with respect to the images.
    figures['forward' + suffix] = forward
    figures['train' + suffix] = 3 * forward - convs['conv1']
  return figures


def buffer_bytes(jitted, *args) -> int:
  """XLA's own accounting: arguments + outputs + temporaries of the compiled program."""
  return compiled_buffer_bytes(jitted.lower(*args).compile())


def compiled_buffer_bytes(compiled) -> int:
  """`buffer_bytes` of an already compiled program (-1 where XLA gives no analysis)."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return -1
  return (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
          + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)
