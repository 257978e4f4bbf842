"""Where a CapsNet training step and an inference call spend their time, per model part.

  python benchmarks/profile_step.py --batch 128                      # the paper's model
  python benchmarks/profile_step.py --batch 128 --conv_impl xla
  python benchmarks/profile_step.py --experiment images --input_shape 128,128,3

Traces a few calls with `jax.profiler` (XLA:CPU or GPU thunks, each named after its HLO
instruction), reads the Perfetto trace, and charges each instruction's time to the part of
the model its HLO metadata names (Conv1, PrimaryCaps' matmul / patch extraction /
col2im, the prediction vectors û, the routing iterations, the decoder, the loss, Adam,
the augmentation), forward and backward apart. Instructions that run at the same time
(XLA:CPU runs independent thunks concurrently) share the wall time between them, so the
rows add up to the time the device was busy, not to the sum of the durations.
Run on the machine you care about; name it beside the figures (docs/results.md).
"""
import argparse
import collections
import glob
import gzip
import importlib
import json
import math
import os
import re
import tempfile
import time
from typing import Optional

import jax
import jax.numpy as jnp

from capsjax import assemble, formulations
from capsjax.app import cli
from capsjax.data.sources import Dataset
from capsjax.steps import make_train_step
from timing import random_inputs, seconds_per_call


def matmul_peak_gflops(size: int = 4096, steps: int = 5) -> float:
  """This machine's float32 matmul rate now (4096³), the peak the parts are held against."""
  a = jnp.ones((size, size), jnp.float32)
  b = jnp.ones((size, size), jnp.float32)
  seconds = seconds_per_call(jax.jit(jnp.matmul), (a, b), steps)
  return 2 * size ** 3 / seconds / 1e9


def instruction_op_names(hlo_text: str) -> dict:
  """{HLO instruction name: its metadata op_name} from a compiled module's text."""
  names = {}
  for match in re.finditer(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name="([^"]*)"', hlo_text, re.M):
    names[match.group(1)] = match.group(2)
  return names


_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = (\([^)]*\)|\S+?)(?:\{[^}]*\})? ([\w\-]+)\((.*?)\)(.*)$')
_COMPUTATION = re.compile(r'^(?:ENTRY )?%([\w.\-]+) \((.*)\) -> .* \{$')
_PARAMETER = re.compile(r'([\w.\-]+): ([a-z0-9]+\[[0-9,]*\])')


def _dims(shape: str):
  """[1, 2, 3] of 'f32[1,2,3]' (None for a tuple or a token)."""
  match = re.match(r'^[a-z0-9]+\[([0-9,]*)\]$', shape)
  return None if match is None else [int(d) for d in match.group(1).split(',') if d]


def _fft_flops(out: list, attrs: str) -> float:
  """The conventional count of a fast Fourier transform: 5 N log2 N per complex transform of
  N points, half that for a real one (RFFT, IRFFT); an estimate, not a measurement."""
  length = [int(n) for n in re.search(r'fft_length=\{([0-9,]+)\}', attrs).group(1).split(',')]
  points = math.prod(length)
  transforms = math.prod(out[:len(out) - len(length)])
  real = 'RFFT' in attrs   # RFFT and IRFFT
  return (2.5 if real else 5.0) * points * math.log2(max(points, 2)) * transforms


def _own_flops(opcode: str, out, operands: list, attrs: str, shapes: dict) -> float:
  """The multiply-adds (× 2) of one dot or convolution, from its shapes; an FFT's estimate."""
  if out is None:
    return 0.0
  if opcode == 'dot':
    lhs = shapes.get(operands[0])
    contracting = re.search(r'lhs_contracting_dims=\{([0-9,]*)\}', attrs)
    size = math.prod(lhs[int(d)] for d in contracting.group(1).split(',') if d) if lhs and contracting else 1
    return 2.0 * math.prod(out) * size
  if opcode == 'convolution':
    rhs = shapes.get(operands[1])
    labels = re.search(r'dim_labels=\w+_(\w+)->', attrs)
    if rhs is None or labels is None:
      return 0.0
    kernel = labels.group(1)   # e.g. 01io: spatial sizes, input and output features
    per_output = math.prod(size for size, label in zip(rhs, kernel) if label != 'o')
    return 2.0 * math.prod(out) * per_output
  if opcode == 'fft':
    return _fft_flops(out, attrs)
  return 0.0


