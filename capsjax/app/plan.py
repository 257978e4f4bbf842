"""Plan a run on TPUs or GPUs that are not here: `capsjax-plan` (also `python -m capsjax.app.plan`).

  capsjax-plan --experiment=mnist --target=v5e:16x16 [--config.KEY=VALUE …]
  capsjax-plan --experiment=mnist --target=v5litepod-256      # Cloud's accelerator-type name
  capsjax-plan --experiment=mnist --target=h100:8             # 8 H100s in one host (h100:2x8: two hosts)
  capsjax-plan --target=list                                  # what can be described here

The run's own jitted training step and evaluation step (capsjax.experiment.build_program: the
same config, shardings and donation as `train_and_evaluate`) are lowered from shapes alone
and compiled by the real compiler for compile-only devices (`jax.experimental.topologies`):
a TPU topology that libtpu describes, or NVIDIA GPUs that JAX's CUDA plugin compiles for
from a device description written here from NVIDIA's published figures (`GPUS`), with every
formulation that the config leaves at 'auto' chosen for that platform
(capsjax.formulations.for_platform). Nothing is placed or run. The report gives, per
device: the compiled program's memory against the device's memory, the FLOPs and bytes of
memory traffic, the collectives in the compiled HLO, an estimated step time (a roofline
from the chip's published figures: an estimate, never a measurement), and the largest
per-device batch that fits, from compilations. `capsjax.plan_run(config, target)` is the
same in Python. TPUs need libtpu (`pip install 'capsjax[tpu]'`), GPUs the CUDA plugin and
ptxas in a folder of their own (`gpu_install()` says the command).
"""
import dataclasses
import math
import os
import re
import shlex
import signal
import sys
import threading
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import ml_collections

