"""The start of a multi-host run, before any JAX computation (the command line's job: a
library user calls `jax.distributed.initialize` as they see fit): `jax.distributed` with
the run's keys (config.distributed, coordinator_address, num_processes, process_id,
distributed_timeout_s; declared in capsjax.runtime), each failure one error line, never
JAX's own abort after a silent wait; and the backend JAX_PLATFORMS asks for, checked.
"""
import os
import re
import socket
import sys
import threading
import time

import jax

from capsjax.errors import ConfigError


def initialize_distributed(distributed: bool, coordinator_address: str = '', num_processes: int = 0,
                           process_id: int = -1, timeout_s: int = 120, local_devices: str = 'detected') -> None:
  """`jax.distributed.initialize` when `distributed` (config.distributed) is set.

  On Cloud TPU and SLURM/MPI clusters every argument is detected automatically; elsewhere
  pass config.coordinator_address ('host:port'), config.num_processes and
  config.process_id to every process (0 / -1: detected). `local_devices` (config's):
  'detected' leaves the GPUs to JAX (in a detected cluster, the one of the process's local
  rank); 'all' hands it every GPU the process sees (`local_device_ids`).
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
  if local_devices == 'all':
    kwargs['local_device_ids'] = list(range(visible_gpus()))
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


def visible_gpus() -> int:
  """The NVIDIA GPUs this process may use, counted before JAX starts (jax.distributed must
  come first): CUDA_VISIBLE_DEVICES where set (Slurm sets it for a job's GPUs), else the
  driver's device files. ConfigError for none."""
  import glob  # pylint: disable=g-import-not-at-top
  visible = os.environ.get('CUDA_VISIBLE_DEVICES')
  count = (len([part for part in visible.split(',') if part.strip()]) if visible is not None
           else len([path for path in glob.glob('/dev/nvidia*') if re.fullmatch(r'/dev/nvidia\d+', path)]))
  if not count:
    raise ConfigError("config.local_devices='all': this process sees no GPU (CUDA_VISIBLE_DEVICES="
                      f"{visible!r})" if visible is not None else
                      "config.local_devices='all': this machine has no NVIDIA GPU (no /dev/nvidiaN)")
  return count


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
