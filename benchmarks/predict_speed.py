"""Predictions of the GPU speed step (docs/gpu.md), made before it runs, from compilations alone.

  PYTHONPATH=.gpu-plan python benchmarks/predict_speed.py \
      --fit benchmarks/results/h100-2026-11-25/gpu_compile.json --out benchmarks/results/predictions

For each row that `bash benchmarks/gpu.sh speed` measures, on a compile-only H100 and
H200 (capsjax-plan's descriptions): the primary capsules' convolution alone
(benchmarks/gpu_speed.py's cells: formulation × batch × dtype, inference and training, XLA's
default GEMM choice) and the paper model's whole steps in each formulation at batch 128
(training and inference, unrolled loop). Each program is compiled for the GPU; its kernels
and the bytes they move come from the compiled module (capsjax.app.plan.kernel_traffic), its
FLOPs from the project's count of what the formulation performs; the time is the fit of
the 2026-11-25 H100 report (benchmarks/gpu_compile.py: μs per kernel, traffic, float32 and
bfloat16 FLOP rates) applied to them. The same fit serves the H200 (the same SMs and clocks;
its larger bandwidth moves only the traffic term, which the fit found small). Printed and
written as PREDICTED: estimates to set beside the measurement, never in its place.
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from capsjax.app import cli  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from benchmarks import gpu_compile, gpu_speed  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def conv_figures(impl: str, batch: int, dtype: str, mode: str, device) -> dict:
  """Kernels, traffic and performed FLOPs of one gpu_speed cell compiled for `device`."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from capsjax import formulations, ops  # pylint: disable=g-import-not-at-top
  from capsjax.app import plan  # pylint: disable=g-import-not-at-top
  layer = gpu_speed.LAYER
  compute = getattr(jnp, dtype)
  placed = jax.sharding.SingleDeviceSharding(device)
  images = jax.ShapeDtypeStruct((batch, layer['size'], layer['size'], layer['channels']), compute, sharding=placed)
  weights = jax.ShapeDtypeStruct((layer['kernel'], layer['kernel'], layer['channels'], layer['features']), compute,
                                 sharding=placed)
  conv = lambda x, w: ops.conv2d(x, w, layer['stride'], impl, patches_inference='whole_batch')
  loss = lambda x, w: jnp.sum(jnp.square(conv(x, w).astype(jnp.float32)))
  program = jax.jit(conv) if mode == 'infer' else jax.jit(jax.grad(loss, argnums=(0, 1)))
  compiled = program.lower(images, weights).compile()
  kernels, traffic = plan.kernel_traffic(compiled.as_text())
  shape = formulations.ConvLayer(layer['size'], layer['size'], layer['channels'], layer['features'],
                                 layer['kernel'], layer['stride'])
  per_image = shape.space_to_depth_multiply_adds() if impl == 'space_to_depth' else shape.direct_multiply_adds()
  return {'kernels': kernels, 'traffic_bytes': traffic, 'flops': 2 * per_image * batch * (3 if mode == 'train' else 1)}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--fit', required=True, help="benchmarks/gpu_compile.py's JSON (its 'fit')")
  parser.add_argument('--out', required=True, help='folder of speed-TARGET.json')
  parser.add_argument('--targets', default='h100,h200', help="capsjax-plan's GPUs")
  parser.add_argument('--batches', default='128,384,512', help='the convolution cells\' batches')
  parser.add_argument('--no_steps', action='store_true', help='the convolution cells only (the whole steps '
                      'compile for minutes each)')
  args = parser.parse_args()
  try:
    with open(args.fit) as f:
      fitted = json.load(f)['fit']
  except (OSError, ValueError, KeyError) as e:
    cli.fail(f'--fit={args.fit}: {e}')
  cli.start_jax_quietly()
  from capsjax import sharding  # pylint: disable=g-import-not-at-top
  from capsjax.app import plan  # pylint: disable=g-import-not-at-top
  from capsjax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  os.makedirs(args.out, exist_ok=True)
  batches = [int(b) for b in args.batches.split(',') if b]
  for target in [t for t in args.targets.split(',') if t]:
    try:
      devices = plan.compile_only_devices(plan.parse_target(target))
    except ConfigError as e:
      cli.fail(str(e))
    rows = []
    for dtype in gpu_speed.DTYPES:
      for batch in batches:
        for impl in gpu_speed.FORMULATIONS:
          row = {'kind': 'conv', 'formulation': impl, 'batch': batch, 'dtype': dtype}
          for mode in ('infer', 'train'):
            started = time.time()
            figures = conv_figures(impl, batch, dtype, mode, devices[0])
            seconds = gpu_compile.predict(fitted, dict(figures, dtype=dtype))
            row[mode] = dict(figures, predicted_ms=1e3 * seconds, compile_s=time.time() - started,
                             predicted_tflops=gpu_speed.direct_flops(gpu_speed.LAYER, batch)
                             * (3 if mode == 'train' else 1) / seconds / 1e12)
          rows.append(row)
          print(f'PREDICTED (not measured) {target}: conv {impl:14s} {dtype:8s} batch {batch:3d}: infer '
                f'{row["infer"]["predicted_ms"]:.3f} ms ({row["infer"]["predicted_tflops"]:.0f} TFLOP/s), train '
                f'{row["train"]["predicted_ms"]:.3f} ms ({row["train"]["predicted_tflops"]:.0f} TFLOP/s); '
                f'{row["train"]["kernels"]} kernels', flush=True)
    mesh = sharding.data_mesh(devices[:1])
    for dtype in () if args.no_steps else gpu_speed.DTYPES:
      for impl in gpu_speed.FORMULATIONS:
        formulation = dict(conv_impl=impl, routing_loop='unrolled', patches_inference='whole_batch')
        config = gpu_compile.config_for('mnist', 128, 1, formulation, dtype)
        row = {'kind': 'step', 'formulation': impl, 'batch': 128, 'dtype': dtype}
        for mode in ('infer', 'train'):
          figures = gpu_compile.compiled_figures(config, mode, 128, mesh)
          seconds = gpu_compile.predict(fitted, dict(figures, dtype=dtype))
          row[mode] = dict(figures, predicted_ms=1e3 * seconds, images_per_s=128 / seconds)
        rows.append(row)
        print(f'PREDICTED (not measured) {target}: step {impl:14s} {dtype:8s} batch 128: train '
              f'{row["train"]["images_per_s"]:,.0f} images/s, infer {row["infer"]["images_per_s"]:,.0f} images/s',
              flush=True)
    with open(os.path.join(args.out, f'speed-{target}.json'), 'w') as f:
      json.dump({'target': target, 'fit': args.fit, 'date': time.strftime('%Y-%m-%d'),
                 'note': 'PREDICTED from compilations and the fit; not measured', 'rows': rows}, f, indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
