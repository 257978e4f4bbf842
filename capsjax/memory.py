"""A run's peak memory, estimated before anything is compiled or allocated.

The estimate walks the jaxpr of a jitted step in program order: its arguments stay live
throughout, every equation's outputs are allocated where they are produced and freed after
their last use (an output of the shape and dtype of an input read for the last time takes
that input's buffer, as XLA's buffer assignment does), and an equation that holds a
sub-program (a loop body, a nested jit, a custom gradient) adds that sub-program's own peak
above its inputs. A sub-program of element-wise operations only adds its outputs (XLA fuses
it into one loop, and into the loop of its only reader where that is element-wise or a
transpose); stop_gradient's output is its input's buffer. XLA fuses other element-wise
chains and reuses buffers, so the true peak is usually lower; the walk never misses a
large tensor (û of the whole evaluation batch, a 10 000-class weight), which is what a run
that cannot fit is made of. Tracing costs what the first step's trace costs anyway (about
a second for the paper's model) and allocates nothing.
"""

import os
from typing import Any, Dict, Iterable, Optional, Tuple

import jax
import numpy as np
from jax.extend import core as jex_core

from capsjax.errors import ConfigError


def array_bytes(aval) -> int:
  """Bytes of an array or abstract value (0 for anything without a shape and dtype)."""
  shape = getattr(aval, 'shape', None)
  dtype = getattr(aval, 'dtype', None)
  if shape is None or dtype is None:
    return 0
  try:
    itemsize = np.dtype(dtype).itemsize
  except TypeError:   # PRNG keys and other extended dtypes: a few words per element
    itemsize = 8
  return int(np.prod(shape, dtype=np.int64)) * itemsize


def _sub_jaxprs(params: Dict[str, Any]) -> Iterable[Any]:
  for value in params.values():
    for item in (value if isinstance(value, (tuple, list)) else (value,)):
      if isinstance(item, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):   # the walk reads what both expose
        yield item


# Primitives XLA fuses into one loop with their neighbours (a transpose as the loop's
# indexing): a sub-program made only of these (ops.prediction_vectors' multiply-adds)
# writes its outputs and nothing else.
_ELEMENTWISE = frozenset({'add', 'sub', 'mul', 'div', 'neg', 'max', 'min', 'select_n', 'convert_element_type',
                          'broadcast_in_dim', 'reshape', 'squeeze', 'slice', 'expand_dims', 'transpose'})


def _fused(sub) -> bool:
  return all(eqn.primitive.name in _ELEMENTWISE for eqn in sub.eqns)


def _written_by_reader(eqns, outvars) -> set:
  """Outputs of an element-wise sub-program read once, by an element-wise operation or a
  transpose: XLA computes them inside their reader's loop (û's multiply-adds inside the
  routing's transpose), so they take no buffer of their own."""
  readers = {}
  for eqn in eqns:
    for atom in set(a for a in eqn.invars if _is_var(a)):
      readers.setdefault(atom, []).append(eqn)
  written = set()
  for eqn in eqns:
    subs = list(_sub_jaxprs(eqn.params))
    if subs and all(_fused(sub) for sub in subs):
      written.update(var for var in eqn.outvars if var not in outvars and len(readers.get(var, ())) == 1
                     and readers[var][0].primitive.name in _ELEMENTWISE)
  return written


def _is_var(atom) -> bool:
  return isinstance(atom, jex_core.Var) and not isinstance(atom, jex_core.Literal)


def _same_buffer(a, b) -> bool:
  return getattr(a, 'shape', None) == getattr(b, 'shape', None) and getattr(a, 'dtype', 0) == getattr(b, 'dtype', 1)


