"""What a run compiles before its first step, on a CPU: random draws by rank, and a
model's fresh state (parameters, optimizer state) as capsjax draws it.

  python benchmarks/start_compile.py [--repeats 2]

Draws: the same numbers drawn at the weight's own rank, as the matrix [everything but the
last axis, last axis] (layers.drawn_as_a_matrix) and as one vector (the elastic noise),
for the paper's DigitCaps W_ij, its PrimaryCaps kernel and a batch of elastic noise; each
compiled (`jax.jit(...).lower(seed).compile()`, the seed an argument so that nothing is
constant-folded) `repeats` times in one process with JAX's caches cleared in between, the
fastest kept. States: the initial state of the paper model and of the tests' tiny model
(tests/helpers.py's sizes), compiled the same way. Results: docs/results.md, "CPU speed".
"""
import argparse
import math
import time

import jax
import jax.numpy as jnp
import optax

from capsjax import steps
from capsjax.experiments import mnist
from capsjax.models import build_model

SHAPES = {'DigitCaps W_ij': (1152, 10, 16, 8), 'PrimaryCaps kernel': (9, 9, 256, 256),
          'elastic noise, batch 128': (128, 2, 28, 28)}
TINY = dict(conv1_channels=16, primary_types=4, decoder_hidden=(32, 64))   # tests/helpers.py's tiny_config


def compile_seconds(function, repeats: int) -> float:
  best = float('inf')
  for _ in range(repeats):
    jax.clear_caches()
    start = time.perf_counter()
    jax.jit(function).lower(jnp.int32(0)).compile()
    best = min(best, time.perf_counter() - start)
  return best


def draw_rows(repeats: int):
  for name, shape in SHAPES.items():
    forms = {'own rank': shape, 'matrix': (math.prod(shape[:-1]), shape[-1]), 'vector': (math.prod(shape),)}
    seconds = {form: compile_seconds(lambda seed, s=drawn: jax.random.uniform(jax.random.key(seed), s), repeats)
               for form, drawn in forms.items()}
    yield name, shape, seconds


def state_seconds(model_config, repeats: int) -> float:
  model = build_model(**model_config)
  return compile_seconds(lambda seed: steps.init_state(model, optax.adam(1e-3), (28, 28, 1), seed), repeats)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--repeats', type=int, default=2)
  args = parser.parse_args()
  print(f'backend={jax.default_backend()} jax={jax.__version__}; compile seconds, fastest of {args.repeats}')
  print('| draw | shape | own rank | as a matrix | as a vector |')
  print('| --- | --- | ---: | ---: | ---: |')
  for name, shape, seconds in draw_rows(args.repeats):
    print(f'| {name} | {shape} | {seconds["own rank"]:.2f} | {seconds["matrix"]:.2f} | {seconds["vector"]:.2f} |')
  paper, tiny = mnist.get_model_config(), mnist.get_model_config()
  tiny.update(TINY)
  for name, config in (('paper model', paper), ('tiny model (tests)', tiny)):
    print(f'initial state, {name}: {state_seconds(config, args.repeats):.2f} s')


if __name__ == '__main__':
  main()
