"""What the GPU compiler makes of each formulation, without a GPU: kernels, memory traffic
and FLOPs per call, set beside a device report's measured rows and fitted to them.

  PYTHONPATH=.gpu-plan python benchmarks/gpu_compile.py \
      --report benchmarks/results/h100-2026-11-25/report.json --out /tmp/gpu_compile.json

Each capsjax row of the report (a mode, batch, ensemble size and the formulations it
resolved to on the GPU) is compiled again here for a compile-only GPU of capsjax-plan's
description (`capsjax.app.plan.GPUS`; `--target`): training as the run's own step
(`experiment.build_program`), inference as the report times it (`model.apply` on a batch). From
the compiled module: the kernels per call and the bytes they read and write
(`capsjax.app.plan.kernel_traffic`); the FLOPs are the project's count of what the formulation
computes (benchmarks/timing.py: XLA's cost analysis counts a loop's body once, and the
chunked inference and the rolled routing loop are loops). The measured time per call is then fitted, by non-negative least squares, as

    seconds ≈ traffic / bandwidth_fit + kernels × seconds_per_kernel
              + float32 flops / float32_rate_fit + bfloat16 flops / bfloat16_rate_fit

and every variant of `--predict` (inference at batch 128 by default, the GPU issue's gap)
gets the fitted time: a prediction, printed as one, for the next GPU run to check. Needs
the gpu-plan packages on the path (`pip install 'capsjax[gpu-plan]'` or `.gpu-plan/`).
"""
import argparse
import itertools
import json
import os
import sys
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from capsjax.app import cli  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def config_for(experiment: str, batch: int, members: int, formulations: dict, dtype: str):
  import importlib  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  config = importlib.import_module(f'capsjax.experiments.{experiment}').get_config()
  config = ml_collections.ConfigDict(config.to_dict())
  config.batch_size = batch
  config.model.formulation.update(dtype=dtype, **formulations)
  if members > 1:
    config.ensemble = ml_collections.ConfigDict(dict(seeds=tuple(range(members))))
  config.host_images = 'rows'
  return config


def compiled_figures(config, mode: str, batch: int, mesh) -> dict:
  """Kernels, traffic (bytes) and FLOPs of one call of `mode` ('train' or 'infer')."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from capsjax import assemble, sharding  # pylint: disable=g-import-not-at-top
  from capsjax.app import plan  # pylint: disable=g-import-not-at-top
  config = assemble.resolve_data(config)
  if mode == 'train':
    program = plan._program(config, mesh, 'gpu').steps  # pylint: disable=protected-access
    lowered = program.lower(program.abstract_state)['training']
  else:
    model = assemble.model(config, 'gpu')
    replicated = sharding.replicated(mesh)
    images = jax.ShapeDtypeStruct((batch,) + tuple(config.model.input_shape), jnp.float32, sharding=replicated)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(images.shape))['params'])
    params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=replicated), params)
    lowered = jax.jit(lambda p, x: model.apply({'params': p}, x)).lower(params, images)
  compiled = lowered.compile()
  from benchmarks.timing import capsnet_flops  # pylint: disable=g-import-not-at-top
  kernels, traffic = plan.kernel_traffic(compiled.as_text())
  members = len(config.ensemble.seeds) if config.get('ensemble') else 1
  per_image = capsnet_flops(config.model, 'gpu', batch)['train_performed' if mode == 'train' else 'forward_performed']
  return {'kernels': kernels, 'traffic_bytes': traffic, 'flops': per_image * batch * members}


def _columns(row) -> list:
  """TB moved, millions of kernels, PFLOP in float32, PFLOP in bfloat16: columns of similar size."""
  bf16 = row['dtype'] == 'bfloat16'
  return [row['traffic_bytes'] / 1e12, row['kernels'] / 1e6, 0.0 if bf16 else row['flops'] / 1e15,
          row['flops'] / 1e15 if bf16 else 0.0]


def fit(rows):
  """Non-negative least squares of the measured seconds per call on the four columns,
  weighted for relative error (a 0.6 ms and a 10 ms call count alike)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from scipy.optimize import nnls  # pylint: disable=g-import-not-at-top
  design = np.array([_columns(r) for r in rows])
  seconds = np.array([r['measured_s'] for r in rows])
  weights = 1 / seconds
  coefficients, _ = nnls(design * weights[:, None], seconds * weights)
  predicted = design @ coefficients
  rate = lambda c, unit: unit / c if c else None
  return {'coefficients': coefficients.tolist(), 'seconds_per_kernel': coefficients[1] / 1e6,
          'bandwidth_fit_tb_s': rate(coefficients[0], 1.0), 'float32_fit_tflop_s': rate(coefficients[2], 1e3),
          'bfloat16_fit_tflop_s': rate(coefficients[3], 1e3),
          'median_relative_error': float(np.median(np.abs(predicted - seconds) / seconds)),
          'predicted_s': predicted.tolist()}