def jaxpr_peak_bytes(jaxpr) -> int:
  """The largest sum of live buffers while `jaxpr` (a ClosedJaxpr or a Jaxpr: their public
  eqns, invars, outvars and constvars) runs in program order (its inputs and constants
  included)."""
  # stop_gradient's output is its input's buffer (XLA emits nothing for it).
  views = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'stop_gradient' and _is_var(eqn.invars[0]):
      views[eqn.outvars[0]] = views.get(eqn.invars[0], eqn.invars[0])
  buffer = lambda atom: views.get(atom, atom)
  last_use = {}
  for index, eqn in enumerate(jaxpr.eqns):
    for atom in eqn.invars:
      if _is_var(atom):
        last_use[buffer(atom)] = index
  for atom in jaxpr.outvars:
    if _is_var(atom):
      last_use[buffer(atom)] = len(jaxpr.eqns)    # outputs stay live to the end
  arguments = list(jaxpr.invars) + list(jaxpr.constvars)
  live = sum(array_bytes(var.aval) for var in arguments)
  for var in arguments:                   # arguments are the caller's: never freed here
    last_use[var] = len(jaxpr.eqns)
  peak = live
  virtual = _written_by_reader(jaxpr.eqns, set(a for a in jaxpr.outvars if _is_var(a)))
  for index, eqn in enumerate(jaxpr.eqns):
    inner = 0
    for sub in _sub_jaxprs(eqn.params):   # its own peak above the inputs it shares with us
      if not _fused(sub):
        inner = max(inner, jaxpr_peak_bytes(sub) - sum(array_bytes(var.aval) for var in sub.invars))
    dying = [atom for atom in set(buffer(a) for a in eqn.invars if _is_var(a))
             if last_use.get(atom) == index and atom not in virtual]
    made = [var for var in eqn.outvars if var not in virtual and var not in views]
    produced = 0
    for var in made:   # an output the size of an input read for the last time reuses it
      reused = next((atom for atom in dying if _same_buffer(atom.aval, var.aval)), None)
      if reused is not None:
        dying.remove(reused)
        live -= array_bytes(reused.aval)
      produced += array_bytes(var.aval)
    peak = max(peak, live + max(inner, produced))
    live += produced
    for atom in dying:
      live -= array_bytes(atom.aval)
    for var in made:                      # outputs nobody reads
      if var not in last_use:
        live -= array_bytes(var.aval)
  return peak


def traced_peak_bytes(jitted, *args) -> int:
  """The estimate for one call of the jitted function `jitted` on `args` (arrays or
  jax.ShapeDtypeStruct: nothing is allocated)."""
  return jaxpr_peak_bytes(jitted.trace(*args).jaxpr)   # the ClosedJaxpr itself (no legacy .jaxpr)


def _cgroup_limit() -> Optional[int]:
  """The container's memory limit left (cgroup v2, then v1), or None."""
  for limit_file, usage_file in (('/sys/fs/cgroup/memory.max', '/sys/fs/cgroup/memory.current'),
                                 ('/sys/fs/cgroup/memory/memory.limit_in_bytes',
                                  '/sys/fs/cgroup/memory/memory.usage_in_bytes')):
    try:
      with open(limit_file) as f:
        text = f.read().strip()
      if text == 'max' or int(text) >= 1 << 60:
        return None
      with open(usage_file) as f:
        return int(text) - int(f.read().strip())
    except (OSError, ValueError):
      continue
  return None


def available_bytes(device=None) -> Optional[int]:
  """Memory a run may still take on `device` (default the first): an accelerator's
  free memory from its allocator's statistics; on the CPU, the host's available memory
  (MemAvailable, capped by a container's limit). None where nothing says."""
  device = device or jax.local_devices()[0]
  if device.platform != 'cpu':
    stats = device.memory_stats() or {}
    if 'bytes_limit' in stats:
      return int(stats['bytes_limit']) - int(stats.get('bytes_in_use', 0))
    return None
  available = None
  try:
    with open('/proc/meminfo') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          available = int(line.split()[1]) * 1024
  except OSError:
    pass
  limit = _cgroup_limit()
  if limit is not None:
    available = limit if available is None else min(available, limit)
  if available is None and hasattr(os, 'sysconf'):
    try:
      available = os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')
    except (ValueError, OSError):
      pass
  return available


def gigabytes(num_bytes: int) -> str:
  return f'{num_bytes / 1e9:.2f} GB' if num_bytes < 1e11 else f'{num_bytes / 1e9:.0f} GB'


def check_fits(estimates: Dict[str, Tuple[int, str]], available: Optional[int]) -> None:
  """One ConfigError line naming each of `estimates` (what → (bytes per device, the setting
  that lowers it)) that is more than `available`."""
  if available is None:
    return
  too_large = [(what, needed, advice) for what, (needed, advice) in estimates.items() if needed > available]
  if too_large:
    needs = ' and '.join(f'{what} needs about {gigabytes(needed)}' for what, needed, _ in too_large)
    advice = '; '.join(dict.fromkeys(advice for _, _, advice in too_large))
    raise ConfigError(f'{needs} (estimated before compiling), more than the {gigabytes(available)} of memory '
                      f'available: {advice} (or --config.check_memory=False to try anyway)')


def describe(estimates: Dict[str, Tuple[int, str]], available: Optional[int]) -> str:
  """The header's words: 'model buffers at peak ≈ 1.05 GB estimated (parameters, optimizer
  state, a step's activations; the process adds JAX's runtime and the data) of 19.80 GB
  available'. What the estimate covers is said, as the process's resident memory is larger."""
  needed = max(value[0] for value in estimates.values())
  return (f"model buffers at peak ≈ {gigabytes(needed)} estimated (parameters, optimizer state, a step's "
          "activations; the process adds JAX's runtime and the data)") + (
      f' of {gigabytes(available)} available' if available is not None else '')
