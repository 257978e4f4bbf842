"""Which formulation of the same math runs on which backend: one table, from measurements.

A formulation option (the config's model.formulation section: `Formulation`'s fields) set
to 'auto' (`conv_impl`, `patches_inference`, `routing_loop`, `dtype`, `member_convs`,
`patch_extraction`, `prediction_vectors`) is chosen here once, for the platform the run compiles for, when the
run builds its model (`for_platform`, called by capsjax.assemble.model): a name, or a rule each convolution
applies to its own shape where it is traced. A model built without that ('auto' left in
it, as a library user may) resolves for JAX's default backend where it is traced. Every
entry names the measurement behind it; an entry nobody has measured says so.
`python benchmarks/device_report.py` measures every formulation on a backend in
one run: change an entry when a report says so, and name that report.
"""
import dataclasses
from typing import Annotated, Any, List, Mapping, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp

from capsjax.errors import ArgumentError, ConfigError
from capsjax.keys import About, field_problems, one_of

# 'patches': im2col of the whole kernel, one matmul; 'kernel_rows': im2col one kernel row
# and a few images at a time, rebuilt in the backward pass; 'fourier': a product per
# frequency of the stride phases' discrete Fourier transforms; 'space_to_depth': the
# strided convolution as a unit-stride one on s×s pixel blocks folded into channels
# (capsjax.ops).
CONV_IMPLS = ('auto', 'xla', 'patches', 'kernel_rows', 'fourier', 'space_to_depth')
ROUTING_LOOPS = ('auto', 'rolled', 'unrolled', 'unrolled_inference')
# The im2col ('patches') convolution without gradients: a few images at a time
# (capsjax.ops.PATCHES_CHUNK, through lax.map) or the whole batch as one matmul.
PATCHES_INFERENCE = ('auto', 'chunked', 'whole_batch')
# What the convolutions' matmuls take in: float32, or bfloat16-rounded inputs accumulated
# in float32 with float32 outputs (twice XLA:CPU's float32 matmul rate on CPUs with
# AVX-512 BF16; docs/results.md "CPU speed"). Not the same values: an accuracy choice.
CONV_INPUTS = ('float32', 'bfloat16')
# The compute dtype of convolutions and capsule predictions (parameters, routing softmax,
# squash, losses and the optimizer stay float32).
DTYPES = ('auto', 'float32', 'bfloat16', 'float16')
# XLA's convolution ('xla', 'space_to_depth') in a vmapped ensemble (members' kernels
# differ): vmap's own batching makes one grouped convolution of all members
# (feature_group_count = members), 'per_member' one dense convolution per member
# (capsjax.ops.member_conv). Same values.
MEMBER_CONVS = ('auto', 'grouped', 'per_member')
# How the im2col forms build their patch matrix (capsjax.ops.extract_patches): one strided
# slice per kernel offset, concatenated, or one gather. The same patches; the backward's
# scatter sums overlaps in another order (float32 rounding).
PATCH_EXTRACTION = ('auto', 'slices', 'gather')
# How the class capsules' prediction vectors û_{j|i} = W_ij u_i are computed
# (capsjax.ops.prediction_vectors): one einsum, or in_dim multiply-adds in one elementwise
# pass that XLA fuses with the routing's transpose of û (derivatives the einsum's either way);
# 'factored': none, where the routing has a form whose sums contract W_ij and u_i directly
# (dynamic routing: capsjax.routing.per_capsule_dynamic_routing), else the multiply-adds.
PREDICTION_VECTORS = ('auto', 'einsum', 'multiply_adds', 'factored')
# The options whose every choice computes the same values (up to float32 rounding); dtype
# and conv_inputs are accuracy choices.
SAME_VALUES = ('conv_impl', 'patches_inference', 'routing_loop', 'member_convs', 'patch_extraction',
               'prediction_vectors')