from capsjax import console
from capsjax.app import cli
from capsjax.errors import ConfigError

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation's or GPU's published figures, per chip."""
  kind: str                  # as jax names its devices' kind
  hbm_bytes: float
  hbm_bytes_per_s: float
  bf16_flops_per_s: float    # peak dense bf16 (what the MXUs / tensor cores do)
  # What one chip sends per second in an all-reduce: the pod's published all-reduce bandwidth
  # over its chips, or half the bidirectional inter-chip interconnect bandwidth (NVLink).
  allreduce_bytes_per_s: float
  source: str
  platform: str = 'tpu'
  # Float32 matmuls in bf16-rate passes, at JAX's default precision and at 'highest': a TPU
  # runs the default as one bf16 pass and 'highest' as about 6; a GPU the default as TF32
  # (half the bf16 rate) and 'highest' on its float32 units.
  float32_passes: Tuple[float, float] = (1.0, 6.0)
  # The share of the memory JAX lets a run use: on a GPU it preallocates 75 %
  # (XLA_PYTHON_CLIENT_MEM_FRACTION's default).
  usable_fraction: float = 1.0
  # GPUs: what one GPU sends per second to another host (its network adapter), and the
  # device description XLA compiles for (GpuDeviceInfoProto's fields besides memory).
  interhost_bytes_per_s: Optional[float] = None
  device_info: Optional[Tuple[Tuple[str, Any], ...]] = None


# Cloud TPU's documentation pages (docs.cloud.google.com/tpu/docs/<generation>), read 2026-11-25.
CHIPS = {
    'v3': Chip('TPU v3', 32 * GIB, 900e9, 123e12, 340e12 / 1024,
               'tpu/docs/v3: 123 TFLOPs bf16, 32 GiB at 900 GBps; all-reduce 340 TB/s per 1024-chip pod'),
    'v4': Chip('TPU v4', 32 * GIB, 1200e9, 275e12, 1.1e15 / 4096,
               'tpu/docs/v4: 275 TFLOPs bf16, 32 GiB at 1200 GBps; all-reduce 1.1 PB/s per 4096-chip pod'),
    'v5e': Chip('TPU v5 lite', 16e9, 819e9, 197e12, 51.2e12 / 256,
                'tpu/docs/v5e: 197 TFLOPs bf16, 16 GB at 819 GBps; all-reduce 51.2 TB/s per 256-chip pod'),
    'v5p': Chip('TPU v5', 95 * GIB, 2765e9, 459e12, 1200e9 / 2,
                'tpu/docs/v5p: 459 TFLOPs bf16, 95 GiB at 2765 GBps; ICI 1200 GBps bidirectional'),
    'v6e': Chip('TPU v6 lite', 32e9, 1638e9, 918e12, 102.4e12 / 256,
                'tpu/docs/v6e: 918 TFLOPs bf16, 32 GB at 1638 GBps; all-reduce 102.4 TB/s per 256-chip pod'),
    'tpu7x': Chip('TPU7x', 192 * GIB, 7380e9, 2307e12, 1200e9 / 2,
                  'tpu/docs/tpu7x: 2307 TFLOPs bf16, 192 GiB at 7380 GB/s; ICI 1200 GB/s bidirectional'),
}
# NVIDIA's published figures: the H100 and H200 SXM data sheets, the CUDA C++ Programming
# Guide's limits for compute capability 9.0 and the Hopper tuning guide (written down
# 2026-11-25 on a machine that cannot reach them: the device report on a GPU checks
# its SMs and compute capability). Both are Hopper GPUs of 132 SMs; their memory differs.
_HOPPER_SXM = (('threads_per_block_limit', 1024), ('threads_per_warp', 32),
               ('shared_memory_per_block', 48 * 1024), ('shared_memory_per_core', 228 * 1024),
               ('threads_per_core_limit', 2048), ('core_count', 132), ('fpus_per_core', 128),
               ('block_dim_limit_x', 2 ** 31 - 1), ('block_dim_limit_y', 65535), ('block_dim_limit_z', 65535),
               ('l2_cache_size', 50 * 2 ** 20), ('clock_rate_ghz', 1.98),
               ('shared_memory_per_block_optin', 227 * 1024), ('registers_per_core_limit', 65536),
               ('registers_per_block_limit', 65536))
GPUS = {
    'h100': Chip('NVIDIA H100 80GB HBM3', 80 * GIB, 3.35e12, 989e12, 900e9 / 2,
                 'H100 SXM data sheet: 989 TFLOPS bf16 dense, 67 float32, 80 GB at 3.35 TB/s; NVLink 900 GB/s',
                 platform='gpu', float32_passes=(2.0, 989 / 67), usable_fraction=0.75,
                 interhost_bytes_per_s=400e9 / 8, device_info=_HOPPER_SXM),
    'h200': Chip('NVIDIA H200', 141 * GIB, 4.8e12, 989e12, 900e9 / 2,
                 'H200 SXM data sheet: 989 TFLOPS bf16 dense, 67 float32, 141 GB at 4.8 TB/s; NVLink 900 GB/s',
                 platform='gpu', float32_passes=(2.0, 989 / 67), usable_fraction=0.75,
                 interhost_bytes_per_s=400e9 / 8, device_info=_HOPPER_SXM),
}
# Whole training steps measured on an H100 and an H200 over this module's estimate of the same step
# compiled here (docs/results.md, "GPU speed"): one model and three
# vmapped seeds on an H100 (2026-11-25), one model and twelve recipe members with their
# data pipeline on an H200 (2026-11-28). The estimate counts traffic and FLOPs at the peak;
# the ≈ 100–150 kernels' launches and tails, and a leg's pipeline, it does not.
MEASURED_OVER_ESTIMATE = {'gpu': (2.6, 6.3, 'an H100 on 2026-11-25 and an H200 on 2026-11-28')}
# An HGX board's GPUs share one NVLink domain; between hosts each GPU has its own 400 Gb/s
# adapter (the DGX H100 / H200 design), which `interhost_bytes_per_s` is.
GPUS_PER_HOST = 8
# What the CUDA plugin is told besides the device (jaxlib 0.10's CUDA 12 plugin: cuDNN ≥ 9.8).
_GPU_SOFTWARE = 'platform_name: "CUDA"\ndnn_version_info { major: 9 minor: 8 }\nruntime_version { major: 12 minor: 9 }\n'

# TPU generations whose topologies are compiled with both TensorCores of a chip as one
# device (megacore), as JAX runs them on those chips.
MEGACORE = ('v4', 'v5p')

# Cloud's accelerator types → topologies. v5litepod-N and v6e-N count chips; v2/v3/v4/v5p-N
# count TensorCores (two per chip).
_TWO_D = {1: '1x1', 4: '2x2', 8: '2x4', 16: '4x4', 32: '4x8', 64: '8x8', 128: '8x16', 256: '16x16',
          512: '16x32', 1024: '32x32'}
_THREE_D = {4: '2x2x1', 8: '2x2x2', 16: '2x2x4', 32: '2x4x4', 64: '4x4x4', 128: '4x4x8', 256: '4x8x8',
            512: '8x8x8', 1024: '8x8x16', 2048: '8x16x16', 4096: '16x16x16', 6144: '16x16x24'}
ACCELERATOR_TYPES = {  # prefix → (generation, chips per count unit, chip shapes)
    'v5litepod': ('v5e', 1, _TWO_D), 'v6e': ('v6e', 1, _TWO_D),
    'v3': ('v3', 2, _TWO_D), 'v4': ('v4', 2, _THREE_D), 'v5p': ('v5p', 2, _THREE_D),
}
_TOPOLOGY = re.compile(r'^(v2|v3|v4|v5e|v5p|v6e|tpu7x):(\d+(?:x\d+){1,2})$', re.ASCII)
_ACCELERATOR_TYPE = re.compile(r'^(v5litepod|v6e|v3|v4|v5p)-(\d+)$', re.ASCII)
_GPU = re.compile(r'^(' + '|'.join(GPUS) + r')(?::(?:(\d+)x)?(\d+))?$', re.ASCII)
LIST_EXAMPLES = ('v5e:2x2', 'v5e:4x4', 'v5e:16x16', 'v4:2x2x4', 'v5p:4x4x4', 'v6e:16x16', 'v3:4x4', 'tpu7x:2x2x1')
GPU_EXAMPLES = ('h100', 'h100:8', 'h100:4x8', 'h200:8')
INSTALL = "pip install 'capsjax[tpu]' (libtpu, as jax[tpu] pins it)"
# JAX's CUDA plugin and ptxas in a folder of their own beside the environment (installed
# into it, the plugin would log its failed start into every JAX process of a machine
# without a GPU driver): capsjax-plan puts the folder on its path for GPU plans only.
GPU_PLAN_ENV = 'CAPSJAX_GPU_PLAN'


def gpu_plan_folder() -> str:
  """Where capsjax-plan looks for the CUDA plugin: $CAPSJAX_GPU_PLAN, else
  ~/.cache/capsjax/gpu-plan."""
  return os.path.expanduser(os.environ.get(GPU_PLAN_ENV) or os.path.join('~', '.cache', 'capsjax', 'gpu-plan'))


def use_gpu_plan_folder() -> None:
  """The plugin's folder on this process's path (before JAX looks for plugins), if it exists."""
  folder = gpu_plan_folder()
  if os.path.isdir(folder) and folder not in sys.path:
    sys.path.insert(0, folder)


def gpu_install() -> str:
  """The command that installs what GPU plans add, next to this environment."""
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  try:
    version = f'=={importlib.metadata.version("jaxlib")}'
  except importlib.metadata.PackageNotFoundError:
    version = ''
  return (f'pip install --no-deps --target {gpu_plan_folder()} jax-cuda12-plugin{version} '
          f'jax-cuda12-pjrt{version} nvidia-cuda-nvcc-cu12 (JAX\'s CUDA plugin without the CUDA libraries, and '
          f'ptxas, in a folder of their own that capsjax-plan finds; ${GPU_PLAN_ENV} names another)')


@dataclasses.dataclass(frozen=True)
class Target:
  name: str          # as given
  generation: str    # 'v5e', 'h100'
  topology: str      # '4x4'; a GPU's 'HOSTSxGPUS' ('1x8')
  chip: Chip

  @property
  def topology_name(self) -> str:
    return f'{self.generation}:{self.topology}'

  @property
  def chips(self) -> int:
    return math.prod(int(side) for side in self.topology.split('x'))

  @property
  def platform(self) -> str:
    return self.chip.platform


def _parse_gpu_target(name: str, match) -> Target:
  generation, hosts, gpus = match.group(1), int(match.group(2) or 1), int(match.group(3) or 1)
  if hosts < 1:
    raise ConfigError(f'--target={name}: HOSTSxGPUS needs at least one host, e.g. {generation}:2x8')
  if not 1 <= gpus <= GPUS_PER_HOST:
    raise ConfigError(f'--target={name}: a host holds 1 to {GPUS_PER_HOST} {generation.upper()}s; give '
                      f'HOSTSxGPUS for more, e.g. {generation}:4x8')
  return Target(name, generation, f'{hosts}x{gpus}', GPUS[generation])


def parse_target(name: str) -> Target:
  """A target by the names people use: 'v5e:4x4' (topology), 'v5litepod-16' (Cloud's
  accelerator type), 'h100', 'h100:8' or 'h100:2x8' (GPUs: one, one host's eight, two
  hosts of eight); ConfigError naming the forms otherwise."""
  if not isinstance(name, str):   # (None and numbers met `.strip()`: an AttributeError)
    raise ConfigError(f'--target={name!r}: a target is a name such as v5e:4x4, v5litepod-16 or h100:8; '
                      '--target=list shows them')
  name = name.strip()
  match = _GPU.match(name.lower())
  if match:
    return _parse_gpu_target(name, match)
  match = _TOPOLOGY.match(name)
  if match:
    generation, topology = match.groups()
  else:
    match = _ACCELERATOR_TYPE.match(name)
    if not match:
      raise ConfigError(f'--target={name!r}: not a TPU topology (e.g. v5e:4x4, v4:2x2x4, tpu7x:2x2x1), a '
                        'Cloud accelerator type (e.g. v5litepod-16, v4-32, v5p-128, v6e-256) nor GPUs (h100, '
                        'h100:8, h200:2x8); --target=list shows them')
    prefix, count = match.group(1), int(match.group(2))
    generation, per_unit, shapes = ACCELERATOR_TYPES[prefix]
    chips = count // per_unit
    if count % per_unit or chips not in shapes:
      raise ConfigError(f'--target={name}: capsjax knows no {generation} slice of {count} '
                        f'{"chips" if per_unit == 1 else "TensorCores"} (known: '
                        f'{", ".join(f"{prefix}-{c * per_unit}" for c in sorted(shapes))}); '
                        f'give the topology instead, e.g. {generation}:{shapes[sorted(shapes)[1]]}')
    topology = shapes[chips]
  if generation not in CHIPS:
    raise ConfigError(f'--target={name}: libtpu can compile for {generation}, but capsjax has no published '
                      f'figures for its chip (known: {", ".join(CHIPS)})')
  return Target(name, generation, topology, CHIPS[generation])


def require_libtpu() -> None:
  import importlib.util  # pylint: disable=g-import-not-at-top
  if importlib.util.find_spec('libtpu') is None:
    raise ConfigError(f'planning for a TPU needs libtpu, which is not installed: {INSTALL}')


def have_cuda_plugin() -> bool:
  """Whether JAX's CUDA 12 plugin is importable (gpu_install(), jax[cuda12] or capsjax[gpu-plan])."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  try:
    return importlib.util.find_spec('jax_plugins.xla_cuda12') is not None
  except ImportError:   # no jax_plugins package at all
    return False


