"""CapsNet (Sabour et al. 2017, figure 1 + figure 2) as a Flax module, built from a config."""
import dataclasses
import math
from typing import Annotated, Any, Dict, List, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from capsjax.layers import (CAPSULE_TRANSFORMS_NORMAL, LECUN_NORMAL, TRANSFORMS, VOTES, CapsuleLayer, Conv, DeconvDecoder, Decoder, PrimaryCaps,
                            StridedStem, drawn_as_a_matrix, halved, is_image_shape, stem_stages)
from capsjax import formulations
from capsjax.keys import (About, Key, Rule, annotated_keys, boolean, int_at_least, int_in, ints_at_least, is_int,
                          check_values, field_problems, lookup, nested, number_in, one_of, registered,
                          registered_tuple)
from capsjax.errors import ArgumentError, ConfigError
from capsjax.layout import moved_key_hint
from capsjax.losses import class_indices_hint
from capsjax.registry import Registry
from capsjax.routing import (LAYER_INPUTS, MAX_ROUTING_ITERATIONS, ROUTINGS, configurable_routing_options, own_section_problems,
                             routing_option_defaults, routing_option_keys, vector_norm)

Array = jax.Array


def capsule_lengths(capsules: Array) -> Array:
  """Existence probabilities: |v_j|, [batch, caps, dim] → [batch, caps].

  Example:
    >>> capsjax.capsule_lengths(jnp.array([[[3.0, 4.0], [0.0, 1.0]]]))   # [1, 2 caps, 2-D]
    Array([[5., 1.]], dtype=float32)
  """
  return vector_norm(capsules, axis=-1)


def mask_capsules(capsules: Array, mask: Array) -> Array:
  """Zero all capsules but the masked ones: [batch, caps, dim] × [batch, caps]."""
  if tuple(mask.shape) != tuple(capsules.shape[:-1]):   # broadcasting would fail unnamed, or mask wrongly
    raise ArgumentError(f'mask {tuple(mask.shape)} must be one-hot [batch, classes] = {tuple(capsules.shape[:-1])}'
                        + class_indices_hint(mask, capsules.shape[-2]))
  return capsules * mask[..., None].astype(capsules.dtype)


def longest_capsule_mask(lengths: Array) -> Array:
  """One-hot of the longest capsule (test-time masking), [batch, caps]."""
  return jax.nn.one_hot(jnp.argmax(lengths, axis=-1), lengths.shape[-1], dtype=lengths.dtype)


INITS = ('default', 'official')
# CapsNet's stem and decoder; with TRANSFORMS, the paper's first and the one whose size does
# not grow with the image second (capsjax.sizing picks the second where memory is short).
STEMS = ('none', 'strided')
DECODERS = ('dense', 'deconv')

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


def initializers(name: str):
  """Initializers per CapsNet part. 'default': Flax's LeCun normal for the convolutions and
  the decoder, N(0, 0.01²) for the DigitCaps W_ij, zero biases (the paper names none).
  'official': the authors' released code, truncated normals (±2σ) with σ 0.05 for conv1
  and 0.1 elsewhere, every bias 0.1 (the decoder's too). The weights' draws as matrices
  (`drawn_as_a_matrix`: the same numbers, compiled faster)."""
  if name == 'default':
    return {'conv1': LECUN_NORMAL, 'primary': LECUN_NORMAL, 'digit': CAPSULE_TRANSFORMS_NORMAL,
            'decoder': LECUN_NORMAL, 'bias': nn.initializers.zeros}
  if name == 'official':
    truncated = lambda stddev: drawn_as_a_matrix(nn.initializers.truncated_normal(stddev))
    return {'conv1': truncated(0.05), 'primary': truncated(0.1), 'digit': truncated(0.1), 'decoder': truncated(0.1),
            'bias': nn.initializers.constant(0.1)}
  raise ArgumentError(f'model init_scheme must be one of {INITS}, got {name!r}')


# config.model.name → the Flax module class (its fields are the config's other keys) and
# what callers ask of a family instead of comparing its name:
#   objectives     the objectives (capsjax.objectives) it trains with
#   capsules       it has `classify` (capsules, activations), `encode` and `decode`: the
#                  explorer, the figures and segmentation read capsules
#   has_decoder    model config → whether it reconstructs (reconstruction images, predict)
#   routing_probe  its `encode` returns routing logits when its routing has them
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


