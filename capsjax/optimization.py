"""The optimizer, its learning-rate schedules and the run's length: their config keys (the
paper's Adam with exponential decay, and the recipes beyond it) and one definition of each
schedule (`learning_rate_at`), which a run and a recipe member's traced knobs both use.
"""
import dataclasses
import functools
import math

import jax.numpy as jnp
import optax

from capsjax.errors import ArgumentError
from capsjax.keys import Across, as_python, boolean, is_int, key, int_at_least, number_in, one_of, positive_number, seed_value


def total_steps(num_steps: int, num_epochs: float, batch_size: int, num_train_examples: int) -> int:
  """`num_steps` when given, else num_epochs × the steps of one epoch."""
  if num_steps:
    return int(num_steps)
  return int(math.ceil(num_epochs * (num_train_examples // batch_size)))


# config.lr_schedule: the paper's code decays exponentially; cosine and linear decay reach
# config.lr_min at the run's last step (the budgeted recipes of later work).
SCHEDULES = ('exponential', 'cosine', 'linear')
# config.optimizer: Adam (the paper's and the design card's), AdamW (decoupled weight decay),
# Lion (sign of an interpolated momentum; Chen et al. 2023 report it at short budgets).
OPTIMIZERS = ('adam', 'adamw', 'lion')
KEYS = (
    # The paper's MNIST setup (section 5): Adam at 1e-3, exponential decay ×0.96 every 2000
    # steps, batch 128, as in the authors' released code (the paper says only "TensorFlow
    # default Adam ... exponentially decaying learning rate"; BUILD.md).
    key('seed', 0, seed_value(), 'initialisation, data order and augmentation seed'),
    key('batch_size', 128, int_at_least(1), 'training examples per step, over all devices'),
    key('num_epochs', 50.0, number_in(0, math.inf), 'training length in epochs (when num_steps is 0)'),
    key('num_steps', 0, int_at_least(0), 'training length in steps (> 0 overrides num_epochs)'),
    key('learning_rate', 1e-3, positive_number(), "the optimizer's initial learning rate"),
    key('lr_decay_rate', 0.96, number_in(0, 1, low_open=True), 'the learning rate is multiplied by this every '
        'lr_decay_steps steps'),
    key('lr_decay_steps', 2000, int_at_least(1), 'steps per decay factor'),
    key('lr_staircase', False, boolean(), 'decay in whole steps of lr_decay_steps (False: continuously)'),
    key('lr_min', 0.0, number_in(0, math.inf), "floor of the decayed learning rate (0: none; the authors' code: "
        '1e-6); what cosine and linear decay reach at the last step'),
    # Beyond the paper: the schedule's shape, a linear warm-up, the optimizer, its decoupled
    # weight decay, gradient clipping, a parameter average. The defaults are the paper's recipe.
    key('lr_schedule', 'exponential', one_of(SCHEDULES), "the learning rate's decay: exponential (the paper's "
        "code), or cosine / linear to lr_min at the run's last step"),
    key('warmup_steps', 0, int_at_least(0), 'a linear rise of the learning rate from 0 over this many steps before '
        'the decay (0: none)'),
    key('warmup_max_fraction', 1.0, number_in(0, 1, low_open=True), 'the warm-up takes at most this fraction of '
        "the run's steps (a recipe's warm-up fits a shorter run; 1: a warm-up as long as the run is refused)"),
    key('optimizer', 'adam', one_of(OPTIMIZERS), 'adam (the paper), adamw (decoupled weight decay) or lion'),
    key('weight_decay', 0.0, number_in(0, math.inf), "adamw's or lion's decoupled weight decay (0: none)"),
    key('grad_clip_norm', 0.0, number_in(0, math.inf), 'gradients scaled to at most this global norm before the '
        'optimizer (0: no clipping)'),
    key('ema_decay', 0.0, number_in(0, 1, high_open=True), 'keep an exponential moving average of the parameters '
        'with this decay and evaluate it beside them (results: ema_test_error; 0: none)'),
)


def _lr_min_problem(lr_min, learning_rate, lr_schedule):
  if not lr_min or lr_min < learning_rate:
    return None
  return (f'config.lr_min={lr_min!r}: allowed below learning_rate={learning_rate!r} '
          + ('(the exponential decay is floored at it: above the rate it would raise it)'
             if lr_schedule == 'exponential' else f'(the {lr_schedule} schedule decays to it)'))


# The rules across these keys (capsjax.keys.Across), checked by validation.
RULES = (
    Across(('num_steps', 'num_epochs'), lambda num_steps, num_epochs: None if num_steps or num_epochs > 0 else (
        f'config.num_epochs={num_epochs!r}: allowed a number > 0 (or give config.num_steps > 0)')),
    Across(('weight_decay', 'optimizer'), lambda weight_decay, optimizer: (
        f'config.weight_decay={weight_decay!r}: Adam has no decoupled weight decay; use --config.optimizer=adamw '
        '(or lion)') if weight_decay and optimizer == 'adam' else None),
    Across(('lr_min', 'learning_rate', 'lr_schedule'), _lr_min_problem),
    Across(('warmup_steps', 'warmup_max_fraction', 'num_steps'), lambda warmup_steps, fraction, num_steps: (
        f'config.warmup_steps={warmup_steps!r}: allowed below num_steps={num_steps!r} (the run would end inside '
        'the warm-up, below the configured learning rate; config.warmup_max_fraction < 1 caps it)')
        if num_steps and warmup_length(warmup_steps, fraction, num_steps) >= num_steps else None),
)


def warmup_length(warmup_steps: int, max_fraction: float, num_steps: int) -> int:
  """The warm-up's steps in a run of `num_steps`: `warmup_steps`, at most `max_fraction`
  of the run when that is below 1 (a recipe's 100 steps are 20 of an 80-step run at 0.25)."""
  if max_fraction >= 1 or not num_steps:
    return warmup_steps
  return min(warmup_steps, int(max_fraction * num_steps))


def learning_rate_at(count, learning_rate, decay_steps, decay_rate, staircase, minimum, kind, warmup_steps,
                     total_steps):
  """The learning rate at optimizer step `count`: the one definition of every schedule, for
  a run (Python numbers, `kind` a name of SCHEDULES) and for a recipe member (traced knobs,
  `kind` an index into SCHEDULES) alike. 'exponential': learning_rate × decay_rate^(step /
  decay_steps) (staircase: integer exponent), never below `minimum` where it is > 0 (the
  authors' code floors it at 1e-6); 'cosine' / 'linear': from learning_rate to `minimum` at
  `total_steps`. A linear rise from 0 over `warmup_steps` comes first, and the decay counts
  from its end (optax.join_schedules' convention; tests/test_recipes.py checks the values
  against optax's schedules)."""
  number = as_python(kind)   # (a NumPy index as the int it holds; a traced one passes)
  if isinstance(kind, str):
    if kind not in SCHEDULES:
      raise ArgumentError(f'lr_schedule must be one of {SCHEDULES}, got {kind!r}')
    kind = SCHEDULES.index(kind)
  elif isinstance(number, (bool, int)) and not (is_int(number) and 0 <= number < len(SCHEDULES)):
    # (an index past the names once ran as the last one, 'linear'; a traced index cannot be read here)
    raise ArgumentError(f'lr_schedule must be one of {SCHEDULES} or its index 0 to {len(SCHEDULES) - 1}, got {kind!r}')
  count = jnp.asarray(count, jnp.float32)
  after = count - warmup_steps                   # the decay's own count
  exponent = after / decay_steps
  exponent = jnp.where(staircase, jnp.floor(exponent), exponent)
  exponential = learning_rate * jnp.asarray(decay_rate, jnp.float32) ** exponent
  exponential = jnp.where(minimum > 0, jnp.maximum(exponential, minimum), exponential)
  progress = jnp.clip(after / jnp.maximum(total_steps - warmup_steps, 1), 0.0, 1.0)
  # optax's lr·((1 − α)·½(1 + cos πp) + α) with α = minimum / lr, without the division (a rate of 0 gave NaN)
  cosine = (learning_rate - minimum) * 0.5 * (1 + jnp.cos(jnp.pi * progress)) + minimum
  linear = (learning_rate - minimum) * (1 - progress) + minimum
  decayed = jnp.where(kind == SCHEDULES.index('exponential'), exponential,
                      jnp.where(kind == SCHEDULES.index('cosine'), cosine, linear))
  warming = learning_rate * count / jnp.maximum(warmup_steps, 1)   # linear from 0
  return jnp.where(count < warmup_steps, warming, decayed)


def learning_rate_schedule(learning_rate: float, decay_steps: int, decay_rate: float,
                           staircase: bool = False, minimum: float = 0.0, *, kind: str = 'exponential',
                           warmup_steps: int = 0, total_steps: int = 0) -> optax.Schedule:
  """The run's learning rate per step (`learning_rate_at` with these settings)."""
  if kind not in SCHEDULES:
    raise ArgumentError(f'lr_schedule must be one of {SCHEDULES}, got {kind!r}')
  return functools.partial(learning_rate_at, learning_rate=learning_rate, decay_steps=decay_steps,
                           decay_rate=decay_rate, staircase=staircase, minimum=minimum, kind=kind,
                           warmup_steps=warmup_steps, total_steps=total_steps)


def member_learning_rate(count, knobs, total_steps: int):
  """The learning rate at optimizer step `count` of a recipe member (capsjax.ensembles),
  from its traced knobs: `learning_rate_at`, the run's own definition."""
  return learning_rate_at(count, knobs['learning_rate'], knobs['lr_decay_steps'], knobs['lr_decay_rate'],
                          knobs['lr_staircase'], knobs['lr_min'], knobs['lr_schedule'], knobs['warmup_steps'],
                          total_steps)


def member_optimizer(kind: str, clip_norm: float, total_steps: int):
  """knobs → the optimizer of one recipe member: `kind` on its own learning rate schedule
  (member_learning_rate) and weight decay; the same state as make_optimizer's."""
  return lambda knobs: make_optimizer(lambda count: member_learning_rate(count, knobs, total_steps), kind,
                                      knobs['weight_decay'], clip_norm)


def make_optimizer(schedule: optax.Schedule, kind: str = 'adam', weight_decay: float = 0.0,
                   clip_norm: float = 0.0) -> optax.GradientTransformation:
  """`kind` (OPTIMIZERS) on `schedule`; `weight_decay` is AdamW's and Lion's decoupled one;
  `clip_norm` > 0 scales the gradients to at most that global norm first."""
  if kind == 'adam':
    optimizer = optax.adam(schedule)
  elif kind == 'adamw':
    optimizer = optax.adamw(schedule, weight_decay=weight_decay)
  elif kind == 'lion':
    optimizer = optax.lion(schedule, weight_decay=weight_decay)
  else:
    raise ArgumentError(f'optimizer must be one of {OPTIMIZERS}, got {kind!r}')
  # Without clipping the optimizer's state is Adam's own, as every earlier checkpoint holds.
  return optax.chain(optax.clip_by_global_norm(clip_norm), optimizer) if clip_norm else optimizer


@dataclasses.dataclass(frozen=True)
class Optimization:
  """The run's length, optimizer and learning-rate keys (KEYS), typed once from a checked
  config (capsjax.assemble.optimization_of): what the steps train with is built from this, not
  from the config. The fields are those keys, by the same names."""
  num_steps: int
  num_epochs: float
  batch_size: int
  learning_rate: float
  lr_decay_steps: int
  lr_decay_rate: float
  lr_staircase: bool
  lr_min: float
  lr_schedule: str
  warmup_steps: int
  warmup_max_fraction: float
  optimizer: str
  weight_decay: float
  grad_clip_norm: float

  def length(self, num_train_examples: int) -> int:
    """The run's steps on a split of `num_train_examples` (`total_steps`)."""
    return total_steps(self.num_steps, self.num_epochs, self.batch_size, num_train_examples)

  def warmup(self, num_steps: int = 0) -> int:
    """The warm-up's steps in a run of `num_steps` (0: num_steps) (`warmup_length`)."""
    return warmup_length(self.warmup_steps, self.warmup_max_fraction, num_steps or self.num_steps)

  def schedule(self, num_steps: int = 0) -> optax.Schedule:
    """The learning rate per step of a run of `num_steps` (0: num_steps), what 'cosine' and
    'linear' decay over."""
    return learning_rate_schedule(self.learning_rate, self.lr_decay_steps, self.lr_decay_rate, self.lr_staircase,
                                  self.lr_min, kind=self.lr_schedule, warmup_steps=self.warmup(num_steps),
                                  total_steps=num_steps or self.num_steps)

  def transform(self, num_steps: int = 0) -> optax.GradientTransformation:
    """The optimizer on `schedule(num_steps)`."""
    return make_optimizer(self.schedule(num_steps), self.optimizer, self.weight_decay, self.grad_clip_norm)

  def member_transform(self, num_steps: int):
    """knobs → a recipe member's optimizer in a run of `num_steps` (`member_optimizer`)."""
    return member_optimizer(self.optimizer, self.grad_clip_norm, num_steps)