def require_cuda_plugin() -> None:
  import importlib.util  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  if not have_cuda_plugin():
    raise ConfigError(f'planning for a GPU needs JAX\'s CUDA plugin, which is not installed: {gpu_install()}')
  if importlib.util.find_spec('nvidia.cuda_nvcc') is None and shutil.which('ptxas') is None:
    raise ConfigError(f'planning for a GPU needs ptxas (nvidia-cuda-nvcc-cu12), which is not installed: '
                      f'{gpu_install()}')


def gpu_target_config(chip: Chip) -> str:
  """The device description (XLA's GpuTargetConfigProto, text format) that the CUDA plugin
  compiles for: `chip`'s published figures, compute capability 9.0."""
  fields = dict(chip.device_info, memory_bandwidth=int(chip.hbm_bytes_per_s), device_memory_size=int(chip.hbm_bytes))
  lines = [f'  {key}: {value}' for key, value in fields.items()]
  return ('gpu_device_info {\n' + '\n'.join(lines) + '\n  cuda_compute_capability { major: 9 minor: 0 }\n}\n'
          + _GPU_SOFTWARE + f'device_description_str: "{chip.kind}"\n')


def _compile_only_gpus(target: Target):
  require_cuda_plugin()
  # The plugin's own start needs a driver; the compile-only devices need none. JAX stays on
  # the CPU here (capsjax-plan sets JAX_PLATFORMS=cpu before JAX starts) and the plugin is
  # only asked for a topology.
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  hosts, gpus = target.topology.split('x')
  try:
    return topologies.get_topology_desc(platform='cuda', topology=f'1x{hosts}x{gpus}',
                                        target_config=gpu_target_config(target.chip)).devices
  except Exception as e:  # pylint: disable=broad-except
    detail = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    raise ConfigError(f'--target={target.name}: JAX\'s CUDA plugin cannot describe {target.topology_name} '
                      f'({detail})') from None


def compile_only_devices(target: Target):
  """The compile-only devices of `target`'s topology (libtpu) or GPUs (the CUDA plugin), or
  ConfigError."""
  if target.platform == 'gpu':
    return _compile_only_gpus(target)
  require_libtpu()
  console.quiet_libtpu_environment()
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  options = {'chip_config_name': 'megacore'} if target.generation in MEGACORE else {}
  try:
    return topologies.get_topology_desc(topology_name=target.topology_name, platform='tpu', **options).devices
  except Exception as e:  # pylint: disable=broad-except
    detail = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    raise ConfigError(f'--target={target.name}: libtpu cannot describe the topology {target.topology_name} '
                      f'({detail})') from None


def available_topologies(names=LIST_EXAMPLES) -> List[str]:
  """Lines for --target=list: each example topology and whether it can be described here."""
  lines = []
  for name in names:
    target = parse_target(name)
    try:
      devices = compile_only_devices(target)
    except ConfigError as e:
      lines.append(f'  {name:12s} not available: {e}')
      continue
    lines.append(f'  {name:12s} {target.chips:4d} chips, {len(devices):4d} devices, '
                 f'{len({d.process_index for d in devices}):3d} hosts  ({devices[0].device_kind})')
  return lines


# ----------------------------------------------------------------------------- the compiled program

_DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1, 's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2,
                's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8, 'c64': 8, 'c128': 16}
_COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'collective-permute', 'all-to-all')
_SHAPE = re.compile(r'\b(' + '|'.join(_DTYPE_BYTES) + r')\[([\d,]*)\]')


def collectives(hlo_text: str) -> Dict[str, Tuple[int, int]]:
  """{kind: (count, bytes of their results)} of the collectives in a compiled HLO module
  (an async pair counted once, at its start)."""
  found: Dict[str, Tuple[int, int]] = {}
  for line in hlo_text.splitlines():
    match = re.search(r'=\s*(.*?)\s+(' + '|'.join(_COLLECTIVES) + r')(-start)?\(', line)
    if not match or re.search(r'(' + '|'.join(_COLLECTIVES) + r')-done\(', line):
      continue
    shapes = match.group(1)
    if match.group(3):   # the start of an async pair: ((operands), (results)) or one shape
      shapes = shapes.split('),', 1)[-1] if shapes.startswith('((') else shapes
    size = sum(_DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(',') if d)
               for dtype, dims in _SHAPE.findall(shapes))
    count, total = found.get(match.group(2), (0, 0))
    found[match.group(2)] = (count + 1, total + size)
  return found


# HLO instructions that launch no kernel of their own.
_NO_KERNEL = frozenset({'parameter', 'constant', 'bitcast', 'get-tuple-element', 'tuple', 'after-all', 'opt-barrier',
                        'partition-id', 'replica-id', 'while', 'call', 'conditional'})
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$')
_COMPUTATION = re.compile(r'^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$')


def _shape_bytes(shapes: str) -> int:
  return sum(_DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(',') if d)
             for dtype, dims in _SHAPE.findall(shapes))