def predict(result: dict, figures: dict) -> float:
  return sum(c * x for c, x in zip(result['coefficients'], _columns(figures)))


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--report', required=True, help='a device report.json of a GPU (benchmarks/results/…)')
  parser.add_argument('--target', default='h100', help="capsjax-plan's GPU (h100, h200)")
  parser.add_argument('--out', default='', help='write the rows, the fit and the predictions as JSON here')
  parser.add_argument('--predict_batch', type=int, default=128, help='inference batch of the predicted variants')
  args = parser.parse_args()
  try:
    with open(args.report) as f:
      report = json.load(f)
  except (OSError, ValueError) as e:
    cli.fail(f'--report={args.report}: {e}')
  cli.start_jax_quietly()
  from capsjax import sharding  # pylint: disable=g-import-not-at-top
  from capsjax.app import plan  # pylint: disable=g-import-not-at-top
  from capsjax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  try:
    devices = plan.compile_only_devices(plan.parse_target(args.target))
  except ConfigError as e:
    cli.fail(str(e))
  mesh = sharding.data_mesh(devices[:1])
  rows = []
  for row in report['rows']:
    if row['impl'] != 'capsjax':
      continue
    dtype = 'bfloat16' if row['precision'] == 'bf16' else 'float32'
    members = row.get('members', 1)
    config = config_for(row['experiment'], row['batch'], members, row['resolved'], dtype)
    started = time.time()
    try:
      figures = compiled_figures(config, row['mode'], row['batch'], mesh)
    except Exception as e:  # pylint: disable=broad-except
      print(f'{row["mode"]:5s} {row["variant"][:45]:45s}: not compiled here ({type(e).__name__}: {e})', flush=True)
      continue
    per_call = row['batch'] * members / row['images_per_s']
    rows.append(dict(mode=row['mode'], variant=row['variant'], batch=row['batch'], members=members, dtype=dtype,
                     measured_s=per_call, **figures))
    print(f'{row["mode"]:5s} {row["variant"][:45]:45s} {row["batch"]:4d}×{members}: {figures["kernels"]:4d} kernels, '
          f'{figures["traffic_bytes"] / 1e9:6.2f} GB, {figures["flops"] / 1e9:7.1f} GFLOP; measured '
          f'{1e3 * per_call:6.2f} ms  (compiled in {time.time() - started:.0f} s)', flush=True)
  result = fit(rows)
  shown = lambda value, digits: f'{value:.{digits}f}' if value else '∞ (not needed)'
  print(f'fit over {len(rows)} rows: {1e6 * result["seconds_per_kernel"]:.2f} μs per kernel, traffic at '
        f'{shown(result["bandwidth_fit_tb_s"], 2)} TB/s, float32 FLOPs at {shown(result["float32_fit_tflop_s"], 0)} '
        f'TFLOP/s, bfloat16 at {shown(result["bfloat16_fit_tflop_s"], 0)}; median relative error '
        f'{100 * result["median_relative_error"]:.0f} %')
  for row, fitted in zip(rows, result['predicted_s']):
    print(f'  {row["mode"]:5s} {row["variant"][:45]:45s} measured {1e3 * row["measured_s"]:6.2f} ms, fitted '
          f'{1e3 * fitted:6.2f} ms')
  predictions = []
  batch = args.predict_batch
  for conv, dtype, loop, inference in itertools.product(('patches', 'xla'), ('float32', 'bfloat16'),
                                                       ('rolled', 'unrolled'), ('chunked', 'whole_batch')):
    if conv == 'xla' and inference == 'whole_batch':
      continue   # patches_inference applies to patches only
    if not any(row['dtype'] == dtype for row in rows):
      print(f'not predicted: infer {conv} {dtype} {loop} {inference} (no measured {dtype} row to fit)')
      continue
    formulation = dict(conv_impl=conv, routing_loop=loop, patches_inference=inference)
    figures = compiled_figures(config_for('mnist', batch, 1, formulation, dtype), 'infer', batch, mesh)
    seconds = predict(result, dict(figures, dtype=dtype))
    predictions.append(dict(formulation, batch=batch, predicted_s=seconds, dtype=dtype, **figures))
    print(f'PREDICTED (not measured): infer {conv} {dtype} {loop} {inference} at {batch}: {figures["kernels"]} kernels, '
          f'{figures["traffic_bytes"] / 1e9:.2f} GB → {1e3 * seconds:.3f} ms, {batch / seconds:,.0f} images/s', flush=True)
  if args.out:
    with open(args.out, 'w') as f:
      json.dump({'report': args.report, 'target': args.target, 'rows': rows, 'fit': result,
                 'predictions': predictions}, f, indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
