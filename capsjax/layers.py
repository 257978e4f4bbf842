"""Flax (linen) capsule layers: they hold parameters and call the pure functions."""
import math
from typing import Annotated, Any, Callable, Dict, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from capsjax import formulations, ops
from capsjax.errors import ArgumentError, ConfigError
from capsjax.formulations import Formulation
from capsjax.keys import About, Rule, field_problems, int_at_least, int_in, ints_at_least, is_int, one_of, registered
from capsjax.routing import (LAYER_INPUTS, MAX_ROUTING_ITERATIONS, ROUTINGS, UNROLLED_INFERENCE, RoutingResult,
                             coordinate_offsets, own_routing_options, shared_form, shared_votes, squash, vector_norm)
from capsjax.routing import call as call_routing

Array = jax.Array

Initializer = Callable[..., Array]


def drawn_as_a_matrix(init: Initializer) -> Initializer:
  """`init` drawing the numbers of a weight of rank 3 or more as the matrix [everything but
  the last axis, last axis] and reshaping them: the same numbers bit for bit, since a
  draw's i-th number depends on the key and on i (row-major) alone and the matrix has the
  weight's fan-in. Why: XLA:CPU compiles a random draw of rank 4 several times slower than
  the same draw as a matrix (docs/results.md, "CPU speed"). For initializers whose
  distribution depends on the shape at most through the fan-in of the last-but-one axis
  (Flax's LeCun normal, normal, truncated normal)."""
  def matrix_init(key, shape, dtype=jnp.float32):
    if len(shape) <= 2:
      return init(key, shape, dtype)
    return init(key, (math.prod(shape[:-1]), shape[-1]), dtype).reshape(shape)
  return matrix_init


# The layers' default weights, drawn as matrices (the same numbers): Flax's LeCun normal,
# and N(0, 0.01²) for the capsule transforms W_ij.
LECUN_NORMAL = drawn_as_a_matrix(nn.initializers.lecun_normal())
CAPSULE_TRANSFORMS_NORMAL = drawn_as_a_matrix(nn.initializers.normal(0.01))

# A size of a layer: a count of capsules, types, dimensions or pixels.
SIZE = About(int_at_least(1), 'a size')
# CapsuleLayer's transforms and, for 'per_type', how its votes are formed (CapsNet's keys too).
TRANSFORMS = ('per_capsule', 'per_type')
VOTES = ('factored', 'materialised')
PADDINGS = ('VALID', 'SAME')


def is_image_shape(value) -> bool:
  """Whether `value` is an image's (height, width, channels), each >= 1."""
  return isinstance(value, (tuple, list)) and len(value) == 3 and all(is_int(x) and x >= 1 for x in value)


# As a decoder gives it (models.INPUT_SHAPE adds the config's () for the data's).
IMAGE_SHAPE = About(Rule(is_image_shape, 'a tuple of 3 integers >= 1 (height, width, channels)'), 'a shape')


def check_fields(module) -> None:
  """A module's annotated fields by their rules (capsjax.keys.field_problems): ConfigError,
  one line, as build_model refuses a config's model (a layer of 0-D capsules or a 0-pixel
  kernel would build, then fail deep in XLA or divide by zero)."""
  problems = field_problems(module)
  if problems:
    raise ConfigError(problems[0])


def check_images(layer: str, images: Array, kernel_size: int, padding: str = 'VALID', what: str = 'images') -> None:
  """A convolution's input: [batch, height, width, channels], not smaller than a VALID
  kernel (one line where XLA would name an empty or mismatched shape)."""
  if images.ndim != 4:
    raise ArgumentError(f'{layer} takes {what} [batch, height, width, channels]; got shape {images.shape}')
  if padding == 'VALID' and min(images.shape[1:3]) < kernel_size:
    raise ArgumentError(f'{layer}: {what} of {images.shape[1]}×{images.shape[2]} are smaller than its '
                        f'{kernel_size}×{kernel_size} kernel')


def compute_dtype(formulation: Formulation, inputs: Array):
  """The dtype a layer computes in: the formulation's, else its inputs' as JAX holds them
  (NumPy's float64 is float32 without x64), and float32 for integer inputs, as Flax's
  layers promote them (cast to the inputs' integers, the weights would be zeros)."""
  if formulation.dtype is not None:
    return formulation.dtype
  dtype = jax.dtypes.canonicalize_dtype(inputs.dtype)
  return dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.dtype(jnp.float32)


