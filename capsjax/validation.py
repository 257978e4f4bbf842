"""`validate(config)`: every value checked before any data is read or anything compiled.

Each rule names a config key, a check and what is allowed; a config that breaks one
raises ConfigError with one line: `config.KEY=VALUE: allowed ...`. Keys an experiment
does not have are skipped, so one table serves every experiment, and comparison models
(`baseline.model`, `cnn.model`) are checked with the same model rules.
"""
import math
import re
from typing import Any, Callable, Iterable, List, Tuple

import ml_collections

from capsjax.data.images import BACKGROUNDS
from capsjax.data.rows import HOST_IMAGES
from capsjax.data.sources import dataset_names_help, is_dataset_name
from capsjax.data.tasks import TASKS
from capsjax.errors import ConfigError
from capsjax.losses import MARGIN_REDUCTIONS
from capsjax.models import INITS, MODELS
from capsjax.objectives import OBJECTIVES
from capsjax.formulations import CONV_IMPLS, CONV_INPUTS, PATCHES_INFERENCE, ROUTING_LOOPS, conv_inputs_problem
from capsjax.routing import ROUTINGS
from capsjax.steps import OPTIMIZERS, SCHEDULES

DTYPES = ('float32', 'bfloat16', 'float16')


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
  return (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value))


def int_at_least(low: int) -> Tuple[Callable[[Any], bool], str]:
  return (lambda v: _is_int(v) and v >= low), f'an integer >= {low}'


def int_in(low: int, high: int) -> Tuple[Callable[[Any], bool], str]:
  return (lambda v: _is_int(v) and low <= v <= high), f'an integer in [{low}, {high}]'


# Upper bounds that only stop mistakes: a routing of 10⁶ iterations compiles and then runs
# for hours (the paper's appendix goes to 10); an evaluation batch of 10⁹ images asked for
# 730 GiB after the training steps (batches beyond a test set are padding anyway).
MAX_ROUTING_ITERATIONS = 100
MAX_EVAL_BATCH_SIZE = 65536


