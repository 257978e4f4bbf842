"""Errors that `run.py` reports as one line (no traceback) with a non-zero exit."""


class CapsjaxError(Exception):
  """Base class of what capsjax raises for the user's input or environment, never for a
  bug: a config value (ConfigError), data (DataError), a workdir (WorkdirError), a
  checkpoint (CheckpointError), a stopped run (RunStopped). Its message is the one line the
  command prints; `except capsjax.CapsjaxError` catches every such refusal.

  Example:
    >>> try:
    ...   capsjax.load_dataset('mnist', 'validation')
    ... except capsjax.CapsjaxError as error:
    ...   print(type(error).__name__, error)
    DataError unknown split 'validation': allowed train, test
  """


class DataError(CapsjaxError):
  """A dataset is missing, malformed or inconsistent."""


class ConfigError(CapsjaxError):
  """An unknown experiment or config key, or an invalid value: its message is the one line
  the command prints (`config.KEY=VALUE: allowed …`).

  Example:
    >>> config = capsjax.base_config()
    >>> config.learning_rate = -1.0
    >>> try:
    ...   capsjax.validate(config)
    ... except capsjax.ConfigError as error:
    ...   print(error)
    config.learning_rate=-1.0: allowed a finite number > 0
    >>> issubclass(capsjax.ConfigError, capsjax.errors.CapsjaxError)   # what every command catches
    True
  """


class ArgumentError(CapsjaxError, ValueError, TypeError):
  """An argument a library function refuses: an array of the wrong shape or dtype, a value
  out of its range, something of the wrong kind (a routing that returns one array, a
  registration's options). Also a ValueError and a TypeError, what NumPy and JAX raise for
  such input, so code written against either still catches it.

  Example:
    >>> try:
    ...   capsjax.squash(jnp.ones((2, 3)), axis=5)
    ... except capsjax.CapsjaxError as error:
    ...   print(type(error).__name__, error)
    ArgumentError squash: axis 5 is out of bounds for vectors of shape (2, 3)
  """


class NaNLossError(CapsjaxError):
  """The training loss became NaN or infinite."""


class CheckpointError(CapsjaxError):
  """A checkpoint in the workdir cannot be restored (or there is none)."""


class CheckpointWriteError(CheckpointError):
  """A checkpoint could not be written (full disk, read-only or vanished folder)."""


class RunStopped(CapsjaxError):
  """A run stopped before its last step, after saving a checkpoint: by a signal or a
  preemption notice ('preempted'), by Ctrl-C ('interrupted') or at config.stop_at_step
  ('stop_at_step'). The same
  command (or call) resumes it. Command lines exit 75 (capsjax.app.cli.EXIT_RESUMABLE)."""

  def __init__(self, steps: int, num_steps: int, stop_reason: str):
    super().__init__(f'stopped at step {steps} of {num_steps} ({stop_reason}); run again to resume')
    self.steps, self.num_steps, self.stop_reason = steps, num_steps, stop_reason


class WorkdirError(CapsjaxError):
  """The workdir cannot be used: not a directory, not writable, locked by another run."""