def instruction_flops(hlo_text: str) -> dict:
  """{instruction that runs as its own thunk: the matmul-class FLOPs it executes per call}:
  dots and convolutions counted from their shapes (2 per multiply-add), FFTs by the usual
  5 N log2 N estimate, each fusion charged with what it fuses, a while loop's body × its
  known trip count. Elementwise work is not counted: these are the FLOPs the matmul peak
  bounds."""
  computations, order = {}, []
  current = None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      current = header.group(1)
      computations[current] = {'entry': line.startswith('ENTRY'), 'instructions': [],
                               'shapes': {name: _dims(shape) for name, shape in _PARAMETER.findall(header.group(2))}}
      order.append(current)
      continue
    match = _INSTRUCTION.match(line) if current else None
    if match:
      name, shape, opcode, operands, attrs = match.groups()
      computation = computations[current]
      computation['shapes'][name] = _dims(shape)
      computation['instructions'].append((name, opcode, _dims(shape),
                                          [o.strip().lstrip('%') for o in operands.split(',') if o.strip()], attrs))

  def called(attrs: str, key: str):
    match = re.search(key + r'=%([\w.\-]+)', attrs)
    return match.group(1) if match else None

  def fused(computation_name: str) -> float:
    computation = computations.get(computation_name)
    if computation is None:
      return 0.0
    total = 0.0
    for _, opcode, out, operands, attrs in computation['instructions']:
      total += _own_flops(opcode, out, operands, attrs, computation['shapes'])
      if opcode == 'fusion':
        total += fused(called(attrs, 'calls'))
    return total

  flops = collections.defaultdict(float)

  def walk(computation_name: str, times: float) -> None:
    computation = computations.get(computation_name)
    if computation is None:
      return
    for name, opcode, out, operands, attrs in computation['instructions']:
      if opcode == 'while':
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', attrs)
        walk(called(attrs, 'body'), times * (int(trips.group(1)) if trips else 1))
      elif opcode in ('call', 'conditional'):
        for target in re.findall(r'(?:to_apply|branch_computations=\{|true_computation|false_computation)=?%([\w.\-]+)',
                                 attrs):
          walk(target, times)
      else:
        own = _own_flops(opcode, out, operands, attrs, computation['shapes'])
        own += fused(called(attrs, 'calls')) if opcode == 'fusion' else 0.0
        if own:
          flops[name] += own * times

  walk(next(name for name in order if computations[name]['entry']), 1.0)
  return dict(flops)


def part_of(op_name: str) -> str:
  """The model part an HLO instruction belongs to, from its op_name (JAX's name stack)."""
  if not op_name:
    return 'unnamed (copies, layout changes)'
  backward = 'transpose(jvp(' in op_name
  where = 'backward' if backward else 'forward'
  leaf = op_name.rsplit('/', 1)[-1]
  if 'primary_caps/conv' in op_name:
    if '/fourier/' in op_name:   # capsjax.ops.fourier_conv2d
      if '/transforms/' in op_name and 'dot_general' in leaf:   # named scopes of ops.fourier_conv2d
        return f'{where}: PrimaryCaps Fourier transforms (matmuls)'
      if 'dot_general' in leaf:
        return f'{where}: PrimaryCaps convolution (matmul)'
      return f'{where}: PrimaryCaps Fourier: products\' sums, negations, layouts'
    if 'dot_general' in leaf:
      return f'{where}: PrimaryCaps convolution (matmul)'
    if backward and 'transpose(jvp())' in op_name:
      return 'backward: PrimaryCaps col2im (patch gradient → Conv1 output)'
    if 'conv_general_dilated' in leaf:
      return f'{where}: PrimaryCaps convolution (XLA conv)'
    return f'{where}: PrimaryCaps patch extraction'
  for module, label in (('conv1', 'Conv1'), ('primary_caps', 'PrimaryCaps squash/bias'),
                        ('strided_stem', 'strided stem'), ('decoder', 'decoder')):
    if f'/{module}/' in op_name or op_name.endswith(f'/{module}'):
      return f'{where}: {label}'
  if 'digit_caps' in op_name:
    if 'ijdk,bik->bijd' in op_name:
      return f'{where}: prediction vectors û'
    return f'{where}: routing iterations'
  if 'CapsNet' in op_name:
    return f'{where}: rest of the model (masking, lengths)'
  if 'randint' in op_name or 'threefry' in op_name or 'vmap()' in op_name:
    return 'augmentation (shifts, RNG)'
  if 'jvp(' in op_name:
    return f'{where}: loss'
  return 'optimizer update and the rest of the step'


