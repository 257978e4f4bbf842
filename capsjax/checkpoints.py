"""Checkpoints of a run: orbax `CheckpointManager` with one clear error for every failure.

A checkpoint holds two items: `state` (the plain pytree {'params', 'opt_state', 'step'})
and `progress` (JSON: the training wall time so far, so that it adds up over resumes).
Saves are asynchronous; a save that fails (full disk, read-only or vanished folder) is
found by `check()` at the next step, and stops the run with a CheckpointWriteError that
names the last complete checkpoint on disk (command lines then exit without interpreter
teardown, see `capsjax.app.cli.fail`). Orbax's own multi-line error logs are kept off the console for such failures.
"""
import ast
import contextlib
import errno
import json
import logging
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from capsjax import sharding
from capsjax.errors import CheckpointError, CheckpointWriteError

State = Dict[str, Any]
# Where checkpoints that cannot be read are moved (beside workdir/checkpoints), never deleted.
DAMAGED_DIR = 'damaged_checkpoints'
# A reader beside a running training lists the checkpoints again this often when a step it
# listed was removed meanwhile (the training keeps only the latest few).
READER_ATTEMPTS = 5
_OS_ERRORS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EIO, errno.ENOENT, errno.EPERM)


def newest_step_on_disk(directory: str) -> Optional[int]:
  """The largest step folder in a checkpoint directory, read from its listing (no orbax)."""
  try:
    steps = [int(name) for name in os.listdir(directory) if name.isdigit()]
  except OSError:
    return None
  return max(steps) if steps else None


def step_of(state: State) -> int:
  """The step count of a state (an ensemble's members all share it)."""
  return int(np.asarray(sharding.to_host(state['step'])).reshape(-1)[0])


def _first_shape_mismatch(restored, template):
  """(parameter path, saved shape, expected shape) of the first leaf whose shape differs
  (or is missing), or None."""
  def shapes(tree):
    return {jax.tree_util.keystr(path, simple=True, separator='/'): tuple(np.shape(leaf))
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
  saved, expected = shapes(restored), shapes(template)
  for name in sorted(expected, key=lambda name: not name.startswith('params/')):   # parameters first
    shape = expected[name]
    if saved.get(name) != shape:
      return name, saved.get(name, 'nothing'), shape
  return None


# A part of the training state, as a config change that reshapes it is told.
STATE_PARTS = {'params': 'the parameters', 'opt_state': 'the optimizer state (config.optimizer, grad_clip_norm, '
               'weight_decay)', 'ema_params': 'the moving average of the parameters (config.ema_decay)'}


def _saved_paths(step_directory: str) -> Optional[set]:
  """The leaf paths of the state saved in a checkpoint's folder (orbax's metadata file),
  as tuples of names; None where it cannot be read."""
  try:
    with open(os.path.join(step_directory, 'state', '_METADATA')) as f:
      return {tuple(ast.literal_eval(key)) for key in json.load(f)['tree_metadata']}
  except Exception:  # pylint: disable=broad-except
    return None


def _template_paths(template) -> set:
  name = lambda key: str(getattr(key, 'key', getattr(key, 'idx', getattr(key, 'name', key))))
  return {tuple(map(name, path)) for path, _ in jax.tree_util.tree_flatten_with_path(template)[0]}


def structure_change(step_directory: str, template) -> Optional[str]:
  """Which part of the state the saved checkpoint holds in another structure than the
  config's (the optimizer state of another optimizer, a moving average added or dropped),
  as words; None when they agree or the saved structure cannot be read."""
  saved = _saved_paths(step_directory)
  if saved is None:
    return None
  expected = _template_paths(template)
  for part in sorted({path[0] for path in saved | expected}, key=lambda part: part != 'params'):
    mine = {path for path in expected if path[0] == part}
    theirs = {path for path in saved if path[0] == part}
    if mine != theirs:
      what = STATE_PARTS.get(part, f'the state\'s {part!r}')
      return (f'{what}: the config ' + ('has none' if not mine else 'adds it' if not theirs else 'changes its form'))
  return None


def _reason(error: BaseException) -> str:
  """A short cause: the OS error inside orbax's message when there is one."""
  text = str(error)
  for code in _OS_ERRORS:
    if os.strerror(code) in text:
      return os.strerror(code)
  first = text.splitlines()[0] if text else ''
  return f'{type(error).__name__}: {first[:200]}'


class _DropOrbaxRecords(logging.Filter):
  """Orbax logs every failed write with tracebacks from several threads; the run reports
  the failure once itself. A reader drops orbax's warnings too (that its options are
  read-only, as asked)."""

  def __init__(self, level: int = logging.ERROR):
    super().__init__()
    self.level = level

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.levelno >= self.level and f'{os.sep}orbax{os.sep}' in record.pathname)


