"""Training and inference throughput of an experiment's CapsNet, against the PyTorch peer.

  python benchmarks/throughput.py --batch 128
  python benchmarks/throughput.py --batch 128 --sweep 32,64,128,256 --no_torch

Prints images/s, achieved GFLOP/s and the share of this machine's matmul peak (measured
in the same run), XLA's buffer memory, and the ratio to `torch_capsnet.py` run in the
same process tree, in each runtime a PyTorch user picks for speed (`--peers`): eager,
torch.compile and, for inference, ONNX Runtime; each is optional (skipped with a note where
it is not installed or fails), and the ratio that counts is against the fastest peer row.
FLOPs per image come from the layer shapes in the config, counted as each side computes
them (capsjax's 'fourier' convolution needs fewer than the direct form; its direct-form
equivalent rate is printed beside). The last line is machine-readable:

  throughput train_images_per_s=… infer_images_per_s=… torch_train_ratio=… torch_infer_ratio=…
             best_peer_train=… best_peer_train_ratio=… best_peer_infer=… best_peer_infer_ratio=…

(torch_*_ratio: against eager PyTorch; best_peer_*: the fastest peer row and the ratio to it.)
"""
import argparse
import importlib
import statistics
import importlib.util
import os
import re
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax  # pylint: disable=g-import-not-at-top

from capsjax import assemble, formulations, runtime  # pylint: disable=g-import-not-at-top
from capsjax.app import cli  # pylint: disable=g-import-not-at-top
from capsjax.models import MODELS  # pylint: disable=g-import-not-at-top
from capsjax.steps import make_train_step  # pylint: disable=g-import-not-at-top
from profile_step import matmul_peak_gflops, profile_parts
from timing import (buffer_bytes, capsnet_flops, conv_layers, is_paper_architecture, random_inputs, seconds_per_call,
                    seconds_per_step)
from capsjax.data.sources import Dataset

DEFAULT_TORCH_SCRIPT = os.path.join(ROOT, 'benchmarks', 'torch_capsnet.py')


# ----------------------------------------------------------------------------- timing

def jax_programs(config, batch: int, input_shape: str = '') -> dict:
  """The compiled training step of `config`'s model (at `input_shape`, when given) with its
  state and a host batch, and inference as a user runs it, with its images."""
  config, images, labels = random_inputs(config, batch, input_shape)
  model = assemble.model(config)
  optimizer = assemble.optimizer(config)
  state = assemble.initial_state(config, model, optimizer)
  data = assemble.pipeline(config, Dataset(images, labels), training=True)
  train_step = make_train_step(assemble.objective(config), model, optimizer, data, config.seed)
  # Inference as a user runs it: digit capsules, lengths and the reconstruction of the
  # longest capsule (what the PyTorch peer computes too).
  test = assemble.pipeline(config, Dataset(images, labels), training=False)
  infer = jax.jit(lambda params, x: model.apply({'params': params},
                                                test.device_batch(None, (x, labels, labels), None)['images']))
  return {'train_step': train_step, 'state': state, 'host_batch': data.host_batch(0), 'infer': infer,
          'images': images}


def jax_timers(programs: dict, batch: int, steps: int):
  """({'train': seconds → images/s timer, 'infer': …}, XLA buffer bytes per mode) of
  `jax_programs`' (their state threaded through the timed training steps, which donate it)."""
  train_step, host_batch, infer, images = (programs[key] for key in ('train_step', 'host_batch', 'infer', 'images'))
  memory = {'train': buffer_bytes(train_step, programs['state'], None, host_batch),
            'infer': buffer_bytes(infer, programs['state']['params'], images)}

  def time_train():
    seconds, programs['state'] = seconds_per_step(train_step, programs['state'], (None, host_batch), steps)
    return batch / seconds

  def time_infer():
    return batch / seconds_per_call(infer, (programs['state']['params'], images), steps)

  return {'train': time_train, 'infer': time_infer}, memory


def measure_jax(config, batch: int, steps: int, input_shape: str = '') -> dict:
  timers, memory = jax_timers(jax_programs(config, batch, input_shape), batch, steps)
  return {'train_images_per_s': timers['train'](), 'infer_images_per_s': timers['infer'](),
          'train_buffer_bytes': memory['train'], 'infer_buffer_bytes': memory['infer']}


