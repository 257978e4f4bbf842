"""Process-level concerns of a run: multi-host start-up and stop requests (signals).

`initialize_distributed` starts `jax.distributed` for multi-host runs. `StopRequests`
turns SIGTERM (how schedulers and Cloud TPU announce a preemption) and SIGINT (Ctrl-C)
into a flag that the training loop reads after every step: it saves a checkpoint and
exits cleanly. A second Ctrl-C stops at once without saving, and so does a Ctrl-C before
the loop has compiled its first step (nothing is trained yet that a checkpoint would keep).
"""
import os
import platform
import re
import signal
import socket
import sys
import threading
import time

import jax

from capsjax.errors import ConfigError
from capsjax.keys import boolean, declare, host_port, int_at_least, int_in


def cpu_model() -> str:
  """The CPU's model name (/proc/cpuinfo, else the platform's word for it)."""
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def device_name() -> str:
  """What the first device is, in words: the CPU's model name on the CPU backend (JAX calls
  every CPU 'cpu'), else JAX's device kind ('NVIDIA H100 80GB HBM3', 'TPU v4')."""
  if jax.default_backend() == 'cpu':
    return cpu_model()
  return jax.devices()[0].device_kind


# Multi-host (capsjax.sharding): every process runs the same command; on Cloud TPU the
# coordinator is found automatically, elsewhere give address, count and id.
declare('distributed', False, boolean(), 'start jax.distributed (several hosts run the same command)')
declare('coordinator_address', '', host_port(), 'HOST:PORT of process 0 (empty: detected on Cloud TPU, SLURM, '
        'Open MPI)')
declare('num_processes', 0, int_at_least(0), 'processes in a multi-host run (0: detected)')
declare('process_id', -1, int_at_least(-1), "this process's index (-1: detected)")
declare('distributed_timeout_s', 120, int_in(1, 3600), 'seconds to wait for the coordinator and the other '
        'processes before giving up with one error line')


def initialize_distributed(distributed: bool, coordinator_address: str = '', num_processes: int = 0,
                           process_id: int = -1, timeout_s: int = 120) -> None:
  """`jax.distributed.initialize` when `distributed` (config.distributed) is set.

  On Cloud TPU and SLURM/MPI clusters every argument is detected automatically; elsewhere
  pass config.coordinator_address ('host:port'), config.num_processes and
  config.process_id to every process (0 / -1: detected).
  """
  if not distributed:
    return
  timeout = int(timeout_s)
  # JAX aborts the process (a C++ stack) when its own timeout passes: ours ends it first,
  # with one line (see `_Watchdog`).
  kwargs = {'initialization_timeout': timeout + 60}
  if coordinator_address:
    resolve_address(coordinator_address)
    kwargs['coordinator_address'] = coordinator_address
  if num_processes:
    kwargs['num_processes'] = num_processes
  if process_id >= 0:
    kwargs['process_id'] = process_id
  if coordinator_address and process_id > 0:
    # JAX waits for an absent coordinator in silence and then aborts the process: find out
    # first, within the timeout, with one line.
    wait_for_coordinator(coordinator_address, timeout)
  watchdog = _Watchdog(timeout, f'the {num_processes or "other"} processes of the run did not all join '
                                 f'{coordinator_address or "the coordinator"} within '
                                 f'config.distributed_timeout_s={timeout} s; start every process '
                                 'with the same command (its own --config.process_id)')
  try:
    with watchdog:
      jax.distributed.initialize(**kwargs)
  except (ValueError, RuntimeError) as e:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise ConfigError(f'config.distributed=True: {first[:300].rstrip(".")}; outside Cloud TPU, SLURM and Open MPI give '
                      '--config.coordinator_address=HOST:PORT --config.num_processes=N '
                      '--config.process_id=I to every process') from None


