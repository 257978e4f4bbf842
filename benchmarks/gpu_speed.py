"""The primary capsules' convolution alone, in every formulation, on the device at hand.

  python benchmarks/gpu_speed.py --out DIR                 # ≤ 150 s + start-up on one GPU (its budget)
  python benchmarks/gpu_speed.py --smoke --out DIR         # the same code path, CPU, seconds

PrimaryCaps is a 9×9 stride-2 convolution, 256 → 256 channels on 20×20 maps: almost all of
the paper model's FLOPs. Each cell times it forward (inference) and forward + backward to
its input and kernel (training) in one formulation (capsjax.ops.conv2d: 'patches' im2col +
one GEMM, 'xla' XLA's convolution, 'space_to_depth' the unit-stride form on 2×2 pixel
blocks) × batch 128 / 512 / 384 × float32 (JAX's default precision: TF32 on a GPU) /
bfloat16 inputs and outputs, in that order of priority (batch first: every form and dtype
at 128 before any at 512). XLA's GEMM back-ends are the variants, each a child process
with its own XLA_FLAGS (flags act at the start of a process):

  default            XLA's own choice (Triton or cuBLAS per GEMM, autotuned): every cell
  no_triton_gemm     --xla_gpu_enable_triton_gemm=false (cuBLAS/cuBLASLt only): batch 128
  exhaustive_tiling  --xla_gpu_exhaustive_tiling_search=true (Triton's whole tiling space):
                     only when --variants names it (on an H200 its autotuning alone
                     outlasted its share, 2026-11-26)

Per row: the median time of the repeats, TFLOP/s in the direct form's FLOPs (2 × batch ×
6·6 × 9·9·256·256 forward, 3× that for training: what every formulation computes, whatever
it performs) and the share of the matmul peak measured in the same process for the row's
precision. On a GPU the autotuning results go to DIR/autotune/VARIANT.textproto
(--xla_gpu_dump_autotune_results_to) and a committed file of the same device and variant
(benchmarks/results/autotune/DEVICE-VARIANT.textproto, --autotune_dir) is loaded first, so
that a later run spends no minutes autotuning; the GEMM and convolution instructions of
each compiled program go to DIR/hlo/VARIANT-CELL-MODE.txt (one folder deep: the device
tool returns no deeper files).

The variants share one deadline (--budget_s from the start, children's start-up
included): each child gets its share of what is left, skips a cell that would end past
its share (judged by its slowest cell so far) and is stopped 15 s past it; a skipped cell
is listed, never silently dropped; every finished row is written at once (DIR/speed.json),
then DIR/speed.md. The last line is machine-readable:

  gpu_speed duration_s=… rows=… skipped=… best_train_tflops=… out=DIR
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW_MARK = 'GPU_SPEED_ROW '
PEAK_MARK = 'GPU_SPEED_PEAK '

FORMULATIONS = ('patches', 'xla', 'space_to_depth')
DTYPES = ('float32', 'bfloat16')
# PrimaryCaps of the paper's model: 20×20×256 → 6×6×256 through a 9×9 stride-2 kernel.
LAYER = dict(size=20, channels=256, features=256, kernel=9, stride=2)
GEMM_VARIANTS = {
    'default': (),
    'no_triton_gemm': ('--xla_gpu_enable_triton_gemm=false',),
    'exhaustive_tiling': ('--xla_gpu_exhaustive_tiling_search=true',),
}
SETTINGS = {
    # budget shares per variant (the default first and largest), repeats, time per sample
    'full': dict(batches=(128, 512, 384), layer=LAYER, budget_s=150.0, repeats=5, sample_s=0.2,
                 matmul_size=8192, shares={'default': 0.75, 'no_triton_gemm': 0.25}, shares_named=0.25,
                 batches_of={'no_triton_gemm': (128,), 'exhaustive_tiling': (128,)}),
    # The CPU rehearsal: the code path at a small size (channels 32); a second variant's
    # child process on one cell.
    'smoke': dict(batches=(4,), layer=dict(LAYER, channels=32, features=32), budget_s=150.0, repeats=1,
                  sample_s=0.0, matmul_size=256, shares={'default': 0.7, 'no_triton_gemm': 0.3}, shares_named=0.3,
                  only={'no_triton_gemm': (('patches', 'float32'),)}),
}
# HLO instructions that are a GEMM or a convolution (cuBLAS, cuDNN, Triton, XLA's own).
_GEMM_LINE = re.compile(r'custom_call_target="__cu(blas|dnn)|__triton|\bconvolution\(|\bdot\(|kind=kCustom')


def direct_flops(layer, batch: int) -> float:
  """Forward FLOPs of the convolution in the direct form (2 per multiply-add)."""
  out = (layer['size'] - layer['kernel']) // layer['stride'] + 1
  return 2.0 * batch * out * out * layer['kernel'] ** 2 * layer['channels'] * layer['features']


# ============================================================================ the child
def _median_seconds(call, settings) -> float:
  """Median wall time of one call (compiled, warmed), over `repeats` samples of at least
  `sample_s` each."""
  call()
  samples = []
  for _ in range(settings['repeats']):
    count, started = 0, time.perf_counter()
    while True:
      call()
      count += 1
      elapsed = time.perf_counter() - started
      if elapsed >= settings['sample_s']:
        break
    samples.append(elapsed / count)
  return statistics.median(samples)


def child(args) -> int:
  """One GEMM variant: the matmul peaks, then every cell in turn until `args.deadline`
  (seconds since the epoch): a cell that would end past it (judged by the slowest cell
  so far) is listed as skipped."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from capsjax import ops  # pylint: disable=g-import-not-at-top
  settings = SETTINGS['smoke' if args.smoke else 'full']
  backend = jax.default_backend()
  keys = jax.random.split(jax.random.key(0), 4)   # random data: zeros run faster than real data
  size = settings['matmul_size'] if backend != 'cpu' else min(settings['matmul_size'], 1024)

  def peak(dtype) -> float:
    a, b = (jax.random.normal(k, (size, size), jnp.float32).astype(dtype) for k in keys[:2])
    product = jax.jit(jnp.matmul)   # JAX's default precision: the rows' own
    seconds = _median_seconds(lambda: product(a, b).block_until_ready(), settings)
    return 2 * size ** 3 / seconds / 1e12

  peaks = {dtype: peak(getattr(jnp, dtype)) for dtype in DTYPES}
  print(PEAK_MARK + json.dumps({'variant': args.variant, 'backend': backend, 'device': jax.devices()[0].device_kind,
                                'tflops': peaks}), flush=True)
  layer = settings['layer']
  hlo_dir = os.path.join(args.out, 'hlo')
  os.makedirs(hlo_dir, exist_ok=True)
  cells = variant_cells(settings, args.variant)
  slowest = 0.0
  for number, (impl, batch, dtype) in enumerate(cells):
    if time.time() + slowest > args.deadline:
      for skipped in cells[number:]:
        print(ROW_MARK + json.dumps(dict(_cell_fields(args.variant, *skipped), error='time budget spent')), flush=True)
      break
    cell_started = time.time()
    print(ROW_MARK + json.dumps(_measure(jax, jnp, ops, settings, layer, impl, batch, dtype, peaks, hlo_dir,
                                          args.variant, keys)), flush=True)
    slowest = max(slowest, time.time() - cell_started)
  return 0


