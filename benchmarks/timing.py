"""Timing shared by the benchmark scripts (run as `python benchmarks/NAME.py`)."""
import time

import jax


def seconds_per_call(fn, args, steps: int) -> float:
  """Seconds per call of `fn(*args)` after one warm-up call (compilation)."""
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  for _ in range(steps):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / steps