def number_in(low: float, high: float, low_open=False, high_open=False):
  def check(v):
    if not _is_number(v):
      return False
    return (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
  left, right = '(' if low_open else '[', ')' if high_open else ']'
  return check, f'a finite number in {left}{low}, {high}{right}'


class _Registered:
  """'one of …' over a registry read when a config is checked (families may add names)."""

  def __init__(self, names: Callable[[], Iterable[str]]):
    self.names = names

  def __call__(self, value) -> bool:
    return value in tuple(self.names())

  def __str__(self) -> str:
    return f'one of {", ".join(self.names())}'


def registered(names: Callable[[], Iterable[str]]):
  rule = _Registered(names)
  return rule, rule


class _RegisteredTuple(_Registered):
  """'a tuple of … names (…)': a non-empty tuple of registered names."""

  def __init__(self, names: Callable[[], Iterable[str]], what: str):
    super().__init__(names)
    self.what = what

  def __call__(self, value) -> bool:
    return (isinstance(value, (tuple, list)) and len(value) > 0 and all(v in tuple(self.names()) for v in value)
            and len(set(value)) == len(value))

  def __str__(self) -> str:
    return f'a tuple of distinct {self.what} ({", ".join(self.names())})'


def registered_tuple(names: Callable[[], Iterable[str]], what: str):
  rule = _RegisteredTuple(names, what)
  return rule, rule


def boolean():
  return (lambda v: isinstance(v, bool)), 'True or False'


def positive_number():
  return (lambda v: _is_number(v) and v > 0), 'a finite number > 0'


def one_of(choices: Iterable[str]):
  choices = tuple(choices)
  return (lambda v: v in choices), f'one of {", ".join(choices)}'


def ints_at_least(low: int, allow_empty: bool = True):
  def check(v):
    return (isinstance(v, (tuple, list)) and (allow_empty or len(v) > 0)
            and all(_is_int(x) and x >= low for x in v))
  return check, f'a tuple of integers >= {low}' + ('' if allow_empty else ' (at least one)')


def numbers_at_least(low: float):
  return ((lambda v: isinstance(v, (tuple, list)) and all(_is_number(x) and x >= low for x in v)),
          f'a tuple of finite numbers >= {low}')


# key → (check, what is allowed). Keys are relative to the config root.
# Configs under these keys hold a comparison model (its own `model` and `loss`).
COMPARISON_MODELS = ('baseline', 'cnn')

RUN_RULES = {
    'task': registered(TASKS.names),
    'dataset': (is_dataset_name, dataset_names_help()),
    'image_size': int_in(0, 4096),
    'image_background': one_of(tuple(BACKGROUNDS)),
    'class_names': ((lambda v: isinstance(v, (tuple, list)) and all(isinstance(x, str) and x for x in v)),
                    'a tuple of class names (empty: from the data)'),
    'host_images': one_of(HOST_IMAGES),
    'num_train_examples': int_at_least(0),
    'num_test_examples': int_at_least(0),
    'seed': int_at_least(0),
    'batch_size': int_at_least(1),
    'eval_batch_size': int_in(1, MAX_EVAL_BATCH_SIZE),
    'num_epochs': number_in(0, math.inf),
    'num_steps': int_at_least(0),
    'learning_rate': positive_number(),
    'lr_min': number_in(0, math.inf),
    'lr_schedule': one_of(SCHEDULES),
    'warmup_steps': int_at_least(0),
    'optimizer': one_of(OPTIMIZERS),
    'weight_decay': number_in(0, math.inf),
    'grad_clip_norm': number_in(0, math.inf),
    'ema_decay': number_in(0, 1, high_open=True),
    'augment.rotation': number_in(0, 180),
    'augment.scale': number_in(0, 1, high_open=True),
    'augment.shear': number_in(0, 1),
    'augment.elastic_alpha': number_in(0, math.inf),
    'augment.elastic_sigma': number_in(0, math.inf, low_open=True),
    'validation_examples': int_at_least(0),
    'lr_decay_rate': number_in(0, 1, low_open=True),
    'lr_decay_steps': int_at_least(1),
    'log_every_steps': int_at_least(1),
    'eval_every_steps': int_at_least(0),
    'checkpoint_every_steps': int_at_least(1),
    'checkpoint_every_secs': number_in(0, math.inf),
    'keep_checkpoints': int_at_least(1),
    'stop_at_step': int_at_least(0),
    'reevaluate': boolean(),
    'check_memory': boolean(),
    'allow_config_change': boolean(),
    'lr_staircase': boolean(),
    'distributed': boolean(),
    'baseline.enabled': boolean(),
    'cnn.enabled': boolean(),
    'stop_at_test_accuracy': number_in(0, 1),
    'routing_probe_iterations': int_in(0, MAX_ROUTING_ITERATIONS),
    'routing_probe_examples': int_at_least(1),
    'routing_diagnostics': boolean(),
    'routing_diagnostics_examples': int_at_least(0),
    'routing_diagnostics_iterations': int_in(0, MAX_ROUTING_ITERATIONS),
    'expanded_test_seed': int_at_least(0),
    'multimnist.examples_per_digit': int_at_least(1),
    'multimnist.test_seed': int_at_least(0),
    'affnist.test_seed': int_at_least(0),
    'affnist.num_examples': int_at_least(0),
    'ensemble.seeds': ints_at_least(0),
    'ensemble.routing_iterations': ints_at_least(1),
    'ensemble.reconstruction_weights': numbers_at_least(0),
    'routing_zoo.routings': registered_tuple(ROUTINGS.names, 'routing names'),
    'routing_zoo.seeds': ints_at_least(0, allow_empty=False),
    'routing_zoo.speed_rounds': int_at_least(1),
    'routing_zoo.speed_steps': int_at_least(1),
    'coordinator_address': ((lambda v: isinstance(v, str) and (not v or re.fullmatch(r'\S+:\d{1,5}', v) is not None)),
                            'HOST:PORT, or empty (detected)'),
    'num_processes': int_at_least(0),
    'process_id': int_at_least(-1),
    'distributed_timeout_s': int_in(1, 3600),
}

MODEL_RULES = {
    'name': registered(MODELS.names),
    'input_shape': ((lambda v: isinstance(v, (tuple, list)) and len(v) in (0, 3)
                     and all(_is_int(x) and x >= 1 for x in v)),
                    '(height, width, channels), each >= 1, or () for the shape of the data'),
    'num_classes': ((lambda v: _is_int(v) and (v == 0 or v >= 2)), 'an integer >= 2, or 0 for the classes of the data'),
    # CapsNet
    'conv1_channels': int_at_least(1),
    'conv1_kernel': int_at_least(1),
    'primary_types': int_at_least(1),
    'primary_dim': int_at_least(1),
    'primary_kernel': int_at_least(1),
    'primary_stride': int_at_least(1),
    'digit_dim': int_at_least(1),
    'routing_iterations': int_in(1, MAX_ROUTING_ITERATIONS),
    'decoder_hidden': ints_at_least(1),
    'conv_impl': one_of(CONV_IMPLS),
    'patches_inference': one_of(PATCHES_INFERENCE),
    'conv_inputs': one_of(CONV_INPUTS),
    'routing_loop': one_of(ROUTING_LOOPS),
    'transforms': one_of(('auto', 'per_capsule', 'per_type')),
    'stem': one_of(('auto', 'none', 'strided')),
    'votes': one_of(('factored', 'materialised')),
    'stem_channels': int_at_least(1),
    'decoder': one_of(('auto', 'dense', 'deconv')),
    'dtype': one_of(DTYPES),
    'init_scheme': one_of(INITS),
    'routing': registered(ROUTINGS.names),
    'routing_options': ((lambda v: hasattr(v, 'keys')), 'a dict: routing name → its options'),
    'routing_options.em.inverse_temperature': number_in(0, math.inf, low_open=True),
    'routing_options.em.variance_epsilon': number_in(0, math.inf, low_open=True),
    'routing_options.variational_bayes.inverse_temperature': number_in(0, math.inf, low_open=True),
    'routing_options.variational_bayes.prior_extra_dof': number_in(0, math.inf, low_open=True),
    'digit_bias': boolean(),
    'primary_scale_by_types': boolean(),
    'learn_log_priors': boolean(),
    'leaky_routing': boolean(),
    'stop_gradient_predictions': boolean(),
    'use_decoder': boolean(),
    'pool': boolean(),
    # CNN baselines
    'conv_channels': ints_at_least(1, allow_empty=False),
    'conv_kernels': ints_at_least(1, allow_empty=False),
    'dense': ints_at_least(1),
    'dropout_rate': number_in(0, 1, high_open=True),
}

LOSS_RULES = {
    'name': registered(OBJECTIVES.names),
    'm_plus': number_in(0, 1, low_open=True),
    'm_minus': number_in(0, 1, high_open=True),
    'negative_weight': number_in(0, math.inf),
    'reconstruction_weight': number_in(0, math.inf),
    'margin_reduction': one_of(MARGIN_REDUCTIONS),
}


def _get(config, dotted: str):
  """(True, value) for an existing dotted key, else (False, None)."""
  node = config
  for part in dotted.split('.'):
    if node is None or not hasattr(node, 'keys') or part not in node.keys():
      return False, None
    node = node[part]
  return True, node


def _check_rules(config, rules, prefix: str, problems: List[str]) -> None:
  for key, (check, allowed) in rules.items():
    found, value = _get(config, key)
    if found and value is not None and not check(value):
      problems.append(f'config.{prefix}{key}={value!r}: allowed {allowed}')


def _check_model(model, prefix: str, problems: List[str]) -> None:
  before = len(problems)
  _check_rules(model, MODEL_RULES, prefix, problems)
  if len(problems) > before:
    return   # the family's own cross-field checks need valid fields
  inputs_problem = conv_inputs_problem(model.get('conv_impl'), model.get('conv_inputs', 'float32'))
  if inputs_problem:
    problems.append(f'config.{prefix}conv_inputs={model.conv_inputs!r}: {inputs_problem}')
  if model.get('name') in MODELS:
    problems.extend(MODELS[model.name].check(model, prefix))


def _check_loss(loss, model, prefix: str, problems: List[str]) -> None:
  before = len(problems)
  _check_rules(loss, LOSS_RULES, prefix, problems)
  if len(problems) > before:
    return
  if model.get('name') not in MODELS:
    return
  objective, family = OBJECTIVES[loss.name], MODELS[model.name]
  if model.name not in objective.families:
    trained_with = ' or '.join(repr(name) for name in family.objectives) or 'its own'
    problems.append(f'config.{prefix}name={loss.name!r}: a {model.name!r} model is trained with the '
                    f'{trained_with} loss')
  problems.extend(objective.check(loss, prefix))


def problems_of(config) -> List[str]:
  """Every rule `config` breaks, one line each (empty when it is valid)."""
  problems: List[str] = []
  _check_rules(config, RUN_RULES, '', problems)
  for prefix in ('',) + tuple(f'{name}.' for name in COMPARISON_MODELS):
    found, model = _get(config, prefix + 'model')
    if found and model is not None:
      _check_model(model, prefix + 'model.', problems)
      found_loss, loss = _get(config, prefix + 'loss')
      if found_loss and loss is not None:
        _check_loss(loss, model, prefix + 'loss.', problems)
  if problems:
    return problems
  # Cross-field rules on valid fields.
  if not config.get('num_steps') and 'num_epochs' in config and not config.num_epochs > 0:
    problems.append(f'config.num_epochs={config.num_epochs!r}: allowed a number > 0 '
                    '(or give config.num_steps > 0)')
  if 'max_shift' in config:
    side = min(config.model.input_shape[:2] or (28,)) if 'model' in config else 28
    limit = side // 4   # beyond a quarter of the side, shifts cut off much of a digit
    if not (_is_int(config.max_shift) and 0 <= config.max_shift <= limit):
      problems.append(f'config.max_shift={config.max_shift!r}: allowed an integer in [0, {limit}] '
                      f'(a quarter of the {side}-pixel image side)')
  task = config.get('task')
  if config.get('num_train_examples') and not (task in TASKS and TASKS[task].generates_examples):
    if config.num_train_examples < config.get('batch_size', 1):
      problems.append(f'config.batch_size={config.batch_size!r}: allowed at most '
                      f'num_train_examples={config.num_train_examples}')
  given = [f'{key}={config.get(key)!r}' for key, unset in (('coordinator_address', ''), ('num_processes', 0),
                                                             ('process_id', -1)) if config.get(key, unset) != unset]
  if given and 'distributed' in config and not config.distributed:
    problems.append(f'config.{given[0]}: used only with --config.distributed=True (a multi-host run)')
  if config.get('num_processes') and config.get('process_id', -1) >= config.num_processes:
    problems.append(f'config.process_id={config.process_id}: allowed below num_processes={config.num_processes} '
                    '(processes are numbered from 0)')
  found, augmentation = _get(config, 'augment')
  if found and augmentation is not None and task in TASKS and 'augment' not in TASKS.get(task).keys:
    used = [f'augment.{key}={value!r}' for key, value in augmentation.items()
            if key != 'elastic_sigma' and value]
    if used:
      readers = ', '.join(name for name in TASKS if 'augment' in TASKS.get(name).keys)
      problems.append(f'config.{used[0]}: the augmentation beyond shifts applies to task={readers}; '
                      f'task={config.task!r} makes its own examples')
  if config.get('weight_decay') and config.get('optimizer', 'adam') == 'adam':
    problems.append(f'config.weight_decay={config.weight_decay!r}: Adam has no decoupled weight decay; '
                    "use --config.optimizer=adamw (or lion)")
  if config.get('lr_schedule', 'exponential') != 'exponential' and config.get('lr_min', 0) >= config.get('learning_rate', 1):
    problems.append(f'config.lr_min={config.lr_min!r}: allowed below learning_rate={config.learning_rate!r} '
                    f'(the {config.lr_schedule} schedule decays to it)')
  found, zoo_options = _get(config, 'routing_zoo.options')
  if found and zoo_options is not None and 'model' in config:
    problems.extend(_zoo_options_problems(config, zoo_options))
  found, iterations = _get(config, 'ensemble.routing_iterations')
  if found and iterations and config.model.get('routing_iterations') is not None:
    if max(iterations) > config.model.routing_iterations:
      problems.append(f'config.ensemble.routing_iterations={tuple(iterations)!r}: allowed at most '
                      f'model.routing_iterations={config.model.routing_iterations} each')
  return problems


def _zoo_options_problems(config, zoo_options) -> List[str]:
  """routing_zoo.options checked as each member's model.routing_options is: a routing the
  zoo trains, options it takes, values the model's rules allow."""
  if not hasattr(zoo_options, 'keys'):
    return [f'config.routing_zoo.options={zoo_options!r}: allowed a dict: routing name → its options']
  problems = []
  routings = tuple(config.routing_zoo.get('routings', ()))
  for name, options in zoo_options.items():
    where = f'config.routing_zoo.options.{name}'
    if name not in routings:
      problems.append(f'{where}: {name!r} is not among routing_zoo.routings ({", ".join(routings)})')
      continue
    if not hasattr(options, 'keys'):
      problems.append(f'{where}={options!r}: allowed a dict of the routing\'s options')
      continue
    member = config.model.to_dict()
    member.update(routing=name, routing_options={name: dict(options)})
    member_problems: List[str] = []
    _check_model(ml_collections.ConfigDict(member), 'model.', member_problems)
    problems.extend(line.replace(f'config.model.routing_options.{name}.', f'{where}.') for line in member_problems)
  return problems


def split_name_lists(config) -> None:
  """Tuple-of-names keys given on the command line as one comma-separated word
  (`--config.routing_zoo.routings=dynamic,self_routing`, which the flag parser reads as a
  one-element tuple) become the tuple of those names, in place."""
  for key, (rule, _) in RUN_RULES.items():
    if not isinstance(rule, _RegisteredTuple):
      continue
    parent, _, leaf = key.rpartition('.')
    holder = config
    for part in filter(None, parent.split('.')):
      holder = holder.get(part) if holder is not None else None
    value = holder.get(leaf) if holder is not None else None
    if isinstance(value, (tuple, list)) and any(isinstance(v, str) and ',' in v for v in value):
      holder[leaf] = tuple(name.strip() for v in value for name in str(v).split(',') if name.strip())


def validate(config) -> None:
  """Raises ConfigError naming the first invalid key, its value and what is allowed."""
  problems = problems_of(config)
  if problems:
    more = f' (and {len(problems) - 1} more problem(s))' if len(problems) > 1 else ''
    raise ConfigError(problems[0] + more)


# ----------------------------------------------------------------------------- key help
# One line per config key for `run.py --experiment=NAME --help`, beside its allowed values
# (the rules above). Comparison models (`baseline.`, `cnn.`) share the model/loss lines.

DESCRIPTIONS = {
    'experiment': 'the experiment name written into results (set by experiments/NAME.py)',
    'program': 'what runs: train, or an experiment program (ablation, affnist, sweep, routing_zoo)',
    'task': 'classify one label per image, expanded (digits placed on a larger canvas) or multimnist (two overlaid digits)',
    'dataset': 'where the images come from: a TFDS name, or image_folder (the folder in data_dir)',
    'data_dir': 'a folder read instead of TFDS: IDX files (MNIST family), or with dataset=image_folder '
                'DIR/train/CLASS/*.png|jpg and DIR/test/CLASS/…; does not bind the workdir',
    'image_size': '> 0: every image resized to N×N (needed for images of mixed sizes); 0: as stored',
    'image_background': 'what the transparent pixels of image files (alpha, or a palette\'s transparent entry) '
                        'are composited onto, in training, predict and the explorer',
    'class_names': 'the class names written into results, figures and predictions; () = from the data',
    'tfds_data_dir': "TFDS's data folder (default ~/tensorflow_datasets); does not bind the workdir",
    'host_images': "memory: each split loaded whole; rows: each process reads only its batches' rows; auto: rows on several processes",
    'num_train_examples': 'use the first N training examples (0: all)',
    'num_test_examples': 'evaluate on the first N test examples (0: all)',
    'validation_examples': 'hold out the last N training images as a validation split (results select by it)',
    'max_shift': 'training images shifted by up to ± this many pixels (zero padding)',
    'augment': 'training augmentation beyond the shifts (all 0: the paper\'s recipe)',
    'augment.rotation': 'training images rotated by up to ± this many degrees',
    'augment.scale': 'training images scaled by a factor in [1 − scale, 1 + scale]',
    'augment.shear': 'training images sheared by a factor in [−shear, shear]',
    'augment.elastic_alpha': 'elastic distortion of training images: displacements of this many pixels (0: none)',
    'augment.elastic_sigma': 'elastic distortion: the Gaussian smoothing of the displacement field, in pixels',
    'seed': 'initialisation, data order and augmentation seed',
    'batch_size': 'training examples per step, over all devices',
    'num_epochs': 'training length in epochs (when num_steps is 0)',
    'num_steps': 'training length in steps (0: from num_epochs)',
    'learning_rate': "Adam's initial learning rate",
    'lr_decay_rate': 'the learning rate is multiplied by this every lr_decay_steps steps',
    'lr_decay_steps': 'steps per decay factor',
    'lr_staircase': 'decay in whole steps of lr_decay_steps (False: continuously)',
    'lr_min': 'floor of the decayed learning rate (0: none); what cosine and linear decay reach at the last step',
    'lr_schedule': "the learning rate's decay: exponential (the paper's code), or cosine / linear to lr_min at the run's last step",
    'warmup_steps': 'a linear rise of the learning rate from 0 over this many steps before the decay (0: none)',
    'optimizer': 'adam (the paper), adamw (decoupled weight decay) or lion',
    'weight_decay': "adamw's or lion's decoupled weight decay (0: none)",
    'grad_clip_norm': 'gradients scaled to at most this global norm before the optimizer (0: no clipping)',
    'ema_decay': 'keep an exponential moving average of the parameters with this decay and evaluate it beside '
                 'them (results: ema_test_error; 0: none)',
    'log_every_steps': 'a progress line and a metrics.jsonl row every N steps',
    'eval_every_steps': 'evaluate every N steps (0: only at the end)',
    'eval_batch_size': 'examples per evaluation batch',
    'checkpoint_every_steps': 'save a checkpoint every N steps',
    'checkpoint_every_secs': 'also save every N seconds of wall time (0: off)',
    'keep_checkpoints': 'checkpoints kept in the workdir',
    'stop_at_step': 'save and stop at this step, resumable (0: run to the end)',
    'stop_at_test_accuracy': 'the run is complete at the first evaluation reaching this accuracy (0: off)',
    'allow_config_change': 'continue a workdir that holds another config (never across parameter shapes)',
    'reevaluate': 'running a finished workdir evaluates it again (otherwise it says it is complete)',
    'check_memory': 'refuse a run whose estimated peak memory exceeds the memory available (False: try anyway)',
    'routing_probe_iterations': 'routing iterations of the convergence probe at each evaluation (0: off)',
    'routing_probe_examples': 'test images the convergence probe routes',
    'routing_diagnostics': 'routing diagnostics at each evaluation (coupling entropy, movement, consistency, activity)',
    'routing_diagnostics_examples': 'the first test images the routing diagnostics read (0: the whole split)',
    'routing_diagnostics_iterations': 'their test-time sweep: accuracy for r = 1 … this (0: none)',
    'expanded_test_seed': "seed of the expanded task's fixed test placements",
    'multimnist.examples_per_digit': 'MultiMNIST pairs per source digit (the paper: 1000)',
    'multimnist.test_seed': "seed of MultiMNIST's fixed test pairs",
    'affnist.mat_dir': 'a folder of the real affNIST .mat files to test on too (empty: generated affine digits only)',
    'affnist.num_examples': 'affine test digits (0: the whole MNIST test set)',
    'affnist.test_seed': 'seed of the fixed affine test transformations',
    'affnist.ranges.rotation_degrees': 'affine test digits: rotation up to ± this many degrees',
    'affnist.ranges.shear': 'affine test digits: shear factor up to ± this',
    'affnist.ranges.scale_min': 'affine test digits: smallest scale',
    'affnist.ranges.scale_max': 'affine test digits: largest scale',
    'ensemble': 'several configurations as one vmapped program: seeds × routing_iterations × reconstruction_weights',
    'ensemble.seeds': 'ensemble members: one per seed',
    'ensemble.routing_iterations': 'ensemble members: routing iterations each (at most model.routing_iterations)',
    'ensemble.reconstruction_weights': 'ensemble members: reconstruction loss weights',
    'sweep.variants': 'the sweep: one run per variant, KEY=VALUE overrides separated by commas',
    'routing_zoo.routings': 'the routing algorithms the zoo trains, each over routing_zoo.seeds',
    'routing_zoo.seeds': 'the seeds of each routing (one vmapped program per routing)',
    'routing_zoo.options': 'per routing name, its options (as model.routing_options)',
    'routing_zoo.speed_rounds': 'interleaved rounds of the speed measurement (every routing once per round)',
    'routing_zoo.speed_steps': 'training steps per timed sample of the speed measurement',
    'enabled': 'also train this comparison model',
    'distributed': 'start jax.distributed (several hosts run the same command)',
    'coordinator_address': 'HOST:PORT of process 0 (empty: detected on Cloud TPU, SLURM, Open MPI)',
    'num_processes': 'processes in a multi-host run (0: detected)',
    'process_id': "this process's index (-1: detected)",
    'distributed_timeout_s': 'seconds to wait for the coordinator and the other processes',
    'model.name': 'the model family (registered in capsjax.models / capsjax.families)',
    'model.input_shape': 'image height, width, channels the model reads; () = those of the data',
    'model.num_classes': 'classes (digit capsules, or output units); 0 = those of the data',
    'model.routing': 'the routing algorithm (dynamic: the paper\'s Procedure 1; em, self_attention, '
                     'inverted_dot_product, self_routing, variational_bayes, uniform, max_pooling: see '
                     'docs/results.md)',
    'model.routing_options': 'the routings\' options, a section per routing (em: inverse_temperature, '
                             'variance_epsilon; variational_bayes: inverse_temperature, prior_extra_dof); '
                             'the model reads model.routing\'s; learned parameters are not options',
    'model.routing_options.em': 'em\'s options',
    'model.routing_options.em.inverse_temperature': 'the final inverse temperature λ (λ rises linearly to it '
                                                    'over the iterations)',
    'model.routing_options.em.variance_epsilon': 'added to every variance σ² (keeps log σ finite)',
    'model.routing_options.variational_bayes': 'variational_bayes\'s options',
    'model.routing_options.variational_bayes.inverse_temperature': 'λ of its activations',
    'model.routing_options.variational_bayes.prior_extra_dof': 'the Wishart prior\'s degrees of freedom ν₀ '
                                                               'beyond the capsule dimension (ν₀ = D + this, > D − 1)',
    'model.conv1_channels': 'channels of the first convolution (the paper: 256)',
    'model.conv1_kernel': 'kernel side of the first convolution (9)',
    'model.primary_types': 'primary capsule types (32)',
    'model.primary_dim': 'primary capsule dimensions (8)',
    'model.primary_kernel': "PrimaryCaps' kernel side (9)",
    'model.primary_stride': "PrimaryCaps' stride (2)",
    'model.primary_scale_by_types': "PrimaryCaps' convolution ÷ types before its bias (the authors' code)",
    'model.digit_dim': 'digit capsule dimensions (16)',
    'model.digit_bias': "a bias added to s_j in every routing iteration (the authors' code)",
    'model.routing_iterations': 'routing-by-agreement iterations (3)',
    'model.routing_loop': 'the routing loop rolled or unrolled (same values; auto: faster on the backend)',
    'model.transforms': 'class-capsule transforms: per_capsule (the paper) or per_type (shared over positions, '
                        'with coordinate addition; parameters independent of the image size); auto: by the '
                        'image size and memory (capsjax.sizing)',
    'model.stem': 'none (the paper) or strided: 3×3 stride-2 convolutions before conv1 halving the image to '
                  'at most 40 px; auto: by the image size',
    'model.stem_channels': "the strided stem's channels (32)",
    'model.votes': 'per_type transforms: routing without û (factored) or with û built first (materialised); '
                   'same values',
    'model.decoder': "dense (the paper's 512-1024-pixels) or deconv (transposed convolutions, size independent "
                     'of the image); auto: by the image size',
    'model.learn_log_priors': 'learned initial routing logits',
    'model.leaky_routing': "a 'none-of-the-above' parent in routing",
    'model.stop_gradient_predictions': 'gradients reach the predictions through the last routing iteration only',
    'model.use_decoder': 'the reconstruction decoder (and its loss)',
    'model.decoder_hidden': "the decoder's hidden widths (512, 1024)",
    'model.conv_impl': "convolutions as XLA's, im2col + matmul, im2col by kernel rows, or products of Fourier transforms (same values; auto: faster on the backend, on a CPU per layer)",
    'model.patches_inference': 'the im2col conv at inference a few images at a time or the whole batch (same values)',
    'model.conv_inputs': "the convolutions' matmul inputs: float32, or bfloat16 accumulated in float32 (faster on AVX-512 BF16 CPUs)",
    'model.dtype': 'compute dtype of convolutions and predictions (routing, losses and decoder stay float32)',
    'model.init_scheme': "default initialisers, or the authors' code's (official)",
    'model.conv_channels': "the CNN's convolution channels",
    'model.conv_kernels': "the CNN's kernel sides",
    'model.pool': 'the CNN pools 2×2 after each convolution',
    'model.dense': "the CNN's fully connected widths",
    'model.dropout_rate': 'dropout before the CNN\'s output layer',
    'loss.name': 'the loss (capsnet: margin + reconstruction; cross-entropies for the CNNs)',
    'loss.m_plus': 'margin loss m+ (0.9)',
    'loss.m_minus': 'margin loss m− (0.1)',
    'loss.negative_weight': 'margin loss λ for absent classes (0.5)',
    'loss.reconstruction_weight': 'reconstruction loss weight (0.0005)',
    'loss.margin_reduction': "sum over classes (the paper) or official (the authors' code: 0.5 × mean)",
}

# Allowed values of keys that no rule above checks (text only).
ALLOWED_TEXT = {
    'experiment': 'a name', 'program': 'train, ablation, affnist, sweep, routing_zoo',
    'routing_zoo.options': 'a dict: routing name → its options',
    'data_dir': 'a folder, or empty', 'tfds_data_dir': 'a folder, or empty', 'affnist.mat_dir': 'a folder, or empty',
    'coordinator_address': 'HOST:PORT, or empty', 'ensemble': 'a dict, or None',
    'sweep.variants': 'a tuple of override strings', 'max_shift': 'an integer in [0, a quarter of the image side]',
    'affnist.ranges.rotation_degrees': 'a number >= 0', 'affnist.ranges.shear': 'a number >= 0',
    'affnist.ranges.scale_min': 'a number > 0', 'affnist.ranges.scale_max': 'a number >= scale_min',
}


def _general(key: str) -> str:
  """A dotted key without a comparison model's prefix (baseline.model.x → model.x)."""
  return key.split('.', 1)[1] if key.split('.')[0] in COMPARISON_MODELS else key


def allowed(key: str) -> str:
  """What config.KEY allows (dotted key; comparison models share the model/loss rules), or ''."""
  general = _general(key)
  if general.startswith('model.'):
    rule = MODEL_RULES.get(general[len('model.'):])
  elif general.startswith('loss.'):
    rule = LOSS_RULES.get(general[len('loss.'):])
  elif general == 'enabled':   # baseline.enabled, cnn.enabled
    rule = RUN_RULES.get(f'{key.split(".")[0]}.enabled')
  else:
    rule = RUN_RULES.get(general)
  return str(rule[1]) if rule else ALLOWED_TEXT.get(general, '')


def key_help(key: str) -> str:
  """'description [allowed]' of a config key (dotted), for --help; '' when undescribed."""
  description, allowed_values = DESCRIPTIONS.get(_general(key), ''), allowed(key)
  return f'{description} [{allowed_values}]' if description and allowed_values else description
