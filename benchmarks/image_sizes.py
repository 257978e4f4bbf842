"""CapsNets on images of 28–224 px: parameters, peak memory and images/s, in one run.

  python benchmarks/image_sizes.py [--sizes 28,64,128,224] [--batch 8] [--steps 2] [--out FILE.md]

Two tables (markdown on stdout, and in --out):

1. The class-capsule layer alone, on the primary capsules of the paper's two
   convolutions at each size (1 152 at 28 px … 346 112 at 224 px), forward + backward at
   --batch: the paper's per-capsule W_ij (û materialised), per-type transforms with û
   materialised, and per-type transforms routed without û (capsjax.routing.
   shared_dynamic_routing). XLA's memory analysis of the compiled program (arguments +
   outputs + temporaries), milliseconds per batch, and the largest difference between
   the two per-type forms' outputs (the same math).
2. Whole models at each size, grey and RGB, each in its own process (so that its peak
   resident memory is its own): the paper's model (where it fits the --limit_s), per-type
   transforms on the paper's convolutions (materialised and factored; transposed-
   convolution decoder), the model `images` chooses (capsjax.sizing), and the PyTorch peer
   (benchmarks/torch_capsnet.py: the paper's model) where it fits. Parameters, XLA's
   memory analysis of the training step, the process's peak RSS, and training / inference
   images/s (Adam, margin + reconstruction loss, --steps timed after a warm-up).
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VARIANTS = {
    # name → model keys over the paper's (capsjax.defaults.capsnet_config)
    'paper': dict(transforms='per_capsule', stem='none', decoder='dense'),
    'per_type materialised': dict(transforms='per_type', votes='materialised', stem='none', decoder='deconv'),
    'per_type factored': dict(transforms='per_type', votes='factored', stem='none', decoder='deconv'),
    'chosen by images': dict(transforms='auto', stem='auto', decoder='auto'),
}


def layer_row(size: int, batch: int, steps: int) -> dict:
  """Table 1's row at `size` px (grey: the layer does not see the channels): the model's
  own CapsuleLayer in its three forms, on random squashed primary capsules."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp
  from benchmarks.timing import buffer_bytes, seconds_per_call
  from capsjax.defaults import capsnet_config
  from capsjax.layers import CapsuleLayer
  from capsjax.models import count_params, primary_grid
  from capsjax.routing import squash
  model = capsnet_config()
  model.input_shape = (size, size, 1)
  grid = primary_grid(model)
  in_caps = grid[0] * grid[1] * model.primary_types
  capsules = squash(jax.random.normal(jax.random.key(0), (batch, in_caps, model.primary_dim)))   # [batch, in, dim]
  forms = {'paper (per-capsule W, û)': dict(transforms='per_capsule'),
           'per-type W, û materialised': dict(transforms='per_type', votes='materialised'),
           'per-type W, factored': dict(transforms='per_type', votes='factored')}
  row = {'size': size, 'primary_capsules': in_caps}
  outputs = {}
  for name, form in forms.items():
    layer = CapsuleLayer(model.num_classes, model.digit_dim, types=model.primary_types, **form)
    apply = lambda params, u, layer=layer: layer.apply({'params': params}, u, grid=grid)
    params = layer.init(jax.random.key(1), capsules[:1], grid=grid)['params']
    step = jax.jit(jax.value_and_grad(lambda params, u, apply=apply: jnp.sum(apply(params, u)[1]), argnums=(0, 1)))
    row[name] = {'xla_bytes': buffer_bytes(step, params, capsules),
                 'ms_per_batch': 1e3 * seconds_per_call(step, (params, capsules), steps),
                 'params': count_params(params)}
    if form['transforms'] == 'per_type':   # the same initial W (same key and shape): equal outputs expected
      outputs[name] = jax.jit(apply)(params, capsules)[0]
    del params
  materialised, factored = outputs.values()
  row['max_difference'] = float(jnp.max(jnp.abs(materialised - factored)))
  return row