def variant_cells(settings, variant: str) -> list:
  """(formulation, batch, dtype) of a variant's cells in priority order: batch by batch
  (the settings' order), both dtypes, every formulation."""
  only = settings.get('only', {}).get(variant)
  batches = settings.get('batches_of', {}).get(variant, settings['batches'])
  return [(impl, batch, dtype) for batch in batches for dtype in DTYPES for impl in FORMULATIONS
          if only is None or (impl, dtype) in only]


def _cell_fields(variant: str, impl: str, batch: int, dtype: str) -> dict:
  return {'variant': variant, 'formulation': impl, 'batch': batch, 'dtype': dtype,
          'cell': f'{impl}-{dtype}-{batch}'}


def _measure(jax, jnp, ops, settings, layer, impl, batch, dtype, peaks, hlo_dir, variant, keys) -> dict:
  fields = _cell_fields(variant, impl, batch, dtype)
  size, channels, features, kernel = layer['size'], layer['channels'], layer['features'], layer['kernel']
  compute = getattr(jnp, dtype)
  images = jax.random.normal(keys[2], (batch, size, size, channels), jnp.float32).astype(compute)
  weights = (jax.random.normal(keys[3], (kernel, kernel, channels, features), jnp.float32)
             / (kernel * channels ** 0.5)).astype(compute)
  conv = lambda x, w: ops.conv2d(x, w, layer['stride'], impl, patches_inference='whole_batch')
  forward = jax.jit(conv)
  # Training: the gradients to the input (the layer below) and to the kernel.
  loss = lambda x, w: jnp.sum(jnp.square(conv(x, w).astype(jnp.float32)))
  backward = jax.jit(jax.grad(loss, argnums=(0, 1)))
  row = dict(fields)
  try:
    for mode, program, factor in (('infer', forward, 1.0), ('train', backward, 3.0)):
      compile_started = time.time()
      compiled = program.lower(images, weights).compile()
      compile_s = time.time() - compile_started
      with open(os.path.join(hlo_dir, f'{variant}-{fields["cell"]}-{mode}.txt'), 'w') as f:
        f.write('\n'.join(line.strip() for line in compiled.as_text().splitlines() if _GEMM_LINE.search(line)) + '\n')
      seconds = _median_seconds(lambda: jax.block_until_ready(compiled(images, weights)), settings)
      tflops = factor * direct_flops(layer, batch) / seconds / 1e12
      row[mode] = {'ms': 1e3 * seconds, 'tflops': tflops, 'share_of_peak': tflops / peaks[dtype],
                   'compile_s': compile_s, 'images_per_s': batch / seconds}
  except Exception as e:  # pylint: disable=broad-except
    row['error'] = f'{type(e).__name__}: {(str(e).splitlines() or [""])[0][:300]}'
  return row