def same_padding(side: int, kernel_size: int, stride: int):
  """(low, high) zero padding of one side so that a convolution gives ⌈side / stride⌉
  outputs (TensorFlow's SAME: the extra pixel, if any, goes after)."""
  outputs = -(-side // stride)
  total = max((outputs - 1) * stride + kernel_size - side, 0)
  return total // 2, total - total // 2


class Conv(nn.Module):
  """Convolution with a [kh, kw, in, out] kernel, computed as `formulation` says
  (capsjax.Formulation: conv_impl, patches_inference, conv_inputs, dtype, member_convs,
  patch_extraction; ops.conv2d).

  padding 'VALID' (CapsNet) or 'SAME' (zero padding: the output is ⌈size / stride⌉, the
  CNN baselines at stride 1 and the strided stem at stride 2).
  `output_scale` multiplies the convolution before the bias is added.
  """
  features: Annotated[int, SIZE]
  kernel_size: Annotated[int, SIZE]
  stride: Annotated[int, SIZE] = 1
  use_bias: bool = True
  padding: Annotated[str, About(one_of(PADDINGS), 'padding')] = 'VALID'
  formulation: Formulation = Formulation()
  kernel_init: Initializer = LECUN_NORMAL
  bias_init: Initializer = nn.initializers.zeros
  output_scale: float = 1.0

  @nn.compact
  def __call__(self, images: Array) -> Array:
    check_fields(self)
    check_images('Conv', images, self.kernel_size, self.padding)
    in_features = images.shape[-1]
    kernel = self.param('kernel', self.kernel_init,
                        (self.kernel_size, self.kernel_size, in_features, self.features))
    how = self.formulation
    dtype = compute_dtype(how, images)
    if self.padding == 'SAME':
      pads = [same_padding(side, self.kernel_size, self.stride) for side in images.shape[1:3]]
      images = jnp.pad(images, ((0, 0), pads[0], pads[1], (0, 0)))
    outputs = ops.conv2d(images.astype(dtype), kernel.astype(dtype), self.stride, how.conv_impl,
                         how.patches_inference, how.conv_inputs, how.member_convs, how.patch_extraction)
    if self.output_scale != 1.0:
      outputs = outputs * self.output_scale
    if self.use_bias:
      bias = self.param('bias', self.bias_init, (self.features,))
      outputs = ops.add_bias(outputs, bias.astype(dtype))
    return outputs


class PrimaryCaps(nn.Module):
  """Convolutional capsules: one conv, outputs grouped into `dim`-D vectors, squashed.

  [batch, h, w, c] → [batch, out_h * out_w * num_types, dim], capsules ordered (h, w, type).
  `scale_by_types` divides the convolution by num_types before the bias, as the authors'
  code does (its PrimaryCaps pass through one routing step with uniform couplings 1/types).

  Example:
    >>> layer = capsjax.PrimaryCaps(num_types=4, dim=8)   # 9×9 kernel, stride 2
    >>> features = jnp.ones((2, 20, 20, 16))             # [batch, h, w, c]
    >>> params = layer.init(jax.random.key(0), features)
    >>> layer.apply(params, features).shape              # 6×6 positions × 4 types, 8-D
    (2, 144, 8)
  """
  num_types: Annotated[int, SIZE] = 32
  dim: Annotated[int, SIZE] = 8
  kernel_size: Annotated[int, SIZE] = 9
  stride: Annotated[int, SIZE] = 2
  formulation: Formulation = Formulation()
  kernel_init: Initializer = LECUN_NORMAL
  bias_init: Initializer = nn.initializers.zeros
  scale_by_types: bool = False

  @nn.compact
  def __call__(self, features: Array) -> Array:
    check_fields(self)
    check_images('PrimaryCaps', features, self.kernel_size, what='feature maps')
    outputs = Conv(self.num_types * self.dim, self.kernel_size, self.stride,
                   formulation=self.formulation, kernel_init=self.kernel_init,
                   bias_init=self.bias_init, output_scale=1.0 / self.num_types if self.scale_by_types else 1.0,
                   name='conv')(features)
    batch, height, width, _ = outputs.shape
    capsules = outputs.reshape(batch, height * width * self.num_types, self.dim)
    return squash(capsules.astype(jnp.float32))


class CapsuleLayer(nn.Module):
  """Fully connected capsule layer with routing by agreement (DigitCaps).

  `transforms='per_capsule'` (the paper): every input capsule i has its own W_ij for every
  output capsule j, û_{j|i} = W_ij u_i, then the routing. `'per_type'`: one W_tj per
  primary capsule type t (the capsules of `grid` positions × `types` types, ordered
  (row, column, type)) shared over positions, with coordinate addition,
  û_{j|(p,t)} = (W_tj u_(p,t) + o_p) / √positions (capsjax.routing.coordinate_offsets): its parameters
  do not grow with the image, and a routing with a `shared` form (all but EM) routes
  without materialising û. [batch, in_caps, in_dim] → [batch, out_caps, out_dim].
  `formulation.routing_loop` 'rolled', 'unrolled', or 'unrolled_inference' (unrolled where
  nothing differentiates it, rolled in training; all the same values; 'auto': the
  backend's faster one, capsjax.formulations).

  Example:
    >>> layer = capsjax.CapsuleLayer(num_capsules=10, dim=16, routing='dynamic')
    >>> primary = jax.random.normal(jax.random.key(0), (2, 144, 8))   # [batch, in_caps, in_dim]
    >>> params = layer.init(jax.random.key(1), primary)
    >>> params['params']['weights'].shape                             # W_ij [in, out, out_dim, in_dim]
    (144, 10, 16, 8)
    >>> routed = layer.apply(params, primary)                        # a RoutingResult
    >>> routed.parents.shape, routed.activations.shape                # [batch, out, dim], [batch, out]
    ((2, 10, 16), (2, 10))
  """
  num_capsules: Annotated[int, SIZE] = 10
  dim: Annotated[int, SIZE] = 16
  routing_iterations: Annotated[int, About(int_in(1, MAX_ROUTING_ITERATIONS), 'iterations')] = 3
  # Which of its inputs (capsjax.routing.LAYER_INPUTS) the layer gives the routing, each
  # under its own name: 'bias' and 'log_priors' are parameters of the layer, 'leaky' and
  # 'stop_gradient_predictions' switches (a routing reads those its layer_inputs name).
  routing_inputs: Sequence[str] = ()
  formulation: Formulation = Formulation()   # its routing_loop and dtype (of the predictions)
  weights_init: Initializer = CAPSULE_TRANSFORMS_NORMAL
  bias_init: Initializer = nn.initializers.zeros
  # The routing algorithm (capsjax.routing.ROUTINGS) and its options, a section per routing
  # as in the config ({'em': {'inverse_temperature': 2.0}}; its own is read); the options it
  # learns (EM's β, self-attention's log priors, …) are parameters `routing_NAME`.
  routing: Annotated[str, About(registered(ROUTINGS.names), 'a routing')] = 'dynamic'
  routing_options: Optional[Dict[str, Any]] = None
  # or 'per_type' (shared over positions; needs `types` and the call's `grid`)
  transforms: Annotated[str, About(one_of(TRANSFORMS), 'transforms')] = 'per_capsule'
  # primary capsule types per position (for 'per_type')
  types: Annotated[int, About(int_at_least(0), 'types')] = 0
  # 'per_type' only, the same math either way: 'factored' routes without û where the routing
  # has a shared form; 'materialised' builds û first (what the benchmark compares against).
  votes: Annotated[str, About(one_of(VOTES), 'votes')] = 'factored'

  @nn.compact
  def __call__(self, capsules: Array, routing_iterations=None, max_iterations=None,
               return_logits: bool = False, grid: Optional[Sequence[int]] = None,
               return_couplings: bool = False):
    """The routing's RoutingResult: parents [batch, out, dim] and activations [batch,
    out]; with `return_logits` (routings whose ROUTINGS entry says returns_logits:
    the routing-convergence probe) its `logits` per iteration, with `return_couplings`
    (returns_couplings: the routing diagnostics) its (first, last) `couplings` [batch, in,
    out]. `grid`: the primary capsules' (rows, columns), for 'per_type' transforms."""
    check_fields(self)
    if capsules.ndim != 3:
      raise ArgumentError(f'CapsuleLayer takes capsules [batch, in_caps, in_dim]; got shape {capsules.shape}')
    batch, in_caps, in_dim = capsules.shape
    if self.transforms == 'per_type' and (self.types < 1 or grid is None or
                                          math.prod(grid) * self.types != in_caps):
      raise ArgumentError(f"CapsuleLayer transforms='per_type' takes types >= 1 (got {self.types}) and the call's "
                          f'grid=(rows, columns) (got {grid}) of rows × columns × types = its {in_caps} input capsules')
    dtype = compute_dtype(self.formulation, capsules)
    shared = None
    if self.transforms == 'per_type':
      weights = self.param('weights', self.weights_init, (self.types, self.num_capsules, self.dim, in_dim))
      rows, columns = grid
      grouped = capsules.reshape(batch, rows * columns, self.types, in_dim)       # [batch, pos, types, in_dim]
      # Votes scaled by 1/√positions: one W_tj sums coherently over the positions, and the
      # offsets add up under routing; unscaled, every length starts near 1 (0.96 for 2
      # classes at 128 px) and the margin loss has no gradient to learn from. Scaled, the
      # initial lengths are the paper layer's (≈ 0.002 for 10 classes). A fixed
      # reparametrisation of W and o: the routing sees ordinary votes.
      scale = (rows * columns) ** -0.5
      offsets = scale * coordinate_offsets(rows, columns, self.dim)                # [pos, dim]
      # In float32 whatever `dtype`: the factored form's contractions are the routing's own
      # sums (float32 in every routing), and there is no large û product to make cheaper.
      shared = (grouped.astype(jnp.float32), scale * weights.astype(jnp.float32), offsets)
      prediction_vectors = None   # materialised below only where the routing needs û
    else:
      weights = self.param('weights', self.weights_init,
                           (in_caps, self.num_capsules, self.dim, in_dim))
    # The bias joins s_j in every routing iteration (see dynamic_routing), as in the authors' code.
    unknown = set(self.routing_inputs) - set(LAYER_INPUTS)
    if unknown:
      raise ArgumentError(f'routing_inputs {sorted(unknown)}: allowed {", ".join(LAYER_INPUTS)}')
    bias = (self.param('bias', self.bias_init, (self.num_capsules, self.dim))
            if 'bias' in self.routing_inputs else None)
    log_priors = (self.param('log_priors', nn.initializers.zeros, (in_caps, self.num_capsules))
                  if 'log_priors' in self.routing_inputs else None)
    iterations = self.routing_iterations if routing_iterations is None else routing_iterations
    unroll = {'rolled': False, 'unrolled': True, 'unrolled_inference': UNROLLED_INFERENCE}[
        formulations.resolve('routing_loop', self.formulation.routing_loop)]
    entry = ROUTINGS[self.routing]
    if return_logits and not entry.returns_logits:
      raise ArgumentError(f'routing {self.routing!r} has no routing logits (see ROUTINGS[name].returns_logits)')
    if return_couplings and not entry.returns_couplings:
      raise ArgumentError(f'routing {self.routing!r} has no couplings (see ROUTINGS[name].returns_couplings)')
    options = own_routing_options(self.routing, self.routing_options)   # its own section, checked
    for name, (shape, initial) in entry.learned.items():
      options[name] = self.param(f'routing_{name}', nn.initializers.constant(initial),
                                 shape(in_caps, self.num_capsules, self.dim))
    inputs = {'bias': bias, 'log_priors': log_priors, 'leaky': True, 'stop_gradient_predictions': True}
    options.update({name: inputs[name] for name in self.routing_inputs})   # validation: only what it reads
    if return_logits:
      options['return_logits'] = True
    if return_couplings:
      options['return_couplings'] = True
    if shared is not None:
      # Without û where the routing has a shared form that takes every option given.
      if self.votes == 'factored' and shared_form(self.routing, options) is not None:
        return call_routing(self.routing, shared, iterations, max_iterations, unroll, shared=True, **options)
      prediction_vectors = shared_votes(*shared)                                 # [batch, in, out, dim]
    elif self._routes_without_votes(options, iterations, max_iterations, dtype):
      parents = ROUTINGS[self.routing].per_capsule(weights, capsules.astype(jnp.float32), iterations, **options)
      return RoutingResult(parents, vector_norm(parents))
    else:   # û_{j|i} = W_ij u_i                           # [batch, in_caps, out_caps, out_dim]
      prediction_vectors = ops.prediction_vectors(weights.astype(dtype), capsules.astype(dtype),
                                                  self.formulation.prediction_vectors)
    # EM reads the primary capsules' lengths as input activations; the others ignore them.
    input_activations = vector_norm(capsules.astype(jnp.float32))             # [batch, in_caps]
    # The options were checked above (own_routing_options), once: not again by `route`.
    return call_routing(self.routing, (prediction_vectors.astype(jnp.float32), input_activations), iterations,
                        max_iterations, unroll, **options)

  def _routes_without_votes(self, options, iterations, max_iterations, dtype) -> bool:
    """Whether the paper's layer routes without û (prediction_vectors 'factored'): a routing
    with a per-capsule form that takes the options given (Procedure 1 with at most a bias),
    r a Python int, float32."""
    return (self.transforms == 'per_capsule' and shared_form(self.routing, options, 'per_capsule') is not None
            and formulations.resolve('prediction_vectors', self.formulation.prediction_vectors) == 'factored'
            and jnp.dtype(dtype) == jnp.float32 and is_int(iterations) and max_iterations is None)


class Decoder(nn.Module):
  """Fully connected decoder (512-1024-pixels, ReLU, sigmoid) from masked digit capsules.

  masked capsules [batch, classes, dim] (all but the chosen class zeroed) → pixels in
  (0, 1) [batch, *output_shape].

  Example:
    >>> decoder = capsjax.Decoder(hidden=(32, 64), output_shape=(28, 28, 1))
    >>> masked = jnp.zeros((2, 10, 16)).at[:, 3].set(0.5)   # class 3's capsule only
    >>> params = decoder.init(jax.random.key(0), masked)
    >>> decoder.apply(params, masked).shape
    (2, 28, 28, 1)
  """
  hidden: Annotated[Sequence[int], About(ints_at_least(1), 'widths')] = (512, 1024)
  output_shape: Annotated[Sequence[int], About(ints_at_least(1, allow_empty=False), 'a shape')] = (28, 28, 1)
  kernel_init: Initializer = LECUN_NORMAL
  bias_init: Initializer = nn.initializers.zeros

  @nn.compact
  def __call__(self, masked_capsules: Array) -> Array:
    check_fields(self)
    batch = masked_capsules.shape[0]
    hidden = masked_capsules.reshape(batch, math.prod(masked_capsules.shape[1:]))  # [batch, out_caps * out_dim] (-1: not for 0 images)
    dense = lambda width: nn.Dense(width, kernel_init=self.kernel_init, bias_init=self.bias_init)
    for width in self.hidden:
      hidden = nn.relu(dense(width)(hidden))
    pixels = nn.sigmoid(dense(math.prod(self.output_shape))(hidden))
    return pixels.reshape((batch,) + tuple(self.output_shape))


# The strided stem's convolutions: 3×3, stride 2, SAME, ReLU, each halving the image.
STEM_KERNEL = 3
# 'strided' halves the image until its larger side is at most this: the paper's two 9×9
# convolutions then see an image the size of MNIST's (28) to MultiMNIST's (36) and more.
STEM_TARGET_SIDE = 40


def halvings_to(side: int, target: int) -> int:
  """How many SAME stride-2 halvings bring `side` to at most `target`."""
  stages = 0
  while halved(side, stages) > target:
    stages += 1
  return stages


def halved(side: int, times: int) -> int:
  """`side` after `times` SAME stride-2 steps: ⌈side / 2^times⌉."""
  for _ in range(times):
    side = -(-side // 2)
  return side


def stem_stages(height: int, width: int) -> int:
  """The strided stem's halvings for an image: max(height, width) to at most STEM_TARGET_SIDE."""
  return halvings_to(max(height, width), STEM_TARGET_SIDE)


class StridedStem(nn.Module):
  """`stages` 3×3 stride-2 convolutions (SAME, ReLU) of `channels` each: a large image
  brought to a small grid before the CapsNet's conv1, so that compute and memory per
  image stay near the paper model's. [batch, h, w, c] → [batch, ⌈h/2^s⌉, ⌈w/2^s⌉, channels]."""
  stages: Annotated[int, About(int_at_least(0), 'halvings')]
  channels: Annotated[int, SIZE] = 32
  formulation: Formulation = Formulation()
  kernel_init: Initializer = LECUN_NORMAL
  bias_init: Initializer = nn.initializers.zeros

  @nn.compact
  def __call__(self, images: Array) -> Array:
    check_fields(self)
    check_images('StridedStem', images, STEM_KERNEL, 'SAME')
    features = images
    for stage in range(self.stages):
      features = nn.relu(Conv(self.channels, STEM_KERNEL, 2, padding='SAME', formulation=self.formulation,
                              kernel_init=self.kernel_init, bias_init=self.bias_init,
                              name=f'conv{stage}')(features))
    return features


# The transposed-convolution decoder starts from a grid of at most this side, doubling it
# per stage, with these channels (the last stage gives the image's channels).
DECONV_START_SIDE = 8
DECONV_CHANNELS = (64, 32, 16)


class TransposedConv(nn.Module):
  """flax.linen.ConvTranspose(features, (k, k), strides=(s, s), padding='SAME') with the same
  parameters ('kernel' [k, k, in, features], 'bias'), computed by ops.conv_transpose2d in
  the form `formulation.conv_impl` picks (same values; in float32)."""
  features: Annotated[int, SIZE]
  kernel_size: Annotated[int, SIZE]
  stride: Annotated[int, SIZE]
  formulation: Formulation = Formulation()
  kernel_init: Initializer = LECUN_NORMAL
  bias_init: Initializer = nn.initializers.zeros

  @nn.compact
  def __call__(self, images: Array) -> Array:
    check_fields(self)
    check_images('TransposedConv', images, self.kernel_size, 'SAME')
    kernel = self.param('kernel', self.kernel_init,
                        (self.kernel_size, self.kernel_size, images.shape[-1], self.features))
    bias = self.param('bias', self.bias_init, (self.features,))
    how = self.formulation
    return ops.conv_transpose2d(images, kernel, self.stride, how.conv_impl, how.patches_inference,
                                how.member_convs, how.patch_extraction) + bias


class DeconvDecoder(nn.Module):
  """A decoder whose size does not grow with the image: masked capsules → Dense → a
  [⌈h/2^s⌉, ⌈w/2^s⌉, 64] grid → s transposed 3×3 stride-2 convolutions (ReLU, channels
  halving to 16; the last gives the image's channels, sigmoid) → cropped to [h, w, c].
  As DeepCaps (Rajasegaran et al., CVPR 2019) decodes; at 28×28 it has
  0.5M parameters where the paper's dense decoder has 1.4M, at 128×128×3 0.7M vs 50M."""
  output_shape: Annotated[Sequence[int], IMAGE_SHAPE] = (28, 28, 1)
  formulation: Formulation = Formulation()   # the transposed convolutions' (TransposedConv)
  kernel_init: Initializer = LECUN_NORMAL
  bias_init: Initializer = nn.initializers.zeros

  @nn.compact
  def __call__(self, masked_capsules: Array) -> Array:
    check_fields(self)
    height, width, channels = self.output_shape
    stages = max(halvings_to(max(height, width), DECONV_START_SIDE), 1)
    start_h, start_w = (halved(side, stages) for side in (height, width))
    batch = masked_capsules.shape[0]
    hidden = masked_capsules.reshape(batch, math.prod(masked_capsules.shape[1:]))   # [batch, out_caps * out_dim]
    hidden = nn.relu(nn.Dense(start_h * start_w * DECONV_CHANNELS[0], kernel_init=self.kernel_init,
                              bias_init=self.bias_init)(hidden))
    grid = hidden.reshape(batch, start_h, start_w, DECONV_CHANNELS[0])          # [batch, h0, w0, 64]
    for stage in range(stages):
      last = stage == stages - 1
      width_out = channels if last else DECONV_CHANNELS[min(stage + 1, len(DECONV_CHANNELS) - 1)]
      grid = TransposedConv(width_out, 3, 2, formulation=self.formulation, kernel_init=self.kernel_init,
                            bias_init=self.bias_init, name=f'deconv{stage}')(grid)
      grid = grid if last else nn.relu(grid)
    return nn.sigmoid(grid[:, :height, :width, :])                               # [batch, h, w, c]
