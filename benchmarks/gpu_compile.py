"""What the GPU compiler makes of each formulation, without a GPU: kernels, memory traffic
and FLOPs per call, set beside a device report's measured rows and fitted to them.

  PYTHONPATH=.gpu-plan python benchmarks/gpu_compile.py \
      --report benchmarks/results/h100-2026-11-25/report.json --out /tmp/gpu_compile.json

Each capsjax row of the report (a mode, batch, ensemble size and the formulations it
resolved to on the GPU) is compiled again here for a compile-only GPU of capsjax-plan's
description (`capsjax.plan.GPUS`; `--target`): training as the run's own step
(`train.build_program`), inference as the report times it (`model.apply` on a batch). From
the compiled module: the kernels per call and the bytes they read and write
(`capsjax.plan.kernel_traffic`); the FLOPs are the project's count of what the formulation
computes (benchmarks/timing.py: XLA's cost analysis counts a loop's body once, and the
chunked inference and the rolled routing loop are loops). The measured time per call is then fitted, by non-negative least squares, as

    seconds ≈ traffic / bandwidth_fit + kernels × seconds_per_kernel + flops / flops_fit

and every variant of `--predict` (inference at batch 128 by default, the GPU issue's gap)
gets the fitted time: a prediction, printed as one, for the next lent GPU to check. Needs
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

from capsjax import cli  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def config_for(experiment: str, batch: int, members: int, formulations: dict, dtype: str):
  import importlib  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  config = importlib.import_module(f'capsjax.experiments.{experiment}').get_config()
  config = ml_collections.ConfigDict(config.to_dict())
  config.batch_size = batch
  config.model.update(dtype=dtype, **formulations)
  if members > 1:
    config.ensemble = ml_collections.ConfigDict(dict(seeds=tuple(range(members))))
  config.host_images = 'rows'
  return config


def compiled_figures(config, mode: str, batch: int, mesh) -> dict:
  """Kernels, traffic (bytes) and FLOPs of one call of `mode` ('train' or 'infer')."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from capsjax import assemble, formulations, plan, sharding  # pylint: disable=g-import-not-at-top
  from capsjax.models import build_model  # pylint: disable=g-import-not-at-top
  with formulations.target_backend('gpu'):
    config = assemble.resolve_data(config)
    if mode == 'train':
      program, _ = plan._program(config, mesh)  # pylint: disable=protected-access
      lowered = program.lower(program.abstract_state)['training']
    else:
      model = build_model(**config.model)
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


def fit(rows):
  """Non-negative least squares of the measured seconds per call on (traffic, kernels, flops)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from scipy.optimize import nnls  # pylint: disable=g-import-not-at-top
  scale = np.array([1e12, 1e6, 1e15])   # TB, μs-kernels, PFLOP: columns of similar size
  design = np.array([[r['traffic_bytes'] / scale[0], r['kernels'] / scale[1], r['flops'] / scale[2]] for r in rows])
  seconds = np.array([r['measured_s'] for r in rows])
  weights = 1 / seconds   # relative error: a 0.6 ms and a 10 ms call count alike
  coefficients, _ = nnls(design * weights[:, None], seconds * weights)
  predicted = design @ coefficients
  return {'seconds_per_tb': coefficients[0], 'seconds_per_kernel': coefficients[1] / scale[1],
          'seconds_per_pflop': coefficients[2],
          'bandwidth_fit_tb_s': 1 / coefficients[0] if coefficients[0] else None,
          'flops_fit_tflop_s': 1e3 / coefficients[2] if coefficients[2] else None,
          'median_relative_error': float(np.median(np.abs(predicted - seconds) / seconds)),
          'predicted_s': predicted.tolist()}


def predict(coefficients: dict, figures: dict) -> float:
  return (figures['traffic_bytes'] / 1e12 * coefficients['seconds_per_tb']
          + figures['kernels'] * coefficients['seconds_per_kernel'] + figures['flops'] / 1e15 * coefficients['seconds_per_pflop'])


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
  from capsjax import plan, sharding  # pylint: disable=g-import-not-at-top
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
    rows.append(dict(mode=row['mode'], variant=row['variant'], batch=row['batch'], members=members,
                     measured_s=per_call, **figures))
    print(f'{row["mode"]:5s} {row["variant"][:45]:45s} {row["batch"]:4d}×{members}: {figures["kernels"]:4d} kernels, '
          f'{figures["traffic_bytes"] / 1e9:6.2f} GB, {figures["flops"] / 1e9:7.1f} GFLOP; measured '
          f'{1e3 * per_call:6.2f} ms  (compiled in {time.time() - started:.0f} s)', flush=True)
  result = fit(rows)
  print(f'fit over {len(rows)} rows: {1e6 * result["seconds_per_kernel"]:.2f} μs per kernel, traffic at '
        f'{result["bandwidth_fit_tb_s"] or float("inf"):.2f} TB/s, FLOPs at {result["flops_fit_tflop_s"] or float("inf"):.0f} '
        f'TFLOP/s; median relative error {100 * result["median_relative_error"]:.0f} %')
  predictions = []
  batch = args.predict_batch
  for conv, dtype, loop, inference in itertools.product(('patches', 'xla'), ('float32', 'bfloat16'),
                                                       ('rolled', 'unrolled'), ('chunked', 'whole_batch')):
    if conv == 'xla' and inference == 'whole_batch':
      continue   # patches_inference applies to patches only
    formulation = dict(conv_impl=conv, routing_loop=loop, patches_inference=inference)
    figures = compiled_figures(config_for('mnist', batch, 1, formulation, dtype), 'infer', batch, mesh)
    seconds = predict(result, figures)
    predictions.append(dict(formulation, dtype=dtype, batch=batch, predicted_s=seconds, **figures))
    print(f'PREDICTED (not measured): infer {conv} {dtype} {loop} {inference} at {batch}: {figures["kernels"]} kernels, '
          f'{figures["traffic_bytes"] / 1e9:.2f} GB → {1e3 * seconds:.3f} ms, {batch / seconds:,.0f} images/s', flush=True)
  if args.out:
    with open(args.out, 'w') as f:
      json.dump({'report': args.report, 'target': args.target, 'rows': rows, 'fit': result,
                 'predictions': predictions}, f, indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
