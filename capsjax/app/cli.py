"""What every command-line program shares: one error line and exit status 2 for bad
input (flags, data, workdirs), argparse types that validate numbers, and `main_wrapper`.
"""
import argparse
import contextlib
import functools
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
from typing import Callable, List, NoReturn, Optional, Sequence


from capsjax.console import KNOWN_MISCOMPILES, quiet_libtpu_environment
from capsjax.errors import CapsjaxError, CheckpointWriteError, ConfigError, RunStopped


# Exit status of a run that stopped before its last step after saving a checkpoint (a
# signal, a preemption notice, or --config.stop_at_step): EX_TEMPFAIL (sysexits.h), "try
# again": the same command resumes it. A finished run exits 0; bad input 2; Ctrl-C before
# training 130.
EXIT_RESUMABLE = 75


_PROGRAM = False   # set by run_program: this process is a command line, not a library user


def as_program() -> None:
  """This process is a command line (its errors end it hard once orbax is loaded: `fail`).
  On Linux it first restarts itself once with huge pages for its large buffers
  (`huge_pages_environment`)."""
  global _PROGRAM
  _PROGRAM = True
  quiet_libtpu_environment()
  use_huge_pages()


# glibc's malloc tunable (2.35+) that marks its large allocations MADV_HUGEPAGE.
HUGE_PAGES_TUNABLE = 'glibc.malloc.hugetlb=1'
THP_MODE_FILE = '/sys/kernel/mm/transparent_hugepage/enabled'


def start_jax_quietly() -> None:
  """Imports JAX and starts its backends with the process's native stderr closed: where JAX's
  CUDA plugin is installed on a machine without a GPU driver (capsjax-plan's GPU targets),
  its libraries log their driver probe from C++ as they load. A failure here is not
  hidden: the next call into JAX meets it again and reports it."""
  sys.stderr.flush()
  saved = os.dup(2)
  devnull = os.open(os.devnull, os.O_WRONLY)
  try:
    os.dup2(devnull, 2)
    import jax  # pylint: disable=g-import-not-at-top
    jax.devices()
  except Exception:  # pylint: disable=broad-except
    pass
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)
    os.close(devnull)


def huge_pages_environment(environ=None, thp_mode: Optional[str] = None, libc=None) -> Optional[dict]:
  """The environment this process should restart with so that its large buffers get
  transparent huge pages, or None when that would change nothing or was declined.

  Why: XLA:CPU allocates a step's temporaries afresh each step (1 GB for the paper's
  CapsNet at batch 128) and the kernel faults them in 4 KiB pages; 2 MiB pages make the
  step faster (measured: docs/results.md, "CPU speed"). Linux asks for it per mapping (THP mode `madvise`, the common
  default), which glibc's malloc does with the tunable, read only at process start, hence
  the restart. Declined with CAPSJAX_HUGE_PAGES=0 (or false, no, off); not needed where the THP mode is
  `always` (every large mapping already gets them) or possible where it is `never`, nor
  with another C library or an older glibc."""
  environ = os.environ if environ is None else environ
  if not environment_switch(environ, 'CAPSJAX_HUGE_PAGES', default=True) or not sys.platform.startswith('linux'):
    return None
  tunables = environ.get('GLIBC_TUNABLES', '')
  if 'glibc.malloc.hugetlb' in tunables:   # set already (by us, or by the user: theirs stands)
    return None
  name, version = libc if libc is not None else platform.libc_ver()
  try:
    if name != 'glibc' or tuple(int(part) for part in version.split('.')[:2]) < (2, 35):
      return None
  except ValueError:
    return None
  if thp_mode is None:
    try:
      with open(THP_MODE_FILE) as f:
        thp_mode = f.read()
    except OSError:
      return None
  if '[madvise]' not in thp_mode:
    return None
  return dict(environ, GLIBC_TUNABLES=f'{tunables}:{HUGE_PAGES_TUNABLE}' if tunables else HUGE_PAGES_TUNABLE)


TRUE_WORDS = ('1', 'true', 'yes', 'on')
FALSE_WORDS = ('0', 'false', 'no', 'off')


def environment_switch(environ, name: str, default: bool) -> bool:
  """An on/off environment variable: 1/true/yes/on or 0/false/no/off (any case); unset or
  empty: `default`; anything else a ConfigError naming the words."""
  value = environ.get(name, '').strip().lower()
  if not value:
    return default
  if value in TRUE_WORDS or value in FALSE_WORDS:
    return value in TRUE_WORDS
  raise ConfigError(f'{name}={environ[name]!r}: allowed {"/".join(TRUE_WORDS)} or {"/".join(FALSE_WORDS)}')


