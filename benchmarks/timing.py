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


def capsnet_flops(model_config) -> dict:
  """Multiply-adds × 2 per image, from the layer shapes (elementwise ops not counted)."""
  height, width, channels = model_config.input_shape
  k1, k2, stride = model_config.conv1_kernel, model_config.primary_kernel, model_config.primary_stride
  h1, w1 = height - k1 + 1, width - k1 + 1
  h2, w2 = (h1 - k2) // stride + 1, (w1 - k2) // stride + 1
  primary_channels = model_config.primary_types * model_config.primary_dim
  in_caps = h2 * w2 * model_config.primary_types
  classes, dim = model_config.num_classes, model_config.digit_dim
  conv1 = 2 * h1 * w1 * k1 * k1 * channels * model_config.conv1_channels
  primary = 2 * h2 * w2 * k2 * k2 * model_config.conv1_channels * primary_channels
  predictions = 2 * in_caps * classes * dim * model_config.primary_dim
  routing = 2 * 2 * in_caps * classes * dim * model_config.routing_iterations  # s_j and û·v
  decoder = 0
  if model_config.use_decoder:
    widths = [classes * dim, *model_config.decoder_hidden, height * width * channels]
    decoder = sum(2 * a * b for a, b in zip(widths[:-1], widths[1:]))
  forward = conv1 + primary + predictions + routing + decoder
  # Backward: two matmuls per forward matmul (input and weight gradients), except that
  # Conv1 needs no gradient with respect to the images.
  return {'forward': forward, 'train': 3 * forward - conv1}


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