def kernel_traffic(hlo_text: str) -> Tuple[int, int]:
  """(kernels launched, bytes they read and write) of a compiled GPU module: each kernel
  (a fusion, a library call, a copy, a collective …) reads its operands and writes its
  result once, as the memory traffic a roofline counts after fusion; a while loop's body
  counts its known trip count times (once where the count is not known)."""
  computations, name = {}, None
  for line in hlo_text.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      name = 'ENTRY' if match.group(1) else match.group(2)
      computations[name] = []
    elif line.startswith('}'):
      name = None
    elif name:
      computations[name].append(line)
  totals = [0, 0]

  def walk(computation, times):
    shapes = {}
    for line in computations.get(computation, ()):
      match = _INSTRUCTION.match(line)
      if not match:
        continue
      result, shape, op, rest = match.groups()
      shapes[result] = shape
      if op == 'while':
        body = re.search(r'body=%([\w.\-]+)', rest)
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
        if body:
          walk(body.group(1), times * (int(trips.group(1)) if trips else 1))
        continue
      if op in _NO_KERNEL or op.endswith('-done'):
        continue
      depth, end = 1, 0
      while depth and end < len(rest):
        depth += {'(': 1, ')': -1}.get(rest[end], 0)
        end += 1
      operands = re.findall(r'%([\w.\-]+)', rest[:end])
      totals[0] += times
      totals[1] += times * (_shape_bytes(shape) + sum(_shape_bytes(shapes.get(o, '')) for o in operands))

  walk('ENTRY', 1)
  return totals[0], totals[1]


def _hlo_flops(lowered, devices: int) -> float:
  """FLOPs per device of a lowered program, from XLA's HLO cost analysis of the program
  before it is partitioned, split evenly over the data-parallel devices: JAX's public
  `Lowered.cost_analysis()` where the lowering's backend gives one, else the CPU client's
  analysis of the same HLO (the CUDA plugin's compile-only devices give none; that call is
  private to JAX, so a JAX without it leaves the FLOPs unknown, 0, tests/test_plan.py).
  XLA counts a loop's body once: a rolled routing loop's iterations after the first are
  left out (a few % of the paper's step)."""
  flops = _public_flops(lowered)
  if flops is None:
    flops = _cpu_client_flops(lowered)
  return (flops or 0.0) / devices


def _public_flops(lowered) -> Optional[float]:
  try:
    cost = lowered.cost_analysis()
  except Exception:  # pylint: disable=broad-except  (a backend without cost analysis says so its own way)
    return None
  cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else (cost or {})
  flops = float(cost.get('flops', 0.0))
  return flops if flops > 0 else None


def _cpu_client_flops(lowered) -> Optional[float]:
  import jax  # pylint: disable=g-import-not-at-top
  try:
    from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top
    module = lowered._lowering.hlo().as_hlo_module()  # pylint: disable=protected-access
    cost = _jax.hlo_module_cost_analysis(jax.devices('cpu')[0].client, module)
  except (ImportError, AttributeError):   # a JAX whose private names moved: the FLOPs unknown
    return None
  return float(cost.get('flops', 0.0))


def analyse(compiled, lowered=None, devices: int = 1) -> Dict[str, Any]:
  """Per device: the compiled program's memory (arguments, outputs, temporaries, code; the
  donated state aliased), its FLOPs, bytes accessed and XLA's own time estimate, the
  collectives. A TPU's from XLA's cost analysis of the compiled program; a GPU's (whose
  compile-only devices give none) FLOPs from the lowered program's (`lowered`, split over
  `devices`) and bytes from its kernels (`kernel_traffic`, with their count)."""
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else (cost or {})
  text = compiled.as_text()
  kernels = None
  if not cost and lowered is not None:
    kernels, traffic = kernel_traffic(text)
    cost = {'flops': _hlo_flops(lowered, devices), 'bytes accessed': traffic}
  arguments, outputs = memory.argument_size_in_bytes, memory.output_size_in_bytes
  aliased, temporaries, code = memory.alias_size_in_bytes, memory.temp_size_in_bytes, memory.generated_code_size_in_bytes
  return {'arguments': arguments, 'outputs': outputs, 'aliased': aliased, 'temporaries': temporaries,
          'code': code, 'total': arguments + outputs - aliased + temporaries + code,
          'flops': float(cost.get('flops', 0.0)), 'bytes_accessed': float(cost.get('bytes accessed', 0.0)),
          # XLA's own estimate, where it gives a usable one (it has been negative).
          'xla_seconds': float(cost.get('optimal_seconds', 0.0)) if float(cost.get('optimal_seconds', 0.0)) > 0 else None,
          'kernels': kernels, 'collectives': collectives(text)}


@dataclasses.dataclass
class Plan:
  """What `plan_run` found: the target, the run's shape on it and its compiled programs."""
  target: Target
  devices: int
  hosts: int
  devices_per_chip: int
  global_batch: int
  eval_batch: int
  num_params: int
  param_bytes: int
  formulations: List[str]
  training: Dict[str, Any]
  evaluation: Dict[str, Any]
  compile_seconds: float
  largest_batch: Optional[Dict[str, Any]] = None
  model_choice: Optional[str] = None
  members: int = 1   # an ensemble's members, trained side by side on each batch (vmapped)
  batch_note: str = ''   # why the plan's batch is not the config's (a slice with more devices than it)
  num_steps: int = 0     # the run's training steps (its length at the estimated rate)

  @property
  def hbm_per_device(self) -> float:
    """The memory a run may use per device (a GPU's: the share JAX preallocates)."""
    chip = self.target.chip
    return chip.hbm_bytes * chip.usable_fraction / self.devices_per_chip

  def fits(self, analysis: Dict[str, Any]) -> bool:
    return analysis['total'] <= self.hbm_per_device

  def estimate(self, precision_passes: float = 1, training: Optional[Dict[str, Any]] = None,
               global_batch: Optional[int] = None) -> Dict[str, float]:
    """An estimated training step (seconds) from the chip's published figures: compute at the
    bf16 peak (float32 matmuls as `precision_passes` bf16 passes: Chip.float32_passes), or
    HBM traffic, whichever is longer, plus the gradient all-reduce over the interconnect (a
    ring: 2(n−1)/n of its bytes per device; GPUs on several hosts at their network
    adapter's rate), not overlapped. `training`, `global_batch`: another compiled step's
    analysis and batch (the largest batch's) instead of the configured one."""
    training = training or self.training
    global_batch = global_batch or self.global_batch
    chip, share = self.target.chip, self.devices_per_chip
    compute = precision_passes * training['flops'] / (chip.bf16_flops_per_s / share)
    memory = training['bytes_accessed'] / (chip.hbm_bytes_per_s / share)
    reduced = training['collectives'].get('all-reduce', (0, 0))[1]
    n = self.devices
    link = chip.interhost_bytes_per_s if self.hosts > 1 and chip.interhost_bytes_per_s else chip.allreduce_bytes_per_s
    network = (2 * (n - 1) / n * reduced / (link / share)) if n > 1 else 0.0
    step = max(compute, memory) + network
    # Images of all the ensemble's members: each sees the whole batch.
    return {'compute_s': compute, 'memory_s': memory, 'allreduce_s': network, 'step_s': step,
            'images_per_s': self.members * global_batch / step if step else float('inf')}


def _gb(value: float) -> str:
  return f'{value / 1e9:.2f} GB'