def use_huge_pages() -> None:
  """Restarts this process (same interpreter, arguments and pid) with
  `huge_pages_environment`, when there is one; a restart that fails is skipped."""
  try:
    environment = huge_pages_environment()
  except ConfigError as e:
    fail(str(e))
  if environment is None or not getattr(sys, 'orig_argv', None):
    return
  sys.stdout.flush()
  sys.stderr.flush()
  try:
    os.execve(sys.executable, [sys.executable] + list(sys.orig_argv[1:]), environment)
  except OSError:
    pass


def cpu_folder_name() -> str:
  """The CPU's model and instruction set as a folder name (its /proc/cpuinfo lines): XLA
  refuses, with an error line, a CPU executable compiled for another CPU's features."""
  import hashlib  # pylint: disable=g-import-not-at-top
  try:
    with open('/proc/cpuinfo') as f:
      lines = [line for line in f if line.startswith(('vendor_id', 'cpu family', 'model', 'flags'))]
  except OSError:
    lines = [platform.processor()]
  described = ''.join(sorted(set(lines)))
  return f'{platform.machine()}-{hashlib.sha1(described.encode()).hexdigest()[:12]}'


def compilation_cache_environment(environ=None) -> dict:
  """The environment that gives a command JAX's persistent compilation cache, so that its
  next start reuses what this one compiled (predict and the explorer compile the same
  programs at every start: docs/results.md, "CPU speed"): a folder per CPU kind
  (`cpu_folder_name`) in $XDG_CACHE_HOME/capsjax/xla (~/.cache by default). {} where
  JAX_COMPILATION_CACHE_DIR already names one, CAPSJAX_COMPILATION_CACHE=0 (or false, no,
  off) declines it, or the folder cannot be made or written."""
  environ = os.environ if environ is None else environ
  if environ.get('JAX_COMPILATION_CACHE_DIR') or not environment_switch(environ, 'CAPSJAX_COMPILATION_CACHE', True):
    return {}
  base = environ.get('XDG_CACHE_HOME') or os.path.join(environ.get('HOME') or os.path.expanduser('~'), '.cache')
  folder = os.path.join(base, 'capsjax', 'xla', cpu_folder_name())
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError:
    return {}
  if not os.access(folder, os.W_OK | os.X_OK):
    return {}
  return {'JAX_COMPILATION_CACHE_DIR': folder, 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0'}


def use_compilation_cache() -> None:
  """This process (and what it starts) with `compilation_cache_environment`, before JAX
  reads its flags (or into JAX's config, where it is imported already)."""
  try:
    environment = compilation_cache_environment()
  except ConfigError as e:
    fail(str(e))
  os.environ.update(environment)
  if environment and 'jax' in sys.modules:
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update('jax_compilation_cache_dir', environment['JAX_COMPILATION_CACHE_DIR'])
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)


def run_program(main: Callable[[], int]) -> NoReturn:
  """The `__main__` of a command line: `sys.exit(main())` as a program (XLA_FLAGS checked
  first: see xla_flags_problem), with JAX's compilation cache (`use_compilation_cache`)."""
  as_program()
  use_compilation_cache()
  check_xla_flags()
  check_backend()
  sys.exit(main())


# A process that starts XLA's CPU backend: XLA parses XLA_FLAGS when a backend starts.
_XLA_PROBE = 'import jax; jax.devices("cpu")'
_XLA_FLAG = re.compile(r'--[A-Za-z0-9_]+(=.*)?')


def check_xla_flags() -> None:
  """Ends the program with one line (exit 2) if XLA would refuse $XLA_FLAGS."""
  problem = xla_flags_problem()
  if problem:
    fail(problem)