# ============================================================================ the parent
def device_slug() -> str:
  """The GPU's name for file names ('nvidia-h100-80gb-hbm3'), from nvidia-smi; '' elsewhere."""
  if not shutil.which('nvidia-smi'):
    return ''
  query = subprocess.run(['nvidia-smi', '--query-gpu=name', '--format=csv,noheader'], capture_output=True,
                         text=True, check=False)
  name = (query.stdout.strip().splitlines() or [''])[0]
  return re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')


def variant_flags(variant: str, out: str, autotune_dir: str, slug: str) -> list:
  """XLA_FLAGS of a variant's child: its GEMM flags; on a GPU the autotuning results dumped
  into `out` and a committed file of this device loaded first."""
  flags = list(GEMM_VARIANTS[variant])
  if slug:
    os.makedirs(os.path.join(out, 'autotune'), exist_ok=True)
    flags.append(f'--xla_gpu_dump_autotune_results_to={os.path.join(out, "autotune", variant + ".textproto")}')
    carried = os.path.join(autotune_dir, f'{slug}-{variant}.textproto')
    if os.path.isfile(carried):
      flags.append(f'--xla_gpu_load_autotune_results_from={carried}')
  return flags


# A child still running this long past its deadline is stopped (its rows so far are kept).
GRACE_S = 15.0


def run_variant(args, variant: str, deadline: float, slug: str):
  """(rows, peaks, note): one variant's child, its rows as they were printed."""
  flags = variant_flags(variant, args.out, args.autotune_dir, slug)
  env = dict(os.environ, XLA_FLAGS=' '.join(filter(None, [os.environ.get('XLA_FLAGS', '')] + flags)))
  command = [sys.executable, os.path.abspath(__file__), '--child', f'--variant={variant}', f'--out={args.out}',
             f'--deadline={deadline}'] + (['--smoke'] if args.smoke else [])
  rows, peaks, note = [], None, ''
  timeout = max(deadline - time.time(), 0.0) + GRACE_S
  try:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    output, status = done.stdout, done.returncode
    if status:
      note = f'exit {status}: ' + (done.stderr.strip().splitlines() or [''])[-1][:300]
  except subprocess.TimeoutExpired as e:
    output = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or '')
    note = f'stopped after {timeout:.0f} s'
  for line in output.splitlines():
    if line.startswith(ROW_MARK):
      rows.append(dict(json.loads(line[len(ROW_MARK):]), flags=flags))
    elif line.startswith(PEAK_MARK):
      peaks = json.loads(line[len(PEAK_MARK):])
  return rows, peaks, note