class _DropClosedLoopNoise:
  """After a failed write, tensorstore's callbacks into orbax's closed asyncio loop raise
  'Event loop is closed' in background threads, which Python prints as unraisable
  exceptions; the failure itself is reported once, by the run."""

  def __init__(self):
    self.previous = sys.unraisablehook

  def __call__(self, unraisable):
    if isinstance(unraisable.exc_value, RuntimeError) and 'Event loop is closed' in str(unraisable.exc_value):
      return
    self.previous(unraisable)


class _KeptSteps:
  """An orbax preservation policy: the checkpoints of `steps` survive (beside the latest
  ones, which LatestN keeps); the set changes as the run goes."""

  def __init__(self):
    self.steps: set = set()

  def should_preserve(self, checkpoints, *, context) -> List[bool]:
    del context
    return [info.step in self.steps for info in checkpoints]


class Checkpoints:
  """The checkpoints of one run in workdir/checkpoints: the latest `keep`, and those of
  the steps named by `keep_steps` (the best validation step of each member).

  `read_only`: for a reader beside a training that may be running (predict, export,
  load_trained, the explorer): nothing is created, saved or deleted. A writer's start
  removes unfinished saves (*.orbax-checkpoint-tmp); a reader's must not, since one may be
  the running training's save in flight."""

  def __init__(self, workdir: str, keep: int = 3, read_only: bool = False):
    self.directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
    self.read_only = read_only
    self._kept = _KeptSteps()
    if read_only:
      options = ocp.CheckpointManagerOptions(read_only=True, create=False, cleanup_tmp_directories=False,
                                             save_interval_steps=0)
    else:
      options = ocp.CheckpointManagerOptions(
          create=True, cleanup_tmp_directories=True,
          preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(
              [ocp.checkpoint_managers.LatestN(keep), self._kept]))
    self._attempted: List[int] = []   # steps whose save was started
    self.failed = False
    self._filter = _DropOrbaxRecords(logging.WARNING if read_only else logging.ERROR)
    logging.getLogger('absl').addFilter(self._filter)
    self._unraisable = _DropClosedLoopNoise()
    sys.unraisablehook = self._unraisable
    for attempt in range(READER_ATTEMPTS if read_only else 1):
      try:
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        break
      except Exception as e:  # pylint: disable=broad-except
        if self._deleted_under_reader(e) and attempt + 1 < READER_ATTEMPTS:
          continue
        self._remove_filter()
        raise CheckpointError(f'cannot open checkpoints in {self.directory} ({_reason(e)})') from None

  def _deleted_under_reader(self, error: BaseException) -> bool:
    """Whether a reader's failure is a step that the running training removed while it was
    listed (its older checkpoints beyond `keep`): the reader lists them again."""
    return self.read_only and os.path.isdir(self.directory) and _reason(error) == os.strerror(errno.ENOENT)

  # --------------------------------------------------------------------------- reading
  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def all_steps(self) -> List[int]:
    return sorted(self.manager.all_steps())

  def restore(self, template: State, step: Optional[int] = None) -> Tuple[State, Dict[str, Any]]:
    """(state, its progress) of `step` (default: the latest), or (`template`, {}) when
    there is no checkpoint. `template` gives the structure, shapes and dtypes: arrays, or
    jax.ShapeDtypeStruct."""
    if step is None:
      for attempt in range(READER_ATTEMPTS if self.read_only else 1):
        step = self.manager.latest_step()
        if step is None:
          return template, {}
        try:
          return self._restore(template, step)
        except CheckpointError:   # a reader's latest step, removed by a training since it was listed
          if not (self.read_only and attempt + 1 < READER_ATTEMPTS
                  and not os.path.isdir(os.path.join(self.directory, str(step)))):
            raise
          self.manager.reload()
    if step not in self.manager.all_steps():
      raise CheckpointError(f'no checkpoint of step {step} in {self.directory} '
                            f'(there are: {", ".join(map(str, self.all_steps())) or "none"})')
    return self._restore(template, step)

  def _restore(self, template: State, step: int) -> Tuple[State, Dict[str, Any]]:
    abstract = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), template)   # host arrays
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), progress=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises many types for unreadable / mismatched files.
      changed = structure_change(os.path.join(self.directory, str(step)), template)
      if changed:   # no damage: a config change the saved state cannot continue
        raise CheckpointError(
            f'checkpoint step {step} in {self.directory} cannot continue with this config: {changed} '
            '(a changed optimizer or moving average cannot resume this run; use another --workdir)') from None
      error = CheckpointError(
          f'cannot restore checkpoint step {step} in {self.directory} ({_reason(e)}); '
          'it was left in place: move it away to start afresh')
      error.reason = _reason(e)   # for restore_newest_intact's warning
      raise error from None
    mismatch = _first_shape_mismatch(restored['state'], template)
    if mismatch:
      name, saved, expected = mismatch
      raise CheckpointError(
          f'checkpoint step {step} in {self.directory} holds {name} of shape {saved}; this config\'s model '
          f'has {expected}: a change of parameter shapes cannot continue this run (use another --workdir)')
    return jax.tree.map(jnp.asarray, restored['state']), dict(restored['progress'] or {})

  def restore_newest_intact(self, template: State, warn) -> Tuple[State, Dict[str, Any]]:
    """`restore(template)` of the newest checkpoint that can be read. A newer one that
    cannot (truncated, corrupted) is set aside as DAMAGED_DIR/STEP beside the checkpoints,
    never deleted, with one `warn` line naming it; with none intact, the newest one's
    CheckpointError (all left in place). A checkpoint whose shapes do not fit the config
    is no damage: that error stands at once."""
    steps = self.all_steps()
    if not steps:
      return template, {}
    failures = []
    for step in reversed(steps):
      try:
        restored = self.restore(template, step)
      except CheckpointError as e:
        if 'this config' in str(e):   # shapes or state of another config: no damage
          raise
        failures.append((step, e))
        continue
      for damaged, error in failures:
        self._set_aside(damaged)
        warn(f'warning: checkpoint step {damaged} cannot be read ({getattr(error, "reason", error)}); '
             f'moved to {os.path.join(self.damaged_directory, str(damaged))}, resuming from step {step}')
      if failures:
        self.manager.reload()   # the set-aside steps are gone from its list
      return restored
    raise failures[0][1]

  @property
  def damaged_directory(self) -> str:
    return os.path.join(os.path.dirname(self.directory), DAMAGED_DIR)

  def _set_aside(self, step: int) -> None:
    os.makedirs(self.damaged_directory, exist_ok=True)
    target = os.path.join(self.damaged_directory, str(step))
    if os.path.exists(target):   # set aside before: keep both
      target += f'.{len(os.listdir(self.damaged_directory))}'
    os.replace(os.path.join(self.directory, str(step)), target)

  # --------------------------------------------------------------------------- writing
  def keep_steps(self, steps) -> None:
    """The checkpoints of `steps` are kept beside the latest ones from now on (a step
    without a checkpoint is harmless); the previous set is replaced."""
    self._kept.steps = {int(step) for step in steps}

  def finished_steps(self) -> List[int]:
    """Steps whose checkpoint is complete on disk (orbax renames a step's temporary folder
    only once every item is written; a failed save leaves it as *.orbax-checkpoint-tmp)."""
    try:
      names = os.listdir(self.directory)
    except OSError:
      return []
    return sorted(int(name) for name in names if name.isdigit())

  def _failed(self, error: BaseException) -> CheckpointWriteError:
    self.failed = True
    with contextlib.suppress(Exception):   # let an earlier save in flight finish (or fail)
      self.manager.wait_until_finished()
    finished = self.finished_steps()
    last_good = finished[-1] if finished else None
    failed = [step for step in self._attempted if last_good is None or step > last_good]
    step = f' step {failed[0]}' if failed else ''
    kept = f'last good checkpoint: step {last_good}' if last_good is not None else 'no checkpoint was written'
    return CheckpointWriteError(f'cannot write checkpoint{step} to {self.directory} '
                                f'({_reason(error)}); training stopped ({kept})')

  def check(self) -> None:
    """Raises CheckpointWriteError if a background save has failed."""
    try:
      self.manager.check_for_errors()
    except Exception as e:  # pylint: disable=broad-except
      raise self._failed(e) from None

  def save(self, state: State, progress: Dict[str, Any]) -> None:
    """Starts writing `state` (copied to the host first: its device buffers are donated
    to the next step while orbax writes)."""
    self.check()
    host_state = jax.tree.map(np.array, sharding.to_host(state))
    step = step_of(host_state)
    self._attempted.append(step)
    try:
      self.manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(host_state), progress=ocp.args.JsonSave(progress)), force=True)
    except Exception as e:  # pylint: disable=broad-except
      raise self._failed(e) from None

  def wait(self) -> None:
    """Blocks until every save is on disk; raises CheckpointWriteError if one failed."""
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise self._failed(e) from None
    self.check()

  def reached_preemption(self, step: int) -> bool:
    return self.manager.reached_preemption(step)

  def _remove_filter(self) -> None:
    logging.getLogger('absl').removeFilter(self._filter)
    if sys.unraisablehook is self._unraisable and not self.failed:   # the noise outlives a failure
      sys.unraisablehook = self._unraisable.previous

  def close(self) -> None:
    if not self.failed:   # after a failed write, closing can block on orbax's threads
      with contextlib.suppress(Exception):
        self.manager.close()
    self._remove_filter()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
    return False