def xla_flags_problem(environ=None) -> Optional[str]:
  """One line saying what is wrong with $XLA_FLAGS, or None: checked before this process
  starts JAX, because XLA ends a process whose XLA_FLAGS it cannot parse with its own fatal
  log lines (an unknown flag, a value it cannot read). The form is checked here; names and
  values by XLA itself, in a short probe process on the CPU backend with the same
  XLA_FLAGS (about 0.7 s, only when XLA_FLAGS is set). A failure the probe cannot put
  into words is passed through: the run then meets it as XLA reports it."""
  environ = os.environ if environ is None else environ
  raw = environ.get('XLA_FLAGS', '')
  if raw and not raw.strip():   # XLA would read the blanks as the name of a file of flags
    return f'XLA_FLAGS={raw!r}: only white space; unset it or give flags (--name=value …)'
  # (The flag capsjax adds itself against a known miscompile is XLA's own: no probe for it alone.)
  value = ' '.join(token for token in raw.split() if token not in KNOWN_MISCOMPILES.values())
  if not value:
    return None
  if not value.startswith('--'):   # XLA reads such a value as a file of flags
    path = value.split()[0]
    if not os.path.isfile(path):
      return (f'XLA_FLAGS={value!r}: not flags (--name=value …) and not a file of flags ({path} does not exist)')
  else:
    for token in value.split():
      if not _XLA_FLAG.fullmatch(token):
        return f'XLA_FLAGS: {token!r} is not an XLA flag (--name or --name=value)'
  try:
    probe = subprocess.run([sys.executable, '-c', _XLA_PROBE], env=dict(environ, JAX_PLATFORMS='cpu'),
                           capture_output=True, text=True, timeout=120)
  except (OSError, subprocess.TimeoutExpired):
    return None
  if probe.returncode == 0:
    return None
  unknown = re.search(r'Unknown flags? in XLA_FLAGS: (.*)', probe.stderr)
  if unknown:
    return f'XLA_FLAGS: unknown XLA flag {unknown.group(1).strip()} (XLA would stop the run at its start)'
  bad_value = re.search(r"Couldn't interpret value (.*) for flag (\w+)", probe.stderr)
  if bad_value:
    return (f'XLA_FLAGS: --{bad_value.group(2)}={bad_value.group(1).rstrip(".")}: a value this XLA flag '
            'does not take (XLA would stop the run at its start)')
  return None


def check_backend() -> None:
  """Ends the program with one line (exit 2) if JAX cannot start the backend that
  JAX_PLATFORMS (or JAX_PLATFORM_NAME) names. Only when one is named: JAX's default falls back
  to the CPU, and a command's flag errors stay free of JAX's import (about a second)."""
  asked = os.environ.get('JAX_PLATFORMS') or os.environ.get('JAX_PLATFORM_NAME')
  if not asked or asked.strip() == 'cpu':
    return
  from capsjax.app import distributed  # pylint: disable=g-import-not-at-top
  try:
    distributed.check_backend()
  except CapsjaxError as e:
    fail(str(e))


# Files a command is writing under a temporary name (an export's partial file): removed when
# a signal ends the command, which leaves without running `finally` blocks (os._exit).
_PARTIAL_PATHS: List[str] = []


@contextlib.contextmanager
def removed_if_stopped(path: str):
  """While inside: `path` (a file or folder being written) is removed if Ctrl-C or SIGTERM
  ends the command."""
  _PARTIAL_PATHS.append(path)
  try:
    yield path
  finally:
    _PARTIAL_PATHS.remove(path)


def _remove_partial_paths() -> None:
  for path in list(_PARTIAL_PATHS):
    with contextlib.suppress(OSError):
      shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def fail(message: str, status: int = 2, hard: bool = False) -> NoReturn:
  """Prints `error: MESSAGE` and exits. `hard` skips interpreter teardown (os._exit):
  after a Ctrl-C or a failed checkpoint write, orbax's and XLA's background threads can
  print tracebacks, crash or wait for minutes while Python shuts down. A command line that
  has loaded orbax always leaves hard after its error line: at teardown orbax's and
  tensorstore's event loops printed up to 40 lines ('Event loop is closed', 'cannot
  schedule new futures after interpreter shutdown') in 3 of 5 runs. (Its saves have
  finished or failed by then: the checkpoint manager is closed on the way out.)"""
  print(f'error: {message}', file=sys.stderr, flush=True)
  _remove_partial_paths()
  if hard or (_PROGRAM and 'orbax.checkpoint' in sys.modules):
    sys.stdout.flush()
    os._exit(status)
  sys.exit(status)


class ArgumentParser(argparse.ArgumentParser):
  """argparse with a one-line error (no usage block): `error: PROG: MESSAGE`."""

  def error(self, message: str) -> NoReturn:
    fail(f'{self.prog}: {message}')


def int_at_least(low: int) -> Callable[[str], int]:
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f'{text!r} is not an integer') from None
    if value < low:
      raise argparse.ArgumentTypeError(f'{value} is below the minimum {low}')
    return value
  parse.__name__ = f'integer >= {low}'
  return parse


