"""Everything an accelerator should measure, in one command, on whatever backend JAX finds.

  python benchmarks/device_report.py --out DIR            # ≤ 8 minutes on one H100
  python benchmarks/device_report.py --smoke --out DIR    # the same code path, CPU, ≈ 70 s
  python benchmarks/device_report.py --only 'capsjax|peer compile' --out DIR   # a subset

What it measures, each part ("cell") in a fresh child process so that a row's peak
memory is its own and a crash or a hang costs that row alone:
  device   name, memory, versions; the matmul peak (float32, TF32 on a GPU, bfloat16) and
           the device-to-device copy bandwidth, measured now
  capsjax  the paper's MNIST CapsNet through the training loop's own program
           (experiment.build_program: host batch → global batch → the jitted, donated step),
           train and inference images/s for conv xla|patches × float32|bfloat16 × routing
           loop rolled|unrolled; the 3-seed vmapped program (mnist_seeds); inference at a
           larger batch; the patches conv's inference as one matmul over the whole batch
           (formulations' `patches_inference`, float32 and bfloat16, both batches);
           MultiMNIST training (36×36). Inference = capsules, lengths and the reconstruction
           of the longest capsule, from uint8 images already on the device.
  peer     benchmarks/torch_capsnet.py (the paper's CapsNet in PyTorch), eager and --compile, train and
           infer: tf32 and bf16 on a GPU, fp32 on a CPU
  profile  a jax.profiler trace of the fastest training variant; its top 15 ops by device
           time (ms per step, share); the trace is kept (profile_trace.json.gz: open it in
           ui.perfetto.dev; profile.xplane.pb: XProf/TensorBoard)
Per row: images/s (median of repeats), the ratio to the fastest peer row of the same mode,
the share of the measured matmul peak of the row's precision (FLOPs per image from the
layer shapes), and the peak device memory (memory_stats() where the backend has it, XLA's
buffer sizes of the compiled program otherwise; the peer's torch.cuda.max_memory_allocated).

Cells run in priority order under a time budget (--budget_s); a cell that no longer fits
is skipped and listed, never silently dropped. Writes DIR/report.json and DIR/report.md,
prints the markdown, then its duration; the last line is machine-readable:

  device_report duration_s=… rows=… skipped=… train_vs_peer=… infer_vs_peer=… report=DIR/report.json
"""
import argparse
import collections
import concurrent.futures
import datetime
import glob
import gzip
import importlib.metadata
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TORCH_SCRIPT = os.path.join(ROOT, 'benchmarks', 'torch_capsnet.py')
CELL_MARK = 'DEVICE_REPORT_CELL '
PEER_MEMORY_MARK = 'DEVICE_REPORT_PEER_PEAK '

# Per mode: rows' batch, how long each row is timed, how big the peak measurements are.
SETTINGS = {
    'full': dict(batch=128, large_batch=512, seconds_per_row=2.0, repeats=5, min_steps=3,
                 matmul_size=8192, copy_mib=1024, profile_steps=10, budget_s=450.0, cell_timeout_s=150.0, jobs=1,
                 peer_steps={'gpu': {'train': 400, 'infer': 1000}, 'cpu': {'train': 3, 'infer': 5}}),
    'smoke': dict(batch=4, large_batch=8, seconds_per_row=0.0, repeats=1, min_steps=1,
                  matmul_size=512, copy_mib=16, profile_steps=2, budget_s=165.0, cell_timeout_s=90.0, jobs=2,
                  peer_steps={'gpu': {'train': 2, 'infer': 2}, 'cpu': {'train': 2, 'infer': 2}}),
}
VARIANTS = [(conv, dtype, loop) for conv in ('patches', 'xla') for dtype in ('float32', 'bfloat16')
            for loop in ('rolled', 'unrolled')]
# The convolutions without a whole-batch patch matrix (capsjax.ops), timed in the full
# report only, float32 ('fourier' has no bfloat16 inputs), the design card's rolled loop.
ROW_AND_FOURIER_VARIANTS = [('kernel_rows', 'float32', 'rolled'), ('fourier', 'float32', 'rolled'),
                            # the strided convolution as a unit-stride one (capsjax.ops), the GPU's loop
                            ('space_to_depth', 'float32', 'unrolled'), ('space_to_depth', 'bfloat16', 'unrolled')]
# The smoke rehearses the code path: every value of each of the three choices once (2 of
# the 8 variants; each one's compile is most of a cell's time on the CPU, and a GPU run
# runs all 8 through the same code).
SMOKE_VARIANTS = [('patches', 'float32', 'rolled'), ('xla', 'bfloat16', 'unrolled')]
PROFILE_OPS = 15


# ============================================================================ child cells
# Each runs in its own process: `device_report.py --cell JSON` prints CELL_MARK + JSON.