def _capsnet_problems(model, prefix: str) -> List[str]:
  """The input geometry and the routing's options and features of a CapsNet config."""
  problems = []
  why = capsnet_geometry_problem(model)
  if why:
    problems.append(f'config.{prefix}input_shape={tuple(model.input_shape)!r}: {why}')
  name = model.routing
  entry = ROUTINGS[name]
  for feature in model.routing_inputs:
    if feature not in entry.layer_inputs:
      readers = [e.name for e in ROUTINGS.entries() if feature in e.layer_inputs]
      problems.append(f'config.{prefix}routing_inputs={tuple(model.routing_inputs)!r}: {feature} is an input of '
                      f'routing={"|".join(readers)} only; routing={name!r}')
  problems.extend(routing_options_problems(name, model.get('routing_options') or {}, prefix))
  return problems


def routing_options_problems(name: str, sections, prefix: str = 'model.') -> List[str]:
  """config.model.routing_options (a section per routing) for `routing=name`: the shape and
  its own section (routing.own_section_problems, what the layer checks too); another
  routing's section may not change a default (it would be silently unread)."""
  problems = own_section_problems(name, sections, f'config.{prefix}routing_options')
  for section, options in dict(sections).items() if hasattr(sections, 'items') else ():
    where = f'config.{prefix}routing_options.{section}'
    if section == name or not hasattr(options, 'items'):
      continue
    if section in ROUTINGS:
      defaults = routing_option_defaults(section)
      problems.extend(f'{where}.{option}={value!r}: an option of routing {section!r}, but routing={name!r}'
                      for option, value in options.items() if option not in defaults or value != defaults[option])
    elif options:
      problems.append(f'{where}: no routing {section!r} is registered (routing={name!r})')
  return problems


def _cnn_problems(model, prefix: str) -> List[str]:
  if len(model.conv_channels) != len(model.conv_kernels):
    return [f'config.{prefix}conv_kernels={tuple(model.conv_kernels)!r}: allowed one kernel per '
            f'entry of conv_channels={tuple(model.conv_channels)!r}']
  return []


@register_model('capsnet', objectives=('capsnet',), capsules=True, routing_probe=True,
                has_decoder=lambda model: bool(model.get('use_decoder')), check=_capsnet_problems)
