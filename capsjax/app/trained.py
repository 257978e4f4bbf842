"""A trained run, below every program that reads one (predict, the explorer, export,
figures, segmentation, the experiment programs): load its config and a checkpoint,
choose a member or a step, and write or read an exported (float16) model.
"""
import dataclasses
import json
import os
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import traverse_util

from capsjax import assemble, reports, steps
from capsjax.checkpoints import Checkpoints
from capsjax.data.tasks import TASKS
from capsjax.errors import CheckpointError, ConfigError, WorkdirError
from capsjax.keys import is_int
from capsjax.models import MODELS
from capsjax.objectives import OBJECTIVES
from capsjax.stored_config import read_config, upgraded
from capsjax.workdir import EXPLORER_FILES, RUN_ENTRIES, MetricsLog, is_explorer_model, read_results

# The paper's MNIST CapsNet that ships with the package (mnist_official, docs/results.md
# "The capsule explorer"), exported with its sample of test images: what predict and the explorer serve without --workdir.
SHIPPED = os.path.join(os.path.dirname(__file__), 'explorer', 'assets')


@dataclasses.dataclass
class TrainedModel:
  """One trained model as predict and the explorer use it: the run's config (as read from
  its workdir or export), its module, one member's parameters (`summed_seeds`: every
  member's, on a leading axis), where it came from, and what its family, task and
  objective can do (their registry entries).

  Example:
    `workdir` as in load_trained's example.

    >>> trained = capsjax.TrainedModel.from_workdir(workdir)
    >>> trained.step, trained.finished, trained.has_decoder
    (4, True, True)
    >>> capsjax.TrainedModel.shipped().describe()   # the paper's CapsNet capsjax ships
    'the shipped model (exported from mnist_official)'
  """
  config: ml_collections.ConfigDict
  model: Any
  params: Any
  source: str
  step: Optional[int] = None        # the checkpoint's step (None: an export)
  num_steps: Optional[int] = None   # the run's length, where known
  finished: Optional[bool] = None   # whether training reached its end (or stopped early, done)
  member: Optional[int] = None      # of an ensemble run: which member, of how many
  members: Optional[int] = None
  summed: bool = False              # every member of a seed ensemble (summed_seeds): params [members, …]
  in_memory: bool = False           # given from Python (load_trained's tuple): no workdir, no export

  @classmethod
  def from_workdir(cls, workdir: str, member: Optional[int] = None, data: Optional[Dict[str, str]] = None,
                   step: Optional[int] = None) -> 'TrainedModel':
    """The run in `workdir` at its latest checkpoint (or `step`), member `member` of an
    ensemble (default: the last); `data` as in load_trained. A folder `export` wrote (an
    exported model: one model, float16 parameters) is read as `exported` reads it."""
    if member is not None:
      check_member_type(member)   # before the checkpoint is read
    if is_explorer_model(workdir):
      if member is not None or step is not None:
        raise CheckpointError(f'{workdir} holds an exported model (one model, no checkpoints): --member and --step '
                              "choose within a run's workdir")
      trained = cls.exported(workdir)
      trained.config.update(_checked_data(data))
      return trained
    config, model, params, state, progress, which = _restore_one(workdir, data, step, member)
    return cls(config, model, params, workdir, *_progress(workdir, state, progress, config.get('num_steps')), *which)

  @classmethod
  def summed_seeds(cls, workdir: str, data: Optional[Dict[str, str]] = None,
                   step: Optional[int] = None) -> 'TrainedModel':
    """Every member of an ensemble run whose members differ by seed alone, as the one
    classifier the run reports (`ensemble_test_error`: the class of the largest score
    summed over the members): `params` carry a leading member axis and `summed` is True.
    Predict (`--member=all`) sums their scores; the explorer, export and figures take one
    model (`from_workdir`'s member). The members of an ablation's grid or of several
    recipes differ by more than their seed: their sum is no classifier the run reports, and
    is refused."""
    if is_explorer_model(workdir):
      raise CheckpointError(f'--member=all: {workdir} holds an exported model (one model); all sums the members '
                            "of an ensemble run's workdir")
    config, model, state, progress = _restore(workdir, data, step)
    members = assemble.members(config)
    if not members:
      raise CheckpointError(f'--member=all: {workdir} holds a single run, not an ensemble')
    if not steps.seeds_alone(members):
      differing = sorted({field for member in members for field, value in member.items()
                          if field != 'seed' and value != members[0][field]})
      raise CheckpointError(f'--member=all: the members of {workdir} differ by {", ".join(differing)} besides their '
                            'seed, so their summed scores are no classifier the run reports; --member=K chooses one')
    single = assemble.member_config(config, 0)   # the members' model: theirs differ by seed alone
    return cls(single, assemble.model(single), state['params'], workdir,
               *_progress(workdir, state, progress, config.get('num_steps')), None, len(members), True)

  def describe(self) -> str:
    """Which model this is, for the console and the explorer's page: the checkpoint's step,
    of how many, whether the run finished, and of an ensemble run which member."""
    if self.step is None:
      return self.source if self.in_memory else f'{self.source} (exported from {self.config.experiment})'
    of = f' of {self.num_steps:,}' if self.num_steps else ''
    state = 'finished' if self.finished else 'training not finished: this is an intermediate checkpoint'
    if self.summed:
      member = f", the ensemble's {self.members} members (0..{self.members - 1}, differing by seed alone) summed"
    elif self.members is None:
      member = ''
    else:
      member = (f', member {self.member} of the ensemble\'s 0..{self.members - 1}'
                + (' (the last; --member chooses)' if self.member == self.members - 1 else ''))
    return f'{self.source} at step {self.step:,}{of} ({state}){member}'

  def require_one_model(self, what: str) -> None:
    """Refuses a seed ensemble summed (`summed_seeds`) where `what` takes one model."""
    if self.summed:
      raise CheckpointError(f'{what} takes one model, not the {self.members} members of {self.source} summed '
                            '(--member=all): choose one with --member=K (from Python, member=K)')

  @classmethod
  def of(cls, value, member: Optional[int] = None, step: Optional[int] = None) -> 'TrainedModel':
    """`value` as a TrainedModel: one already; a run's workdir (`from_workdir` with `member`
    and `step`); or load_trained's (config, model, params) of one model, held in memory.
    CapsjaxError for anything else, and for an ensemble's params (every member's at once)."""
    if isinstance(value, cls):
      return value
    if isinstance(value, (str, os.PathLike)):
      return cls.from_workdir(os.fspath(value), member, step=step)
    if isinstance(value, tuple) and len(value) == 3 and isinstance(value[0], ml_collections.ConfigDict):
      config, model, params = value
      if assemble.members(config):
        raise CheckpointError(f'the params of {config.experiment!r} hold every member of its ensemble: load one '
                              'with TrainedModel.from_workdir(workdir, member=K)')
      return cls(config, model, params, f'a model in memory ({config.experiment})', in_memory=True)
    raise CheckpointError(f'a trained model is a TrainedModel, a run\'s workdir or load_trained\'s (config, model, '
                          f'params), got {type(value).__name__}')

  @classmethod
  def exported(cls, directory: str, source: Optional[str] = None) -> 'TrainedModel':
    """A model written by `export` (float16 parameters, read back as float32)."""
    config, params = read_explorer_model(directory)
    return cls(config, assemble.model(config), params, source or directory)

  @classmethod
  def shipped(cls) -> 'TrainedModel':
    return cls.exported(SHIPPED, 'the shipped model')

  @property
  def family(self):
    return MODELS[self.config.model.name]

  @property
  def task(self):
    return TASKS[self.config.task]

  @property
  def objective(self):
    return OBJECTIVES[self.config.loss.name]

  @property
  def has_decoder(self) -> bool:
    return self.family.capsules and self.family.has_decoder(self.config.model)

  @property
  def info(self):
    """How the run held its images (shape, preprocessing, class names)."""
    return assemble.source_info(self.config)


