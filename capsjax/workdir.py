"""A run's working directory: checked before use, locked while in use, bound to one config.

- `prepare(path)`: `~` expanded, created, and proven writable with a probe file, so a
  read-only folder, a file or a full disk is one clear error before anything is computed.
- `Lock`: a second run on the same workdir stops at once with the holder's pid.
- `run_status` / `end_status`: what the run in it is (fresh, resumed, finished) at the start
  and at the end of an invocation. Its `config.json` is capsjax.stored_config's (bound,
  recorded, compared).
- `MetricsLog`: `metrics.jsonl`, cut back to the restored step on resume, so every step
  appears once.
"""
import errno
import fcntl
import json
import os
import time
from typing import Any, Dict, List, Optional

from capsjax.errors import CheckpointError, WorkdirError
from capsjax.runtime import SIGNAL_STOPS

CONFIG_FILE = 'config.json'
LOCK_FILE = '.lock'
METRICS_FILE = 'metrics.jsonl'
# What a run keeps in its workdir: name → whether it is a folder.
RUN_ENTRIES = {CONFIG_FILE: False, 'results.json': False, METRICS_FILE: False, LOCK_FILE: False,
               'table.md': False, 'checkpoints': True}
# The explorer's model (what capsjax-export writes for the explorer): a config.json too, never a run.
EXPLORER_FILES = ('params.npz', 'test_sample.npz', CONFIG_FILE)

def is_explorer_model(directory: str) -> bool:
  """Whether `directory` holds what capsjax-export writes (and no run's checkpoints)."""
  checkpoints = os.path.join(directory, 'checkpoints')
  return (all(os.path.isfile(os.path.join(directory, name)) for name in EXPLORER_FILES)
          and not (os.path.isdir(checkpoints) and os.listdir(checkpoints)))


def _describe_os_error(error: OSError) -> str:
  return error.strerror or os.strerror(error.errno or 0) or type(error).__name__


def prepare(path: str) -> str:
  """The absolute, `~`-expanded workdir, created and checked writable."""
  path = os.path.abspath(os.path.expanduser(path))
  if os.path.exists(path) and not os.path.isdir(path):
    raise WorkdirError(f'workdir {path} exists and is not a directory')
  for name, is_folder in RUN_ENTRIES.items():   # found now, not after the data is read and traced
    entry = os.path.join(path, name)
    if os.path.lexists(entry) and os.path.isdir(entry) != is_folder:
      what, expected = ('a file', 'folder') if is_folder else ('a folder', 'file')
      raise WorkdirError(f'workdir {path}: {name} is {what} where a run keeps its {expected} '
                         f'({"checkpoints" if is_folder else "its record"}); move it away or use another --workdir')
  if is_explorer_model(path):   # (once: "holds a run with another config")
    raise WorkdirError(f'workdir {path} holds an exported model ({", ".join(EXPLORER_FILES)}: capsjax-export\'s '
                       'files), not a run; use another --workdir')
  try:
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, f'.write_probe.{os.getpid()}')
    with open(probe, 'wb') as f:
      f.write(b'\0' * 4096)   # a few blocks: a full disk fails here, not an hour later
      f.flush()
      os.fsync(f.fileno())
    os.remove(probe)
  except OSError as e:
    raise WorkdirError(f'workdir {path} is not usable: {_describe_os_error(e)}') from None
  return path


def discard_unbound(path: str) -> None:
  """Removes a workdir that no run has bound (no config.json): what a failed start left
  there (the lock, empty folders). Anything else in it stays."""
  if os.path.exists(os.path.join(path, CONFIG_FILE)):
    return
  for folder, subfolders, files in os.walk(path, topdown=False):
    for name in files:
      if name == LOCK_FILE and folder == path:
        os.remove(os.path.join(folder, name))
    try:
      os.rmdir(folder)   # only when empty
    except OSError:
      pass


class Lock:
  """An exclusive lock on workdir/.lock for the life of a run (released by the kernel if
  the process dies, so a killed run never leaves a stale lock). A lock file this lock made
  goes again when the block raises before the run recorded its config: a start refused in
  a folder of someone else's (its config.json another run's) leaves nothing there."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_FILE)
    self._config = os.path.join(workdir, CONFIG_FILE)
    self._file = None
    self._made, self._config_before = False, None

  def _config_state(self):   # (None: no config.json)
    found = os.stat(self._config) if os.path.exists(self._config) else None
    return found and (found.st_mtime_ns, found.st_size, found.st_ino)

  def __enter__(self):
    self._made, self._config_before = not os.path.lexists(self.path), self._config_state()
    self._file = open(self.path, 'a+')
    try:
      fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EAGAIN, errno.EACCES):
        raise
      self._file.seek(0)
      holder = self._file.read().strip() or 'unknown'
      self._file.close()
      self._file = None
      raise WorkdirError(f'workdir {os.path.dirname(self.path)} is in use by another run '
                         f'(pid {holder}); wait for it to end or use another --workdir') from None
    self._file.seek(0)
    self._file.truncate()
    self._file.write(f'{os.getpid()}\n')
    self._file.flush()
    return self

  def __exit__(self, exc_type, *exc):
    if self._file is not None:
      if exc_type and self._made and self._config_state() == self._config_before and os.path.exists(self.path):
        os.remove(self.path)   # (the run bound nothing: its lock file is all it left)
      fcntl.flock(self._file, fcntl.LOCK_UN)
      self._file.close()
      self._file = None
    return False


def read_results(workdir: str) -> Dict[str, Any]:
  """The run's results.json, or {} where there is none (or it cannot be read)."""
  try:
    with open(os.path.join(workdir, 'results.json')) as f:
      results = json.load(f)
  except (OSError, ValueError):
    return {}
  return results if isinstance(results, dict) else {}