def report(plan: Plan, experiment: str, workdir_hint: str = '/mnt/shared/RUN', overrides: Sequence[str] = (),
           with_largest: bool = True, with_batch_note: bool = True) -> List[str]:
  """The plan as lines for the console; the launch line carries `overrides` (the
  command line's --config.KEY=VALUE, but the batch size the plan sets). `with_largest`:
  the largest-batch search's lines among them (largest_batch_lines); `with_batch_note`:
  why the plan's batch is not the config's (the command says it as the plan starts)."""
  target, chip = plan.target, plan.target.chip
  per_device = plan.global_batch // plan.devices
  platform = target.platform.upper()
  units, over = ('GPUs', 'GPUs') if platform == 'GPU' else ('chips', 'slice')   # what the lines call them
  lines = [
      f'target: {target.name} = {target.topology_name}: {target.chips} {units} of {chip.kind}, {plan.devices} devices ({plan.devices_per_chip} per chip), {plan.hosts} host{"s" if plan.hosts != 1 else ""}; '
      f'mesh data={plan.devices}',
      f'batch: {plan.global_batch} global, {per_device} per device (evaluation: {plan.eval_batch} global, '
      f'{-(-plan.eval_batch // plan.devices)} per device); {plan.num_params:,} parameters, {_gb(plan.param_bytes)} as '
      'float32' + (f'; {plan.members} ensemble members side by side (images/s below count each member\'s)'
                   if plan.members > 1 else ''),
      f'formulations for the {platform}: ' + '; '.join(plan.formulations),
  ]
  if plan.batch_note and with_batch_note:
    lines.append(plan.batch_note)
  if plan.model_choice:
    lines.append(plan.model_choice)
  usable = (f', {chip.usable_fraction:.0%} of {_gb(chip.hbm_bytes)}: what JAX preallocates'
            if chip.usable_fraction < 1 else '')
  lines.append(f'per device, from the compiled programs (HBM {_gb(plan.hbm_per_device)} per device{usable}; '
               f'{chip.source}):')
  for name, analysis in (('training step', plan.training), ('evaluation batch', plan.evaluation)):
    verdict = 'fits' if plan.fits(analysis) else 'DOES NOT FIT'
    lines.append(f'  {name:16s} arguments {_gb(analysis["arguments"])}, outputs {_gb(analysis["outputs"])} '
                 f'({_gb(analysis["aliased"])} of them donated), temporaries {_gb(analysis["temporaries"])}, code '
                 f'{_gb(analysis["code"])}: {_gb(analysis["total"])} = '
                 f'{100 * analysis["total"] / plan.hbm_per_device:.1f} % of HBM, {verdict}')
  training = plan.training
  if training.get('kernels') is None:
    lines.append(f'  training step: {training["flops"] / 1e9:.1f} GFLOP and {_gb(training["bytes_accessed"])} of '
                 'memory traffic (XLA\'s cost analysis)')
  else:
    lines.append(f'  training step: {training["flops"] / 1e9:.1f} GFLOP (XLA\'s cost analysis of the program), '
                 f'{training["kernels"]} kernels reading and writing {_gb(training["bytes_accessed"])} (each its '
                 f'operands and result once); an evaluation batch {plan.evaluation["kernels"]} kernels')
  moved = ', '.join(f'{count} {kind} ({_gb(size)})' for kind, (count, size) in sorted(training['collectives'].items()))
  lines.append(f'  collectives in the training step: {moved or "none"}; the gradients are '
               f'{_gb(plan.param_bytes)} (the parameters\' bytes)')
  default_passes, highest_passes = chip.float32_passes
  default, highest = plan.estimate(default_passes), plan.estimate(highest_passes)
  as_default = ('float32 matmuls as TF32, at half the bf16 peak' if platform == 'GPU'
                else 'float32 matmuls as one bf16 pass, JAX\'s default precision')
  lines.append(
      f'ESTIMATE (not a measurement): a training step ≈ {1e3 * default["step_s"]:.2f} ms → '
      f'{default["images_per_s"]:,.0f} images/s over the {over} (compute '
      f'{1e3 * default["compute_s"]:.2f} ms with {as_default}, HBM traffic {1e3 * default["memory_s"]:.2f} ms, '
      f'all-reduce {1e3 * default["allreduce_s"]:.2f} ms, not overlapped); '
      + (f'with float32 matmuls at \'highest\' precision (≈ {highest_passes:.0f} bf16 passes) ≈ '
         f'{1e3 * highest["step_s"]:.2f} ms → {highest["images_per_s"]:,.0f} images/s'
         if highest['step_s'] > default['step_s'] * 1.005 else
         'the same at \'highest\' float32 precision: the memory traffic, not the matmuls, sets the time')
      + (f'; XLA\'s own estimate {1e3 * training["xla_seconds"]:.2f} ms' if training['xla_seconds'] else ''))
  lines.append(measured_band(plan, default['step_s']))
  if with_largest:
    lines += largest_batch_lines(plan)
  kept = [shlex.quote(flag) for flag in overrides
          if not flag.startswith(('--config.batch_size=', '--config.distributed='))]
  batch = ''.join(f' {flag}' for flag in kept) + f' --config.batch_size={plan.global_batch}'
  lines += launch_lines(platform, plan.hosts, plan.devices // plan.hosts, experiment, workdir_hint, batch)
  lines += [f'(compiled in {plan.compile_seconds:.0f} s on this machine; XLA\'s analyses are an aid whose exact '
             'values may change between versions)']
  return lines


def launch_lines(platform: str, hosts: int, devices_per_host: int, experiment: str, workdir_hint: str,
                 flags: str) -> List[str]:
  """How to start the planned run: one process for one GPU host; under Slurm one task per
  GPU (JAX gives each detected task the GPU of its local rank), elsewhere one process per
  host with every GPU (--config.local_devices=all); on a TPU slice every host the same."""
  command = f'python run.py --experiment={experiment} --workdir={workdir_hint}'
  if platform == 'GPU' and hosts == 1:
    return ['launch (one process sees all the host\'s GPUs):', f'  {command}{flags}']
  command += f' --config.distributed=True{flags}'
  if platform == 'GPU':
    return [f'launch under Slurm (one task per GPU, {devices_per_host} on each of the {hosts} hosts; JAX reads the '
            'job):',
            f'  srun --nodes={hosts} --ntasks-per-node={devices_per_host} --gpus-per-node={devices_per_host} {command}',
            'launch elsewhere (one process per host, every GPU of it, its own process id):',
            f'  {command} --config.local_devices=all --config.coordinator_address=HOST0:1234 '
            f'--config.num_processes={hosts} --config.process_id=I']
  return ['launch (every host of the slice runs the same command):',
          '  gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --worker=all --command \\',
          f'    "cd capsjax && {command}"']


def measured_band(plan: Plan, step_s: float) -> str:
  """What the estimate has been worth: the whole steps measured on GPUs over it
  (MEASURED_OVER_ESTIMATE) applied to `step_s`, with the run's length at both ends; for a
  platform never measured, that its estimate is a floor."""
  platform = plan.target.platform
  if platform not in MEASURED_OVER_ESTIMATE:
    low, high, where = MEASURED_OVER_ESTIMATE['gpu']
    floor = (f'; the run\'s {plan.num_steps:,} steps take at least {console.format_duration(step_s * plan.num_steps)}, '
             f'≈ {console.format_duration(low * step_s * plan.num_steps)}–'
             f'{console.format_duration(high * step_s * plan.num_steps)} if the GPUs\' factors held here'
             if plan.num_steps else '')
    return (f'  (no {platform.upper()} has run capsjax against this estimate: take it as a floor; on GPUs the '
            f'measured steps took {low}–{high}× theirs, {where}){floor}')
  low, high, where = MEASURED_OVER_ESTIMATE[platform]
  length = (f'; the run\'s {plan.num_steps:,} steps ≈ {console.format_duration(low * step_s * plan.num_steps)}–'
            f'{console.format_duration(high * step_s * plan.num_steps)}' if plan.num_steps else '')
  return (f'  the estimate is a floor: measured steps took {low}–{high}× it ({where}; docs/results.md), so expect '
          f'≈ {1e3 * low * step_s:.2f}–{1e3 * high * step_s:.2f} ms a step{length}')


def largest_batch_lines(plan: Plan) -> List[str]:
  """The largest-batch search's lines of the report (none without a search)."""
  if not plan.largest_batch:
    return []
  largest, over = plan.largest_batch, 'GPUs' if plan.target.platform.upper() == 'GPU' else 'slice'
  default_passes = plan.target.chip.float32_passes[0]
  lines = [f'largest per-device batch that fits: {largest["per_device"]} ({largest["per_device"] * plan.devices} '
               f'global; {_gb(largest["total"])} of {_gb(plan.hbm_per_device)} compiled; from compilations at '
               f'{", ".join(str(b) for b in largest["tried"])} per device)'
               + ('; the whole training split: a larger batch would not fit an epoch' if largest['capped'] else '')]
  if largest.get('analysis'):
    at_largest = plan.estimate(default_passes, largest['analysis'], largest['per_device'] * plan.devices)
    lines.append(f'ESTIMATE at that batch (not a measurement): a training step ≈ {1e3 * at_largest["step_s"]:.2f} ms → '
                 f'{at_largest["images_per_s"]:,.0f} images/s over the {over} (compute '
                 f'{1e3 * at_largest["compute_s"]:.2f} ms, HBM traffic {1e3 * at_largest["memory_s"]:.2f} ms, '
                 f'all-reduce {1e3 * at_largest["allreduce_s"]:.2f} ms)')
    if plan.target.platform in MEASURED_OVER_ESTIMATE:   # (a TPU's floor is said under the first estimate)
      low, high, where = MEASURED_OVER_ESTIMATE[plan.target.platform]
      lines.append(f'  a floor too: the measured {low}–{high}× ({where}) were steps at the batch a single model '
                   f'trains at (128), not at this one; no larger batch has run against its estimate')
  return lines


# ----------------------------------------------------------------------------- the plan

def _zeros_loader(config):
  """Zeros of each split's size and image shape for a described dataset (nothing read), or
  None: the source itself, read lazily (image folders, other TFDS datasets)."""
  from capsjax.data.datasets import DATASETS  # pylint: disable=g-import-not-at-top
  from capsjax.data.sources import Dataset  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  described = DATASETS.get(config.dataset)
  if described is None or not all(described.split_sizes):
    return None
  sizes = dict(zip(('train', 'test'), described.split_sizes))
  # Labels of every class in turn: MultiMNIST pairs digits of two different classes.
  return lambda info, split: Dataset(np.zeros((sizes[split],) + tuple(info.image_shape), np.uint8),
                                     np.arange(sizes[split], dtype=np.int32) % info.num_classes)


def _program(config, mesh, platform: str):
  """The run built on `mesh`, whose devices are `platform`'s (capsjax.experiment.Experiment)."""
  from capsjax import experiment  # pylint: disable=g-import-not-at-top
  return experiment.start(config, mesh, platform=platform, loader=_zeros_loader(config), resolved=True)


def _silent(line: str) -> None:
  del line


def _compile(lowered, what: str, show: bool = True):
  """`lowered.compile()` on a worker thread, its elapsed time shown as it goes (a bar after
  a few seconds): the main thread stays free for a signal (capsjax-plan's SIGTERM or
  Ctrl-C end the plan at once, not after the compilation)."""
  outcome = {}

  def work():
    try:
      # Executables for compile-only devices cannot be read back from JAX's persistent cache
      # (no client to load them): a user's cache made a repeated plan warn "Error reading
      # persistent compilation cache entry … PjRtCompiler must be constructed with a Client".
      # capsjax-plan turns the cache off (main); a plan inside a caller's process leaves the
      # caller's setting alone and keeps the failed reads quiet.
      with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='Error reading persistent compilation cache entry')
        outcome['compiled'] = lowered.compile()
    except BaseException as e:  # pylint: disable=broad-except
      outcome['error'] = e

  worker = threading.Thread(target=work, name=f'compile {what}', daemon=True)
  started = time.time()
  worker.start()
  # In a log, a compilation's elapsed time once a minute (its line redraws in place on a terminal).
  with console.progress(what=f'compiling {what}', unit='s', total=None, disable=not show, log_every_s=60.0) as bar:
    bar.bar_format = '{desc}: {elapsed} so far'
    while worker.is_alive():
      worker.join(0.5)
      bar.update(int(time.time() - started) - bar.n)
  if 'error' in outcome:
    raise outcome['error']
  return outcome['compiled']