def busy_shares(events: list) -> dict:
  """{instruction: wall seconds}: each moment's wall time split evenly among the
  instructions running then (events: (name, start_us, end_us))."""
  boundaries = sorted({t for _, start, end in events for t in (start, end)})
  shares = collections.defaultdict(float)
  by_start = sorted(events, key=lambda e: e[1])
  active, next_event = [], 0
  for left, right in zip(boundaries[:-1], boundaries[1:]):
    while next_event < len(by_start) and by_start[next_event][1] <= left:
      active.append(by_start[next_event])
      next_event += 1
    active = [e for e in active if e[2] > left]
    running = [e for e in active if e[1] <= left < e[2]]
    for name, _, _ in running:
      shares[name] += (right - left) / len(running) / 1e6
  return shares


def profile(fn, args, calls: int, threaded: bool):
  """(wall seconds per call, {instruction: busy seconds per call}) of `fn(*args)`
  (threaded: fn returns (state, out) and its first argument is threaded through)."""
  def run(args):
    if threaded:
      state, out = fn(*args)
      return (state,) + tuple(args[1:]), out
    return args, fn(*args)

  for _ in range(2):   # compile and warm up
    args, out = run(args)
  jax.block_until_ready(out)
  trace_dir = tempfile.mkdtemp(prefix='capsjax_profile_')
  jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
  start = time.perf_counter()
  for _ in range(calls):
    args, out = run(args)
  jax.block_until_ready(out)
  wall = (time.perf_counter() - start) / calls
  jax.profiler.stop_trace()
  trace_file = glob.glob(os.path.join(trace_dir, '**', 'perfetto_trace.json.gz'), recursive=True)[0]
  with gzip.open(trace_file) as f:
    trace = json.load(f)
  events = [(e['args']['hlo_op'], e['ts'], e['ts'] + e['dur'])
            for e in (trace['traceEvents'] if isinstance(trace, dict) else trace)
            if e.get('ph') == 'X' and 'hlo_op' in e.get('args', {})]
  return wall, {name: seconds / calls for name, seconds in busy_shares(events).items()}, args


def report(title: str, wall: float, shares: dict, op_names: dict, top: int, flops: Optional[dict] = None,
           peak: Optional[float] = None):
  """The parts' busy time (and, with `flops` from `instruction_flops`, each part's executed
  matmul-class GFLOP, its rate while busy, and that rate's share of the matmul `peak`,
  GFLOP/s measured in the same process), then the longest instructions."""
  by_part, part_flops = collections.defaultdict(float), collections.defaultdict(float)
  for name, seconds in shares.items():
    by_part[part_of(op_names.get(name, ''))] += seconds
  for name, count in (flops or {}).items():
    part_flops[part_of(op_names.get(name, ''))] += count
  busy = sum(by_part.values())
  print(f'\n{title}: {wall * 1e3:.0f} ms per call wall, {busy * 1e3:.0f} ms busy in XLA instructions'
        + (f', {sum(part_flops.values()) / 1e9:.2f} GFLOP executed (matmul-class)' if flops else ''))
  columns = f' {"GFLOP":>7s} {"GFLOP/s":>8s} {"of peak":>7s}' if flops else ''
  print(f'{"part":62s} {"ms":>8s} {"share":>6s}' + columns)
  for part, seconds in sorted(by_part.items(), key=lambda kv: -kv[1]):
    row = f'{part:62s} {seconds * 1e3:8.1f} {100 * seconds / busy:5.1f}%'
    if flops:
      rate = part_flops[part] / seconds / 1e9 if seconds else 0.0
      row += (f' {part_flops[part] / 1e9:7.2f} {rate:8.1f} {100 * rate / peak:6.1f}%' if part_flops[part] and peak
              else f' {part_flops[part] / 1e9:7.2f}' if part_flops[part] else '')
    print(row)
  print(f'  the {top} longest instructions:')
  for name, seconds in sorted(shares.items(), key=lambda kv: -kv[1])[:top]:
    print(f'  {seconds * 1e3:8.1f} ms  {name:28s} {op_names.get(name, "")[-90:]}')