def model_row(size: int, channels: int, variant: str, batch: int, steps: int) -> dict:
  """Table 2's row, in this process."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp
  import optax
  from benchmarks.timing import compiled_buffer_bytes, seconds_per_call, seconds_per_step
  from capsjax import assemble, defaults
  from capsjax.losses import capsnet_loss
  from capsjax.models import build_model, count_params
  config = defaults.base_config()
  config.model.input_shape = (size, size, channels)
  config.batch_size = batch
  config.model.update(VARIANTS[variant])
  config, _ = assemble.choose_model(config)
  model = build_model(**config.model)
  key = jax.random.key(0)
  images = jax.random.uniform(key, (batch, size, size, channels))
  labels = jax.random.randint(jax.random.fold_in(key, 1), (batch,), 0, 10)
  targets = jax.nn.one_hot(labels, 10)
  params = model.init(key, images[:1])['params']
  optimizer = optax.adam(1e-3)
  state = (params, optimizer.init(params))

  def train_step(state, images, targets):
    params, opt_state = state

    def loss_fn(params):
      outputs = model.apply({'params': params}, images, targets)
      return jnp.mean(capsnet_loss(outputs['lengths'], targets, outputs['reconstructions'], images)[0])
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  infer = jax.jit(lambda params, images: model.apply({'params': params}, images, method='classify')[1])
  train = jax.jit(train_step, donate_argnums=(0,))
  compiled = train.lower(state, images, targets).compile()
  row = {'size': size, 'channels': channels, 'variant': variant, 'params': count_params(params),
         'model': {k: config.model[k] for k in ('stem', 'transforms', 'decoder')},
         'xla_train_bytes': compiled_buffer_bytes(compiled)}
  train_seconds, state = seconds_per_step(compiled, state, (images, targets), steps)
  row['train_images_per_s'] = batch / train_seconds
  row['infer_images_per_s'] = batch / seconds_per_call(infer, (state[0], images), steps)
  return row


def torch_row(size: int, channels: int, batch: int, steps: int) -> dict:
  """The PyTorch peer (the paper's model) at this size, training then inference."""
  import contextlib  # pylint: disable=g-import-not-at-top
  import io
  from benchmarks import torch_capsnet
  out = {}
  for mode in ('train', 'infer'):
    argv = ['torch_capsnet.py', '--batch', str(batch), '--steps', str(steps), '--input_shape',
            f'{size},{size},{channels}'] + (['--infer'] if mode == 'infer' else [])
    printed = io.StringIO()
    saved, sys.argv = sys.argv, argv
    try:
      with contextlib.redirect_stdout(printed):
        torch_capsnet.main()
    finally:
      sys.argv = saved
    out[f'{mode}_images_per_s'] = float(printed.getvalue().split('images_per_s=')[1].split()[0])
  return out


def peak_resident_bytes() -> int:
  """This process's peak resident memory (VmHWM: its own address space's high-water mark;
  getrusage's ru_maxrss would include the parent's size at fork)."""
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith('VmHWM:'):
        return int(line.split()[1]) * 1024
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def in_subprocess(args, limit_s: float) -> dict:
  """One measurement in a fresh process: its JSON row plus its peak RSS, or why not."""
  command = [sys.executable, os.path.abspath(__file__), '--one', json.dumps(args)]
  try:
    result = subprocess.run(command, capture_output=True, text=True, timeout=limit_s)
  except subprocess.TimeoutExpired:
    return {'skipped': f'over {limit_s:.0f} s'}
  if result.returncode != 0:
    last = (result.stderr.strip().splitlines() or ['?'])[-1]
    return {'skipped': last[:120]}
  return json.loads(result.stdout.strip().splitlines()[-1])


def one(args: dict) -> None:
  """--one: a single measurement; prints its JSON row with this process's peak RSS."""
  if args['kind'] == 'model':
    row = model_row(args['size'], args['channels'], args['variant'], args['batch'], args['steps'])
  else:
    row = torch_row(args['size'], args['channels'], args['batch'], args['steps'])
  row['peak_rss_bytes'] = peak_resident_bytes()
  print(json.dumps(row))


def gb(value) -> str:
  return '—' if value is None or value < 0 else f'{value / 1e9:.2f}'


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--sizes', default='28,64,128,224')
  parser.add_argument('--channels', default='1,3')
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--steps', type=int, default=2)
  parser.add_argument('--limit_s', type=float, default=300, help='per whole-model measurement')
  parser.add_argument('--variants', default=','.join(VARIANTS))
  parser.add_argument('--no_torch', action='store_true')
  parser.add_argument('--skip_layer', action='store_true')
  parser.add_argument('--out', default='')
  parser.add_argument('--one', default='', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.one:
    one(json.loads(args.one))
    return
  from capsjax import runtime  # pylint: disable=g-import-not-at-top
  sizes = [int(s) for s in args.sizes.split(',')]
  lines = [f'# CapsNets at 28–224 px ({runtime.device_name()}, {os.cpu_count()} cores, '
           f'{time.strftime("%Y-%m-%d")}; `python benchmarks/image_sizes.py --batch {args.batch} --steps {args.steps}`)', '']
  if not args.skip_layer:
    lines += [f'## The class-capsule layer, forward + backward at batch {args.batch} (XLA memory analysis, GB; ms)', '',
              '| size | primary capsules | paper W_ij: params / GB / ms | per-type, û: GB / ms | per-type, factored: GB / ms '
              '| factored vs û: max difference |', '|---|---|---|---|---|---|']
    for size in sizes:
      row = layer_row(size, args.batch, args.steps)
      paper, mat, fac = (row[k] for k in ('paper (per-capsule W, û)', 'per-type W, û materialised',
                                          'per-type W, factored'))
      lines.append(f'| {size} | {row["primary_capsules"]:,} | {paper["params"]:,} / {gb(paper["xla_bytes"])} / '
                   f'{paper["ms_per_batch"]:.0f} | {gb(mat["xla_bytes"])} / {mat["ms_per_batch"]:.0f} | '
                   f'{gb(fac["xla_bytes"])} / {fac["ms_per_batch"]:.0f} | {row["max_difference"]:.1e} |')
      print(lines[-1], flush=True)
    lines.append('')
  lines += [f'## Whole models, training step at batch {args.batch} (Adam, margin + reconstruction)', '',
            '| size | variant | stem / transforms / decoder | params | XLA train GB | peak RSS GB | train img/s '
            '| infer img/s |', '|---|---|---|---|---|---|---|---|']
  for size in sizes:
    for channels in (int(c) for c in args.channels.split(',')):
      shape = f'{size}×{size}×{channels}'
      for variant in args.variants.split(','):
        row = in_subprocess(dict(kind='model', size=size, channels=channels, variant=variant, batch=args.batch,
                                 steps=args.steps), args.limit_s)
        if 'skipped' in row:
          lines.append(f'| {shape} | {variant} | | | | | {row["skipped"]} | |')
        else:
          model = row['model']
          lines.append(f'| {shape} | {variant} | {model["stem"]} / {model["transforms"]} / {model["decoder"]} | '
                       f'{row["params"]:,} | {gb(row["xla_train_bytes"])} | {gb(row["peak_rss_bytes"])} | '
                       f'{row["train_images_per_s"]:.1f} | {row["infer_images_per_s"]:.1f} |')
        print(lines[-1], flush=True)
      if not args.no_torch:
        row = in_subprocess(dict(kind='torch', size=size, channels=channels, batch=args.batch, steps=args.steps),
                            args.limit_s)
        lines.append(f'| {shape} | PyTorch peer (paper) | none / per_capsule / dense | | | '
                     + (f'| {row["skipped"]} | |' if 'skipped' in row else
                        f'{gb(row["peak_rss_bytes"])} | {row["train_images_per_s"]:.1f} | '
                        f'{row["infer_images_per_s"]:.1f} |'))
        print(lines[-1], flush=True)
  text = '\n'.join(lines) + '\n'
  if args.out:
    with open(args.out, 'w') as f:
      f.write(text)
  print(text)


if __name__ == '__main__':
  main()