def out_of_memory(error: Exception) -> Optional[str]:
  """The compiler's own line where it refused a program for more memory than the device
  has (the TPU compiler does, where its temporaries exceed the HBM), else None."""
  text = str(error)
  return text.splitlines()[0][:200] if 'RESOURCE_EXHAUSTED' in text else None


def _memory_line(what: str, analysis: Dict[str, Any], hbm: float) -> str:
  return (f'{what}: {_gb(analysis["total"])} per device = {100 * analysis["total"] / hbm:.1f} % of HBM, '
          + ('fits' if analysis['total'] <= hbm else 'DOES NOT FIT'))


def planned_batch_note(batch_size: int, devices: int) -> str:
  """Why a plan compiles another batch than the config's, or '': a batch smaller than the
  slice's device count (the paper's 128 on a 256-chip slice) is planned at one example per
  device, the smallest batch that divides over them; any other batch as configured (one
  that does not divide is refused)."""
  if batch_size >= devices:
    return ''
  return (f'config.batch_size={batch_size} is smaller than the {devices} devices of the slice: planned at '
          f'{devices} (one example per device, the smallest batch that divides over them); the launch line '
          'carries it, and the largest-batch search says how far it can grow')


def configure(config: ml_collections.ConfigDict, target: str, log=_silent):
  """What a plan settles before it compiles anything (seconds): the target, its compile-only
  devices and data mesh, and the config as planned (the batch it compiles at, with the note
  that says why where it is not the configured one). ConfigError as plan_run raises it."""
  from capsjax import sharding  # pylint: disable=g-import-not-at-top
  from capsjax.validation import validate  # pylint: disable=g-import-not-at-top
  from capsjax.app import launch  # pylint: disable=g-import-not-at-top
  launch.registered_programs()   # the built-in programs' sections are checked with the run's keys
  parsed = parse_target(target)
  validate(config)
  devices = compile_only_devices(parsed)
  mesh = sharding.data_mesh(devices)
  config = ml_collections.ConfigDict(config.to_dict())
  batch_note = planned_batch_note(config.batch_size, mesh.size)
  if batch_note:   # a slice with more devices than the batch has examples: one example each
    config.batch_size = mesh.size
    log(batch_note)
  sharding.check_batch_size(config.batch_size, mesh)
  return parsed, devices, mesh, config, batch_note


