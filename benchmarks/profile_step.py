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
import os
import re
import tempfile
import time

import jax

from capsjax import assemble, formulations
from capsjax.app import cli
from capsjax.data.sources import Dataset
from capsjax.steps import make_train_step
from timing import random_inputs


def instruction_op_names(hlo_text: str) -> dict:
  """{HLO instruction name: its metadata op_name} from a compiled module's text."""
  names = {}
  for match in re.finditer(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name="([^"]*)"', hlo_text, re.M):
    names[match.group(1)] = match.group(2)
  return names


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


def report(title: str, wall: float, shares: dict, op_names: dict, top: int):
  by_part = collections.defaultdict(float)
  for name, seconds in shares.items():
    by_part[part_of(op_names.get(name, ''))] += seconds
  busy = sum(by_part.values())
  print(f'\n{title}: {wall * 1e3:.0f} ms per call wall, {busy * 1e3:.0f} ms busy in XLA instructions')
  print(f'{"part":62s} {"ms":>8s} {"share":>6s}')
  for part, seconds in sorted(by_part.items(), key=lambda kv: -kv[1]):
    print(f'{part:62s} {seconds * 1e3:8.1f} {100 * seconds / busy:5.1f}%')
  print(f'  the {top} longest instructions:')
  for name, seconds in sorted(shares.items(), key=lambda kv: -kv[1])[:top]:
    print(f'  {seconds * 1e3:8.1f} ms  {name:28s} {op_names.get(name, "")[-90:]}')


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

  op_names = instruction_op_names(train_step.lower(state, None, host_batch).compile().as_text())
  wall, shares, (state, _, _) = profile(train_step, (state, None, host_batch), args.calls, threaded=True)
  report('training step', wall, shares, op_names, args.top)

  test = assemble.pipeline(config, dataset, training=False)
  infer = jax.jit(lambda params, x: model.apply(
      {'params': params}, test.device_batch(None, (x, labels, labels), None)['images']))
  op_names = instruction_op_names(infer.lower(state['params'], images).compile().as_text())
  wall, shares, _ = profile(infer, (state['params'], images), args.calls, threaded=False)
  report('inference (capsules, lengths, reconstruction)', wall, shares, op_names, args.top)


if __name__ == '__main__':
  main()
