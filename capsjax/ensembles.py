"""Ensembles: several configurations trained as one vmapped program.

The members (capsjax.assemble.members) are the product of config.ensemble's seeds,
routing iterations and reconstruction weights, or, with `ensemble.recipes`, of named
recipes and the seeds. Whatever differs between members becomes a traced knob here
(capsjax.steps.member_knobs); a run without an ensemble uses the model's and the objective's own
static values.

A recipe is 'NAME: key=value, key=value' as a sweep variant is (config.sweep.variants),
limited to the keys one program can vary per member (RECIPE_KEYS: the learning rate and
its schedule, weight decay, the parameter average, the loss's reduction and
reconstruction weight, the routing iterations, the augmentation strengths). Anything
else stays a sweep variant: one training per variant.
"""
import ast
from typing import Any, Dict, List, Tuple

from capsjax.errors import ConfigError
from capsjax.keys import Across, Rule, key, ints_at_least, numbers_at_least, distinct_seeds

KEYS = (
    # None: a single run. The members are the product of the tuples (capsjax.assemble.members;
    # an empty tuple = the config's own value).
    key('ensemble', None, Rule(lambda v: v is None or hasattr(v, 'keys'), 'a dict, or None'),
        'several configurations as one vmapped program: seeds × routing_iterations × reconstruction_weights, '
        'or recipes × seeds'),
    key('ensemble.seeds', (), distinct_seeds(), 'ensemble members: one per seed', in_base=False),
    key('ensemble.routing_iterations', (), ints_at_least(1), 'ensemble members: routing iterations each (at most '
        'model.routing_iterations)', in_base=False),
    key('ensemble.reconstruction_weights', (), numbers_at_least(0), 'ensemble members: reconstruction loss weights',
        in_base=False),
    key('ensemble.recipes', (), Rule(lambda v: isinstance(v, (tuple, list)) and all(isinstance(x, str) for x in v),
                                     "a tuple of 'NAME: key=value, …' strings"),
        "ensemble members: named recipes, 'NAME: key=value, …' over the config (keys of ensembles.RECIPE_KEYS), "
        'each trained with every seed', in_base=False),
)


def _iterations_problem(iterations, routing_iterations):
  if not iterations or routing_iterations is None or max(iterations) <= routing_iterations:
    return None
  return (f'config.ensemble.routing_iterations={tuple(iterations)!r}: allowed at most '
          f'model.routing_iterations={routing_iterations} each')


# The rule across these keys (capsjax.keys.Across), checked by validation.
RULES = (Across(('ensemble.routing_iterations', 'model.routing_iterations'), _iterations_problem),)

# The config keys a recipe may set, as the member's field each becomes: what one program
# varies per member (traced in the step). The loss's reduction becomes a scale of the
# summed margin loss; the schedule's kind an index into optimization.SCHEDULES.
RECIPE_KEYS = {
    'learning_rate': 'learning_rate', 'lr_schedule': 'lr_schedule', 'lr_decay_rate': 'lr_decay_rate',
    'lr_decay_steps': 'lr_decay_steps', 'lr_staircase': 'lr_staircase', 'lr_min': 'lr_min',
    'warmup_steps': 'warmup_steps', 'warmup_max_fraction': 'warmup_max_fraction', 'weight_decay': 'weight_decay',
    'ema_decay': 'ema_decay',
    'loss.reconstruction_weight': 'reconstruction_weight', 'loss.margin_reduction': 'margin_reduction',
    'model.routing_iterations': 'routing_iterations',
    **{f'augment.{key}': f'augment.{key}' for key in ('rotation', 'scale', 'shear', 'rotation_std', 'margin_shift',
                                                      'squish', 'erase', 'elastic_alpha')},
}


def _top_level_parts(text: str) -> List[str]:
  """`text` split at the commas outside brackets and quotes ('a=1, b=(1, 2)' → two parts)."""
  parts, depth, quote, start = [], 0, '', 0
  for index, char in enumerate(text):
    if quote:
      quote = '' if char == quote else quote
    elif char in '\'"':
      quote = char
    elif char in '([{':
      depth += 1
    elif char in ')]}':
      depth -= 1
    elif char == ',' and depth == 0:
      parts.append(text[start:index])
      start = index + 1
  return parts + [text[start:]]


def parse_variant(spec: str, what: str = 'sweep variant') -> Tuple[str, Dict[str, Any]]:
  """'name: a=1, b.c=2e-3, d=("x", "y")' → ('name', {'a': 1, 'b.c': 0.002, 'd': ('x', 'y')});
  `what` names it in errors."""
  name, _, assignments = spec.partition(':')
  name = name.strip()
  if not name or not name.replace('_', '').replace('-', '').replace('.', '').isalnum():
    raise ConfigError(f'{what} {spec!r}: the name before ":" must be a plain word')
  overrides = {}
  for assignment in filter(None, (a.strip() for a in _top_level_parts(assignments))):
    key, equals, value = assignment.partition('=')
    key, value = key.strip(), value.strip()
    if not equals:
      raise ConfigError(f'{what} {name!r}: expected key=value, got {assignment!r}')
    if key in overrides:   # (the last one silently won; the command line refuses a key given twice)
      raise ConfigError(f'{what} {name!r}: {key} is given twice: give it once')
    try:
      overrides[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      quoted = f" (a string is quoted: {key}='{value}')" if value.replace('_', '').replace('/', '').isalnum() else ''
      raise ConfigError(f'{what} {name!r}: {value!r} is not a Python literal{quoted}') from None
  return name, overrides
