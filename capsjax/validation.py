"""`validate(config)`: every value checked before any data is read or anything compiled.

Each rule names a config key, a check and what is allowed; a config that breaks one
raises ConfigError with one line: `config.KEY=VALUE: allowed ...`. Keys an experiment
does not have are skipped, so one table serves every experiment, and comparison models
(`baseline.model`, `cnn.model`) are checked with the same model rules.
"""
import math
from typing import Any, Callable, Iterable, List, Optional, Tuple

from capsjax.data.datasets import DATASETS
from capsjax.data.rows import HOST_IMAGES
from capsjax.errors import ConfigError
from capsjax.losses import MARGIN_REDUCTIONS
from capsjax.models import INITS, registered_models
from capsjax.objectives import registered_objectives
from capsjax.formulations import CONV_IMPLS, ROUTING_LOOPS

TASKS = ('classify', 'expanded', 'multimnist')
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
RUN_RULES = {
    'task': one_of(TASKS),
    'dataset': one_of(DATASETS),
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
    'stop_at_test_accuracy': number_in(0, 1),
    'routing_probe_iterations': int_in(0, MAX_ROUTING_ITERATIONS),
    'routing_probe_examples': int_at_least(1),
    'expanded_test_seed': int_at_least(0),
    'multimnist.examples_per_digit': int_at_least(1),
    'multimnist.test_seed': int_at_least(0),
    'affnist.test_seed': int_at_least(0),
    'affnist.num_examples': int_at_least(0),
    'ensemble.seeds': ints_at_least(0),
    'ensemble.routing_iterations': ints_at_least(1),
    'ensemble.reconstruction_weights': numbers_at_least(0),
    'num_processes': int_at_least(0),
    'process_id': int_at_least(-1),
    'distributed_timeout_s': int_in(1, 3600),
}

MODEL_RULES = {
    'name': registered(registered_models),
    'input_shape': ((lambda v: isinstance(v, (tuple, list)) and len(v) == 3
                     and all(_is_int(x) and x >= 1 for x in v)), '(height, width, channels), each >= 1'),
    'num_classes': int_at_least(2),
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
    'routing_loop': one_of(ROUTING_LOOPS),
    'dtype': one_of(DTYPES),
    'init_scheme': one_of(INITS),
    'digit_bias': boolean(),
    'primary_scale_by_types': boolean(),
    # CNN baselines
    'conv_channels': ints_at_least(1, allow_empty=False),
    'conv_kernels': ints_at_least(1, allow_empty=False),
    'dense': ints_at_least(1),
    'dropout_rate': number_in(0, 1, high_open=True),
}

LOSS_RULES = {
    'name': registered(registered_objectives),
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


def _capsnet_geometry(model) -> Optional[str]:
  """Why the CapsNet's layers do not fit its input, or None."""
  height, width = model.input_shape[:2]
  sizes = []
  for side in (height, width):
    conv1 = side - model.conv1_kernel + 1
    primary = (conv1 - model.primary_kernel) // model.primary_stride + 1 if conv1 >= model.primary_kernel else 0
    sizes.append((conv1, primary))
  if min(s[1] for s in sizes) < 1:
    return (f'the input {tuple(model.input_shape[:2])} is too small for conv1_kernel={model.conv1_kernel}, '
            f'primary_kernel={model.primary_kernel}, primary_stride={model.primary_stride}')
  return None


def _check_model(model, prefix: str, problems: List[str]) -> None:
  before = len(problems)
  _check_rules(model, MODEL_RULES, prefix, problems)
  if len(problems) > before:
    return   # the cross-field checks below need valid fields
  if model.get('name') == 'capsnet':
    why = _capsnet_geometry(model)
    if why:
      problems.append(f'config.{prefix}input_shape={tuple(model.input_shape)!r}: {why}')
  if model.get('name') == 'cnn' and len(model.conv_channels) != len(model.conv_kernels):
    problems.append(f'config.{prefix}conv_kernels={tuple(model.conv_kernels)!r}: allowed one kernel per '
                    f'entry of conv_channels={tuple(model.conv_channels)!r}')


def _check_loss(loss, model, prefix: str, problems: List[str]) -> None:
  before = len(problems)
  _check_rules(loss, LOSS_RULES, prefix, problems)
  if len(problems) > before:
    return
  if loss.name == 'capsnet' and model.get('name') != 'capsnet':
    problems.append(f'config.{prefix}name=\'capsnet\': allowed only with a CapsNet model '
                    f'(the model is {model.get("name")!r}); use sigmoid_xent or softmax_xent')
  if loss.name != 'capsnet' and model.get('name') == 'capsnet':
    problems.append(f'config.{prefix}name={loss.name!r}: a CapsNet model is trained with the '
                    "'capsnet' loss")
  if loss.name == 'capsnet' and 'm_minus' in loss and loss.m_minus >= loss.m_plus:
    problems.append(f'config.{prefix}m_minus={loss.m_minus!r}: allowed a value below '
                    f'm_plus={loss.m_plus!r}')


def problems_of(config) -> List[str]:
  """Every rule `config` breaks, one line each (empty when it is valid)."""
  problems: List[str] = []
  _check_rules(config, RUN_RULES, '', problems)
  for prefix in ('', 'baseline.', 'cnn.'):
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
    side = min(config.model.input_shape[:2]) if 'model' in config else 28
    limit = side // 4   # beyond a quarter of the side, shifts cut off much of a digit
    if not (_is_int(config.max_shift) and 0 <= config.max_shift <= limit):
      problems.append(f'config.max_shift={config.max_shift!r}: allowed an integer in [0, {limit}] '
                      f'(a quarter of the {side}-pixel image side)')
  if config.get('num_train_examples') and config.get('task', 'classify') != 'multimnist':
    if config.num_train_examples < config.get('batch_size', 1):
      problems.append(f'config.batch_size={config.batch_size!r}: allowed at most '
                      f'num_train_examples={config.num_train_examples}')
  found, iterations = _get(config, 'ensemble.routing_iterations')
  if found and iterations and config.model.get('routing_iterations') is not None:
    if max(iterations) > config.model.routing_iterations:
      problems.append(f'config.ensemble.routing_iterations={tuple(iterations)!r}: allowed at most '
                      f'model.routing_iterations={config.model.routing_iterations} each')
  return problems


def validate(config) -> None:
  """Raises ConfigError naming the first invalid key, its value and what is allowed."""
  problems = problems_of(config)
  if problems:
    more = f' (and {len(problems) - 1} more problem(s))' if len(problems) > 1 else ''
    raise ConfigError(problems[0] + more)