def load_trained(workdir: str, data: Optional[Dict[str, str]] = None, step: Optional[int] = None):
  """(config, model, params) of the run in `workdir`, finished or not: its config.json and
  latest checkpoint, or that of `step` (an ensemble's params carry a leading member axis).
  `data` replaces where the data comes from (data_dir, tfds_data_dir: this machine's, not
  the run's).

  Example:
    `workdir`: the run trained in train_and_evaluate's example.

    >>> config, model, params = capsjax.load_trained(workdir)
    >>> config.experiment, type(model).__name__
    ('mnist_smoke', 'CapsNet')
    >>> jax.jit(model.apply)({'params': params}, jnp.zeros((1, 28, 28, 1)))['lengths'].shape   # [batch, classes]
    (1, 10)
  """
  config, model, state, _ = _restore(workdir, data, step)
  return config, model, state['params']


def is_seed_ensemble(workdir: str) -> bool:
  """Whether `workdir` holds an ensemble run whose members differ by seed alone (its
  reported classifier: the members summed, TrainedModel.summed_seeds); from its config."""
  if is_explorer_model(workdir):
    return False
  config = read_config(workdir)
  return bool(config.get('ensemble')) and steps.seeds_alone(assemble.members(config))


def _progress(workdir: str, state, progress, configured_steps: Optional[int]) -> Tuple[int, Optional[int], bool]:
  """(the checkpoint's step, the run's length where known, whether training reached it)."""
  at = int(np.asarray(state['step']).reshape(-1)[0])
  results = read_results(workdir)
  finished_at = results.get('steps') if results.get('completed') else None
  num_steps = finished_at or progress.get('num_steps') or configured_steps or None
  return at, num_steps, finished_at is not None and at == finished_at


