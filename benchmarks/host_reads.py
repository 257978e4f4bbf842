"""Host-side data reads: a split loaded whole vs rows read on demand (config.host_images).

  python benchmarks/host_reads.py --tfds_data_dir=DIR [--dataset=mnist] [--batch=128]
      [--processes=1] [--step_ms=10] [--steps=100] [--out=reads.json]
  python benchmarks/host_reads.py --data_dir=DIR   # a folder of uncompressed IDX files

Three modes, each in a fresh process (for its peak memory), in the same run:
  memory     the training split decoded into one uint8 array ('memory', one process)
  rows       labels only at start; each step reads and decodes this process's rows
             (batch / --processes) while the previous step runs (read-ahead; 'rows')
  rows_sync  the same reads without read-ahead
For each: seconds and peak host-memory growth to open the split, and milliseconds per
step of host batch preparation beside a simulated device step of --step_ms (a sleep:
the devices run asynchronously, so the host's reads overlap it when they are read ahead).
Ratios are against `memory`, measured in the same run.
"""
import argparse
import importlib
import json
import resource
import subprocess
import sys
import time

MODES = ('memory', 'rows', 'rows_sync')


def _peak_mib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux


def measure(args) -> dict:
  """One mode, in this process."""
  from capsjax import assemble  # pylint: disable=g-import-not-at-top
  from capsjax.data import pipeline  # pylint: disable=g-import-not-at-top
  from capsjax.data.sources import load_dataset  # pylint: disable=g-import-not-at-top
  from capsjax.experiments import mnist  # pylint: disable=g-import-not-at-top
  if not args.data_dir:
    importlib.import_module('tensorflow_datasets')   # imported first: its own memory is not counted below
  before = _peak_mib()
  start = time.perf_counter()
  train = load_dataset(args.dataset, 'train', args.data_dir, args.tfds_data_dir, on_demand=args.mode != 'memory')
  open_s = time.perf_counter() - start
  growth = _peak_mib() - before
  config = mnist.get_config()
  config.dataset, config.batch_size = args.dataset, args.batch
  batches = assemble.pipeline(config, train, True)
  host_batch = batches.host_batch
  if args.mode == 'rows_sync' and isinstance(host_batch, pipeline.ReadAhead):
    host_batch = host_batch._host_batch   # pylint: disable=protected-access
  rows = slice(0, args.batch // args.processes)   # what one process reads (process_rows)
  host_batch(0, None, rows)
  start = time.perf_counter()
  for step in range(1, args.steps + 1):
    host_batch(step, None, rows)
    time.sleep(args.step_ms / 1000)   # the devices' step, which the host does not wait for
  step_ms = (time.perf_counter() - start) / args.steps * 1000
  return {'mode': args.mode, 'open_s': round(open_s, 2), 'peak_growth_mib': round(growth, 1),
          'ms_per_step': round(step_ms, 2), 'host_ms_per_step': round(step_ms - args.step_ms, 2)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--dataset', default='mnist')
  parser.add_argument('--tfds_data_dir', default='')
  parser.add_argument('--data_dir', default='', help='uncompressed IDX files instead of TFDS')
  parser.add_argument('--batch', type=int, default=128)
  parser.add_argument('--processes', type=int, default=1)
  parser.add_argument('--step_ms', type=float, default=10.0)
  parser.add_argument('--steps', type=int, default=100)
  parser.add_argument('--out', default='')
  parser.add_argument('--mode', choices=MODES, help=argparse.SUPPRESS)   # one child measurement
  args = parser.parse_args()
  if args.mode:
    print(json.dumps(measure(args)))
    return
  if not (args.tfds_data_dir or args.data_dir):
    parser.error('pass --tfds_data_dir (a prepared TFDS folder) or --data_dir (uncompressed IDX files)')
  results = []
  for mode in MODES:
    child = subprocess.run([sys.executable, __file__, *sys.argv[1:], f'--mode={mode}'], capture_output=True,
                           text=True, check=False)
    if child.returncode:
      sys.exit(f'error: {mode} failed: {child.stderr.strip().splitlines()[-1] if child.stderr.strip() else ""}')
    results.append(json.loads(child.stdout.strip().splitlines()[-1]))
  memory = results[0]
  print(f'{args.dataset} train, batch {args.batch} over {args.processes} process(es) '
        f'({args.batch // args.processes} rows each), simulated device step {args.step_ms:g} ms, {args.steps} steps')
  print(f'{"mode":10} {"open (s)":>9} {"peak growth (MiB)":>18} {"ms/step":>8} {"host ms/step":>13} {"× memory":>9}')
  for row in results:
    ratio = row['ms_per_step'] / memory['ms_per_step']
    row['step_time_vs_memory'] = round(ratio, 3)
    print(f'{row["mode"]:10} {row["open_s"]:9.2f} {row["peak_growth_mib"]:18.1f} {row["ms_per_step"]:8.2f} '
          f'{row["host_ms_per_step"]:13.2f} {ratio:9.2f}')
  if args.out:
    with open(args.out, 'w') as f:
      json.dump({'args': {k: v for k, v in vars(args).items() if k != 'mode'}, 'results': results}, f, indent=1)


if __name__ == '__main__':
  main()