def render(report) -> str:
  lines = [f'# The primary capsules\' convolution alone, {report["device"]} ({report["backend"]}), {report["date"]}',
           '', f'{report["layer"]["size"]}×{report["layer"]["size"]}×{report["layer"]["channels"]} → '
           f'{report["layer"]["features"]} channels, {report["layer"]["kernel"]}×{report["layer"]["kernel"]} stride '
           f'{report["layer"]["stride"]}; TFLOP/s in the direct form\'s FLOPs; share of the matmul peak measured in '
           'the same process for the row\'s precision (float32: JAX\'s default, TF32 on a GPU).'
           + (' Smoke: the code path, not a measurement.' if report['smoke'] else ''), '',
           '| variant | formulation | dtype | batch | infer ms | infer TFLOP/s | train ms | train TFLOP/s | '
           'train % of peak | compile s |', '| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |']
  for row in report['rows']:
    if 'error' in row:
      lines.append(f'| {row["variant"]} | {row["formulation"]} | {row["dtype"]} | {row["batch"]} | '
                   f'{row["error"]} | | | | | |')
      continue
    infer, train = row['infer'], row['train']
    lines.append(f'| {row["variant"]} | {row["formulation"]} | {row["dtype"]} | {row["batch"]} | {infer["ms"]:.3f} | '
                 f'{infer["tflops"]:.2f} | {train["ms"]:.3f} | {train["tflops"]:.2f} | '
                 f'{100 * train["share_of_peak"]:.1f} | {train["compile_s"]:.1f} |')
  lines += ['', 'Matmul peaks (TFLOP/s): ' + '; '.join(
      f'{variant}: ' + ', '.join(f'{k} {v:.2f}' for k, v in peaks['tflops'].items())
      for variant, peaks in report['peaks'].items() if peaks)]
  if report['notes']:
    lines += ['', 'Notes: ' + '; '.join(f'{k}: {v}' for k, v in report['notes'].items())]
  return '\n'.join(lines) + '\n'


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', required=True, help='the folder of speed.json, speed.md, hlo/, autotune/')
  parser.add_argument('--smoke', action='store_true', help='a small layer and batch, two variants: the code path')
  parser.add_argument('--budget_s', type=float, default=0.0, help='time budget (default 150 s; smoke 150 s: every cell on a slow CPU beside other work)')
  parser.add_argument('--variants', default='', help='comma-separated GEMM variants (default: the settings\')')
  parser.add_argument('--autotune_dir', default=os.path.join(ROOT, 'benchmarks', 'results', 'autotune'),
                      help='committed autotuning results, DEVICE-VARIANT.textproto, loaded when present')
  parser.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
  parser.add_argument('--variant', default='default', help=argparse.SUPPRESS)
  parser.add_argument('--deadline', type=float, default=0.0, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.budget_s < 0:
    parser.error('--budget_s must be >= 0')
  settings = SETTINGS['smoke' if args.smoke else 'full']
  args.budget_s = args.budget_s or settings['budget_s']
  if args.child:
    return child(args)
  variants = [v for v in args.variants.split(',') if v] or list(settings['shares'])
  unknown = [v for v in variants if v not in GEMM_VARIANTS]
  if unknown:
    parser.error(f'--variants: unknown {", ".join(unknown)} (known: {", ".join(GEMM_VARIANTS)})')
  os.makedirs(args.out, exist_ok=True)
  started = time.time()
  slug = device_slug()
  report = {'date': time.strftime('%Y-%m-%d'), 'smoke': args.smoke, 'layer': settings['layer'], 'rows': [],
            'peaks': {}, 'notes': {}, 'device': '', 'backend': '', 'device_slug': slug}
  shares = {v: settings['shares'].get(v, settings['shares_named']) for v in variants}
  for index, variant in enumerate(variants):
    left = args.budget_s - (time.time() - started)
    # This variant's share of what is left (the later ones' shares wait for them).
    share = max(left * shares[variant] / sum(shares[v] for v in variants[index:]), 0.0)
    rows, peaks, note = run_variant(args, variant, time.time() + share, slug)
    report['rows'] += rows
    report['peaks'][variant] = peaks
    if peaks:
      report['device'], report['backend'] = peaks['device'], peaks['backend']
    if note:
      report['notes'][variant] = note
    with open(os.path.join(args.out, 'speed.json'), 'w') as f:   # what is known so far
      json.dump(report, f, indent=1)
  report['duration_s'] = time.time() - started
  with open(os.path.join(args.out, 'speed.json'), 'w') as f:
    json.dump(report, f, indent=1)
  markdown = render(report)
  with open(os.path.join(args.out, 'speed.md'), 'w') as f:
    f.write(markdown)
  print(markdown)
  measured = [row for row in report['rows'] if 'error' not in row]
  best = max((row['train']['tflops'] for row in measured), default=0.0)
  print(f'gpu_speed duration_s={report["duration_s"]:.1f} rows={len(measured)} '
        f'skipped={len(report["rows"]) - len(measured)} best_train_tflops={best:.3f} out={args.out}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