def _checked_data(data: Optional[Dict[str, str]]) -> Dict[str, str]:
  """load_trained's `data`: where the data is on this machine (data_dir, tfds_data_dir)."""
  unknown = sorted(set(data or {}) - {'data_dir', 'tfds_data_dir'})
  if unknown:   # (once added to the config unread)
    raise ConfigError(f'data={{{unknown[0]!r}: …}}: data names where the data is on this machine, '
                      'data_dir and tfds_data_dir')
  return dict(data or {})


def _restore(workdir: str, data: Optional[Dict[str, str]], step: Optional[int]):
  """(config, model, state, progress) of a checkpoint of the run in `workdir`."""
  data = _checked_data(data)
  if step is not None and (not is_int(step) or step < 0):
    # ('2' once read "no checkpoint of step 2 … (there are: 2)")
    raise ConfigError(f'step={step!r}: allowed an integer >= 0 (a checkpoint\'s step) or None (the latest)')
  if is_explorer_model(workdir):   # (once: "no checkpoint in W/checkpoints")
    raise CheckpointError(f"{workdir} holds an exported model (capsjax-export's files: float16 parameters, no "
                          'checkpoint), not a run; TrainedModel.from_workdir reads it, as the commands\' --workdir does')
  config = read_config(workdir)
  config.update(data)
  model = assemble.model(config)
  # Shapes only: restoring needs no initial values (initialising op by op took seconds).
  template = jax.eval_shape(lambda: assemble.initial_state(config, model, assemble.optimizer(config)))
  with Checkpoints(workdir, read_only=True) as checkpoints:   # a training may be writing beside it
    if checkpoints.latest_step() is None:
      raise CheckpointError(f'no checkpoint in {checkpoints.directory}')
    state, progress = checkpoints.restore(template, step)
  return config, model, state, progress


def _restore_one(workdir: str, data: Optional[Dict[str, str]], step: Optional[int], member: Optional[int]):
  """(config, model, params, state, progress, (member, members)) of one model of the run in
  `workdir`: the single run's ((None, None)), or an ensemble's member `member` (default: the
  last) as one model, with its own config (assemble.member_config: its seed, recipe, routing
  iterations)."""
  config, model, state, progress = _restore(workdir, data, step)
  params = select_member(state['params'], member, workdir, bool(config.ensemble))   # (checks `member`)
  which = (None, None)
  if config.ensemble:
    which = (member_index(state['params'], member), jax.tree.leaves(state['params'])[0].shape[0])
    config = assemble.member_config(config, which[0])
    model = assemble.model(config)
  return config, model, params, state, progress, which


def check_member(member: int, members: int, workdir: str) -> None:
  check_member_type(member)
  if not 0 <= member < members:
    raise CheckpointError(f'--member={member}: the run in {workdir} has members 0..{members - 1}')


def check_member_type(member) -> None:
  """A member is an integer (True once selected x[True], an extra axis; '1' failed in a
  comparison)."""
  if not (is_int(member) or isinstance(member, np.integer)):
    raise ConfigError(f'--member={member!r}: allowed an integer >= 0 (a member of the ensemble) or None')


def select_member(params, member: Optional[int], workdir: str, ensemble: bool):
  """The parameters of one member of an ensemble run (`ensemble`: its params carry a
  leading member axis; default: the last member); a single run's own parameters, where
  `member` must be None."""
  if ensemble:
    member = member_index(params, member)
    check_member(member, jax.tree.leaves(params)[0].shape[0], workdir)
    return jax.tree.map(lambda x: x[member], params)
  if member is not None:
    raise CheckpointError(f'--member={member}: {workdir} holds a single run, not an ensemble')
  return params


def member_index(params, member: Optional[int]) -> int:
  """The member of an ensemble's params (a leading member axis) that `member` names
  (None: the last)."""
  return jax.tree.leaves(params)[0].shape[0] - 1 if member is None else member