class CapsNet(nn.Module):
  """Conv1 → PrimaryCaps → DigitCaps (routing) → Decoder.

  `__call__(images, mask)` returns a dict with `capsules` [batch, classes, dim], `lengths`
  [batch, classes] (|v|), `activations` [batch, classes] (the routing's, what the margin
  loss reads; Procedure 1's are the lengths; `routing` names the algorithm,
  capsjax.routing) and, with a decoder, `reconstructions` [batch, *input_shape]. `mask`
  [batch, classes] selects the capsules the decoder sees (true labels in training); None
  masks by the most active capsule, as at test time. A mask [batch, k, classes] decodes k
  times (one digit each, MultiMNIST): reconstructions [batch, k, *input_shape].
  The defaults are the paper's MNIST model (8.2M parameters with the decoder).

  Example:
    A small CapsNet; `classify`, `encode` and `decode` are its other methods.

    >>> model = capsjax.CapsNet(conv1_channels=32, primary_types=8)
    >>> images = jnp.zeros((2, 28, 28, 1))                      # [batch, h, w, c]
    >>> params = jax.jit(model.init)(jax.random.key(0), images)
    >>> outputs = jax.jit(model.apply)(params, images)          # mask None: longest capsule
    >>> for name, value in sorted(outputs.items()):
    ...   print(name, value.shape)
    activations (2, 10)
    capsules (2, 10, 16)
    lengths (2, 10)
    reconstructions (2, 28, 28, 1)
    >>> capsules, activations = model.apply(params, images, method='classify')   # no decoder
  """
  conv1_channels: Annotated[int, About(int_at_least(1), 'channels of the first convolution (the paper: 256)')] = 256
  conv1_kernel: Annotated[int, About(int_at_least(1), 'kernel side of the first convolution (9)')] = 9
  primary_types: Annotated[int, About(int_at_least(1), 'primary capsule types (32)')] = 32
  primary_dim: Annotated[int, About(int_at_least(1), 'primary capsule dimensions (8)')] = 8
  primary_kernel: Annotated[int, About(int_at_least(1), "PrimaryCaps' kernel side (9)")] = 9
  primary_stride: Annotated[int, About(int_at_least(1), "PrimaryCaps' stride (2)")] = 2
  num_classes: Annotated[int, NUM_CLASSES] = 10
  digit_dim: Annotated[int, About(int_at_least(1), 'digit capsule dimensions (16)')] = 16
  routing_iterations: Annotated[int, About(int_in(1, MAX_ROUTING_ITERATIONS),
                                           'routing-by-agreement iterations (3)')] = 3
  routing_inputs: Annotated[Sequence[str], About(registered_tuple(lambda: LAYER_INPUTS, 'layer inputs',
                                                                 allow_empty=True), (
      "what the class capsules' layer gives the routing, by the names its function takes (empty: "
      "the votes alone, the paper): bias (a learned bias added to s_j in every iteration, the authors' "
      "code), log_priors (learned initial routing logits), leaky (a 'none-of-the-above' parent), "
      'stop_gradient_predictions (gradients reach the predictions through the last iteration only)'))] = ()
  decoder_hidden: Annotated[Sequence[int], About(ints_at_least(1), "the decoder's hidden widths (512, 1024)")] = (
      512, 1024)
  use_decoder: Annotated[bool, About(boolean(), 'the reconstruction decoder (and its loss)')] = True
  input_shape: Annotated[Sequence[int], INPUT_SHAPE] = (28, 28, 1)
  # Formulations of the same math (capsjax.formulations: the config's model.formulation
  # section, shared by the families); 'auto' = the backend's measured faster one.
  formulation: formulations.Formulation = formulations.Formulation(dtype='auto')
  # The authors' released code (experiments/mnist_official.py): 'official' truncated-normal
  # weights and 0.1 biases; PrimaryCaps' pre-squash output ÷ types.
  init_scheme: Annotated[str, About(one_of(INITS), "default initialisers, or the authors' code's "
                                    '(official)')] = 'default'
  primary_scale_by_types: Annotated[bool, About(boolean(), "PrimaryCaps' convolution ÷ types before its bias "
                                                "(the authors' code)")] = False
  routing: Annotated[str, About(registered(ROUTINGS.names), "the routing algorithm (capsjax.routing.ROUTINGS; "
                                "dynamic: the paper's Procedure 1; see docs/results.md)")] = 'dynamic'
  # A section per routing, in the config (at their defaults: --config.model.routing_options.
  # em.inverse_temperature=2) as in the module and its capsule layer, which read their own.
  routing_options: Annotated[Optional[Dict[str, Any]], About(
      Rule(lambda v: hasattr(v, 'keys'), 'a dict: routing name → its options'),
      "the routings' options, a section per routing; the model reads model.routing's (learned parameters "
      'are not options)', config_default=configurable_routing_options)] = None
  transforms: Annotated[str, About(one_of(('auto',) + TRANSFORMS), (
      'class-capsule transforms: per_capsule (the paper: W_ij for every primary capsule) or per_type (W_tj '
      'shared over positions, with coordinate addition: parameters independent of the image size; see '
      'CapsuleLayer); auto: by the image size and memory (capsjax.sizing)'))] = 'per_capsule'
  votes: Annotated[str, About(one_of(VOTES), (
      'per_type transforms: routing without û (factored) or with û built first (materialised); same '
      'values'))] = 'factored'
  stem: Annotated[str, About(one_of(('auto',) + STEMS), (
      'none (the paper: conv1 sees the image) or strided: 3×3 stride-2 convolutions of stem_channels before '
      'conv1 halving the image to at most 40 px (layers.StridedStem); auto: by the image size'))] = 'none'
  stem_channels: Annotated[int, About(int_at_least(1), "the strided stem's channels (32)")] = 32
  decoder: Annotated[str, About(one_of(('auto',) + DECODERS), (
      "dense (the paper's 512-1024-pixels) or deconv (transposed convolutions, layers.DeconvDecoder: its size "
      'does not grow with the image); auto: by the image size'))] = 'dense'

  def setup(self):
    check_module(self)
    for key, value in (('transforms', self.transforms), ('stem', self.stem), ('decoder', self.decoder)):
      if value == 'auto':   # capsjax.sizing chooses, once the data's shape is known
        raise ArgumentError(f"CapsNet {key}='auto' must be resolved first (capsjax.assemble.choose_model)")
    inits = initializers(self.init_scheme)
    # The formulation, one object for every layer ('auto' resolves where each is traced).
    how = self.formulation.with_dtype()
    if self.stem == 'strided':
      self.strided_stem = StridedStem(stem_stages(*self.input_shape[:2]), self.stem_channels, formulation=how,
                                      kernel_init=inits['conv1'], bias_init=inits['bias'])
    self.conv1 = Conv(self.conv1_channels, self.conv1_kernel, formulation=how, kernel_init=inits['conv1'],
                      bias_init=inits['bias'])
    self.primary_caps = PrimaryCaps(self.primary_types, self.primary_dim, self.primary_kernel, self.primary_stride,
                                    formulation=how, kernel_init=inits['primary'], bias_init=inits['bias'],
                                    scale_by_types=self.primary_scale_by_types)
    self.digit_caps = CapsuleLayer(
        self.num_classes, self.digit_dim, self.routing_iterations, routing_inputs=tuple(self.routing_inputs),
        formulation=how,
        weights_init=inits['digit'], bias_init=inits['bias'], routing=self.routing,
        routing_options=dict(self.routing_options or {}), transforms=self.transforms, types=self.primary_types,
        votes=self.votes)
    if self.use_decoder and self.decoder == 'deconv':
      self.reconstruction = DeconvDecoder(tuple(self.input_shape), formulation=how, kernel_init=inits['decoder'],
                                          bias_init=inits['bias'], name='decoder')
    elif self.use_decoder:
      self.reconstruction = Decoder(tuple(self.decoder_hidden), tuple(self.input_shape),
                                    kernel_init=inits['decoder'], bias_init=inits['bias'], name='decoder')

  def classify(self, images: Array, routing_iterations=None, max_iterations=None):
    """Images [batch, h, w, c] → (digit capsules [batch, classes, dim], the routing's
    activations [batch, classes]: for Procedure 1 the capsule lengths)."""
    routed = self._route(images, routing_iterations, max_iterations, False)
    return routed.parents, routed.activations

  def encode(self, images: Array, routing_iterations=None, max_iterations=None,
             return_logits: bool = False):
    """Images [batch, h, w, c] → digit capsules [batch, classes, dim] (and logits)."""
    routed = self._route(images, routing_iterations, max_iterations, return_logits)
    return (routed.parents, routed.logits) if return_logits else routed.parents

  def routing_details(self, images: Array, routing_iterations=None, max_iterations=None) -> Dict[str, Any]:
    """What the routing diagnostics read (capsjax.diagnostics): images [batch, h, w, c] →
    {'primary_lengths' [batch, in], 'activations' [batch, classes] (the class capsules'
    presence as the routing reports it), 'couplings': (first, last) [batch, in, classes]
    each, or None where the routing has none (ROUTINGS[name].returns_couplings)}."""
    with_couplings = ROUTINGS[self.routing].returns_couplings
    primary, grid = self._primary(images)
    routed = self.digit_caps(primary, routing_iterations, max_iterations, False, grid,
                             return_couplings=with_couplings)
    return {'primary_lengths': capsule_lengths(primary),
            'activations': routed.activations, 'couplings': routed.couplings}

  def _primary(self, images):
    """(primary capsules [batch, in, dim], their grid (rows, columns))."""
    check_input_images(self, images)
    if self.stem == 'strided':
      images = self.strided_stem(images)
    features = nn.relu(self.conv1(images))
    grid = formulations.valid_output_size(*features.shape[1:3], self.primary_kernel, self.primary_stride)
    return self.primary_caps(features), grid

  def _route(self, images, routing_iterations, max_iterations, return_logits):
    primary, grid = self._primary(images)
    return self.digit_caps(primary, routing_iterations, max_iterations, return_logits, grid)

  def decode(self, capsules: Array, mask: Array) -> Array:
    return self.reconstruction(mask_capsules(capsules, mask))

  def __call__(self, images: Array, mask: Optional[Array] = None, routing_iterations=None,
               max_iterations=None):
    capsules, activations = self.classify(images, routing_iterations, max_iterations)
    outputs = {'capsules': capsules, 'lengths': capsule_lengths(capsules), 'activations': activations}
    if self.use_decoder:
      if mask is None:
        mask = longest_capsule_mask(activations)
      if mask.ndim == 3:
        outputs['reconstructions'] = jnp.stack(
            [self.decode(capsules, mask[:, k]) for k in range(mask.shape[1])], axis=1)
      else:
        outputs['reconstructions'] = self.decode(capsules, mask)
    return outputs