def plan_run(config: ml_collections.ConfigDict, target: str, find_largest_batch: bool = True,
             log=_silent, on_configured: Optional[Callable[[Plan], None]] = None) -> Plan:
  """Compiles config's training step and evaluation batch for `target` ('v5e:4x4',
  'v5litepod-16', 'h100:8', …) without its hardware and returns what they need. ConfigError
  for a bad target, a missing libtpu or CUDA plugin, a batch that does not divide over the
  devices, or one the compiler refuses for more memory than a device has.
  `on_configured(plan)`: called with the plan at the configured batch before the
  largest-batch search (the command prints its report then: a stop keeps it).

  Example:
    A CapsNet of `mnist_smoke`'s recipe, shrunk, planned for a 2×2 TPU v5e slice:

    >>> from capsjax.experiments import mnist_smoke
    >>> config = mnist_smoke.get_config()
    >>> config.model.update(conv1_channels=16, primary_types=4, digit_dim=8, decoder_hidden=(32,))
    >>> config.batch_size, config.eval_batch_size = 32, 64
    >>> result = capsjax.plan_run(config, 'v5e:2x2', find_largest_batch=False)   # doctest: +SKIP
    >>> result.devices, result.global_batch // result.devices                # doctest: +SKIP
    (4, 8)
  """
  import jax  # pylint: disable=g-import-not-at-top
  from capsjax import experiment, formulations, models  # pylint: disable=g-import-not-at-top
  if not isinstance(find_largest_batch, bool):   # ('no' is true: it ran the minutes-long search)
    raise ConfigError(f'plan_run: find_largest_batch={find_largest_batch!r}: allowed True or False')
  for name, function in (('log', log), ('on_configured', on_configured)):
    if function is not None and not callable(function):
      raise ConfigError(f'plan_run: {name}={function!r}: allowed a function (or leave it out)')
  log = _silent if log is None else log
  parsed, devices, mesh, config, batch_note = configure(config, target, log)
  devices_per_chip = max(1, len(devices) // parsed.chips)
  hbm_per_device = parsed.chip.hbm_bytes * parsed.chip.usable_fraction / devices_per_chip
  config.host_images = 'rows'   # a source without split sizes is read lazily, never whole
  started = time.time()
  built = experiment.start(config, mesh, platform=parsed.platform, loader=_zeros_loader(config),
                           available=hbm_per_device)
  config, model_choice = ml_collections.ConfigDict(built.recorded), built.model_choice   # as resolved and chosen
  program, train_examples = built.steps, built.train.num_examples
  abstract_state = program.abstract_state
  log(f'compiling the training step and an evaluation batch for {parsed.topology_name} '
      f'({len(devices)} devices)…')
  lowered = program.lower(abstract_state)
  show = log is not _silent   # the compilations' elapsed time where the lines are shown

  def compiled(name: str, what: str, key: str):
    try:
      return analyse(_compile(lowered[name], what, show), lowered[name], len(devices))
    except jax.errors.JaxRuntimeError as error:
      refusal = out_of_memory(error)
      if refusal is None:
        raise
      raise ConfigError(f'the run does not fit {parsed.name}: the compiler refused {what} ({refusal}); '
                        f'lower {key}') from None
  per_device = config.batch_size // len(devices)
  training = compiled('training', f'the training step at {per_device} per device', 'config.batch_size')
  log(_memory_line(f'the training step at {per_device} per device', training,
                   hbm_per_device) + f'; {training["flops"] / 1e9:.1f} GFLOP')
  evaluation = compiled('evaluation', 'an evaluation batch', 'config.eval_batch_size')
  log(_memory_line('an evaluation batch', evaluation, hbm_per_device))
  members = len(program.members) if program.members else 1
  params = abstract_state['params']
  num_params = models.count_params(params) // members
  param_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))
  formulation = models.formulation_of(built.model)   # as chosen for the target's platform
  chosen = formulations.describe(formulation) if formulation else []
  result = Plan(parsed, len(devices), len({d.process_index for d in devices}), devices_per_chip,
                config.batch_size, config.eval_batch_size, num_params, param_bytes,
                chosen, training, evaluation, 0.0, model_choice=model_choice, members=members, batch_note=batch_note,
                num_steps=built.num_steps)
  result.compile_seconds = time.time() - started
  if on_configured is not None:
    on_configured(result)
  if find_largest_batch:
    result.largest_batch = _largest_batch(config, mesh, parsed.platform, result, train_examples // len(devices), log)
    result.compile_seconds = time.time() - started
  return result


def _training_memory(config, mesh, platform: str, per_device: int, show: bool = False) -> Dict[str, Any]:
  config = ml_collections.ConfigDict(config.to_dict())
  config.batch_size = per_device * mesh.size
  program = _program(config, mesh, platform).steps
  lowered = program.lower(program.abstract_state)['training']
  return analyse(_compile(lowered, f'the training step at {per_device} per device', show), lowered, mesh.size)


def _largest_batch(config, mesh, platform: str, result: Plan, most: int, log,
                   compilations: int = 5) -> Dict[str, Any]:
  """The largest per-device training batch (a multiple of 8, at most `most`: an epoch's
  examples over the devices) whose compiled step fits the HBM, from compilations: the
  configured batch and twice it give a line of memory against batch, each further
  compilation is at the batch where the line through the two largest fitting batches meets
  the HBM (below the smallest batch that did not fit), until one is within 10 % of the HBM,
  no larger batch is predicted, or `compilations` more have been made."""
  import jax  # pylint: disable=g-import-not-at-top  (loaded by the plan already)
  hbm = result.hbm_per_device
  first = result.global_batch // result.devices
  analyses = {first: result.training}

  def compile_at(batch):
    log(f'finding the largest batch: compiling the training step at {batch} per device…')
    try:
      analyses[batch] = _training_memory(config, mesh, platform, batch, log is not _silent)
    except jax.errors.JaxRuntimeError as error:
      # (The line through two small batches can overshoot far: that batch does not fit.)
      if out_of_memory(error) is None:
        raise
      analyses[batch] = {'total': math.inf}
      log(f'  at {batch} per device: the compiler refused it, DOES NOT FIT ({out_of_memory(error)})')
      return
    log('  ' + _memory_line(f'at {batch} per device', analyses[batch], hbm))

  if min(2 * first, most) > first:
    compile_at(min(2 * first, most))
  for _ in range(compilations):
    fitting = sorted(batch for batch, analysis in analyses.items() if analysis['total'] <= hbm)
    failing = sorted(batch for batch, analysis in analyses.items() if analysis['total'] > hbm)
    if len(fitting) < 2 or analyses[fitting[-1]]['total'] >= 0.9 * hbm:
      break
    low, high = fitting[-2], fitting[-1]
    slope = max((analyses[high]['total'] - analyses[low]['total']) / (high - low), 1.0)
    candidate = high + (0.97 * hbm - analyses[high]['total']) / slope
    if failing:
      candidate = min(candidate, (high + failing[0]) / 2)
    candidate = int(min(candidate, most)) // 8 * 8
    if candidate <= high or candidate in analyses:
      break
    compile_at(candidate)
  tried = {batch: analysis['total'] for batch, analysis in analyses.items()}
  fitting = [batch for batch, total in tried.items() if total <= hbm]
  best = max(fitting) if fitting else min(tried)
  return {'per_device': best, 'total': tried[best], 'tried': sorted(tried), 'fits': bool(fitting),
          'capped': best >= most // 8 * 8, 'analysis': analyses[best]}


# ----------------------------------------------------------------------------- the command

_EXPERIMENTS_DIR = None


def _stopped(signum, frame) -> None:
  del frame
  sys.stdout.flush()
  cli.fail(f'capsjax-plan stopped by {signal.Signals(signum).name} before the plan was complete', 128 + signum,
           hard=True)


@cli.main_wrapper
def main(argv) -> int:
  from absl import flags  # pylint: disable=g-import-not-at-top
  from capsjax.app import launch  # pylint: disable=g-import-not-at-top
  flag_values = flags.FLAGS
  launch.quiet_logs()
  if len(argv) > 1:
    cli.fail(f'unexpected arguments: {" ".join(argv[1:])}')
  target = flag_values.target
  if not target:
    cli.fail('--target=NAME is required (a TPU topology such as v5e:4x4, an accelerator type such as '
             'v5litepod-16, or GPUs such as h100:8; --target=list shows them)')
  config = flag_values.config
  if config is None:
    cli.fail(f'--experiment=NAME is required; available: {", ".join(launch.available_experiments())}')
  from capsjax.validation import split_name_lists  # pylint: disable=g-import-not-at-top
  split_name_lists(config)
  parsed = parse_target(target)   # a bad target is one line before anything is compiled
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_enable_compilation_cache', False)   # _compile says why; before any compilation
  # libtpu installs its own SIGTERM handler as it loads (a crash dump on every stop): load
  # it now, then stop in one line (compilations run on a worker thread, so at once).
  compile_only_devices(parsed)
  signal.signal(signal.SIGTERM, _stopped)
  from capsjax import train  # pylint: disable=g-import-not-at-top
  programs = launch.registered_programs()
  if programs.get(config.program) is not train.train_and_evaluate:
    cli.fail(f'--experiment={flag_values.experiment}: its program ({config.program}) trains several models; '
             'plan one of them (e.g. its member config) with --config.program=train')
  overrides = [arg for arg in sys.argv[1:] if arg.startswith('--config.')]

  def configured(result: Plan) -> None:   # before the search: a stop during it keeps the estimate and launch line
    for line in report(result, flag_values.experiment or 'NAME', f'/mnt/shared/{flag_values.experiment or "run"}',
                       overrides, with_largest=False, with_batch_note=False):   # (said as it was configured)
      print(line, flush=True)
    if flag_values.find_largest_batch:
      console.say('searching for the largest batch that fits (--nofind_largest_batch skips it)…')

  result = plan_run(config, target, flag_values.find_largest_batch, log=console.say, on_configured=configured)
  for line in largest_batch_lines(result):
    print(line)
  if not result.fits(result.training) or not result.fits(result.evaluation):
    cli.fail(f'the run does not fit {result.target.name}: lower config.batch_size or config.eval_batch_size'
             + (f' (at most {result.largest_batch["per_device"] * result.devices} for training)'
                if result.largest_batch and result.largest_batch['fits'] else ''))
  return 0


@cli.main_wrapper
def list_targets(argv=None) -> int:
  """The TPU topologies libtpu describes and the GPUs the CUDA plugin compiles for, each
  section where its package is installed; one error line where neither is."""
  del argv
  missing = []
  for needs, heading, names in (
      (require_libtpu, 'TPU topologies this libtpu describes (any AxB or AxBxC of a generation works; Cloud\'s '
       'accelerator types v5litepod-N, v6e-N, v4-N, v5p-N, v3-N too):', LIST_EXAMPLES),
      (require_cuda_plugin, f'GPUs the CUDA plugin compiles for ({", ".join(GPUS)}; NAME:GPUS in one host, '
       f'NAME:HOSTSxGPUS across hosts, up to {GPUS_PER_HOST} per host):', GPU_EXAMPLES)):
    try:
      needs()
    except ConfigError as e:
      missing.append(str(e))
      print(f'{heading.split(" ", 1)[0]}: none here, {e}')
      continue
    print(heading)
    for line in available_topologies(names):
      print(line)
  if len(missing) == 2:
    cli.fail(missing[0] + '; ' + missing[1].replace('planning for a GPU', 'for a GPU'))
  return 0


def entry_point(experiments_dir: Optional[str] = None) -> None:
  """`capsjax-plan` and `python -m capsjax.app.plan`: the experiment flags of `capsjax`, plus
  --target and --find_largest_batch."""
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from capsjax.app import launch  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string('target', None, 'A TPU topology (v5e:4x4), an accelerator type (v5litepod-16), GPUs '
                      '(h100, h100:8, h200:2x8), or list.')
  flags.DEFINE_bool('find_largest_batch', True, 'Compile two or three more times to find the largest batch.')
  launch.set_experiments_dir(experiments_dir)
  argv = list(sys.argv)
  # GPUs are compile-only devices of JAX's CUDA plugin, which needs no driver for them; a
  # plan runs nothing, so JAX itself stays on the CPU (where the plugin would otherwise log
  # its failed start into every plan).
  use_gpu_plan_folder()
  if have_cuda_plugin():
    os.environ.setdefault('JAX_PLATFORMS', 'cpu')
    cli.start_jax_quietly()
  cli.as_program()
  if '--target=list' in argv[1:]:   # needs no experiment
    sys.exit(list_targets())
  remaining = launch.parse_flags(argv, __doc__ + '\n  --target=NAME          a TPU topology, an accelerator type, GPUs, or list\n'
                                 '  --nofind_largest_batch skip the two or three compilations that find the largest batch')
  app.run(main, argv=remaining)


if __name__ == '__main__':
  entry_point()