def profile_parts(train_step, state, host_batch, infer, images, calls: int = 3,
                  peak: Optional[float] = None, top: int = 8):
  """The training step's and inference's per-part profile (`report`), each instruction's
  FLOPs from the compiled module; `state` is donated to the step (the new one is returned)."""
  compiled = train_step.lower(state, None, host_batch).compile().as_text()
  wall, shares, (state, _, _) = profile(train_step, (state, None, host_batch), calls, threaded=True)
  report('training step', wall, shares, instruction_op_names(compiled), top, instruction_flops(compiled), peak)
  compiled = infer.lower(state['params'], images).compile().as_text()
  wall, shares, _ = profile(infer, (state['params'], images), calls, threaded=False)
  report('inference (capsules, lengths, reconstruction)', wall, shares, instruction_op_names(compiled), top,
         instruction_flops(compiled), peak)
  return state


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--batch', type=int, default=128)
  parser.add_argument('--calls', type=int, default=3, help='traced calls after two warm-up calls')
  parser.add_argument('--experiment', default='mnist', help='config module in capsjax.experiments')
  parser.add_argument('--conv_impl', default='auto', choices=list(formulations.CONV_IMPLS))
  parser.add_argument('--dtype', default='float32')
  parser.add_argument('--conv_inputs', default='float32', choices=['float32', 'bfloat16'])
  parser.add_argument('--input_shape', default='', help='H,W,C (the `images` experiment)')
  parser.add_argument('--top', type=int, default=12, help='longest instructions listed')
  parser.add_argument('--huge_pages', default='on', choices=['on', 'off'],
                      help="large buffers in transparent huge pages where Linux allows it (what capsjax's "
                           'commands do; capsjax.app.cli.huge_pages_environment)')
  args = parser.parse_args()
  if args.huge_pages == 'on':
    cli.use_huge_pages()   # restarts this process once

  config = importlib.import_module(f'capsjax.experiments.{args.experiment}').get_config()
  config.model.formulation.conv_impl = args.conv_impl
  config.model.formulation.dtype = args.dtype
  config.model.formulation.conv_inputs = args.conv_inputs
  config, images, labels = random_inputs(config, args.batch, args.input_shape)   # the `images` models' 'auto' keys
  dataset = Dataset(images, labels)
  model = assemble.model(config)
  optimizer = assemble.optimizer(config)
  state = assemble.initial_state(config, model, optimizer)
  data = assemble.pipeline(config, dataset, training=True)
  train_step = make_train_step(assemble.objective(config), model, optimizer, data, config.seed)
  host_batch = data.host_batch(0)
  print(f'machine: backend={jax.default_backend()} cpus={os.cpu_count()} jax={jax.__version__} '
        f'experiment={args.experiment} batch={args.batch} conv_impl={args.conv_impl} dtype={args.dtype} '
        f'conv_inputs={args.conv_inputs} GLIBC_TUNABLES={os.environ.get("GLIBC_TUNABLES", "")!r}')

  test = assemble.pipeline(config, dataset, training=False)
  infer = jax.jit(lambda params, x: model.apply(
      {'params': params}, test.device_batch(None, (x, labels, labels), None)['images']))
  profile_parts(train_step, state, host_batch, infer, images, args.calls, matmul_peak_gflops(), args.top)


if __name__ == '__main__':
  main()
