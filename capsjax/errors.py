"""Errors that `run.py` reports as one line (no traceback) with a non-zero exit."""


class CapsjaxError(Exception):
  """Base class: a problem with the user's input or environment, not a bug."""


class DataError(CapsjaxError):
  """A dataset is missing, malformed or inconsistent."""


class ConfigError(CapsjaxError):
  """An unknown experiment or config key, or an invalid value."""


class NaNLossError(CapsjaxError):
  """The training loss became NaN or infinite."""


class CheckpointError(CapsjaxError):
  """A checkpoint in the workdir cannot be restored (or there is none)."""


class CheckpointWriteError(CheckpointError):
  """A checkpoint could not be written (full disk, read-only or vanished folder)."""


class WorkdirError(CapsjaxError):
  """The workdir cannot be used: not a directory, not writable, locked by another run."""