@dataclasses.dataclass(frozen=True)
class Formulation:
  """How a model computes the same math, handed to its layers as one object; its fields
  are the config's `model.formulation` section, the same for every model family (each
  family's default is its field's: capsjax.models). `conv_impl`, `patches_inference`,
  `routing_loop`, `member_convs`, `patch_extraction`, `prediction_vectors`: a value, or what `for_platform` chose for
  'auto' (a convolution's may be a rule: `ConvRule`, `StrideRule`, applied to each layer's shape in
  `resolve` where it is traced: capsjax.ops, CapsuleLayer). `conv_inputs`: the convolutions' matmul inputs
  (CONV_INPUTS). `dtype`: the compute dtype of convolutions and capsule predictions (None:
  the input's, a layer's default; 'auto': the backend's, a model's default).

  Example:
    >>> fast = capsjax.Formulation(conv_impl='patches', routing_loop='unrolled')
    >>> layer = capsjax.PrimaryCaps(num_types=4, dim=8, formulation=fast)
    >>> layer.formulation.conv_impl, layer.formulation.conv_inputs
    ('patches', 'float32')
  """
  conv_impl: Annotated[Any, About(one_of(CONV_IMPLS), (
      "convolutions as XLA's, im2col + matmul, im2col by kernel rows, products of Fourier transforms, or "
      'unit-stride on pixel blocks folded into channels (space_to_depth) (same values; auto: faster on the '
      'backend, on a CPU per layer)'))] = 'auto'
  patches_inference: Annotated[Any, About(one_of(PATCHES_INFERENCE), (
      'the im2col conv at inference a few images at a time or the whole batch (same values)'))] = 'auto'
  conv_inputs: Annotated[str, About(one_of(CONV_INPUTS), (
      "the convolutions' matmul inputs: float32, or bfloat16 accumulated in float32 (faster on AVX-512 BF16 "
      'CPUs; not the same values)'))] = 'float32'
  routing_loop: Annotated[str, About(one_of(ROUTING_LOOPS), (
      'the routing loop rolled, unrolled, or unrolled where nothing differentiates it (evaluation, '
      'predict) and rolled in training (same values; auto: faster on the backend; models with '
      'routing)'))] = 'auto'
  dtype: Annotated[Optional[Any], About(one_of(DTYPES), (
      'compute dtype of convolutions and capsule predictions (routing, losses, dense layers and the '
      'decoder stay float32; auto: bfloat16 on a GPU, else float32)'))] = None
  member_convs: Annotated[str, About(one_of(MEMBER_CONVS), (
      "XLA's convolutions (xla, space_to_depth) in a vmapped ensemble: one grouped convolution of all "
      'members, or one dense convolution per member (same values; reverse-mode derivatives only; auto: per '
      "member in a GPU run's ensemble)"))] = 'auto'
  patch_extraction: Annotated[str, About(one_of(PATCH_EXTRACTION), (
      "the im2col forms' patch matrix as one strided slice per kernel offset or as one gather (same values; "
      'auto: gather on a CPU, where it compiles several times faster)'))] = 'auto'
  prediction_vectors: Annotated[str, About(one_of(PREDICTION_VECTORS), (
      'the class capsules\' prediction vectors as one einsum, as multiply-adds in one elementwise pass, or '
      'none where the routing contracts W and u directly (factored: dynamic routing) (same values; auto: '
      'factored on a CPU, where the step trains and infers faster)'))] = 'auto'

  def __post_init__(self):
    # A name is checked when the Formulation is built, as config.model.formulation is
    # (otherwise 'nope' fails where a layer is traced); what for_platform and with_dtype
    # put in its place (a rule, a jnp dtype) is no name.
    problems = field_problems(self, kinds=(str,))
    if not problems and self.dtype is not None and not isinstance(self.dtype, str):
      # A jnp dtype (what with_dtype gives) or scalar type (jnp.bfloat16): one of the named
      # ones, as a dtype (jnp.int32 once ran as the compute dtype; jnp.bfloat16 failed when traced).
      if _dtype_name(self.dtype) not in DTYPES:
        problems = [f'Formulation.dtype={self.dtype!r}: allowed one of {", ".join(DTYPES)}']
      else:
        object.__setattr__(self, 'dtype', jnp.dtype(self.dtype))
    if problems:
      raise ConfigError(problems[0])

  def with_dtype(self) -> 'Formulation':
    """This formulation with its dtype a jnp dtype (None stays: the input's; 'auto' left by
    a library user: JAX's default backend's entry, where the model is traced)."""
    if self.dtype is None:
      return self
    return dataclasses.replace(self, dtype=jnp.dtype(resolve('dtype', self.dtype)))


