"""Which formulation of the same math runs on which backend: one table, from measurements.

A model option set to 'auto' (`conv_impl`, `patches_inference`, `routing_loop`) resolves
here, by the backend JAX runs on. Every entry names the measurement behind it; an entry nobody has measured
says so. `python benchmarks/device_report.py` measures every formulation on a backend in
one run: change an entry when a report says so, and name that report.
"""
import jax

CONV_IMPLS = ('auto', 'xla', 'patches')
ROUTING_LOOPS = ('auto', 'rolled', 'unrolled')
# The im2col ('patches') convolution without gradients: a few images at a time
# (capsjax.ops.PATCHES_CHUNK, through lax.map) or the whole batch as one matmul.
PATCHES_INFERENCE = ('auto', 'chunked', 'whole_batch')
# What the convolutions' matmuls take in: float32, or bfloat16-rounded inputs accumulated
# in float32 with float32 outputs (twice XLA:CPU's float32 matmul rate on CPUs with
# AVX-512 BF16; docs/results.md "CPU speed"). Not the same values: an accuracy choice.
CONV_INPUTS = ('float32', 'bfloat16')

FASTEST = {
    'cpu': {
        # 2-core x86-64 CPU, paper model, batch 128 (BUILD.md "Formulations per backend", docs/results.md): PrimaryCaps
        # forward+backward 1.4 s as patches vs 28 s with XLA's convolution.
        'conv_impl': 'patches',
        # 2-core x86-64 CPU, PrimaryCaps forward at batch 128 (capsjax.ops.patches_conv2d):
        # 325 ms in chunks of 16 images against 533 ms as one matmul (the whole batch's
        # 382 MB patch matrix is memory traffic; a chunk's stays in cache). Whole model,
        # 2026-11-23, `device_report.py --only 'capsjax patches (float32|bfloat16) rolled|
        # whole-batch'`: inference 237.7 images/s chunked vs 162.9 whole-batch (float32).
        'patches_inference': 'chunked',
        # 2-core x86-64 CPU, paper model, batch 128, 2026-11-23, two runs of
        # `device_report.py --only 'capsjax patches float32'` (docs/results.md "GPU readiness"):
        # training 79.4 / 64.4 images/s rolled vs 80.5 / 66.3 unrolled, inference 272 / 233
        # vs 289 / 235: within the repeats' spread, so the design card's rolled loop.
        'routing_loop': 'rolled',
    },
    'gpu': {
        # One H100, 2026-11-23 (the GPU-speed issue): patches trained at 34.4k images/s
        # against 24.7k for XLA's convolution.
        'conv_impl': 'patches',
        # Not measured on a GPU yet (the device report's 'capsjax patches whole-batch
        # inference' row against the 'patches float32' rows decides): chunks run one after
        # another in lax.map, which may leave an H100 idle; the CPU's choice until then.
        'patches_inference': 'chunked',
        # Not measured on a GPU yet: the rolled loop until a device report says otherwise.
        'routing_loop': 'rolled',
    },
    'tpu': {
        # Not measured on a TPU: XLA's own convolution (the TPU's native op).
        'conv_impl': 'xla',
        # Not measured on a TPU (read only where conv_impl='patches' is asked for).
        'patches_inference': 'chunked',
        # Not measured on a TPU.
        'routing_loop': 'rolled',
    },
}


def resolve(option: str, value: str, backend: str = '') -> str:
  """`value` of model option `option`, with 'auto' replaced by FASTEST[backend][option]
  (backend: JAX's default backend unless given; an unknown backend uses the CPU's entry)."""
  allowed = {'conv_impl': CONV_IMPLS, 'patches_inference': PATCHES_INFERENCE, 'routing_loop': ROUTING_LOOPS}[option]
  if value not in allowed:
    raise ValueError(f'{option} must be one of {allowed}, got {value!r}')
  if value != 'auto':
    return value
  backend = backend or jax.default_backend()
  return FASTEST.get(backend, FASTEST['cpu'])[option]


# Explicit choices measured several times slower than another formulation on a backend:
# (option, value, backend) → why. A run that asks for one says so in one line at start
# (capsjax.train); `auto` never resolves to one (tests/test_models.py checks).
SLOW_CHOICES = {
    ('conv_impl', 'xla', 'cpu'): (
        "XLA:CPU's strided-convolution gradient trained the paper's model 20-24x slower than "
        "'patches' (AMD EPYC 2026-11-23, Intel Xeon 2026-11-24; docs/results.md)"),
    ('dtype', 'bfloat16', 'cpu'): (
        'bfloat16 outputs take a slow XLA:CPU path (training 2.5x slower than float32 on an Intel Xeon, '
        "2026-11-24); model.conv_inputs='bfloat16' gets the bfloat16 matmul rate with float32 outputs"),
    ('dtype', 'float16', 'cpu'): 'XLA:CPU has no fast float16 matmul; float32 is faster',
}


def slow_choices(model_config, backend: str = '') -> list:
  """One line per option of `model_config` (a mapping: the config's model) set to a value
  that SLOW_CHOICES lists for `backend` (default: JAX's)."""
  backend = backend or jax.default_backend()
  lines = []
  for (option, value, slow_backend), why in SLOW_CHOICES.items():
    if slow_backend == backend and str(model_config.get(option, '')) == value:
      lines.append(f'note: model.{option}={value!r} on this {backend.upper()} is slow: {why}.')
  return lines