def choose_checkpoint(workdir: str, step: str, member: Optional[int]) -> Tuple[Optional[int], Optional[int], str]:
  """(checkpoint step or None for the latest, ensemble member or None, why) for --step."""
  if step == 'latest':
    return None, member, 'the latest checkpoint'
  if step != 'best':
    return int(step), member, f'the checkpoint of step {step}'
  selected = reports.select_by_validation(MetricsLog(workdir).read())
  if selected is None:
    return None, member, 'the latest checkpoint (the run has no validation split to select by)'
  if not isinstance(selected['step'], list):
    return selected['step'], member, (f'the best validation step {selected["step"]} (validation error '
                                      f'{100 * selected["validation_error"]:.2f} %; test error there '
                                      f'{100 * selected["test_error"]:.2f} %)')
  if member is None:
    member = int(np.argmin(selected['validation_error']))
  check_member(member, len(selected['step']), workdir)
  return selected['step'][member], member, (
      f'member {member} at its best validation step {selected["step"][member]} (validation error '
      f'{100 * selected["validation_error"][member]:.2f} %; test error there '
      f'{100 * selected["test_error"][member]:.2f} %)')


def write_explorer_model(workdir: str, directory: str, test_images: np.ndarray, test_labels: np.ndarray,
           member: Optional[int] = None, step: Optional[int] = None) -> Dict[str, Any]:
  """Writes a trained run's config and float16 parameters (no optimiser state) of its
  latest checkpoint or that of `step`, with a sample of test images, into `directory`:
  the files `Explorer.shipped` reads. `directory` is new, empty, or an earlier export's
  (check_explorer_folder); the three files replace the earlier ones together, once all are
  written, so a stop midway leaves the earlier export whole."""
  directory = check_explorer_folder(directory)
  config, _, params, _, _, _ = _restore_one(workdir, None, step, member)   # one model: a member's own config
  flat = {name: np.asarray(leaf, np.float16)
          for name, leaf in traverse_util.flatten_dict(jax.device_get(params), sep='/').items()}
  shipped_config = config.to_dict()
  shipped_config.update(data_dir='', tfds_data_dir='')   # this machine's paths mean nothing elsewhere
  os.makedirs(directory, exist_ok=True)
  partial = {name: os.path.join(directory, f'.{name}.partial') for name in EXPLORER_FILES}
  try:
    with open(partial['params.npz'], 'wb') as f:
      np.savez_compressed(f, **flat)
    with open(partial['test_sample.npz'], 'wb') as f:
      np.savez_compressed(f, images=test_images, labels=test_labels)
    with open(partial['config.json'], 'w') as f:
      json.dump(shipped_config, f, indent=2, default=str)
    for name, path in partial.items():
      os.replace(path, os.path.join(directory, name))
  finally:
    for path in partial.values():
      if os.path.exists(path):
        os.remove(path)
  return {'num_params': int(sum(v.size for v in flat.values())),
          'bytes': {name: os.path.getsize(os.path.join(directory, name)) for name in EXPLORER_FILES}}


def check_explorer_folder(directory: str) -> str:
  """The absolute folder `export` may write into: new, empty, or holding an earlier
  export's files only. Anything else is refused in one line (the words of
  capsjax-export's --out): a file, or a folder with other entries, a run's workdir above
  all (its config.json is the run's record; an export's would replace it)."""
  if not str(directory).strip():
    raise WorkdirError('--out is empty: give the folder to write')
  path = os.path.abspath(os.path.expanduser(directory))
  if os.path.lexists(path) and not os.path.isdir(path):
    raise WorkdirError(f'--out={directory} is a file, not a folder')
  others = sorted(name for name in (os.listdir(path) if os.path.isdir(path) else ())
                  if name not in EXPLORER_FILES and not name.startswith('.'))
  if others:
    shown = ', '.join(others[:3]) + (', …' if len(others) > 3 else '')
    what = ("a run's workdir: its config.json would be replaced" if set(others) & set(RUN_ENTRIES)
            else 'entries an export does not write')
    raise WorkdirError(f'--out={directory} holds {shown} ({what}); give a new or empty folder, or one an '
                       'export wrote')
  return path


def read_explorer_model(directory: str):
  """(config, float32 params) written by `export`."""
  try:
    with open(os.path.join(directory, 'config.json')) as f:
      config = ml_collections.ConfigDict(upgraded(json.load(f)))   # an export of any capsjax version
    with np.load(os.path.join(directory, 'params.npz')) as archive:
      flat = {name: np.asarray(archive[name], np.float32) for name in archive.files}
  except (OSError, ValueError, KeyError) as e:
    raise CheckpointError(f'cannot read the exported model in {directory}: {e}') from None
  params = traverse_util.unflatten_dict({name: jnp.asarray(v) for name, v in flat.items()}, sep='/')
  return config, params