class _Watchdog:
  """Ends the process with one error line (exit 2) if the block it guards outlasts
  `seconds`: for calls that wait in C++ and then abort."""

  def __init__(self, seconds: float, message: str):
    self.timer = threading.Timer(seconds, self._fire, (message,))
    self.timer.daemon = True

  @staticmethod
  def _fire(message: str) -> None:
    print(f'error: {message}', file=sys.stderr, flush=True)
    os._exit(2)   # the main thread is inside C++: no exception can reach it

  def __enter__(self):
    self.timer.start()
    return self

  def __exit__(self, *exc):
    self.timer.cancel()
    return False


def resolve_address(address: str) -> None:
  """ConfigError unless `address` is HOST:PORT with a host that resolves (JAX aborts the
  process on one that does not)."""
  host, _, port = address.rpartition(':')
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ConfigError(f'config.coordinator_address={address!r}: allowed HOST:PORT (a port in 1..65535)')
  try:
    socket.getaddrinfo(host.strip('[]'), int(port))
  except OSError as e:
    raise ConfigError(f'config.coordinator_address={address!r}: the host {host!r} does not resolve '
                      f'({e.strerror or e})') from None


def check_backend() -> None:
  """ConfigError if JAX cannot start the backend it was asked for (JAX_PLATFORMS=cuda on a
  machine without a GPU raises a bare AssertionError deep in JAX)."""
  try:
    jax.devices()
  except (RuntimeError, AssertionError) as e:
    asked = os.environ.get('JAX_PLATFORMS') or os.environ.get('JAX_PLATFORM_NAME') or 'the default'
    detail = (str(e).strip().splitlines() or ['no backend'])[0]
    detail = re.sub(r'\s*\(set JAX_PLATFORMS=.*$', '', detail)[:200]   # its advice is the line's own
    raise ConfigError(f'JAX cannot start the backend JAX_PLATFORMS={asked!r} asks for on this machine ({detail}); '
                      'unset JAX_PLATFORMS, or install the JAX build for that device') from None


def wait_for_coordinator(address: str, timeout_s: float) -> None:
  """Returns once HOST:PORT accepts a TCP connection; ConfigError after `timeout_s`."""
  host, _, port = address.rpartition(':')
  if not host or not port.isdigit():
    raise ConfigError(f'config.coordinator_address={address!r}: allowed HOST:PORT')
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host.strip('[]'), int(port)), timeout=min(5.0, timeout_s)):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise ConfigError(f'the coordinator {address} did not answer within {timeout_s:g} s ({e.strerror or e}): '
                          'start process 0 first, or check --config.coordinator_address') from None
      time.sleep(0.5)


class StopRequests:
  """A context in which SIGTERM and SIGINT set `raised` (and `signal_name`) instead of
  killing the process. With `install=False` (several processes, where JAX's preemption
  service owns SIGTERM) nothing is installed and `raised` stays False.

  Until `arm()` (the loop calls it once its first step has compiled) a Ctrl-C goes to the
  handler that was there before (the command line's: one line, exit 130): compiling can
  take minutes, and waiting for it only to save the step restored would look like a hang."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self, install: bool = True):
    self.raised = False
    self.signal_name = None
    self.install = install
    self.armed = False
    self._previous = {}

  def arm(self) -> None:
    """From now on a Ctrl-C saves a checkpoint after the current step."""
    self.armed = True

  def __enter__(self):
    if self.install:
      for signum in self.SIGNALS:
        try:
          self._previous[signum] = signal.signal(signum, self._handle)
        except ValueError:   # not the main thread: no signal handling
          pass
    return self

  def _handle(self, signum, frame):
    if signum == signal.SIGINT and not self.armed:
      previous = self._previous.get(signum)
      if callable(previous):
        previous(signum, frame)
      raise KeyboardInterrupt
    del frame
    if self.raised and signum == signal.SIGINT:
      raise KeyboardInterrupt   # a second Ctrl-C: stop now, without saving
    self.raised = True
    self.signal_name = signal.Signals(signum).name
    if signum == signal.SIGINT:
      print('\ninterrupted: saving a checkpoint after this step (Ctrl-C again to quit without saving)',
            file=sys.stderr, flush=True)

  def __exit__(self, *exc):
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous = {}
    return False
