"""The model families' registry (`MODELS`, `register_model`) and what every family shares:
the input shape and class count keys, the checks of a built module's fields and images."""
from typing import Optional, Tuple

import jax

from capsjax.layers import is_image_shape
from capsjax.keys import About, Rule, is_int, field_problems
from capsjax.errors import ArgumentError, ConfigError
from capsjax.registry import Registry


Array = jax.Array


# Keys every family has, declared once for all of them.
INPUT_SHAPE = About(Rule(lambda v: is_image_shape(v) or (isinstance(v, (tuple, list)) and len(v) == 0),
                         '(height, width, channels), each >= 1, or () for the shape of the data'),
                    'image height, width, channels the model reads; () = those of the data')


NUM_CLASSES = About(Rule(lambda v: is_int(v) and (v == 0 or v >= 2),
                         'an integer >= 2, or 0 for the classes of the data'),
                    'classes (digit capsules, or output units); 0 = those of the data')


def check_module(module) -> None:
  """A family's module as built (directly, `CapsNet(num_classes=1)`, or by build_model from
  a checked config): its fields by their keys' rules (capsjax.keys.field_problems), and the
  numbers a config leaves to the data given. ConfigError, one line."""
  problems = field_problems(module)
  if problems:
    raise ConfigError(problems[0])
  left = left_to_the_data(getattr(module, 'num_classes', None), getattr(module, 'input_shape', None))
  if left:
    meaning, needed = left
    raise ConfigError(f'{type(module).__name__}.{meaning} in a config; a module needs {needed}')


def check_input_images(module, images: Array) -> None:
  """ValueError unless `images` are [batch, *module.input_shape]: a model built for one
  size silently becomes another model on another (its dense layers sized by the images)."""
  expected = tuple(module.input_shape)
  if tuple(images.shape[1:]) != expected:
    raise ArgumentError(f'{type(module).__name__} expects images of shape [batch, {", ".join(map(str, expected))}], '
                        f'got {list(images.shape)}')


def left_to_the_data(num_classes, input_shape) -> Optional[Tuple[str, str]]:
  """(what it means, what a module needs instead) where `num_classes` or `input_shape`
  holds a config's "from the data" value (0 classes, no image size: filled in when a run
  reads its data), else None; None for a value a family does not have."""
  if num_classes == 0:
    return 'num_classes=0 means the classes of the data', 'the number (num_classes=10)'
  if input_shape is not None and not tuple(input_shape):
    return 'input_shape=() means the image size of the data', 'the size (input_shape=(28, 28, 1))'
  return None


# config.model.name → the Flax module class (its fields are the config's other keys) and
# what callers ask of a family instead of comparing its name:
#   objectives     the objectives (capsjax.objectives) it trains with
#   capsules       it has `classify` (capsules, activations), `encode` and `decode`: the
#                  explorer, the figures and segmentation read capsules
#   has_decoder    model config → whether it reconstructs (reconstruction images, predict)
#   routing_probe  its `routed` returns routing logits when its routing has them
#   check          (model config, key prefix) → problems, one line each (validation)
MODELS = Registry('model', objectives=(), capsules=False, has_decoder=lambda model: False,
                  routing_probe=False, check=lambda model, prefix: [],
                  doc="""The model families by name (`config.model.name`, `build_model(name, ...)`): each
entry's value is the Flax module class; its capabilities say which objectives train it,
whether it has capsules and a decoder (the comment above this registry lists them).

Example:
  >>> capsjax.MODELS.names()
  ('capsnet', 'cnn')
  >>> capsjax.MODELS['capsnet'].value is capsjax.CapsNet, capsjax.MODELS['capsnet'].objectives
  (True, ('capsnet',))
""")


def register_model(name: str, **capabilities):
  """Class decorator: `config.model.name = name` builds this module (see the capabilities
  above). A model family is one file: its module and its objective
  (`capsjax.objectives.register_objective`), imported by the config that names it."""
  return MODELS.register(name, **capabilities)


def count_params(params) -> int:
  return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