@register_model('cnn', objectives=('softmax_xent', 'sigmoid_xent'), check=_cnn_problems)
class BaselineCNN(nn.Module):
  """The paper's CNN baselines: conv (+ 2×2 max-pool) layers, fully connected layers, logits.

  MNIST (section 5): convs 256, 256, 128 @5×5 (SAME, no pooling), FC 328 and 192, dropout
  before the 10-way softmax layer: 35,445,522 parameters (the paper: 35.4M).

  MultiMNIST (section 6.2): convs 512@9×9 and 256@5×5 (SAME), each pooled, FC 1024, 10
  sigmoid outputs: 24,563,978 parameters on 36×36 inputs (the paper: 24.56M).
  images [batch, *input_shape] → {'logits': [batch, num_classes]}.

  Example:
    >>> cnn = capsjax.BaselineCNN(conv_channels=(8, 16), conv_kernels=(5, 5), dense=(32,),
    ...                           input_shape=(28, 28, 1))
    >>> images = jnp.zeros((2, 28, 28, 1))
    >>> params = jax.jit(cnn.init)(jax.random.key(0), images)
    >>> jax.jit(cnn.apply)(params, images)['logits'].shape
    (2, 10)
  """
  conv_channels: Annotated[Sequence[int], About(ints_at_least(1, allow_empty=False),
                                                 "the CNN's convolution channels")] = (512, 256)
  conv_kernels: Annotated[Sequence[int], About(ints_at_least(1, allow_empty=False), "the CNN's kernel sides")] = (
      9, 5)
  pool: Annotated[bool, About(boolean(), 'the CNN pools 2×2 after each convolution')] = True
  dense: Annotated[Sequence[int], About(ints_at_least(1), "the CNN's fully connected widths")] = (1024,)
  dropout_rate: Annotated[float, About(number_in(0, 1, high_open=True),
                                       "dropout before the CNN's output layer")] = 0.0
  num_classes: Annotated[int, NUM_CLASSES] = 10
  input_shape: Annotated[Sequence[int], INPUT_SHAPE] = (36, 36, 1)
  # The convolutions' formulation (the config's model.formulation, as CapsNet's); float32
  # compute: bfloat16 is unmeasured for the baselines (routing_loop: no routing here).
  formulation: formulations.Formulation = formulations.Formulation(dtype='float32')

  @nn.compact
  def __call__(self, images: Array, train: bool = False):
    check_module(self)
    check_input_images(self, images)
    features = images
    how = self.formulation.with_dtype()
    for channels, kernel in zip(self.conv_channels, self.conv_kernels):
      features = nn.relu(Conv(channels, kernel, padding='SAME', formulation=how)(features))
      if self.pool:
        features = nn.max_pool(features, (2, 2), strides=(2, 2))
    features = features.reshape(features.shape[0], math.prod(features.shape[1:]))   # (-1 fails for 0 images)
    for width in self.dense:
      features = nn.relu(nn.Dense(width)(features))
    if self.dropout_rate:  # "the last fully connected layer is connected with dropout" (section 5)
      features = nn.Dropout(self.dropout_rate, deterministic=not train)(features)
    return {'logits': nn.Dense(self.num_classes)(features)}


