"""Process-level concerns of a run: the multi-host keys (the command line starts
`jax.distributed` with them: capsjax.app.distributed), the devices in words, and stop
requests (signals). `StopRequests` turns SIGTERM (how schedulers and Cloud TPU announce a
preemption) and SIGINT (Ctrl-C) into a flag that the training loop reads after every
step: it saves a checkpoint and exits cleanly. A second Ctrl-C stops at once without saving, and so does a Ctrl-C before
the loop has compiled its first step (nothing is trained yet that a checkpoint would keep).
"""
import platform
import signal
import sys
from typing import Optional

import jax

from capsjax.keys import Across, boolean, key, host_port, int_at_least, int_in, one_of


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


KEYS = (
    # Multi-host (capsjax.sharding): every process runs the same command; on Cloud TPU the
    # coordinator is found automatically, elsewhere give address, count and id. The command
    # line starts jax.distributed with them (capsjax.app.distributed) before any computation.
    key('distributed', False, boolean(), 'start jax.distributed (several hosts run the same command)'),
    key('coordinator_address', '', host_port(), 'HOST:PORT of process 0 (empty: detected on Cloud TPU, SLURM, '
        'Open MPI)'),
    key('num_processes', 0, int_at_least(0), 'processes in a multi-host run (0: detected)'),
    key('process_id', -1, int_at_least(-1), "this process's index (-1: detected)"),
    key('distributed_timeout_s', 120, int_in(1, 3600), 'seconds to wait for the coordinator and the other '
        'processes before giving up with one error line'),
    # JAX gives a process in a detected cluster (Slurm, Open MPI, Kubernetes) only the GPU of
    # its local rank, unless told which: one process per GPU, or 'all' for one per host.
    key('local_devices', 'detected', one_of(('detected', 'all')), "the host's GPUs a process of a multi-host run "
        "uses: 'detected' (JAX's rule: under Slurm, Open MPI or Kubernetes the one of its local rank, so start one "
        "process per GPU), 'all' (every GPU it sees: one process per host)"),
)
# How the command's processes start (read once, before anything runs): one value for
# everything a command trains, never a sweep variant's own.
PROCESS_KEYS = tuple(declared.name for declared in KEYS)


def _distributed_problem(distributed, coordinator_address, num_processes, process_id, local_devices):
  defaults = {declared.name: declared.default for declared in KEYS}
  given = [f'{name}={value!r}' for name, value in (('coordinator_address', coordinator_address),
                                                   ('num_processes', num_processes), ('process_id', process_id),
                                                   ('local_devices', local_devices))
           if value != defaults[name]]
  if given and not distributed:
    return f'config.{given[0]}: used only with --config.distributed=True (a multi-host run)'
  if num_processes and process_id >= num_processes:
    return (f'config.process_id={process_id}: allowed below num_processes={num_processes} (processes are '
            'numbered from 0)')
  return None


# The rule across these keys (capsjax.keys.Across), checked by validation.
RULES = (Across(('distributed', 'coordinator_address', 'num_processes', 'process_id', 'local_devices'),
                _distributed_problem),)


# Why a run stopped early because someone asked: Ctrl-C ('interrupted'), or SIGTERM / a
# preemption notice ('preempted'). Both save and are resumed by the same command.
SIGNAL_STOPS = ('interrupted', 'preempted')


def stop_reason(signal_name: Optional[str]) -> str:
  return 'interrupted' if signal_name == 'SIGINT' else 'preempted'


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


def describe_devices() -> str:
  """'8 × TPU v4 devices (cpu backend), 2 processes'-style: what the run trains on."""
  processes = jax.process_count()
  return (f'{jax.device_count()} × {device_name()} ({jax.default_backend()})'
          + (f' over {processes} processes' if processes > 1 else ''))