def _dtype_name(dtype) -> Optional[str]:
  """The name of a jnp dtype or scalar type (jnp.bfloat16 → 'bfloat16'); None if it is none."""
  try:
    return jnp.dtype(dtype).name
  except TypeError:
    return None


def conv_inputs_problem(conv_impl: str, conv_inputs: str) -> Optional[str]:
  """Why `conv_impl` cannot take `conv_inputs`, or None."""
  if conv_impl == 'fourier' and conv_inputs != 'float32':
    return ("conv_impl='fourier' computes in float32 (its transforms would lose digits); "
            f"conv_inputs={conv_inputs!r} needs 'patches', 'kernel_rows' or 'xla'")
  return None


def spectrum_bins(grid_h: int, grid_w: int) -> tuple:
  """The independent bins (row, column frequency) of a real grid_h × grid_w grid's DFT:
  (complex bins, self-conjugate bins). Columns 0 … ⌊grid_w/2⌋ (the rest are conjugates of
  these); in a self-conjugate column (0, and grid_w/2 when even) row h and row −h are
  conjugates, so only the smaller is kept, and a bin equal to its own conjugate is real.
  PrimaryCaps' 10×10 grid: 48 complex, 4 real (of 100 positions)."""
  complex_bins, real_bins = [], []
  for column in range(grid_w // 2 + 1):
    for row in range(grid_h):
      twin = ((-row) % grid_h, (-column) % grid_w)
      if twin == (row, column):
        real_bins.append((row, column))
      elif twin[1] != column or twin[0] > row:
        complex_bins.append((row, column))
  return tuple(complex_bins), tuple(real_bins)


def valid_output_size(height: int, width: int, kernel_size: int, stride: int) -> tuple:
  """(rows, columns) of a VALID convolution's output."""
  return (height - kernel_size) // stride + 1, (width - kernel_size) // stride + 1


class ConvLayer(NamedTuple):
  """What the CPU's convolution rule decides by: one layer's shape (VALID, square kernel)."""
  height: int
  width: int
  channels: int
  features: int
  kernel_size: int
  stride: int
  dot_inputs: str = 'float32'
  batch: int = 128   # images per call: the kernel's transform is shared by them

  def output_size(self):
    return valid_output_size(self.height, self.width, self.kernel_size, self.stride)

  def direct_multiply_adds(self) -> float:
    """Per image, as im2col (or any direct form) computes it."""
    out_h, out_w = self.output_size()
    return out_h * out_w * self.kernel_size ** 2 * self.channels * self.features

  def space_to_depth_multiply_adds(self) -> float:
    """Per image, as capsjax.ops.space_to_depth_conv2d computes it: the kernel zero-padded
    to ⌈k/s⌉·s taps a side (PrimaryCaps: 10×10 for 9×9, 23 % more than direct)."""
    out_h, out_w = self.output_size()
    taps = -(-self.kernel_size // self.stride) * self.stride
    return out_h * out_w * taps ** 2 * self.channels * self.features

  def patch_matrix_bytes(self) -> int:
    """The im2col matrix of the whole call: [batch, out_h, out_w, k·k·channels]."""
    out_h, out_w = self.output_size()
    itemsize = 2 if self.dot_inputs == 'bfloat16' else 4
    return self.batch * out_h * out_w * self.kernel_size ** 2 * self.channels * itemsize

  def fourier_multiply_adds(self) -> float:
    """Per image, as capsjax.ops.fourier_conv2d computes it: the image's transform (two rows
    per slot: a complex bin, or a pair of real ones), the slot's product of [2, s²c] by
    [s²c, 2·features] (four real products), the inverse at the valid outputs, and the
    kernel's transform shared by the call's `batch` images (a single image pays all of it:
    720 M for PrimaryCaps against 191 M direct; 70 M at batch 128)."""
    grid_h, grid_w = -(-self.height // self.stride), -(-self.width // self.stride)
    taps = -(-self.kernel_size // self.stride)
    complex_bins, real_bins = (len(bins) for bins in spectrum_bins(grid_h, grid_w))
    slots = complex_bins + -(-real_bins // 2)
    phase_channels = self.stride ** 2 * self.channels
    out_h, out_w = self.output_size()
    return (2 * slots * grid_h * grid_w * phase_channels + 4 * slots * phase_channels * self.features
            + 4 * slots * out_h * out_w * self.features
            + 2 * slots * taps ** 2 * phase_channels * self.features / self.batch)


@dataclasses.dataclass(frozen=True)
class ConvRule:
  """A table entry decided per layer: 'fourier' where the call has at least
  `fourier_min_batch` images and needs at most `fourier_share` of the direct form's
  multiply-adds (float32 inputs only: its transforms are float32 math); else
  'kernel_rows' where the call has at least `rows_min_batch` images and a kernel row's
  im2col depth (kernel width × channels) is at least `row_depth`; else 'patches'.
  Without a layer: 'patches'."""
  fourier_share: float
  fourier_min_batch: int
  row_depth: int
  rows_min_batch: int

  def pick(self, layer: Optional[ConvLayer]) -> str:
    if layer is None:
      return 'patches'
    if (layer.dot_inputs == 'float32' and layer.batch >= self.fourier_min_batch
        and layer.fourier_multiply_adds() <= self.fourier_share * layer.direct_multiply_adds()):
      return 'fourier'
    deep = layer.kernel_size * layer.channels >= self.row_depth
    return 'kernel_rows' if deep and layer.batch >= self.rows_min_batch else 'patches'

  def choices(self) -> tuple:
    return ('patches', 'kernel_rows', 'fourier')


@dataclasses.dataclass(frozen=True)
class StrideRule:
  """A table entry decided per layer by its stride: `strided` for a stride above 1, else
  `unit`. Without a layer: `unit`."""
  strided: str
  unit: str

  def pick(self, layer: Optional[ConvLayer]) -> str:
    return self.strided if layer is not None and layer.stride > 1 else self.unit

  def choices(self) -> tuple:
    return (self.unit, self.strided)


@dataclasses.dataclass(frozen=True)
class PatchesRule:
  """A `patches_inference` entry decided per layer: 'whole_batch' where the whole call's
  patch matrix takes at most `whole_batch_bytes` (one matmul, no loop), else 'chunked'
  (a chunk's patch matrix at a time). Without a layer: 'chunked'."""
  whole_batch_bytes: int

  def pick(self, layer: Optional[ConvLayer]) -> str:
    small = layer is not None and layer.patch_matrix_bytes() <= self.whole_batch_bytes
    return 'whole_batch' if small else 'chunked'

  def choices(self) -> tuple:
    return ('chunked', 'whole_batch')


# Table entries decided per layer (the rest are one value).
_RULES = (ConvRule, StrideRule, PatchesRule)

FASTEST = {
    'cpu': {
        # The rule from PrimaryCaps, Conv1 and a 5×5 layer timed in the three forms at batches
        # 1–256 (docs/results.md, "CPU speed"; XLA's convolution: "CPU speed"); the
        # Fourier form from batch 64 since its rows took Gauss's sums ("CPU speed", 2026-11-27).
        'conv_impl': ConvRule(fourier_share=0.5, fourier_min_batch=64, row_depth=1024, rows_min_batch=32),
        # One matmul where the whole batch's patch matrix is small (Conv1 alone inferred 1.3x
        # faster whole than in chunks at 16 MB, batch 128; level at 63 MB), chunks of 16 images
        # where it is large (PrimaryCaps' 382 MB: docs/results.md, "GPU speed": patches
        # inference; "CPU speed": the patches rule).
        'patches_inference': PatchesRule(whole_batch_bytes=32 * 2 ** 20),
        # With the Fourier PrimaryCaps, unrolled inferred faster and rolled trained faster
        # (Zen 3, 2026-11-27: docs/results.md, "CPU speed"): each where it is faster.
        'routing_loop': 'unrolled_inference',
        # bfloat16 outputs take a slow XLA:CPU path (SLOW_CHOICES below).
        'dtype': 'float32',
        # Not measured on a CPU (whose convolutions are not XLA's unless asked for): vmap's own.
        'member_convs': 'grouped',
        # One gather compiled the paper model's forward and gradient 3-6x faster than 81 slices
        # (the tests, the explorer, predict: compile-bound); PrimaryCaps' forward ran faster,
        # its gradient 10-15 % slower, below the 32 images where a CPU leaves patches (Zen 3,
        # 2026-11-29: docs/results.md, "CPU speed").
        'patch_extraction': 'gather',
        # Without û: the paper model's training step 1.07x (rounds 1.00-1.16) and inference
        # 1.05x (1.04-1.09) the multiply-adds' (which had been 1.10x and 1.04x the einsum's;
        # Intel Xeon, 2026-12-03: docs/results.md, "CPU speed").
        'prediction_vectors': 'factored',
    },
    'gpu': {
        # Strided convolutions as unit-stride ones on pixel blocks: PrimaryCaps alone trained
        # 1.55x and inferred 2.3x faster than patches at batch 128, faster at 384 and 512 too
        # (docs/results.md, "GPU speed"); a unit-stride
        # one (conv1) as patches, which trained faster than XLA's convolution in the H100
        # report (docs/results.md, "GPU speed").
        'conv_impl': StrideRule(strided='space_to_depth', unit='patches'),
        # From the H100 report: one whole-batch matmul infers faster than chunks run one
        # after another; the unrolled loop trains faster.
        'patches_inference': 'whole_batch',
        'routing_loop': 'unrolled',
        # 36 000 steps of 3 seeds in bfloat16 ended inside float32's seed spread (0.410 ±
        # 0.044 % against 0.387 ± 0.050) at 1.4x the images/s (docs/results.md, "MNIST
        # reproduction").
        'dtype': 'bfloat16',
        # An ensemble's (for_platform(..., ensemble=True)); a single model keeps vmap's own.
        # The 12-member recipe program (space_to_depth, bfloat16, grouped cuDNN convolutions)
        # stepped at 1.76x twelve single-model steps, where vmapped patches (batched matmuls)
        # kept pace with single steps (docs/results.md, "GPU speed"). Chosen
        # from that comparison and the compiled programs, not yet from a measurement of its own.
        'member_convs': 'per_member',
        # The slices are what every GPU report measured (conv1's patches); a gather
        # there is not measured.
        'patch_extraction': 'slices',
        # What every GPU report measured; the multiply-adds are not measured there.
        'prediction_vectors': 'einsum',
    },
    'tpu': {
        # Not measured on a TPU: XLA's own convolution (the TPU's native op).
        'conv_impl': 'xla',
        # Not measured on a TPU (read only where conv_impl='patches' is asked for).
        'patches_inference': 'chunked',
        # Not measured on a TPU.
        'routing_loop': 'rolled',
        # Not measured on a TPU.
        'dtype': 'float32',
        # Not measured on a TPU: vmap's own.
        'member_convs': 'grouped',
        # Not measured on a TPU (read only where an im2col form is asked for); TPUs gather slowly.
        'patch_extraction': 'slices',
        # Not measured on a TPU.
        'prediction_vectors': 'einsum',
    },
}


_ALLOWED = {'conv_impl': CONV_IMPLS, 'patches_inference': PATCHES_INFERENCE, 'routing_loop': ROUTING_LOOPS,
            'dtype': DTYPES, 'member_convs': MEMBER_CONVS, 'patch_extraction': PATCH_EXTRACTION,
            'prediction_vectors': PREDICTION_VECTORS}


def _platform(platform: str) -> str:
  return platform or jax.default_backend()


def _entry(option: str, platform: str):
  return FASTEST.get(_platform(platform), FASTEST['cpu'])[option]


def for_platform(section: Mapping[str, Any], platform: str = '', ensemble: bool = False) -> Formulation:
  """The Formulation of `section` (a config's model.formulation, or any mapping of
  Formulation's fields; a field it lacks at Formulation's default), each 'auto' replaced by
  `platform`'s entry of FASTEST ('': JAX's default backend; an unknown platform takes the
  CPU's): a value, or a rule its layers apply to their shapes. What a run builds its model
  with (capsjax.assemble.model), once, for the devices it compiles for. `member_convs` takes
  the table's entry only for an `ensemble` (members vmapped as one program); a single model
  keeps XLA's plain convolution, which every JAX transformation (forward mode too) accepts.

  Example:
    >>> chosen = capsjax.formulations.for_platform({'conv_impl': 'auto', 'dtype': 'auto', 'routing_loop': 'rolled'}, 'gpu')
    >>> chosen.conv_impl, chosen.routing_loop, chosen.dtype
    (StrideRule(strided='space_to_depth', unit='patches'), 'rolled', 'bfloat16')
  """
  def chosen(option, value):
    if option not in _ALLOWED or value != 'auto':
      return value
    return _entry(option, platform) if option != 'member_convs' or ensemble else 'grouped'

  return Formulation(**{option: chosen(option, value) for option, value in section.items()})


Choice = Union[str, ConvRule, StrideRule, PatchesRule]


def resolve(option: str, value: Choice, platform: str = '', layer: Optional[ConvLayer] = None) -> str:
  """The formulation `value` of model option `option` names for a layer: a name as it is; a
  rule (what `for_platform` chose) applied to `layer`, the convolution's shape; 'auto' as
  FASTEST[platform][option] would be ('' : JAX's default backend, where this is traced), but
  `member_convs`' 'auto' as vmap's own: where it is traced, nothing says whether the model is
  an ensemble's (for_platform's `ensemble` does)."""
  if isinstance(value, _RULES):
    return value.pick(layer)
  if value not in _ALLOWED[option]:
    raise ArgumentError(f'{option} must be one of {_ALLOWED[option]}, got {value!r}')
  if value != 'auto':
    return value
  if option == 'member_convs':
    return 'grouped'
  return resolve(option, _entry(option, platform), platform, layer)


def describe(chosen: Formulation) -> List[str]:
  """One line per option of `chosen` ('option value'; a rule: a line per case), for a report."""
  lines = []
  for option, value in ((field.name, getattr(chosen, field.name)) for field in dataclasses.fields(chosen)):
    if isinstance(value, StrideRule):
      lines += [f'{option} (stride 1) {value.unit}', f'{option} (stride > 1) {value.strided}']
    elif isinstance(value, (ConvRule, PatchesRule)):
      lines.append(f'{option} (by each layer\'s shape and batch) {" | ".join(value.choices())}')
    else:
      lines.append(f'{option} {value}')
  return lines


def choices(option: str, platform: str = '') -> tuple:
  """Every value 'auto' can resolve to for `option` on `platform` (one, or a rule's two)."""
  entry = _entry(option, platform)
  return entry.choices() if isinstance(entry, _RULES) else (entry,)


# Explicit choices measured several times slower than another formulation on a backend:
# (option, value, backend) → why. A run that asks for one says so in one line at start
# (capsjax.train); `auto` never resolves to one (tests/test_models.py checks).
SLOW_CHOICES = {
    ('conv_impl', 'xla', 'cpu'): (
        "XLA:CPU's strided-convolution gradient trains the paper's model about 20x slower than "
        "'patches' (docs/results.md, \"CPU speed\")"),
    ('dtype', 'bfloat16', 'cpu'): (
        'bfloat16 outputs take a slow XLA:CPU path (training slower than float32; docs/results.md, '
        "\"CPU speed\"); model.formulation.conv_inputs='bfloat16' gets the bfloat16 matmul rate with float32 outputs"),
    ('dtype', 'float16', 'cpu'): 'XLA:CPU has no fast float16 matmul; float32 is faster',
}


def slow_choices(chosen: Formulation, platform: str = '') -> list:
  """One line per option of `chosen` (a model's formulation) set to a value that
  SLOW_CHOICES lists for `platform` (default: JAX's default backend); 'auto' never resolves
  to one, so a formulation `for_platform` chose says the same as the config it came from."""
  backend = _platform(platform)
  lines = []
  for (option, value, slow_backend), why in SLOW_CHOICES.items():
    if slow_backend == backend and str(getattr(chosen, option)) == value:
      lines.append(f'note: model.formulation.{option}={value!r} on this {backend.upper()} is slow: {why}.')
  return lines