def primary_grid(model, stem: Optional[str] = None) -> Tuple[int, int]:
  """(rows, columns) of the primary capsules of the CapsNet config `model` on its input
  (0 where a side is too small), with `stem` (default: the model's own)."""
  height, width = model.input_shape[:2]
  stem = model.stem if stem is None else stem
  stages = stem_stages(height, width) if stem == 'strided' else 0
  grid = []
  for side in (halved(height, stages), halved(width, stages)):
    conv1 = formulations.valid_output_size(side, side, model.conv1_kernel, 1)[0]
    grid.append(formulations.valid_output_size(conv1, conv1, model.primary_kernel, model.primary_stride)[0]
                if conv1 >= model.primary_kernel else 0)
  return grid[0], grid[1]


def capsnet_geometry_problem(model) -> Optional[str]:
  """Why the CapsNet's two valid convolutions do not fit its input (a model config),
  or None: each side needs at least conv1_kernel + primary_kernel − 1 pixels."""
  if not model.input_shape:
    return None   # the shape of the data, checked once the data has said it
  if min(primary_grid(model)) < 1:
    height, width = model.input_shape[:2]
    least = model.conv1_kernel + model.primary_kernel - 1
    return (f'images of {height}×{width} are too small for the CapsNet\'s {model.conv1_kernel}×'
            f'{model.conv1_kernel} and {model.primary_kernel}×{model.primary_kernel} convolutions (at least '
            f'{least}×{least}): pass --config.image_size=N with N >= {least} to resize them')
  return None