def member(text: str) -> int:
  """--member of a command that takes one model: an ensemble member's index (capsjax-predict's
  --member=all, a seed ensemble's members summed, is said to be its alone)."""
  if text == 'all':
    raise argparse.ArgumentTypeError("'all' (a seed ensemble's members summed) is capsjax-predict's; this command "
                                     'takes one member, an integer >= 0')
  return int_at_least(0)(text)


member.__name__ = 'integer >= 0'


def int_in(low: int, high: int) -> Callable[[str], int]:
  """An integer in [low, high] (e.g. what fits JAX's int32 seeds and indices)."""
  at_least = int_at_least(low)

  def parse(text: str) -> int:
    value = at_least(text)
    if value > high:
      raise argparse.ArgumentTypeError(f'{value} is above the maximum {high}')
    return value
  parse.__name__ = f'integer in [{low}, {high}]'
  return parse


DATA_KEYS = ('data_dir', 'tfds_data_dir')


def add_data_flags(parser: argparse.ArgumentParser) -> None:
  """--data_dir / --tfds_data_dir (also spelled --config.KEY, as run.py and its error
  lines spell them) for programs that read a workdir: where the data comes from on this
  machine, never part of the run's config."""
  parser.add_argument('--data_dir', '--config.data_dir', dest='data_dir', default=None,
                      help="a folder of IDX files (default: the run's own source)")
  parser.add_argument('--tfds_data_dir', '--config.tfds_data_dir', dest='tfds_data_dir', default=None,
                      help="TFDS's data folder (default: the run's own, or ~/tensorflow_datasets)")


def data_overrides(args) -> dict:
  """{key: value} of the data flags given (for load_trained)."""
  return {key: os.path.expanduser(getattr(args, key)) for key in DATA_KEYS if getattr(args, key) is not None}


def number_between(low: float, high: float) -> Callable[[str], float]:
  def parse(text: str) -> float:
    try:
      value = float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f'{text!r} is not a number') from None
    if not low < value < high:
      raise argparse.ArgumentTypeError(f'{value} is outside ({low}, {high})')
    return value
  parse.__name__ = f'number in ({low}, {high})'
  return parse


def existing_workdir(text: str) -> str:
  path = os.path.abspath(os.path.expanduser(text))
  if not os.path.isdir(path):
    raise argparse.ArgumentTypeError(f'{path} is not a directory')
  return path


def _interrupted(signum, frame) -> NoReturn:
  del signum, frame
  fail('interrupted', 130, hard=True)


def _terminated(signum, frame) -> NoReturn:
  del frame
  sys.stdout.flush()
  fail(f'stopped by {signal.Signals(signum).name}', 128 + signum, hard=True)


def main_wrapper(main: Callable[[Optional[Sequence[str]]], int]):
  """Runs `main(argv)`: a CapsjaxError or an OS error is one line and exit 2, Ctrl-C exit 130,
  SIGTERM one line and exit 143 (unhandled, it ended the process without a word), a run
  stopped before its end (RunStopped, any program's inner run) exit 75.

  Ctrl-C exits from the signal handler itself: Python's default handler raises
  KeyboardInterrupt wherever the main thread is, and inside a garbage-collection callback
  (JAX registers one) that exception is printed and dropped, so the program ran on. The
  training loop installs its own handlers (save, then stop) while it runs; with several
  processes JAX's preemption service takes SIGTERM over as it starts.
  """

  @functools.wraps(main)
  def wrapped(argv: Optional[Sequence[str]] = None) -> int:
    try:
      previous = {signal.SIGINT: signal.signal(signal.SIGINT, _interrupted),
                  signal.SIGTERM: signal.signal(signal.SIGTERM, _terminated)}
    except ValueError:   # not the main thread: leave signals alone
      previous = None
    try:
      return main(argv) or 0
    except RunStopped:   # the run has said where it stopped; the same command resumes it
      sys.stdout.flush()
      return EXIT_RESUMABLE
    except CheckpointWriteError as e:
      fail(str(e), hard=True)
    except CapsjaxError as e:
      fail(str(e))
    except OSError as e:
      fail(f'{e.filename or ""}: {e.strerror or e}'.lstrip(': '))
    except KeyboardInterrupt:
      fail('interrupted', 130, hard=True)
    finally:
      for signum, handler in (previous or {}).items():
        signal.signal(signum, handler)

  return wrapped
