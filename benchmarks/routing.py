"""Routing micro-benchmark: the fori_loop routing against a plain unrolled Python loop.

  python benchmarks/routing.py --batch 128

Both are jit-compiled; shapes are the paper's DigitCaps (1152 → 10 capsules of 16D).
Also times the traced-iteration-count variant (what `jax.vmap` over r uses) and checks
that all of them return the same parents.
"""
import argparse


import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np
from timing import seconds_per_call

from capsjax.routing import dynamic_routing, squash  # pylint: disable=g-import-not-at-top


def unrolled_routing(prediction_vectors, routing_iterations: int):
  """Procedure 1 as a Python loop in the public [batch, in, out, dim] layout."""
  logits = jnp.zeros(prediction_vectors.shape[:3], prediction_vectors.dtype)
  for _ in range(routing_iterations):
    coupling = jax.nn.softmax(logits, axis=-1)                               # [batch, in, out]
    parents = squash(jnp.einsum('bij,bijd->bjd', coupling, prediction_vectors))  # [batch, out, dim]
    logits = logits + jnp.einsum('bijd,bjd->bij', prediction_vectors, parents)   # [batch, in, out]
  return parents


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--batch', type=int, default=128)
  parser.add_argument('--iterations', type=int, default=3)
  parser.add_argument('--steps', type=int, default=10)
  args = parser.parse_args()
  r = args.iterations
  predictions = 0.05 * jax.random.normal(jax.random.key(0), (args.batch, 1152, 10, 16))
  variants = {
      'unrolled python loop': lambda u: unrolled_routing(u, r),
      'fori_loop (static r)': lambda u: dynamic_routing(u, r).parents,
      'fori_loop (traced r, max 5)': lambda u: dynamic_routing(u, jnp.asarray(r), max_iterations=5).parents,
  }
  reference = jax.jit(variants['unrolled python loop'])(predictions)
  baseline = None
  for name, fn in variants.items():
    forward = jax.jit(fn)
    np.testing.assert_allclose(forward(predictions), reference, rtol=1e-4, atol=1e-6)
    grad = jax.jit(jax.grad(lambda u, f=fn: jnp.sum(f(u) ** 2)))
    t_forward = seconds_per_call(forward, (predictions,), args.steps)
    t_grad = seconds_per_call(grad, (predictions,), args.steps)
    baseline = baseline or (t_forward, t_grad)
    print(f'{name:30s} forward {1e3 * t_forward:7.1f} ms ({baseline[0] / t_forward:4.2f}× unrolled)  '
          f'forward+backward {1e3 * t_grad:7.1f} ms ({baseline[1] / t_grad:4.2f}× unrolled)')


if __name__ == '__main__':
  main()