def model_keys(name: str) -> Dict[str, Key]:
  """config.model's keys for the family `name`: `name` itself and its module's annotated
  fields (each field's default, rule and help: capsjax.keys)."""
  family = Key('name', name, registered(MODELS.names), 'the model family (registered in capsjax.models / '
               'capsjax.families)')
  return {'name': family, **annotated_keys(MODELS.get(name))}


def model_config(name: str = 'capsnet') -> ml_collections.ConfigDict:
  """config.model of family `name` at its defaults (the paper's CapsNet: 8,215,568 parameters,
  6,804,224 without the decoder).

  Example:
    >>> capsjax.model_config('cnn').conv_channels
    (512, 256)
  """
  return ml_collections.ConfigDict(nested(model_keys(name).values()))


def model_problems(model, prefix: str = 'model.') -> List[str]:
  """Every rule the model section `model` (config.model) breaks, one line each, keys named
  `config.{prefix}KEY`: its family's keys, each routing's options, the family's own checks.
  capsjax.validation and `build_model` run it."""
  problems: List[str] = []
  family = model.get('name')
  if family not in MODELS:
    return [f'config.{prefix}name={family!r}: allowed one of {", ".join(MODELS.names())}']
  declared = model_keys(family)
  names = dict.fromkeys(name.split('.')[0] for name in declared)   # its keys and sections
  unknown = [key for key in model.keys() if key not in names]
  if unknown:
    problems.append(f'config.{prefix}{unknown[0]}: not a key of the {family!r} model (its keys: '
                    f'{", ".join(names)})' + moved_key_hint(prefix + unknown[0]))
  for section in (name for name in names if name not in declared):
    found, value = lookup(model, section)
    keys_of = [name[len(section) + 1:] for name in declared if name.startswith(section + '.')]
    if found and not hasattr(value, 'keys'):
      problems.append(f'config.{prefix}{section}={value!r}: allowed a section of {", ".join(keys_of)}')
    elif found and any(key not in keys_of for key in value.keys()):
      other = next(key for key in value.keys() if key not in keys_of)
      problems.append(f'config.{prefix}{section}.{other}: not a key of model.{section} (its keys: '
                      f'{", ".join(keys_of)})')
  check_values(model, declared, problems, prefix)
  if 'routing_options' in declared:
    for routing in ROUTINGS.names():   # each routing's section by its own options' rules
      check_values(model, {f'routing_options.{routing}.{option}': key
                          for option, key in routing_option_keys(routing).items()}, problems, prefix)
  if problems:
    return problems   # the family's own cross-field checks need valid fields
  (has_impl, impl), (has_inputs, inputs) = (lookup(model, f'formulation.{key}') for key in ('conv_impl', 'conv_inputs'))
  inputs_problem = formulations.conv_inputs_problem(impl, inputs) if has_impl and has_inputs else None
  if inputs_problem:
    problems.append(f'config.{prefix}formulation.conv_inputs={inputs!r}: {inputs_problem}')
  return problems + list(MODELS[family].check(model, prefix))


