"""The im2col patch matrix as 81 slices or as one gather (model.formulation.patch_extraction):
compile and run times of the paper's two convolutions and compile times of the whole model.

  python benchmarks/patch_extraction.py [--batch 128] [--model_batch 8] [--repeats 10]

Each layer: conv2d in the 'patches' form (whole batch, as under differentiation), its
forward and its gradient (images and kernel), compiled then timed (timing.seconds_per_call:
the mean of `repeats` calls after a warm-up one).
The model: the paper's CapsNet's forward and its gradient compiled at `model_batch` (the
size the tests and the explorer compile at). Results: docs/results.md, "Patches by one
gather".
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import capsjax
from capsjax import ops
from capsjax.experiments import mnist
from timing import seconds_per_call   # benchmarks/timing.py: what the benchmark scripts share

LAYERS = {'conv1': ((28, 28, 1), 9, 1), 'primary': ((20, 20, 256), 9, 2)}
EXTRACTIONS = ('slices', 'gather')


def _compiled(function, *args):
  start = time.perf_counter()
  compiled = jax.jit(function).lower(*args).compile()
  return compiled, time.perf_counter() - start


def layer_rows(batch: int, repeats: int):
  for name, (shape, kernel_size, stride) in LAYERS.items():
    images = jax.random.normal(jax.random.key(0), (batch,) + shape)
    kernel = 0.01 * jax.random.normal(jax.random.key(1), (kernel_size, kernel_size, shape[-1], 256))
    outputs = {}
    for extraction in EXTRACTIONS:
      conv = lambda x, w, e=extraction: ops.conv2d(x, w, stride, 'patches', 'whole_batch', patch_extraction=e)
      grad = jax.grad(lambda x, w: jnp.sum(conv(x, w) ** 2), argnums=(0, 1))
      forward, forward_s = _compiled(conv, images, kernel)
      backward, backward_s = _compiled(grad, images, kernel)
      outputs[extraction] = np.asarray(forward(images, kernel))
      yield (f'| {name} | {extraction} | {batch} | {forward_s:.2f} | {backward_s:.2f} | '
             f'{1e3 * seconds_per_call(forward, (images, kernel), repeats):.1f} | '
             f'{1e3 * seconds_per_call(backward, (images, kernel), repeats):.1f} |')
    assert np.array_equal(*outputs.values()), 'the two patch matrices gave different convolutions'


def model_rows(batch: int):
  for extraction in EXTRACTIONS:
    config = mnist.get_config().model
    config.formulation.update(conv_impl='patches', patch_extraction=extraction)
    model = capsjax.build_model(config)
    images = jnp.zeros((batch, 28, 28, 1))
    variables = jax.jit(model.init)(jax.random.key(0), images)
    loss = lambda v, x: jnp.sum(model.apply(v, x)['lengths'])
    _, forward_s = _compiled(lambda v, x: model.apply(v, x)['lengths'], variables, images)
    _, backward_s = _compiled(jax.grad(loss), variables, images)
    yield f'| the paper\'s CapsNet | {extraction} | {batch} | {forward_s:.2f} | {backward_s:.2f} | | |'


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--batch', type=int, default=128, help='images per layer call')
  parser.add_argument('--model_batch', type=int, default=8, help="images per call of the whole model's programs")
  parser.add_argument('--repeats', type=int, default=10, help='timed calls per program (their mean is reported)')
  args = parser.parse_args()
  print(f'{jax.devices()[0].device_kind}, jax {jax.__version__}')
  print('| what | extraction | batch | compile forward s | compile gradient s | forward ms | gradient ms |')
  print('| --- | --- | ---: | ---: | ---: | ---: | ---: |')
  for line in [*layer_rows(args.batch, args.repeats), *model_rows(args.model_batch)]:
    print(line, flush=True)


if __name__ == '__main__':
  main()
