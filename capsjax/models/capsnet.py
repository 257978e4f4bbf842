"""CapsNet (Sabour et al. 2017, figure 1 + figure 2) as a Flax module: its capsule helpers
(lengths, masks), its initialisers, its config checks (geometry, routing inputs and
options) and the primary capsules' grid."""
from typing import Annotated, Any, Dict, List, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from capsjax.layers import (CAPSULE_TRANSFORMS_NORMAL, LECUN_NORMAL, TRANSFORMS, VOTES, CapsuleLayer, Conv,
                            DeconvDecoder, Decoder, PrimaryCaps, StridedStem, drawn_as_a_matrix, halved, stem_stages)
from capsjax import formulations
from capsjax.keys import (About, Rule, boolean, int_at_least, int_in, ints_at_least, one_of, registered,
                          registered_tuple)
from capsjax.errors import ArgumentError
from capsjax.losses import class_indices_hint
from capsjax.routing import (LAYER_INPUTS, MAX_ROUTING_ITERATIONS, ROUTINGS, configurable_routing_options,
                             own_section_problems, routing_option_defaults, vector_norm)
from capsjax.routing.base import option_value_problems
from capsjax.models.base import INPUT_SHAPE, NUM_CLASSES, Array, check_input_images, check_module, register_model


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
    if section in ROUTINGS:   # its options by their rules first, then: unread, so at their defaults
      defaults = routing_option_defaults(section)
      problems.extend(option_value_problems(section, options, f'{where}.')
                      or [f'{where}.{option}={value!r}: an option of routing {section!r}, but routing={name!r}'
                          for option, value in options.items() if option not in defaults or value != defaults[option]])
    elif options:
      problems.append(f'{where}: no routing {section!r} is registered (routing={name!r})')
  return problems


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
    A small CapsNet; `classify`, `encode`, `routed` and `decode` are its other methods.

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

  def encode(self, images: Array, routing_iterations=None, max_iterations=None) -> Array:
    """Images [batch, h, w, c] → digit capsules [batch, classes, dim]."""
    return self._route(images, routing_iterations, max_iterations, False).parents

  def routed(self, images: Array, routing_iterations=None, max_iterations=None, return_logits: bool = False):
    """Images [batch, h, w, c] → the class capsules' RoutingResult (parents [batch, classes,
    dim], activations; with `return_logits`, routings whose ROUTINGS entry returns_logits, the
    logits after every iteration [iterations, batch, in, classes]: the convergence probe)."""
    return self._route(images, routing_iterations, max_iterations, return_logits)

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