def write_json(path: str, value) -> None:
  temporary = path + '.tmp'
  with open(temporary, 'w') as f:
    json.dump(value, f, indent=2, default=str)
  os.replace(temporary, path)   # never a half-written file


class MetricsLog:
  """workdir/metrics.jsonl, one JSON object per line; only the writer process writes.
  With `events` (capsjax.events.EventWriter) every row is also written for TensorBoard."""

  def __init__(self, workdir: str, is_writer: bool = True, events=None):
    self.path = os.path.join(workdir, METRICS_FILE)
    self.is_writer = is_writer
    self.events = events if is_writer else None

  def truncate_after(self, step: int) -> None:
    """Drops rows after `step` (written after the checkpoint a resumed run restarts from)."""
    if self.events is not None and step:
      self.events.restart_at(step)
    if not self.is_writer or not os.path.isfile(self.path):
      return
    kept = []
    with open(self.path) as f:
      for line in f:
        try:
          if json.loads(line).get('step', 0) <= step:
            kept.append(line if line.endswith('\n') else line + '\n')
        except ValueError:
          continue   # a line cut off by a crash
    temporary = self.path + '.tmp'
    with open(temporary, 'w') as f:
      f.writelines(kept)
    os.replace(temporary, self.path)

  def write(self, **record) -> None:
    """Appends one row, with `time`: the wall clock (Unix seconds) when it was written, so
    that curves can be read against time as well as steps."""
    if not self.is_writer:
      return
    record = dict(record, time=round(time.time(), 3))
    try:
      with open(self.path, 'a') as f:
        f.write(json.dumps(record) + '\n')
    except OSError as e:
      raise WorkdirError(f'cannot append to {self.path}: {_describe_os_error(e)}') from None
    if self.events is not None:
      fields = {k: v for k, v in record.items() if k not in ('split', 'step', 'epoch', 'time')}   # events keep their own
      self.events.scalars(record.get('step', 0), record.get('split', 'metrics'), fields)

  def images(self, step: int, tag: str, images) -> None:
    """uint8 images [n, h, w, c] for TensorBoard (nothing without `events`)."""
    if self.events is not None:
      self.events.images(step, tag, images)

  def close(self) -> None:
    if self.events is not None:
      self.events.close()

  def read(self) -> List[Dict[str, Any]]:
    if not os.path.isfile(self.path):
      return []
    with open(self.path) as f:
      return [json.loads(line) for line in f if line.strip()]


def _reevaluation_refused(workdir: str, previous: Dict[str, Any], found: str) -> str:
  return (f'--config.reevaluate=True: {workdir} finished at step {previous.get("steps")} but {found}, so its '
          'final parameters cannot be evaluated again (training on would overwrite results.json); '
          'nothing was changed')


def run_status(workdir: str, reevaluate: bool, previous: Dict[str, Any], step: Optional[int],
               num_steps: Optional[int] = None, restored: bool = False) -> str:
  """What the run in `workdir` is: 'fresh' (no checkpoint), 'resume' (train on from `step`),
  'finished' (its results.json stands) or 'reevaluate' (finished, and `reevaluate`, the
  run's setting, asks for its final parameters to be evaluated again).

  `previous`: its results.json ({} if none); `step`: its newest checkpoint's step (None:
  none), on disk or as `restored`; `num_steps`: the run's length (None: the length it ran
  to). CheckpointError where re-evaluation is asked of a finished run whose final
  checkpoint is gone: training on from an older one would overwrite its results."""
  completed = bool(previous.get('completed'))
  at_final_step = completed and step == previous.get('steps')
  if reevaluate and completed and not at_final_step:
    found = (f'restored step {step}' if restored else 'it has no checkpoint' if step is None
             else f'its newest checkpoint is of step {step}')
    raise CheckpointError(_reevaluation_refused(workdir, previous, found))
  if at_final_step and (num_steps is None or step >= num_steps or previous.get('stopped_early')):
    return 'reevaluate' if reevaluate else 'finished'
  return 'resume' if step else 'fresh'


def end_status(step: int, num_steps: int, stop_reason: Optional[str], evaluated_step: Optional[int]) -> str:
  """What the run is when an invocation's loop ends at `step` of its `num_steps`, as
  run_status says it at the start: 'stopped' (short of its length, or a stop request during
  its last evaluation: resumable, nothing to report), 'unevaluated' (at its length, that
  step not evaluated: a finished run resumed, its parameters to evaluate now) or 'finished'."""
  if step < num_steps or (stop_reason in SIGNAL_STOPS and evaluated_step != step):
    return 'stopped'
  return 'finished' if evaluated_step == step else 'unevaluated'