def build_model(name, **fields) -> nn.Module:
  """The model family `name` with `fields` (config.model's other keys: `build_model(**config.model)`,
  or the section itself, `build_model(config.model)`) as its sizes (lists become tuples),
  checked first as the config's model is (capsjax.ConfigError, the command's line).
  `routing_options` has one shape everywhere: a section per routing ({'em': {...}}).

  Example:
    >>> model = capsjax.build_model('capsnet', conv1_channels=32, primary_types=8, routing='em')
    >>> type(model).__name__, model.routing, model.primary_types
    ('CapsNet', 'em', 8)
    >>> config = capsjax.base_config()
    >>> paper = capsjax.build_model(**config.model)             # the config's model
    >>> paper.conv1_channels, paper.routing_iterations
    (256, 3)
    >>> capsjax.build_model(config.model).num_classes            # the same, given the section
    10
    >>> capsjax.build_model('capsnet', routing_iterations=0)
    Traceback (most recent call last):
    ...
    capsjax.errors.ConfigError: config.model.routing_iterations=0: allowed an integer in [1, 100]
  """
  name, fields, sections = _checked(name, fields)
  return _construct(MODELS.get(name), fields, sections)


def _checked(name, fields: Dict[str, Any]):
  """(family, fields, its sections' defaults) of build_model's arguments, checked as the
  config's model section is: ConfigError, the command's line."""
  if hasattr(name, 'keys') and 'model' in name.keys():
    raise ConfigError('build_model takes the model section, build_model(config.model) or '
                      'build_model(**config.model), not the whole config')
  if hasattr(name, 'keys'):   # build_model(config.model): the section, its name inside
    fields = {**dict(name.items()), **fields}
    name = fields.pop('name', None)
  if name not in MODELS:
    raise ConfigError(f'config.model.name={name!r}: allowed one of {", ".join(MODELS.names())}')
  sections = {field.name: field.default for field in dataclasses.fields(MODELS.get(name))
              if dataclasses.is_dataclass(field.default) and not isinstance(field.default, type)}
  fields = {key: tuple(value) if isinstance(value, list) else value.to_dict()
            if isinstance(value, ml_collections.ConfigDict) else value for key, value in fields.items()}
  model = _as_config(name, fields, sections)
  problems = model_problems(model)
  if problems:
    raise ConfigError(problems[0])
  # A module built from a config's "from the data" values would have no classes or no image size.
  left = left_to_the_data(model.get('num_classes'), model.get('input_shape'))
  if left:
    meaning, needed = left
    raise ConfigError(f'config.model.{meaning}, filled in when a run reads them; build_model needs {needed}')
  return name, fields, sections


def _construct(cls, fields: Dict[str, Any], sections: Dict[str, Any]) -> nn.Module:
  """The module of family `cls` with `fields` (checked), a section's dict over its defaults."""
  for key, value in fields.items():
    if key in sections and isinstance(value, dict):   # a config's section: its keys over the family's
      fields[key] = dataclasses.replace(sections[key], **value)
  return cls(**fields)


def _as_config(name: str, fields: Dict[str, Any], sections: Dict[str, Any]) -> ml_collections.ConfigDict:
  """The model section `fields` make (the family's defaults for what they leave out, a
  section given as its dataclass as its dict), as validation sees config.model."""
  model = model_config(name).to_dict()
  for key, value in fields.items():
    if key in sections and dataclasses.is_dataclass(value):
      value = {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
    if isinstance(model.get(key), dict) and isinstance(value, dict) and key != 'routing_options':
      value = {**model[key], **value}
    model[key] = value
  return ml_collections.ConfigDict(model)


def model_for_platform(model, platform: str = '', ensemble: bool = False) -> nn.Module:
  """The module of the model config `model` (config.model), its formulation's 'auto'
  options chosen once for `platform` (capsjax.formulations.for_platform; '' : JAX's default
  backend) and for an `ensemble`'s members or one model: what a run, the planner and the
  memory estimate build."""
  name, fields, sections = _checked(model, {})   # as given: 'auto' is a config value, a rule is not
  if 'formulation' in model:   # a user's family may declare none
    fields['formulation'] = formulations.for_platform(model.formulation, platform, ensemble)
  return _construct(MODELS.get(name), fields, sections)


def formulation_of(module: nn.Module) -> Optional[formulations.Formulation]:
  """The formulation a built model computes with (what `model_for_platform` chose), or
  None for a family without one."""
  return getattr(module, 'formulation', None)


def count_params(params) -> int:
  return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
