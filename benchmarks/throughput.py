"""Training and inference throughput of an experiment's CapsNet, against the PyTorch peer.

  python benchmarks/throughput.py --batch 128
  python benchmarks/throughput.py --batch 128 --sweep 32,64,128,256 --no_torch

Prints images/s, achieved GFLOP/s and the share of this machine's matmul peak (measured
in the same run), XLA's buffer memory, and the ratio to `torch_capsnet.py` run in the
same process tree. FLOPs per image come from the layer shapes in the config. The last
line is machine-readable:

  throughput train_images_per_s=… infer_images_per_s=… torch_train_ratio=… torch_infer_ratio=…
"""
import argparse
import importlib
import importlib.util
import os
import re
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np

from capsjax import assemble  # pylint: disable=g-import-not-at-top
from capsjax.steps import make_train_step  # pylint: disable=g-import-not-at-top
from timing import buffer_bytes, capsnet_flops, seconds_per_call, seconds_per_step
from capsjax.data.datasets import dataset_info
from capsjax.data.sources import Dataset

DEFAULT_TORCH_SCRIPT = os.path.join(ROOT, 'benchmarks', 'torch_capsnet.py')


# ----------------------------------------------------------------------------- timing

def matmul_peak_gflops(size: int = 4096, steps: int = 5) -> float:
  a = jnp.ones((size, size), jnp.float32)
  b = jnp.ones((size, size), jnp.float32)
  seconds = seconds_per_call(jax.jit(jnp.matmul), (a, b), steps)
  return 2 * size ** 3 / seconds / 1e9


def measure_jax(config, batch: int, steps: int) -> dict:
  model = assemble.model(config)
  optimizer = assemble.optimizer(config)
  state = assemble.initial_state(config, model, optimizer)
  rng = np.random.default_rng(0)
  # Random images as the dataset stores them; the pipeline crops, resizes and jitters them.
  images = rng.integers(0, 256, (batch,) + dataset_info(config.dataset).image_shape).astype(np.uint8)
  labels = rng.integers(0, config.model.num_classes, batch).astype(np.int32)
  config.batch_size = batch
  data = assemble.pipeline(config, Dataset(images, labels), training=True)
  train_step = make_train_step(assemble.objective(config), model, optimizer, data, config.seed)
  host_batch = data.host_batch(0)

  memory_train = buffer_bytes(train_step, state, None, host_batch)
  # The train step donates its state, so it is threaded through the timed calls.
  train_seconds, state = seconds_per_step(train_step, state, (None, host_batch), steps)

  # Inference as a user runs it: digit capsules, lengths and the reconstruction of the
  # longest capsule (what the PyTorch peer computes too).
  test = assemble.pipeline(config, Dataset(images, labels), training=False)
  infer = jax.jit(lambda params, x: model.apply({'params': params},
                                                test.device_batch(None, (x, labels, labels), None)['images']))
  memory_infer = buffer_bytes(infer, state['params'], images)
  infer_seconds = seconds_per_call(infer, (state['params'], images), steps)
  return {'train_images_per_s': batch / train_seconds, 'infer_images_per_s': batch / infer_seconds,
          'train_buffer_bytes': memory_train, 'infer_buffer_bytes': memory_infer}


def measure_torch(script: str, batch: int, steps: int, infer: bool):
  command = [sys.executable, script, '--batch', str(batch), '--steps', str(steps)]
  if infer:
    command.append('--infer')
  result = subprocess.run(command, capture_output=True, text=True, check=False)
  match = re.search(r'images_per_s=([0-9.]+)', result.stdout)
  if result.returncode or not match:
    raise RuntimeError(f'{script} failed: {result.stderr.strip().splitlines()[-1:]}')
  return float(match.group(1))


# ----------------------------------------------------------------------------- main

def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--batch', type=int, default=128)
  parser.add_argument('--steps', type=int, default=8, help='timed steps after a warm-up')
  parser.add_argument('--experiment', default='mnist', help='config module in experiments/')
  parser.add_argument('--conv_impl', default='auto', choices=['auto', 'xla', 'patches'])
  parser.add_argument('--dtype', default='float32', help='model compute dtype (bfloat16 for GPU/TPU)')
  parser.add_argument('--conv_inputs', default='float32', choices=['float32', 'bfloat16'],
                      help="the convolutions' matmul inputs (bfloat16: accumulated in float32)")
  parser.add_argument('--sweep', default='', help='comma-separated batch sizes (JAX only)')
  parser.add_argument('--no_torch', action='store_true')
  parser.add_argument('--torch_script', default=DEFAULT_TORCH_SCRIPT)
  args = parser.parse_args()

  config = importlib.import_module(f'capsjax.experiments.{args.experiment}').get_config()
  config.model.conv_impl = args.conv_impl
  config.model.dtype = args.dtype
  config.model.conv_inputs = args.conv_inputs
  flops = capsnet_flops(config.model)
  peak = matmul_peak_gflops()
  print(f'machine: backend={jax.default_backend()} devices={jax.device_count()} '
        f'cpus={os.cpu_count()} jax={jax.__version__}')
  print(f'matmul peak (4096³ float32, measured now): {peak:.1f} GFLOP/s')
  print(f'FLOPs per image from the shapes: forward {flops["forward"] / 1e9:.3f} G, '
        f'training {flops["train"] / 1e9:.3f} G')

  def report(batch, figures):
    for mode in ('train', 'infer'):
      rate = figures[f'{mode}_images_per_s']
      gflops = rate * flops['train' if mode == 'train' else 'forward'] / 1e9
      print(f'jax {mode:5s} batch={batch:4d}: {rate:7.1f} images/s  {gflops:6.1f} GFLOP/s '
            f'({100 * gflops / peak:4.1f} % of peak)  XLA buffers {figures[f"{mode}_buffer_bytes"] / 2**20:7.0f} MiB')

  for batch in [int(b) for b in args.sweep.split(',') if b]:
    report(batch, measure_jax(config, batch, args.steps))

  ours = measure_jax(config, args.batch, args.steps)
  report(args.batch, ours)
  ratios = {'train': 'NA', 'infer': 'NA'}
  torch_available = importlib.util.find_spec('torch') is not None and os.path.isfile(args.torch_script)
  if args.no_torch:
    print('torch: skipped (--no_torch)')
  elif not torch_available:
    print(f'torch: not measured (torch not installed or no {args.torch_script}); ratios are NA')
  else:
    for mode in ('train', 'infer'):
      theirs = measure_torch(args.torch_script, args.batch, args.steps, mode == 'infer')
      ratios[mode] = f'{ours[f"{mode}_images_per_s"] / theirs:.2f}'
      print(f'torch {mode:5s} batch={args.batch:4d}: {theirs:7.1f} images/s  → jax/torch = {ratios[mode]}')
  print(f'max resident memory of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB')
  print(f'throughput train_images_per_s={ours["train_images_per_s"]:.1f} '
        f'infer_images_per_s={ours["infer_images_per_s"]:.1f} '
        f'torch_train_ratio={ratios["train"]} torch_infer_ratio={ratios["infer"]}')


if __name__ == '__main__':
  main()
