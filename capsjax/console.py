"""What the library shows on the user's terminal and how it keeps others' noise out of it:
a line saying what is happening (`say`), tqdm's progress bars (`progress`, a log-friendly form
when stderr is not a terminal), XLA's slow-compilation banners dropped from native stderr,
and libtpu's start-up banner kept quiet where no TPU is attached. The command lines
(capsjax.app.cli) build on it; nothing here ends a process.
"""
import contextlib
import os
import re
import sys
import tempfile
from typing import Optional

import tqdm


# Google's PCI vendor id, which TPU chips carry (as jax._src.hardware_utils reads them).
_GOOGLE_PCI_VENDOR = '0x1ae0'
LIBTPU_QUIET = (('TPU_SKIP_MDS_QUERY', '1'), ('TPU_WORKER_HOSTNAMES', 'localhost'),
                ('TPU_ACCELERATOR_TYPE', 'v5litepod-1'), ('ALLOW_MULTIPLE_LIBTPU_LOAD', '1'))


def quiet_libtpu_environment(environ=None) -> None:
  """Where libtpu is installed (`capsjax[tpu]`, for capsjax-plan) on a machine with no TPU
  attached: the values libtpu reads when JAX starts, so that it stays silent (unset, it
  prints an error banner about TPU_WORKER_HOSTNAMES into every command's output) and a
  second process may load it (its lock file). Nothing changes on a TPU VM (a Google PCI
  device attached: there libtpu finds its own values) or where a value is set already."""
  import glob  # pylint: disable=g-import-not-at-top
  import importlib.util  # pylint: disable=g-import-not-at-top
  environ = os.environ if environ is None else environ
  if importlib.util.find_spec('libtpu') is None:
    return
  for vendor in glob.glob('/sys/bus/pci/devices/*/vendor'):
    try:
      with open(vendor) as f:
        if f.read().strip() == _GOOGLE_PCI_VENDOR:
          return
    except OSError:
      continue
  for key, value in LIBTPU_QUIET:
    environ.setdefault(key, value)


# jaxlib releases that compute wrong answers silently on a CPU, and the XLA flag that keeps
# capsjax off the broken path. jaxlib 0.10.2's YNNPACK reduce fusions sum a vmapped
# matrix-vector product wrongly past 16 384 rows in float64 and 32 768 in float32 (JAX
# issue 39103; 0.10.1 and 0.12 are right). The cost of the guard, capsjax's paper model at
# batch 128 on an AMD EPYC Zen 5 (2026-12-02, four runs each way): training unchanged within
# the runs' spread, inference about 10 % slower; every YNN fusion off cost 15-19 %.
KNOWN_MISCOMPILES = {'0.10.2': '--xla_cpu_experimental_ynn_fusion_type=-reduce'}
# The flag guard_known_miscompiles added to this process's XLA_FLAGS (None: none).
miscompile_guard: Optional[str] = None


def guard_known_miscompiles(environ=None) -> Optional[str]:
  """Adds to XLA_FLAGS the flag that avoids the installed jaxlib's known silent CPU
  miscompile (KNOWN_MISCOMPILES), before JAX starts its backend (`import capsjax` does it:
  JAX starts backends lazily). A user's own value of that flag wins, and XLA_FLAGS naming a
  file of flags is left alone. Returns the flag added, or None."""
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  global miscompile_guard
  environ = os.environ if environ is None else environ
  try:
    flag = KNOWN_MISCOMPILES.get(importlib.metadata.version('jaxlib'))
  except importlib.metadata.PackageNotFoundError:
    return None
  raw = environ.get('XLA_FLAGS', '')
  current = raw.strip()
  if (flag is None or flag.split('=')[0] in current or (current and not current.startswith('--'))
      or (raw and not current)):   # (white space alone: the command refuses it, as XLA would)
    return None
  environ['XLA_FLAGS'] = f'{current} {flag}'.strip()
  if environ is os.environ:
    miscompile_guard = flag
  return flag


# XLA's banners for a compilation or constant folding that takes long (slow_operation_alarm.cc,
# logged as errors: a user reads them as one); each ends with the advice to dump and attach.
_ALARM = 'slow_operation_alarm.cc'
_ALARM_END = 'attach the results'
_ALARM_MAX_LINES = 40


