"""Process-level concerns of a run: multi-host start-up and stop requests (signals).

`initialize_distributed` starts `jax.distributed` for multi-host runs. `StopRequests`
turns SIGTERM (how schedulers and Cloud TPU announce a preemption) and SIGINT (Ctrl-C)
into a flag that the training loop reads after every step: it saves a checkpoint and
exits cleanly. A second Ctrl-C stops at once without saving.
"""
import signal
import sys

import jax


def initialize_distributed(config) -> None:
  """`jax.distributed.initialize` when config.distributed is set (multi-host runs).

  On Cloud TPU and SLURM/MPI clusters every argument is detected automatically; elsewhere
  pass config.coordinator_address ('host:port'), config.num_processes and
  config.process_id to every process.
  """
  if not config.distributed:
    return
  kwargs = {}
  if config.coordinator_address:
    kwargs['coordinator_address'] = config.coordinator_address
  if config.num_processes:
    kwargs['num_processes'] = config.num_processes
  if config.process_id >= 0:
    kwargs['process_id'] = config.process_id
  jax.distributed.initialize(**kwargs)


class StopRequests:
  """A context in which SIGTERM and SIGINT set `raised` (and `signal_name`) instead of
  killing the process. With `install=False` (several processes, where JAX's preemption
  service owns SIGTERM) nothing is installed and `raised` stays False."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self, install: bool = True):
    self.raised = False
    self.signal_name = None
    self.install = install
    self._previous = {}

  def __enter__(self):
    if self.install:
      for signum in self.SIGNALS:
        try:
          self._previous[signum] = signal.signal(signum, self._handle)
        except ValueError:   # not the main thread: no signal handling
          pass
    return self

  def _handle(self, signum, frame):
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