def exported_file_timer(path: str, batch: int, steps: int):
  """images/s of an ONNX file written by `capsjax-export --format=onnx` (uint8 images in),
  run by ONNX Runtime on the CPU, timed as the peers are: a warm-up call, then `steps`."""
  import time  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import onnxruntime  # pylint: disable=g-import-not-at-top
  session = onnxruntime.InferenceSession(path, providers=['CPUExecutionProvider'])
  shape = session.get_inputs()[0].shape[1:]
  images = np.random.default_rng(0).integers(0, 256, (batch, *shape), np.uint8)

  def time_file():
    session.run(None, {'images': images})
    start = time.perf_counter()
    for _ in range(steps):
      session.run(None, {'images': images})
    return batch * steps / (time.perf_counter() - start)
  return time_file


# The peer's runtimes: name → (torch_capsnet.py's --runtime, the modes it runs, the module it needs).
PEERS = {'torch': ('eager', ('train', 'infer'), 'torch'),
         'torch.compile': ('compile', ('train', 'infer'), 'torch'),
         'onnxruntime': ('onnxruntime', ('infer',), 'onnxruntime')}


def measure_torch(script: str, batch: int, steps: int, infer: bool, precision: str = '', input_shape: str = '',
                  runtime: str = 'eager'):
  command = [sys.executable, script, '--batch', str(batch), '--steps', str(steps), '--runtime', runtime]
  if input_shape:
    command += ['--input_shape', input_shape]
  if infer:
    command.append('--infer')
  if precision:
    command += ['--precision', precision]
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
  parser.add_argument('--conv_impl', default='auto', choices=list(formulations.CONV_IMPLS))
  parser.add_argument('--dtype', default='auto', help="model compute dtype (auto: the backend's, capsjax.formulations)")
  parser.add_argument('--patches_inference', default='auto', choices=['auto', 'chunked', 'whole_batch'])
  parser.add_argument('--routing_loop', default='auto', choices=list(formulations.ROUTING_LOOPS))
  parser.add_argument('--conv_inputs', default='float32', choices=['float32', 'bfloat16'],
                      help="the convolutions' matmul inputs (bfloat16: accumulated in float32)")
  parser.add_argument('--input_shape', default='',
                      help="H,W,C: capsjax's model for that shape (the `images` experiment's choice with "
                           "--experiment images) against the peer's paper layers at that shape")
  parser.add_argument('--sweep', default='', help='comma-separated batch sizes (JAX only)')
  parser.add_argument('--rounds', type=int, default=3, help='turns of capsjax and the peer')
  parser.add_argument('--torch_precision', default='', choices=['', 'fp32', 'bf16'],
                      help="the peer's precision (bf16: autocast, the peer's counterpart of --conv_inputs bfloat16)")
  parser.add_argument('--no_torch', action='store_true', help='no peer rows at all')
  parser.add_argument('--peers', default=','.join(PEERS),
                      help=f'comma-separated peer runtimes, of {", ".join(PEERS)} (each skipped where not installed)')
  parser.add_argument('--torch_script', default=DEFAULT_TORCH_SCRIPT)
  parser.add_argument('--exported', default='',
                      help='an ONNX file of `capsjax-export --format=onnx --reconstructions` (what inference here '
                           'computes): ONNX Runtime runs it beside, the row capsjax.onnx')
  parser.add_argument('--profile', action='store_true',
                      help="after the timings, capsjax's step and inference per part (conv1, PrimaryCaps in its "
                           'form, û, routing, decoder, the optimizer update): busy time, executed matmul-class '
                           'FLOPs and their share of the matmul peak (benchmarks/profile_step.py)')
  parser.add_argument('--huge_pages', default='on', choices=['on', 'off'],
                      help="both sides' large buffers in transparent huge pages where Linux allows it "
                           "(on: what capsjax's commands do; capsjax.app.cli.huge_pages_environment)")
  args = parser.parse_args()
  if args.huge_pages == 'on':
    cli.use_huge_pages()   # restarts this process once; the peer's processes inherit it
  else:
    os.environ['CAPSJAX_HUGE_PAGES'] = '0'

  try:
    config = importlib.import_module(f'capsjax.experiments.{args.experiment}').get_config()
  except ModuleNotFoundError as error:
    if error.name != f'capsjax.experiments.{args.experiment}':
      raise
    parser.exit(2, f'{parser.prog}: error: --experiment={args.experiment}: no such experiment (experiments/NAME.py)\n')
  if not MODELS[config.model.name].capsules:   # (its CNN once ended in an AttributeError on conv1_kernel)
    parser.exit(2, f'{parser.prog}: error: --experiment={args.experiment}: its model is a {config.model.name!r}; '
                'this benchmark times CapsNets against the PyTorch CapsNet\n')
  config.model.formulation.conv_impl = args.conv_impl
  config.model.formulation.dtype = args.dtype
  config.model.formulation.conv_inputs = args.conv_inputs
  config.model.formulation.patches_inference = args.patches_inference
  config.model.formulation.routing_loop = args.routing_loop
  config, _, _ = random_inputs(config, args.batch, args.input_shape)   # the model timed below
  # FLOPs from the shapes count the paper's layers only; the `images` models' are not counted.
  flops = capsnet_flops(config.model, batch=args.batch) if is_paper_architecture(config.model) else None
  peak = matmul_peak_gflops()
  print(f'machine: cpu={runtime.cpu_model()!r} backend={jax.default_backend()} devices={jax.device_count()} '
        f'cpus={os.cpu_count()} jax={jax.__version__}')
  print(f'matmul peak (4096³ float32, measured now): {peak:.1f} GFLOP/s')
  if flops:
    print(f'FLOPs per image from the shapes, direct form (the peer\'s arithmetic): forward '
          f'{flops["forward"] / 1e9:.3f} G, training {flops["train"] / 1e9:.3f} G; as capsjax computes them '
          f'here: {flops["forward_performed"] / 1e9:.3f} G, {flops["train_performed"] / 1e9:.3f} G')
    layers = conv_layers(config.model, args.batch)
    print('capsjax convolutions: ' + ', '.join(
        f'{name} {formulations.resolve("conv_impl", args.conv_impl, layer=layer)}' for name, layer in layers.items()))
  print(f'model: input_shape={tuple(config.model.input_shape)} stem={config.model.stem} '
        f'transforms={config.model.transforms} decoder={config.model.decoder}; the peer: the paper\'s layers at '
        f'{args.input_shape or "28,28,1"}')
  print(f'capsjax: conv_impl={args.conv_impl} patches_inference={args.patches_inference} '
        f'routing_loop={args.routing_loop} dtype={args.dtype} '
        f'conv_inputs={args.conv_inputs}; '
        f'torch: precision={args.torch_precision or "fp32"}; both: '
        f'GLIBC_TUNABLES={os.environ.get("GLIBC_TUNABLES", "")!r} (--huge_pages {args.huge_pages})')

  def line(side, mode, batch, rate, memory=None):
    text = f'{side:13s} {mode:5s} batch={batch:4d}: {rate:7.1f} images/s'
    if flops and (side == 'jax' or not args.input_shape):
      # FLOPs performed per second against the matmul peak; for capsjax also the direct
      # form's count per second (the peer's arithmetic: an equivalent rate, not a share).
      performed = rate * flops[('train' if mode == 'train' else 'forward') + ('_performed' if side == 'jax' else '')] / 1e9
      text += f'  {performed:6.1f} GFLOP/s ({100 * performed / peak:4.1f} % of peak)'
      if side == 'jax' and flops['train_performed'] != flops['train']:
        text += f', direct-form equivalent {rate * flops["train" if mode == "train" else "forward"] / 1e9:6.1f}'
    return text + (f'  XLA buffers {memory / 2**20:7.0f} MiB' if memory is not None else '')

  for batch in [int(b) for b in args.sweep.split(',') if b]:
    figures = measure_jax(config, batch, args.steps, args.input_shape)
    for mode in ('train', 'infer'):
      print(line('jax', mode, batch, figures[f'{mode}_images_per_s'], figures[f'{mode}_buffer_bytes']))

  peers = [name for name in args.peers.split(',') if name]
  unknown = sorted(set(peers) - set(PEERS))
  if unknown:
    parser.error(f'--peers: unknown {", ".join(unknown)}; known: {", ".join(PEERS)}')
  if args.no_torch:
    print('peers: skipped (--no_torch)')
    peers = []
  elif not os.path.isfile(args.torch_script):
    print(f'peers: not measured (no {args.torch_script}); ratios are NA')
    peers = []
  for name in list(peers):
    module = PEERS[name][2]
    if importlib.util.find_spec(module) is None or importlib.util.find_spec('torch') is None:
      print(f'peer {name}: not measured ({module} is not installed: pip install \'capsjax[peers]\')')
      peers.remove(name)
  programs = jax_programs(config, args.batch, args.input_shape)
  timers, memory = jax_timers(programs, args.batch, args.steps)
  if args.exported:   # capsjax's own model leaving JAX: a row beside the peers, not one of them
    timers['exported'] = exported_file_timer(args.exported, args.batch, args.steps)
  rates = {('jax', mode): [] for mode in ('train', 'infer')}
  rates.update({('capsjax.onnx', 'infer'): []} if args.exported else {})
  rates.update({(name, mode): [] for name in peers for mode in PEERS[name][1]})
  failed = set()
  for round_index in range(args.rounds):
    for mode in ('train', 'infer'):   # neighbours in time: capsjax, then each peer
      rates['jax', mode].append(timers[mode]())
      print(f'round {round_index + 1}: ' + line('jax', mode, args.batch, rates['jax', mode][-1], memory[mode]))
      if mode == 'infer' and args.exported:
        rates['capsjax.onnx', mode].append(timers['exported']())
        print(f'round {round_index + 1}: ' + line('capsjax.onnx', mode, args.batch, rates['capsjax.onnx', mode][-1]))
      for name in peers:
        if mode not in PEERS[name][1] or name in failed:
          continue
        try:
          rate = measure_torch(args.torch_script, args.batch, args.steps, mode == 'infer', args.torch_precision,
                               args.input_shape, PEERS[name][0])
        except RuntimeError as e:   # e.g. torch.compile without a C++ compiler: the row is left out
          print(f'peer {name}: not measured ({e})')
          failed.add(name)
          continue
        rates[name, mode].append(rate)
        print(f'round {round_index + 1}: ' + line(name, mode, args.batch, rate))
  rates = {key: values for key, values in rates.items() if values and key[0] not in failed}
  medians = {key: statistics.median(values) for key, values in rates.items()}
  ratios = {'train': 'NA', 'infer': 'NA'}
  best = {}
  for mode in ('train', 'infer'):
    print('median ' + line('jax', mode, args.batch, medians['jax', mode], memory[mode]))
    if ('capsjax.onnx', mode) in medians:
      per_round = [ours / theirs for ours, theirs in zip(rates['jax', mode], rates['capsjax.onnx', mode])]
      print('median ' + line('capsjax.onnx', mode, args.batch, medians['capsjax.onnx', mode]) +
            f'  → capsjax/capsjax.onnx = {statistics.median(per_round):.2f} (the exported file, ONNX Runtime)')
    mode_peers = [name for name in peers if (name, mode) in medians]
    for name in mode_peers:
      per_round = [ours / theirs for ours, theirs in zip(rates['jax', mode], rates[name, mode])]
      ratio = statistics.median(per_round)
      if name == 'torch':
        ratios[mode] = f'{ratio:.2f}'
      print('median ' + line(name, mode, args.batch, medians[name, mode]) +
            f'  → capsjax/{name} = {ratio:.2f} (rounds {min(per_round):.2f}–{max(per_round):.2f})')
    if mode_peers:
      fastest = max(mode_peers, key=lambda name: medians[name, mode])
      best[mode] = (fastest, statistics.median(
          [ours / theirs for ours, theirs in zip(rates['jax', mode], rates[fastest, mode])]))
      print(f'{mode}: the fastest peer row is {fastest}; capsjax is {best[mode][1]:.2f}× it')
  if args.profile:   # after the timed rounds: the traced calls never share the machine with a peer
    programs['state'] = profile_parts(programs['train_step'], programs['state'], programs['host_batch'],
                                      programs['infer'], programs['images'], peak=peak)
  print(f'max resident memory of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB')
  best_words = ' '.join(f'best_peer_{mode}={best[mode][0] if mode in best else "NA"} '
                        f'best_peer_{mode}_ratio={f"{best[mode][1]:.2f}" if mode in best else "NA"}'
                        for mode in ('train', 'infer'))
  print(f'throughput train_images_per_s={medians["jax", "train"]:.1f} '
        f'infer_images_per_s={medians["jax", "infer"]:.1f} '
        f'torch_train_ratio={ratios["train"]} torch_infer_ratio={ratios["infer"]} {best_words}')


if __name__ == '__main__':
  main()