def _median_rate(call, block, images_per_call: int, settings) -> dict:
  """images/s of `call()` (already warm): `repeats` timings of enough calls to fill
  seconds_per_row; median, min and max."""
  start = time.perf_counter()
  block(call())
  one = max(time.perf_counter() - start, 1e-6)
  repeats = settings['repeats']
  calls = max(settings['min_steps'], int(settings['seconds_per_row'] / repeats / one))
  rates = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = call()
    block(out)
    rates.append(images_per_call * calls / (time.perf_counter() - start))
  return {'images_per_s': statistics.median(rates), 'images_per_s_min': min(rates),
          'images_per_s_max': max(rates), 'timed_calls': calls * repeats}


def _peak_memory(jax):
  stats = jax.devices()[0].memory_stats()
  return stats.get('peak_bytes_in_use') if stats else None


def cell_device(settings) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  device = jax.devices()[0]
  backend = jax.default_backend()
  stats = device.memory_stats() or {}
  versions = {}
  for package in ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'torch', 'numpy'):
    try:
      versions[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      versions[package] = None
  facts = {
      'backend': backend, 'name': device.device_kind, 'device_count': jax.device_count(),
      'memory_bytes': stats.get('bytes_limit') or os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'),
      'memory_source': 'memory_stats bytes_limit' if stats.get('bytes_limit') else 'host RAM',
      'host_cpus': os.cpu_count(), 'python': platform.python_version(), 'versions': versions,
      # What capsjax-plan's GPU description (capsjax.app.plan.GPUS) assumes of this device.
      'core_count': getattr(device, 'core_count', None),
      'compute_capability': getattr(device, 'compute_capability', None),
  }
  if shutil.which('nvidia-smi'):
    query = subprocess.run(['nvidia-smi', '--query-gpu=name,driver_version,memory.total,clocks.max.sm',
                            '--format=csv,noheader'], capture_output=True, text=True, check=False)
    facts['nvidia_smi'] = query.stdout.strip().splitlines()[:1]

  size = settings['matmul_size'] if backend != 'cpu' else min(settings['matmul_size'], 2048)   # a CPU: seconds each
  keys = jax.random.split(jax.random.key(0), 4)   # random data: zeros run faster than real data

  def matmul_tflops(dtype, precision) -> float:
    a, b = (jax.random.normal(k, (size, size), jnp.float32).astype(dtype) for k in keys[:2])
    product = jax.jit(lambda a, b: jnp.matmul(a, b, precision=precision))
    rate = _median_rate(lambda: product(a, b), jax.block_until_ready, 1, dict(settings, seconds_per_row=1.0))
    return 2 * size ** 3 * rate['images_per_s'] / 1e12

  peaks = {'f32': matmul_tflops(jnp.float32, jax.lax.Precision.HIGHEST)}
  if backend == 'gpu':   # JAX's default float32 matmul precision on a GPU
    peaks['tf32'] = matmul_tflops(jnp.float32, jax.lax.Precision.DEFAULT)
  peaks['bf16'] = matmul_tflops(jnp.bfloat16, jax.lax.Precision.DEFAULT)
  copy_mib = settings['copy_mib'] if backend != 'cpu' else min(settings['copy_mib'], 256)
  elements = copy_mib * 2 ** 20 // 4
  source = jax.random.normal(keys[2], (elements,), jnp.float32)
  negate = jax.jit(lambda x: -x)   # reads and writes every byte once (a copy XLA cannot elide)
  copy = _median_rate(lambda: negate(source), jax.block_until_ready, 1, dict(settings, seconds_per_row=1.0))
  facts['matmul_peak_tflops'] = peaks
  facts['matmul_size'] = size
  facts['copy_gb_per_s'] = 2 * 4 * elements * copy['images_per_s'] / 1e9   # bytes read + written
  facts['copy_mib'] = copy_mib
  return {'device': facts}


def _capsjax_setup(spec):
  """The config, model and the training loop's RunSteps for `spec`, on random uint8 images
  of the dataset's stored shape (speed does not depend on the digits)."""
  import importlib  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from capsjax import assemble, experiment, sharding  # pylint: disable=g-import-not-at-top
  from capsjax.data import pipeline  # pylint: disable=g-import-not-at-top
  from capsjax.data.tasks import TASKS  # pylint: disable=g-import-not-at-top
  from capsjax.data.datasets import dataset_info  # pylint: disable=g-import-not-at-top
  from capsjax.data.sources import Dataset  # pylint: disable=g-import-not-at-top

  config = importlib.import_module(f'capsjax.experiments.{spec["experiment"]}').get_config()
  config.batch_size = spec['batch']
  how = config.model.formulation
  how.conv_impl, how.dtype, how.routing_loop = spec['conv_impl'], spec['dtype'], spec['routing_loop']
  how.patches_inference = spec.get('patches_inference', 'auto')
  how.member_convs = spec.get('member_convs', 'auto')
  if spec.get('seeds'):
    config.ensemble = ml_collections.ConfigDict(dict(seeds=tuple(spec['seeds'])))
  info = dataset_info(config.dataset)
  rng = np.random.default_rng(0)
  count = max(4 * config.batch_size, 512)
  dataset = Dataset(rng.integers(0, 256, (count,) + tuple(info.image_shape), dtype=np.uint8),
                    rng.integers(0, info.num_classes, count).astype(np.int32))
  if TASKS[config.task].generates_examples:   # MultiMNIST: pairs made on device
    make = lambda seed, examples: pipeline.multimnist_pipeline(
        dataset, seed, examples, batch_size=config.batch_size,
        examples_per_digit=config.multimnist.examples_per_digit, num_classes=info.num_classes)
    train_data, test_data = make(config.seed, 0), make(config.multimnist.test_seed, count)
  else:
    train_data, test_data = assemble.pipeline(config, dataset, True), assemble.pipeline(config, dataset, False)
  model = assemble.model(config)   # 'auto' as a run chooses it (member_convs: for an ensemble's members)
  program = experiment.build_program(assemble.training(config, train_data.num_examples), model, train_data,
                                     test_data, sharding.data_mesh())
  return config, model, program, test_data, dataset


def cell_capsjax(spec, settings) -> dict:
  """Inference then training rows of one variant (inference first: the peak memory after
  it is inference's alone; after training, the larger of the two)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from capsjax import formulations  # pylint: disable=g-import-not-at-top
  from capsjax.models import formulation_of  # pylint: disable=g-import-not-at-top
  from timing import capsnet_flops, compiled_buffer_bytes, conv_layers  # pylint: disable=g-import-not-at-top

  config, model, program, test_data, dataset = _capsjax_setup(spec)
  members = len(spec.get('seeds') or ()) or 1
  primary = conv_layers(config.model, spec['batch'])['primary']   # the layer the CPU's rule decides by
  resolved = {'conv_impl': formulations.resolve('conv_impl', spec['conv_impl'], layer=primary),
              'patches_inference': formulations.resolve('patches_inference', spec.get('patches_inference', 'auto')),
              'routing_loop': formulations.resolve('routing_loop', spec['routing_loop']),
              'member_convs': formulation_of(model).member_convs}   # as the run's model chose it
  flops = capsnet_flops(config.model, batch=spec['batch'])
  rows = []

  def row(mode, batch, figures, compiled, compile_s):
    xla_bytes = compiled_buffer_bytes(compiled)
    measured = _peak_memory(jax)
    return dict(impl='capsjax', mode=mode, variant=spec['variant'], batch=batch, members=members,
                experiment=spec['experiment'], precision='bf16' if spec['dtype'] == 'bfloat16' else 'f32',
                resolved=resolved, flops_per_image=flops[('train' if mode == 'train' else 'forward') + '_performed'],
                compile_s=compile_s, xla_buffer_bytes=xla_bytes if xla_bytes >= 0 else None,
                peak_memory_bytes=measured if measured is not None else (xla_bytes if xla_bytes >= 0 else None),
                memory_source='memory_stats' if measured is not None else 'xla_buffers', **figures)

  params = program.initial_state['params']
  for batch in spec.get('infer_batches', ()):
    images = jax.device_put(dataset.images[:batch])
    labels, indices = dataset.labels[:batch], np.arange(batch, dtype=np.int32)
    infer = jax.jit(lambda params, images: model.apply(
        {'params': params}, test_data.device_batch(None, (images, labels, indices), None)['images']))
    start = time.perf_counter()
    compiled = infer.lower(params, images).compile()
    compile_s = time.perf_counter() - start
    figures = _median_rate(lambda: compiled(params, images), jax.block_until_ready, batch, settings)
    rows.append(row('infer', batch, figures, compiled, compile_s))

  if spec.get('train'):
    state = jax.tree.map(lambda x: x.copy(), program.initial_state)
    start = time.perf_counter()
    compiled = program.jitted_step.lower(*program.step_arguments(state, 0)).compile()
    compile_s = time.perf_counter() - start
    counter = iter(range(10 ** 9))
    box = {'state': state}

    def step():   # the loop's own call: host batch of step n → the compiled, donated step
      box['state'], metrics = compiled(*program.step_arguments(box['state'], next(counter)))
      return metrics

    figures = _median_rate(step, jax.block_until_ready, config.batch_size * members, settings)
    rows.append(row('train', config.batch_size, figures, compiled, compile_s))
    if spec.get('profile_dir'):
      profile = _profile(step, jax, spec['profile_dir'], settings['profile_steps'])
      return {'rows': rows, 'profile': profile}
  return {'rows': rows}


def _profile(step, jax, out_dir: str, steps: int) -> dict:
  """Trace `steps` calls of `step`; the top ops by device time, the trace files kept."""
  trace_dir = tempfile.mkdtemp(prefix='capsjax_trace_')
  jax.block_until_ready(step())
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(steps):
      out = step()
    jax.block_until_ready(out)
  ops = summarise_trace(_find(trace_dir, 'perfetto_trace.json.gz'), steps)
  kept = []
  for pattern, name in (('perfetto_trace.json.gz', 'profile_trace.json.gz'), ('*.xplane.pb', 'profile.xplane.pb')):
    found = _find(trace_dir, pattern)
    if found:
      shutil.copy(found, os.path.join(out_dir, name))
      kept.append(name)
  shutil.rmtree(trace_dir, ignore_errors=True)
  return {'ops': ops, 'steps': steps, 'files': kept}


def _find(folder: str, pattern: str):
  found = sorted(glob.glob(os.path.join(folder, '**', pattern), recursive=True))
  return found[0] if found else None


# Threads of a trace that carry the device's op executions: on a GPU/TPU the device's
# 'XLA Ops' line; on the CPU backend, XLA's own executor threads.
_HOST_OP_THREADS = ('tf_XLAPjRtCpuClient', 'tf_XLAEigen', 'XLACpu')
_NOT_OPS = ('ThreadpoolListener', 'end: ', 'ThunkExecutor')
_SUMMARY_LINES = ('XLA Modules', 'Steps', 'XLA TraceMe', 'TensorFlow Name Scope', 'TensorFlow Ops', 'Source code')


def summarise_trace(path, steps: int, top: int = PROFILE_OPS) -> list:
  """[{name, ms_per_step, share}] of the `top` ops by summed duration in a Chrome/Perfetto
  JSON trace of `steps` steps."""
  if not path:
    return []
  with gzip.open(path, 'rt') as f:
    trace = json.load(f)
  events = trace['traceEvents'] if isinstance(trace, dict) else trace
  processes, threads = {}, {}
  for event in events:
    if event.get('ph') == 'M' and event.get('name') == 'process_name':
      processes[event['pid']] = event['args']['name']
    elif event.get('ph') == 'M' and event.get('name') == 'thread_name':
      threads[(event['pid'], event['tid'])] = event['args']['name']
  devices = {pid for pid, name in processes.items() if name.startswith('/device:')}

  op_lines = {key for key, name in threads.items() if key[0] in devices and name == 'XLA Ops'}

  def is_op(event) -> bool:
    key = (event['pid'], event.get('tid'))
    if op_lines:
      return key in op_lines
    if devices:   # no 'XLA Ops' line: the device's kernels, less its module/step summary lines
      return event['pid'] in devices and threads.get(key, '') not in _SUMMARY_LINES
    return threads.get(key, '').startswith(_HOST_OP_THREADS) and not event['name'].startswith(_NOT_OPS)

  durations = collections.Counter()
  for event in events:
    if event.get('ph') == 'X' and is_op(event):
      durations[event['name']] += float(event.get('dur', 0.0))   # microseconds
  total = sum(durations.values()) or 1.0
  return [{'name': name, 'ms_per_step': micros / 1e3 / steps, 'share': micros / total}
          for name, micros in durations.most_common(top)]


def run_cells(specs: list, deadline_s: float) -> None:
  """Runs `specs` in order in this process, printing one result line per cell as it ends
  (a cell that fails prints its error and the next one runs; a cell that would start
  after `deadline_s` seconds is reported as skipped)."""
  start = time.perf_counter()
  for spec in specs:
    settings = SETTINGS['smoke' if spec['smoke'] else 'full']
    if time.perf_counter() - start > deadline_s - 10:
      result = {'error': 'time budget spent'}
    else:
      try:
        result = cell_device(settings) if spec['kind'] == 'device' else cell_capsjax(spec, settings)
      except Exception as e:  # pylint: disable=broad-except  (one row's failure is that row's, reported)
        result = {'error': f'{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ""}'}
    print(CELL_MARK + json.dumps(dict(result, name=spec['name'])), flush=True)


# ============================================================================ the parent

def _run(command, timeout: float, env=None):
  """(stdout, error or None, seconds) of a child process, killed after `timeout` s."""
  start = time.perf_counter()
  try:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
  except subprocess.TimeoutExpired as e:   # what it printed until then still counts
    partial = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or '')
    return partial, f'timed out after {timeout:.0f} s', time.perf_counter() - start
  seconds = time.perf_counter() - start
  if done.returncode:
    last = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or ['no output'])[-1]
    return done.stdout, f'exit {done.returncode}: {last[:300]}', seconds
  return done.stdout, None, seconds


def cell_group(specs: list, timeout: float, env) -> dict:
  """{name: (result or None, error or None)} of `specs` run in one child process."""
  stdout, error, _ = _run([sys.executable, os.path.abspath(__file__), '--cells', json.dumps(specs),
                           '--deadline_s', str(timeout)], timeout + 5, env)
  results = {}
  for line in stdout.splitlines():
    if line.startswith(CELL_MARK):
      result = json.loads(line[len(CELL_MARK):])
      results[result.pop('name')] = (None, result['error']) if 'error' in result else (result, None)
  return {spec['name']: results.get(spec['name'], (None, error or 'no result line')) for spec in specs}


# Runs the peer unmodified, then reads its peak CUDA memory in the same process.
PEER_WRAPPER = (
    'import runpy, sys\n'
    'sys.argv = sys.argv[1:]\n'
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    'import torch\n'
    'cuda = torch.cuda.is_available() and torch.cuda.is_initialized()\n'
    f"print({PEER_MEMORY_MARK!r}, torch.cuda.max_memory_allocated() if cuda else 'null')\n")


def peer_cell(spec: dict, timeout: float, args) -> tuple:
  # The smoke rehearses torch.compile's capture with aot_eager: inductor's C++ code for a CPU
  # took 83 s of a cold smoke (23 s this way) and is not the GPU's code (Triton) anyway.
  backend = ('aot_eager' if args.smoke else 'inductor') if spec['compile'] else None
  command = [args.torch_python or sys.executable, '-c', PEER_WRAPPER, args.torch_script,
             '--batch', str(spec['batch']), '--steps', str(spec['steps']), '--device', spec['device'],
             '--precision', spec['precision']]
  command += ['--compile', '--compile_backend', backend] if backend else []
  command += ['--infer'] if spec['mode'] == 'infer' else []
  stdout, error, seconds = _run(command, timeout)
  rate = re.search(r'images_per_s=([0-9.]+)', stdout)
  memory = re.search(re.escape(PEER_MEMORY_MARK) + r'\s*(\d+|null)', stdout)
  if error is None and not rate:
    error = 'no images_per_s in its output'
  if error:
    return None, error, seconds
  row = dict(impl='torch', mode=spec['mode'], variant=spec['variant'], batch=spec['batch'], members=1,
             compile_backend=backend,
             experiment='mnist', precision={'fp32': 'f32'}.get(spec['precision'], spec['precision']),
             images_per_s=float(rate.group(1)), timed_calls=spec['steps'],
             peak_memory_bytes=int(memory.group(1)) if memory and memory.group(1) != 'null' else None,
             memory_source='torch.cuda.max_memory_allocated' if spec['device'] == 'cuda' else None)
  return {'rows': [row]}, None, seconds


def plan(args, backend: str, settings, out_dir: str) -> list:
  """Every cell after the device facts, in priority order: what must be in a report first
  (the default formulation and the peer rows a ratio needs), what decides a choice next,
  the profile last (it needs the fastest variant)."""
  batch = settings['batch']
  from_table = _auto_formulations(backend)
  base = _variant_spec(args, settings, 'auto', from_table[1], 'auto')

  def variant_cell(conv, dtype, loop):
    spec = _variant_spec(args, settings, conv, dtype, loop)
    return dict(spec, name=f'capsjax {spec["variant"]}', train=True, infer_batches=[batch])

  # The table's own variant first, then float32 before bfloat16.
  variants = sorted(SMOKE_VARIANTS if args.smoke else VARIANTS + ROW_AND_FOURIER_VARIANTS,
                    key=lambda v: (v != from_table, v[1] != 'float32'))
  capsjax = [variant_cell(*v) for v in variants]
  auto = base
  seeds = dict(auto, name='capsjax mnist_seeds', variant=f'{auto["variant"]}, seeds 0 1 2 vmapped', seeds=[0, 1, 2],
               train=True, infer_batches=[])
  # Where 'auto' runs XLA's convolutions once per member (a GPU), the same step with vmap's
  # grouped convolution beside it: the comparison formulations.FASTEST's entry waits on.
  member_rows = [seeds] + ([dict(seeds, name='capsjax mnist_seeds grouped', member_convs='grouped',
                                 variant=f'{seeds["variant"]}, grouped convolutions')]
                           if backend == 'gpu' and not args.smoke else [])
  extras = [
      dict(auto, name='capsjax multimnist', variant=f'{auto["variant"]}, MultiMNIST 36×36', experiment='multimnist',
           train=True, infer_batches=[]),
  ] + ([] if args.smoke else [   # (the smoke's larger batch: the whole-batch cell below)
      dict(auto, name='capsjax infer large batch', variant=auto['variant'], train=False,
           infer_batches=[settings['large_batch']]),
  ]) + [   # the patches conv at inference as one matmul (the table's 'patches_inference');
           # the smoke runs the code path once (one dtype, the larger batch)
      dict(_variant_spec(args, settings, 'patches', dtype, 'auto'), name=f'capsjax patches whole-batch inference {dtype}',
           variant=f'patches {dtype} auto, whole-batch inference', patches_inference='whole_batch', train=False,
           infer_batches=[settings['large_batch']] if args.smoke else [batch, settings['large_batch']])
      for dtype in (('float32',) if args.smoke else ('float32', 'bfloat16'))
  ]
  device = 'cuda' if backend == 'gpu' else 'cpu'
  precisions = ('tf32', 'bf16') if backend == 'gpu' else ('fp32',)
  steps = settings['peer_steps']['gpu' if backend == 'gpu' else 'cpu']

  def peer(compiled, precision, mode):
    variant = f'{"compile" if compiled else "eager"} {precision}'
    return dict(kind='peer', name=f'peer {variant} {mode}', variant=variant, compile=compiled,
                precision=precision, mode=mode, device=device, batch=batch, steps=steps[mode])

  peers_compiled = [peer(True, p, m) for m in ('train', 'infer') for p in precisions]
  peers_eager = [peer(False, p, m) for m in ('train', 'infer') for p in precisions]
  profile = dict(kind='profile', name='profile fastest train variant', profile_dir=out_dir)
  # The 3-seed vmapped step right after the ratio's rows: its member rate sizes every leg.
  return capsjax[:1] + peers_compiled + member_rows + capsjax[1:] + extras + peers_eager + [profile]


def _variant_spec(args, settings, conv: str, dtype: str, loop: str) -> dict:
  """A capsjax cell of the paper's MNIST model in one formulation (conv, dtype, loop)."""
  return dict(kind='capsjax', smoke=args.smoke, experiment='mnist', batch=settings['batch'], seeds=None,
              variant=f'{conv} {dtype} {loop}', conv_impl=conv, dtype=dtype, routing_loop=loop)


def _auto_formulations(backend: str) -> tuple:
  from capsjax import formulations  # pylint: disable=g-import-not-at-top  (imports jax: parent only here)
  # (conv_impl, dtype, routing_loop) of 'auto' for the paper's PrimaryCaps (the layer that
  # holds almost all FLOPs); this only orders the cells and names the base's dtype.
  primary = formulations.ConvLayer(20, 20, 256, 256, 9, 2)
  return (formulations.resolve('conv_impl', 'auto', backend, primary), formulations.resolve('dtype', 'auto', backend),
          formulations.resolve('routing_loop', 'auto', backend))


def ratios_and_shares(rows: list, peaks: dict, backend: str) -> None:
  fastest_peer = {}
  for row in rows:
    if row['impl'] == 'torch':
      fastest_peer[row['mode']] = max(fastest_peer.get(row['mode'], 0.0), row['images_per_s'])
  for row in rows:
    peer = fastest_peer.get(row['mode'])
    row['vs_fastest_peer'] = row['images_per_s'] / peer if peer else None
    # JAX runs float32 matmuls as TF32 on a GPU by default; the peer's fp32/tf32/bf16 are its own.
    precision = 'tf32' if (row['impl'] == 'capsjax' and row['precision'] == 'f32' and backend == 'gpu') else row['precision']
    row['peak_precision'] = precision if precision in peaks else 'f32'
    flops = row.get('flops_per_image') or _peer_flops(row)
    row['flops_per_image'] = flops
    row['share_of_peak'] = row['images_per_s'] * flops / (peaks[row['peak_precision']] * 1e12) if flops else None


def _peer_flops(row) -> int:
  """The peer is the paper's MNIST model: the same shapes as experiments/mnist.py."""
  from capsjax.experiments import mnist  # pylint: disable=g-import-not-at-top
  from timing import capsnet_flops  # pylint: disable=g-import-not-at-top
  return capsnet_flops(mnist.get_model_config())['train' if row['mode'] == 'train' else 'forward']


def _mib(value) -> str:
  return '—' if value is None else f'{value / 2 ** 20:,.0f}'


def markdown(report: dict) -> str:
  device = report['device']
  peaks = device.get('matmul_peak_tflops', {})
  lines = [f'# Device report: {device.get("name", "?")} ({device.get("backend", "?")}), {report["date"]}', '',
           f'`{report["command"]}`, commit {report["commit"]}, {report["duration_s"]:.0f} s'
           + (' (smoke: few steps, small batch; not a measurement)' if report['smoke'] else ''), '',
           f'- memory: {_mib(device.get("memory_bytes"))} MiB ({device.get("memory_source")}); host CPUs: '
           f'{device.get("host_cpus")}; ' + ', '.join(f'{k} {v}' for k, v in device.get('versions', {}).items() if v),
           '- matmul peak (measured now, ' + f'{device.get("matmul_size")}³): '
           + ', '.join(f'{k} {v:,.2f} TFLOP/s' for k, v in peaks.items()),
           f'- device-to-device copy: {device.get("copy_gb_per_s", 0):,.1f} GB/s (bytes read + written, '
           f'{device.get("copy_mib")} MiB)']
  if device.get('core_count'):
    lines.append(f'- as capsjax-plan describes GPUs: {device["core_count"]} SMs, compute capability '
                 f'{device.get("compute_capability")}')
  lines.append('')
  header = ['impl', 'mode', 'variant', 'batch', 'images/s', '× fastest peer', '% of peak', 'peak memory MiB', 'memory from']
  table = []
  for row in sorted(report['rows'], key=lambda r: (r['mode'] != 'train', r['impl'] != 'capsjax', -r['images_per_s'])):
    table.append([row['impl'], row['mode'], row['variant'], str(row['batch'] * row.get('members', 1)),
                  f'{row["images_per_s"]:,.1f}',
                  '—' if row.get('vs_fastest_peer') is None else f'{row["vs_fastest_peer"]:.2f}',
                  '—' if row.get('share_of_peak') is None else f'{100 * row["share_of_peak"]:.1f} ({row["peak_precision"]})',
                  _mib(row.get('peak_memory_bytes')), row.get('memory_source') or '—'])
  lines += ['| ' + ' | '.join(header) + ' |', '|' + ' --- |' * len(header)]
  lines += ['| ' + ' | '.join(cells) + ' |' for cells in table]
  info = report.get('profile_info') or {}
  if report['profile']:
    lines += ['', f'Profile of the fastest training variant ({info.get("variant")}), {info.get("steps")} steps; '
              f'trace: {", ".join(info.get("files", []))}', '', '| op | ms / step | share |', '| --- | ---: | ---: |']
    lines += [f'| `{op["name"][:60]}` | {op["ms_per_step"]:.3f} | {100 * op["share"]:.1f} % |' for op in report['profile']]
  if report['skipped']:
    lines += ['', 'Skipped: ' + '; '.join(f'{s["name"]} ({s["reason"]})' for s in report['skipped'])]
  return '\n'.join(lines) + '\n'


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default='', help='folder for report.json, report.md and the trace (required)')
  parser.add_argument('--smoke', action='store_true', help='few steps, small batch: the code path, on a CPU')
  parser.add_argument('--budget_s', type=float, default=0.0, help='time budget (default 450 s; smoke 165 s)')
  parser.add_argument('--only', default='', help='regular expression: run only the cells whose name matches')
  parser.add_argument('--jobs', type=int, default=0,
                      help='work items run at once (default 1; smoke 2: concurrent timings are not measurements)')
  parser.add_argument('--torch_script', default=DEFAULT_TORCH_SCRIPT)
  parser.add_argument('--torch_python', default='', help='interpreter with torch (default: this one)')
  parser.add_argument('--cells', default='', help=argparse.SUPPRESS)
  parser.add_argument('--deadline_s', type=float, default=0.0, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.cells:
    return run_cells(json.loads(args.cells), args.deadline_s)
  if not args.out:
    parser.error('--out DIR is required')
  try:
    only = re.compile(args.only)
  except re.error as e:
    parser.error(f'--only {args.only!r}: {e}')
  if args.budget_s < 0:
    parser.error('--budget_s must be >= 0')
  if args.jobs < 0:
    parser.error('--jobs must be >= 1')

  start = time.perf_counter()
  elapsed = lambda: time.perf_counter() - start
  settings = SETTINGS['smoke' if args.smoke else 'full']
  budget = args.budget_s or settings['budget_s']
  out_dir = os.path.abspath(os.path.expanduser(args.out))
  os.makedirs(out_dir, exist_ok=True)
  # Children: memory grows as used (so memory_stats peaks are the program's own) and the
  # profile cell reuses the compiled fastest variant from a compilation cache.
  cache = tempfile.mkdtemp(prefix='capsjax_report_cache_')
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE='false', JAX_COMPILATION_CACHE_DIR=cache,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0')

  def log(message):
    print(f'[{elapsed():6.1f} s] {message}', flush=True)

  result, error = cell_group([{'kind': 'device', 'smoke': args.smoke, 'name': 'device'}],
                             settings['cell_timeout_s'], env)['device']
  if error:
    sys.exit(f'error: the device cell failed: {error}')
  device = result['device']
  backend = device['backend']
  log(f'{device["name"]} ({backend}): matmul ' + ', '.join(
      f'{k} {v:,.2f}' for k, v in device['matmul_peak_tflops'].items()) + f' TFLOP/s, copy {device["copy_gb_per_s"]:,.1f} GB/s')

  rows, skipped, profile, profile_info = [], [], [], None

  def record(spec, result, error, seconds=None):
    if error:
      skipped.append({'name': spec['name'], 'reason': error})
      log(f'{spec["name"]}: {error}')
      return
    rows.extend(result['rows'])
    log(f'{spec["name"]}' + (f' ({seconds:.0f} s)' if seconds else '') + ': ' + ', '.join(
        f'{r["mode"]} {r["images_per_s"]:,.1f} images/s' for r in result['rows']))

  cells = [spec for spec in plan(args, backend, settings, out_dir) if only.search(spec['name'])]
  profile_cells = [spec for spec in cells if spec['kind'] == 'profile']
  jobs = args.jobs or settings['jobs']

  def run_item(item):
    """One work item: a peer cell, or capsjax cells in one child process."""
    remaining = budget - elapsed()
    if remaining < 10:
      return [(spec, None, f'time budget of {budget:.0f} s spent', None) for spec in item]
    if item[0]['kind'] == 'peer':
      if not os.path.isfile(args.torch_script):
        return [(item[0], None, f'no peer script at {args.torch_script}', None)]
      return [(item[0],) + peer_cell(item[0], min(settings['cell_timeout_s'], remaining), args)]
    timeout = remaining if len(item) > 1 else min(settings['cell_timeout_s'], remaining)
    item_start = elapsed()
    outcomes = cell_group(item, timeout, env)
    seconds = elapsed() - item_start if len(item) == 1 else None
    return [(spec,) + outcomes[spec['name']] + (seconds,) for spec in item]

  # Where the backend has memory_stats, each capsjax cell gets a process of its own, so
  # its peak is its own. On the CPU memory comes from each compiled program's buffer
  # sizes, so the capsjax cells share `jobs` processes (one start-up and initialisation
  # each). With jobs > 1 work items run at once (the smoke's default: its timings are not
  # measurements anyway).
  capsjax = [spec for spec in cells if spec['kind'] == 'capsjax']
  groups = [capsjax[k::jobs] for k in range(jobs)] if backend == 'cpu' else [[spec] for spec in capsjax]
  peers = [[spec] for spec in cells if spec['kind'] == 'peer']
  if backend == 'cpu':   # the shared processes are the long poles: they start first
    items = [group for group in groups if group] + peers
  else:                  # one cell per item, in the plan's priority order
    items = [[spec] for spec in cells if spec['kind'] in ('capsjax', 'peer')]
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    for future in concurrent.futures.as_completed([pool.submit(run_item, item) for item in items]):
      for spec, result, error, seconds in future.result():
        record(spec, result, error, seconds)

  for spec in profile_cells:   # last: it needs the fastest training variant
    trained = [r for r in rows if r['impl'] == 'capsjax' and r['mode'] == 'train' and r['experiment'] == 'mnist'
               and r['members'] == 1]
    remaining = budget - elapsed()
    if not trained or remaining < 10:
      reason = 'no training variant was measured' if not trained else f'time budget of {budget:.0f} s spent'
      skipped.append({'name': spec['name'], 'reason': reason})
      continue
    fastest = max(trained, key=lambda r: r['images_per_s'])
    spec = dict(spec, **_variant_spec(args, settings, *fastest['variant'].split()), train=True, infer_batches=[])
    result, error = cell_group([spec], min(settings['cell_timeout_s'], remaining), env)[spec['name']]
    if error:
      skipped.append({'name': spec['name'], 'reason': error})
      log(f'{spec["name"]}: {error}')
      continue
    profile = result['profile']['ops']
    profile_info = {k: v for k, v in result['profile'].items() if k != 'ops'}
    profile_info['variant'] = fastest['variant']
    log(f'{spec["name"]} ({fastest["variant"]}): top op ' + (profile[0]['name'] if profile else 'none'))
  shutil.rmtree(cache, ignore_errors=True)

  ratios_and_shares(rows, device['matmul_peak_tflops'], backend)
  commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True, text=True,
                          check=False).stdout.strip() or 'unknown'
  report = {'device': device, 'rows': rows, 'profile': profile, 'profile_info': profile_info,
            'skipped': skipped, 'smoke': args.smoke, 'settings': settings, 'duration_s': elapsed(),
            'date': datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d'),
            'command': ' '.join(['python', 'benchmarks/device_report.py'] + (sys.argv[1:] if argv is None else argv)),
            'commit': commit}
  text = markdown(report)
  with open(os.path.join(out_dir, 'report.json'), 'w') as f:
    json.dump(report, f, indent=1)
  with open(os.path.join(out_dir, 'report.md'), 'w') as f:
    f.write(text)
  print(text)
  print(f'duration: {elapsed():.1f} s')

  def best(mode):
    ours = [r['vs_fastest_peer'] for r in rows if r['impl'] == 'capsjax' and r['mode'] == mode
            and r['experiment'] == 'mnist' and r['members'] == 1 and r.get('vs_fastest_peer')]
    return f'{max(ours):.2f}' if ours else 'NA'

  print(f'device_report duration_s={elapsed():.1f} rows={len(rows)} skipped={len(skipped)} '
        f'train_vs_peer={best("train")} infer_vs_peer={best("infer")} report={os.path.join(out_dir, "report.json")}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