def without_xla_alarms(text: str) -> str:
  """`text` (native stderr) less XLA's slow-operation banners: from a line naming
  slow_operation_alarm.cc to the line with its advice (and a row of '*' after it)."""
  kept, left, closing = [], 0, False
  for line in text.splitlines(keepends=True):
    if left:   # inside a banner
      left -= 1
      if _ALARM_END in line:
        left, closing = 0, True
      continue
    if closing:   # the row of '*' that may close it
      closing = False
      if line.strip() and not line.strip().strip('*'):
        continue
    if _ALARM in line:
      left = _ALARM_MAX_LINES
      continue
    kept.append(line)
  return ''.join(kept)


@contextlib.contextmanager
def xla_alarms_dropped(all_if_failed: bool = False):
  """Native stderr written inside (XLA compiling: a run's first step, its first evaluation)
  is held and written out afterwards without XLA's slow-operation banners; Python's own
  stderr writes go out at once, as before (an error line is never held). `all_if_failed`:
  when the block raises, nothing held is written (MLIR's diagnostics of a file it cannot
  read, which the raised error's one line says)."""
  failed = False
  try:
    sys.stderr.flush()
    saved = os.dup(2)
  except (OSError, ValueError):   # no real stderr (a test's capture): nothing to filter
    yield
    return
  previous = sys.stderr
  held = tempfile.TemporaryFile()
  try:
    sys.stderr = os.fdopen(os.dup(saved), 'w', buffering=1, encoding=getattr(previous, 'encoding', None) or 'utf-8',
                           errors='backslashreplace')
    os.dup2(held.fileno(), 2)
    yield
  except BaseException:
    failed = all_if_failed
    raise
  finally:
    try:
      sys.stderr.flush()
      sys.stderr.close()
    finally:
      sys.stderr = previous
      os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      text = '' if failed else without_xla_alarms(held.read().decode('utf-8', errors='replace'))
      held.close()
      if text:
        previous.write(text)
        previous.flush()


def say(what: str) -> None:
  """A line saying what a program is doing now (at once: before the work, not after)."""
  print(what, flush=True)


# A bar appears once its work has taken this long: quick work stays quiet.
PROGRESS_DELAY_S = 2.0
# In a log (stderr not a terminal): a progress line this often while the work goes on.
LOG_PROGRESS_INTERVAL_S = 5.0


class LogLines:
  """A stream for tqdm writing to a log: each redraw (tqdm moves back with a carriage
  return, which a log shows as one ever-growing line) becomes a line of its own."""

  def __init__(self, stream):
    self.stream = stream
    self.last = None

  def write(self, text: str) -> None:
    for part in text.replace('\r', '\n').split('\n'):
      line = part.rstrip()
      # The closing redraw repeats the last count with a newer rate: a finished bar once.
      count = re.sub(r'\s*\[[^\]]*\]$', '', line)
      if line.strip() and not (count == self.last and '100%' in count):
        self.stream.write(line + '\n')
        self.last = count
    self.stream.flush()

  def flush(self) -> None:
    self.stream.flush()


def progress(iterable=None, *, what: str, total: Optional[int] = None, unit: str = 'it', disable: bool = False,
             log_every_s: float = LOG_PROGRESS_INTERVAL_S):
  """tqdm's bar on stderr for work that takes more than PROGRESS_DELAY_S: `what`, the count,
  the rate and the ETA. On a terminal it redraws in place; in a log (no terminal) it
  writes a line every `log_every_s` while the work goes on, and the final count."""
  terminal = sys.stderr.isatty()
  return tqdm.tqdm(iterable, desc=what, total=total, unit=unit, file=sys.stderr if terminal else LogLines(sys.stderr),
                   dynamic_ncols=terminal, ascii=None if terminal else True,
                   mininterval=0.2 if terminal else log_every_s, smoothing=0.1, disable=disable,
                   delay=PROGRESS_DELAY_S)


def format_duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  hours, rest = divmod(seconds, 3600)
  return f'{hours}h{rest // 60:02d}m' if hours else f'{rest // 60}m{rest % 60:02d}s'
