"""Convolution written three ways with identical math, so each backend gets its fast one.

XLA's CPU backend computes the input gradient of a strided 9×9 convolution (PrimaryCaps)
about 30× slower than the same convolution written as strided slices (im2col) plus one
einsum; on an H100 the im2col form also trained faster. The third way, `kernel_rows`,
builds the im2col matrix one kernel row at a time for a few images at a time and
recomputes it in the backward pass, so the whole batch's patch matrix (382 MB for
PrimaryCaps at batch 128) is never written to memory. Which one 'auto' picks per backend
(and on a CPU per layer) is capsjax.formulations' table. All take the same [kh, kw, in,
out] kernel, so parameters are shared.
"""
import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from capsjax import formulations
from capsjax.errors import ArgumentError

Array = jax.Array
CONV_IMPLS = formulations.CONV_IMPLS
CONV_INPUTS = formulations.CONV_INPUTS


@jax.custom_vjp
def add_bias(outputs: Array, bias: Array) -> Array:
  """outputs [..., features] + bias [features], whose bias gradient is one matrix-vector
  product: ones [rows] · the output gradient [rows, features]. (XLA:CPU with jaxlib
  0.10.2's reduce fusions off, capsjax.console, sums a Conv1 gradient [128, 20, 20, 256]
  over its rows as a tree of strided windows: 72 ms of a 1.02 s training step on an Intel
  Xeon, 2026-12-02; the product is a few ms. docs/results.md, "CPU speed".) Values and gradients are
  those of `outputs + bias`."""
  return outputs + bias


def _add_bias_fwd(outputs, bias):
  # Only the dtypes are kept: the gradient needs no values of the forward pass.
  return outputs + bias, (jnp.zeros((), outputs.dtype), jnp.zeros((), bias.dtype))


def _add_bias_bwd(dtypes, sum_grad):
  outputs_dtype, bias_dtype = dtypes
  rows = sum_grad.reshape(-1, sum_grad.shape[-1])                                  # [rows, features]
  bias_grad = jnp.einsum('r,rf->f', jnp.ones(rows.shape[:1], rows.dtype), rows)     # [features]
  return sum_grad.astype(outputs_dtype.dtype), bias_grad.astype(bias_dtype.dtype)


add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


def prediction_vectors(weights: Array, capsules: Array, form: str = 'auto') -> Array:
  """û_{j|i} = W_ij u_i: weights [in_caps, out_caps, out_dim, in_dim], capsules [batch,
  in_caps, in_dim] → [batch, in_caps, out_caps, out_dim], as `form`
  (formulations.PREDICTION_VECTORS) says: one einsum, or in_dim multiply-adds in one
  elementwise pass (`multiply_adds`, also what `factored` computes where a layer needs û),
  the same values to float32 rounding; 'auto' as formulations.FASTEST has it for JAX's
  default backend."""
  if formulations.resolve('prediction_vectors', form) in ('multiply_adds', 'factored'):
    return _multiply_adds(weights, capsules)
  return _votes(weights, capsules)


def _votes(weights: Array, capsules: Array) -> Array:
  return jnp.einsum('ijdk,bik->bijd', weights, capsules)   # [batch, in_caps, out_caps, out_dim]


@jax.custom_jvp
def _multiply_adds(weights: Array, capsules: Array) -> Array:
  """û as Σ_k u_ik W_ij[:, k], in float32 (an einsum's accumulation), in the inputs' dtype.

  Why: the einsum's output (its matmul's layout) is transposed to the routing's
  parent-major layout by a pass of its own over 94 MB at batch 128; this pass writes û
  parent-major (transposed back for the API, a transpose the routing's own cancels), so
  XLA writes û once, in the routing's layout. Its derivatives are the einsum's (two
  matmuls the gradient transposes well; the elementwise form's would be in_dim reductions
  over û)."""
  dtype = jnp.result_type(weights, capsules)
  weights, capsules = weights.astype(jnp.float32), capsules.astype(jnp.float32)
  by_parent = jnp.transpose(weights, (1, 0, 2, 3))          # [out_caps, in_caps, out_dim, in_dim]
  total = sum(capsules[:, None, :, None, k] * by_parent[None, :, :, :, k] for k in range(weights.shape[-1]))
  return jnp.swapaxes(total, 1, 2).astype(dtype)            # [batch, in_caps, out_caps, out_dim]


@_multiply_adds.defjvp
def _multiply_adds_jvp(primals, tangents):
  (weights, capsules), (weights_dot, capsules_dot) = primals, tangents
  return _multiply_adds(weights, capsules), _votes(weights_dot, capsules) + _votes(weights, capsules_dot)


def resolve_conv_impl(impl, layer: Optional[formulations.ConvLayer] = None) -> str:
  """The form `impl` names for `layer` (its shape): a name as it is, a rule of
  capsjax.formulations (what a run chose for 'auto') applied to the layer, 'auto' as JAX's
  default backend's entry of capsjax.formulations.FASTEST."""
  return formulations.resolve('conv_impl', impl, layer=layer)


@functools.partial(jax.jit, static_argnames=('kernel_size', 'stride', 'extraction'))
def extract_patches(images: Array, kernel_size: int, stride: int, extraction: str = 'slices') -> Array:
  """VALID im2col: [batch, h, w, c] → [batch, out_h, out_w, kh*kw*c] (kh, kw, c order, the
  row order of kernel.reshape(kh*kw*c, out)); `extraction` (formulations.PATCH_EXTRACTION):
  one strided slice per kernel offset, concatenated, or one gather (the same values).

  Jitted so that a call outside jit (`model.init` as the Flax docs write it) compiles one
  program, not one per kernel offset's slice (81 for PrimaryCaps); inside a traced
  program it is inlined."""
  out_h, out_w = formulations.valid_output_size(images.shape[1], images.shape[2], kernel_size, stride)
  if extraction == 'gather':
    rows = stride * np.arange(out_h)[:, None] + np.arange(kernel_size)[None, :]      # [out_h, kh]
    columns = stride * np.arange(out_w)[:, None] + np.arange(kernel_size)[None, :]   # [out_w, kw]
    patches = images[:, rows[:, None, :, None], columns[None, :, None, :], :]       # [batch, out_h, out_w, kh, kw, c]
    return patches.reshape(patches.shape[:3] + (math.prod(patches.shape[3:]),))
  slices = [
      images[:, dy:dy + stride * (out_h - 1) + 1:stride, dx:dx + stride * (out_w - 1) + 1:stride, :]
      for dy in range(kernel_size) for dx in range(kernel_size)
  ]
  return jnp.concatenate(slices, axis=-1)  # [batch, out_h, out_w, kh*kw*c]


def batch_chunk_size(batch: int, target: int) -> int:
  """The largest divisor of `batch` that is ≤ target (so chunks tile the batch exactly); 1
  for an empty batch."""
  if batch == 0:
    return 1
  return max(d for d in range(1, min(batch, max(target, 1)) + 1) if batch % d == 0)


def _chunked(images: Array, chunk: int) -> Array:
  return images.reshape((images.shape[0] // chunk, chunk) + images.shape[1:])


def _unchunked(chunks: Array) -> Array:
  return chunks.reshape((chunks.shape[0] * chunks.shape[1],) + chunks.shape[2:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def patches_conv2d(images: Array, kernel: Array, stride: int, chunk: int, dot_inputs: str = 'float32',
                   extraction: str = 'slices') -> Array:
  """im2col convolution (its patches as `extraction` says: extract_patches); without
  gradients it runs `chunk` images at a time.

  Why chunks: the whole batch's patch matrix (382 MB for PrimaryCaps at batch 128) is
  written once and read once, so its cost is memory traffic and fresh-page faults; per
  chunk it stays small and is reused: forward 533 → 325 ms (the bare matmul: 280 ms).
  Under differentiation the forward keeps the whole batch's patches instead, because
  the kernel gradient needs them again: chunking the backward as well measured slower
  (training step 94 → 67 images/s).

  `dot_inputs` 'bfloat16': the matmuls' inputs (patches, kernel, output gradient) are
  rounded to bfloat16 and accumulated in float32, outputs float32 (CONV_INPUTS).
  """
  flat_kernel = _dot_input(kernel.reshape(-1, kernel.shape[-1]), dot_inputs)  # [kh*kw*in, out]

  def one_chunk(chunk_images):
    patches = extract_patches(_dot_input(chunk_images, dot_inputs), kernel.shape[0], stride, extraction)
    # [chunk, out_h, out_w, out]
    return _dot('bhwk,ko->bhwo', patches, flat_kernel, images.dtype)

  if chunk >= images.shape[0]:   # one chunk: no loop around it
    return one_chunk(images)
  return _unchunked(jax.lax.map(one_chunk, _chunked(images, chunk)))


def _dot_input(array: Array, dot_inputs: str) -> Array:
  return array.astype(jnp.bfloat16) if dot_inputs == 'bfloat16' else array


def _dot(subscripts: str, a: Array, b: Array, out_dtype) -> Array:
  """einsum whose output is `out_dtype` however its inputs are rounded (accumulating in
  it: XLA:CPU's bfloat16 × bfloat16 → float32 matmul runs at twice the float32 rate,
  while a bfloat16 output takes a slow path)."""
  return jnp.einsum(subscripts, a, b, preferred_element_type=out_dtype)


def _patches_conv2d_fwd(images, kernel, stride, chunk, dot_inputs, extraction):
  del chunk
  patches = extract_patches(_dot_input(images, dot_inputs), kernel.shape[0], stride, extraction)
  flat_kernel = _dot_input(kernel.reshape(-1, kernel.shape[-1]), dot_inputs)
  outputs = _dot('bhwk,ko->bhwo', patches, flat_kernel, images.dtype)   # [batch, out_h, out_w, out]
  return outputs, (patches, flat_kernel, images, kernel)


def _patches_conv2d_bwd(stride, chunk, dot_inputs, extraction, residuals, output_grad):
  del chunk
  patches, flat_kernel, images, kernel = residuals
  output_grad_in = _dot_input(output_grad, dot_inputs)
  # dW = Pᵀ g                                             # [kh*kw*in, out]
  kernel_grad = _dot('bhwk,bhwo->ko', patches, output_grad_in, kernel.dtype)
  # dP = g Wᵀ, then col2im (the transpose of patch extraction)   # [batch, out_h, out_w, kh*kw*in]
  patches_grad = _dot('bhwo,ko->bhwk', output_grad_in, flat_kernel, images.dtype)
  col2im = jax.linear_transpose(lambda x: extract_patches(x, kernel.shape[0], stride, extraction),
                                jax.ShapeDtypeStruct(images.shape, images.dtype))
  return col2im(patches_grad)[0], kernel_grad.reshape(kernel.shape)


patches_conv2d.defvjp(_patches_conv2d_fwd, _patches_conv2d_bwd)

# Images per chunk in `patches_conv2d` (inference); 8–32 measured alike.
PATCHES_CHUNK = 16


def _row_phases(images: Array, stride: int) -> Array:
  """[batch, h, w, c] → [batch, ⌈h/stride⌉, stride, w, c], image row = stride*r + phase
  (zero rows appended): every kernel row's input rows are then one contiguous slice."""
  batch, height, width, channels = images.shape
  rows = -(-height // stride)
  if rows * stride != height:
    images = jnp.pad(images, ((0, 0), (0, rows * stride - height), (0, 0), (0, 0)))
  return images.reshape(batch, rows, stride, width, channels)


def _row_patches(phased: Array, kernel_row, kernel_size: int, stride: int, out_h: int, out_w: int) -> Array:
  """The im2col columns of one kernel row (traced index): [batch, out_h, out_w, kw*c]."""
  batch, _, _, width, channels = phased.shape
  # Input rows stride*y + kernel_row for y < out_h                          # [batch, out_h, w, c]
  rows = jax.lax.dynamic_slice(phased, (0, kernel_row // stride, kernel_row % stride, 0, 0),
                               (batch, out_h, 1, width, channels))[:, :, 0]
  return _column_patches(rows, kernel_size, stride, out_w)


def _column_patches(rows: Array, kernel_size: int, stride: int, out_w: int) -> Array:
  """[batch, out_h, w, c] → [batch, out_h, out_w, kw*c], in (kw, c) order."""
  return jnp.concatenate([rows[:, :, dx:dx + stride * (out_w - 1) + 1:stride, :]
                          for dx in range(kernel_size)], axis=-1)


def _output_size(images: Array, kernel: Array, stride: int):
  return formulations.valid_output_size(images.shape[1], images.shape[2], kernel.shape[0], stride)


def _kernel_rows_forward(images, kernel, stride, chunk, dot_inputs):
  kernel_size, _, channels, features = kernel.shape
  batch = images.shape[0]
  out_h, out_w = _output_size(images, kernel, stride)
  row_kernels = _dot_input(kernel.reshape(kernel_size, kernel_size * channels, features), dot_inputs)

  def one_chunk(chunk_images):
    phased = _row_phases(_dot_input(chunk_images, dot_inputs), stride)

    def add_row(kernel_row, outputs):
      patches = _row_patches(phased, kernel_row, kernel_size, stride, out_h, out_w)
      # [chunk, out_h, out_w, out]
      return outputs + _dot('bhwk,ko->bhwo', patches, row_kernels[kernel_row], images.dtype)

    zeros = jnp.zeros((chunk_images.shape[0], out_h, out_w, features), images.dtype)
    return jax.lax.fori_loop(0, kernel_size, add_row, zeros)

  if chunk >= batch:
    return one_chunk(images)
  return _unchunked(jax.lax.map(one_chunk, _chunked(images, chunk)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def kernel_rows_conv2d(images: Array, kernel: Array, stride: int, chunk: int, train_chunk: int,
                       dot_inputs: str = 'float32') -> Array:
  """im2col convolution one kernel row and `chunk` images at a time (`train_chunk` under
  differentiation); the backward pass rebuilds each row's patches instead of keeping them.

  Why: the whole batch's patch matrix is written once and read twice in a training step
  (forward, kernel gradient), and its gradient written and read once more: memory
  traffic, where a kernel row's patches for a few images (5 MB for PrimaryCaps' 16) stay
  in cache between being built and used. PrimaryCaps forward + backward at batch 128 on a
  2-core AMD EPYC: 0.88–0.93 s against 1.15–1.21 s as `patches_conv2d`. The matmuls are
  kw*c deep instead of kh*kw*c: for thin layers (Conv1's 9 × 1) that is slower, which is
  why 'auto' picks per layer (capsjax.formulations).
  """
  return _kernel_rows_forward(images, kernel, stride, chunk, dot_inputs)


def _kernel_rows_fwd(images, kernel, stride, chunk, train_chunk, dot_inputs):
  del chunk
  return _kernel_rows_forward(images, kernel, stride, train_chunk, dot_inputs), (images, kernel)


def _kernel_rows_bwd(stride, chunk, train_chunk, dot_inputs, residuals, output_grad):
  del chunk
  images, kernel = residuals
  kernel_size, _, channels, features = kernel.shape
  batch, _, width, _ = images.shape
  out_h, out_w = _output_size(images, kernel, stride)
  row_kernels = _dot_input(kernel.reshape(kernel_size, kernel_size * channels, features), dot_inputs)
  column_col2im = jax.linear_transpose(lambda rows: _column_patches(rows, kernel_size, stride, out_w),
                                       jax.ShapeDtypeStruct((min(train_chunk, batch), out_h, width, channels),
                                                            images.dtype))

  def one_chunk(kernel_grad, chunk_arrays):
    chunk_images, chunk_grad = chunk_arrays
    phased = _row_phases(_dot_input(chunk_images, dot_inputs), stride)
    chunk_grad_in = _dot_input(chunk_grad, dot_inputs)

    def add_row(kernel_row, carry):
      kernel_grad, phased_grad = carry
      patches = _row_patches(phased, kernel_row, kernel_size, stride, out_h, out_w)
      # dW_row = P_rowᵀ g                                   # [kw*c, out]
      row_grad = _dot('bhwk,bhwo->ko', patches, chunk_grad_in, kernel.dtype)
      kernel_grad = kernel_grad.at[kernel_row].add(row_grad)
      # dP_row = g W_rowᵀ, then col2im along the row         # [chunk, out_h, w, c]
      patches_grad = _dot('bhwo,ko->bhwk', chunk_grad_in, row_kernels[kernel_row], images.dtype)
      rows_grad = column_col2im(patches_grad)[0][:, :, None]
      at = (0, kernel_row // stride, kernel_row % stride, 0, 0)
      phased_grad = jax.lax.dynamic_update_slice(
          phased_grad, jax.lax.dynamic_slice(phased_grad, at, rows_grad.shape) + rows_grad, at)
      return kernel_grad, phased_grad

    kernel_grad, phased_grad = jax.lax.fori_loop(
        0, kernel_size, add_row, (kernel_grad, jnp.zeros(phased.shape, images.dtype)))
    images_grad = phased_grad.reshape(chunk_images.shape[0], -1, width, channels)[:, :chunk_images.shape[1]]
    return kernel_grad, images_grad

  kernel_grad = jnp.zeros(row_kernels.shape, kernel.dtype)
  if train_chunk >= batch:
    kernel_grad, images_grad = one_chunk(kernel_grad, (images, output_grad))
  else:
    kernel_grad, images_grad = jax.lax.scan(
        one_chunk, kernel_grad, (_chunked(images, train_chunk), _chunked(output_grad, train_chunk)))
    images_grad = _unchunked(images_grad)
  return images_grad, kernel_grad.reshape(kernel.shape)


kernel_rows_conv2d.defvjp(_kernel_rows_fwd, _kernel_rows_bwd)


class _SpectralMatrices(NamedTuple):
  """The Fourier form as three matrices on slots of two rows (`_fourier_matrices`)."""
  images: np.ndarray    # [slots·2, grid positions]
  kernel: np.ndarray    # [slots·2, taps]
  inverse: np.ndarray   # [valid outputs, slots·4], columns (slot, image row, kernel row)


@functools.lru_cache(maxsize=None)
def _fourier_matrices(grid_h: int, grid_w: int, taps_h: int, taps_w: int, out_h: int, out_w: int):
  """The real DFT of a grid_h × grid_w grid on its independent bins
  (formulations.spectrum_bins), two rows per slot, and the inverse at the valid outputs.

  A complex bin is a slot: X = A_c − i·A_s (the images' cos and sin rows) and conj(K) =
  B_c + i·B_s (the kernel's cos and sin rows at its taps). The slot's product of its two
  image rows by its two kernel rows holds all four real products, and the correlation Y =
  X·conj(K) is A_c·B_c + A_s·B_s + i(A_c·B_s − A_s·B_c): linear in them, so the inverse
  reads them directly, y = w_f (cos·Re Y − sin·Im Y) at each valid output (w_f = 2/N: the
  bin stands for its conjugate twin too). Two real bins share a slot (a zero row pads an
  odd count): their two cross products get weight 0, the others w_f = 1/N times cos.
  Stacking a slot's rows doubles each matmul's rows and columns against three matmuls of
  one row each (Gauss's form, a quarter fewer multiply-adds): the products run nearer the
  matmul peak, and the transforms write two rows per bin instead of three."""
  rows, columns = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing='ij')
  complex_bins, real_bins = formulations.spectrum_bins(grid_h, grid_w)
  taps = (rows[:taps_h, :taps_w] * grid_w + columns[:taps_h, :taps_w]).reshape(-1)
  outputs = (rows[:out_h, :out_w] * grid_w + columns[:out_h, :out_w]).reshape(-1)
  size = grid_h * grid_w

  def angle(frequency, points):   # [points]
    return 2 * np.pi * (frequency[0] * rows.reshape(-1)[points] / grid_h
                        + frequency[1] * columns.reshape(-1)[points] / grid_w)

  every, images, kernel, inverse = np.arange(size), [], [], []
  for bin_ in complex_bins:
    cos, sin = 2 / size * np.cos(angle(bin_, outputs)), 2 / size * np.sin(angle(bin_, outputs))
    images += [np.cos(angle(bin_, every)), np.sin(angle(bin_, every))]
    kernel += [np.cos(angle(bin_, taps)), np.sin(angle(bin_, taps))]
    inverse += [cos, -sin, sin, cos]   # A_c·B_c, A_c·B_s, A_s·B_c, A_s·B_s
  cosines = lambda bin_, points: np.cos(angle(bin_, points)) if bin_ else np.zeros(len(points))
  real_bins = list(real_bins) + [None] * (len(real_bins) % 2)
  for first, second in zip(real_bins[::2], real_bins[1::2]):
    images += [cosines(first, every), cosines(second, every)]
    kernel += [cosines(first, taps), cosines(second, taps)]
    zero = np.zeros(len(outputs))
    inverse += [1 / size * cosines(first, outputs), zero, zero, 1 / size * cosines(second, outputs)]
  as32 = lambda matrix: np.ascontiguousarray(matrix, np.float32)
  return _SpectralMatrices(as32(np.stack(images)), as32(np.stack(kernel)), as32(np.stack(inverse).T))


# The transforms at HIGHEST precision: a TF32 DFT would lose digits on a GPU.
_EXACT = jax.lax.Precision.HIGHEST


def _spectral_forward(phased, phased_kernel, grid):
  matrices = _fourier_matrices(*grid)
  slots, batch, features = matrices.images.shape[0] // 2, phased.shape[1], phased_kernel.shape[1]
  with jax.named_scope('transforms'):
    # A slot's [A_c; A_s] of X = Σ_p x e^{-iθ}, its rows (image row, batch)      # [slots, 2·batch, s²c]
    images_rows = jnp.einsum('fp,pbc->fbc', matrices.images, phased, precision=_EXACT).reshape(slots, 2 * batch, -1)
    # and [B_c; B_s] of conj(K) = Σ_t k e^{+iθ}, its rows (kernel row, out)     # [slots, 2·out, s²c]
    kernel_rows = jnp.einsum('ft,toc->foc', matrices.kernel, phased_kernel,
                             precision=_EXACT).reshape(slots, 2 * features, -1)
  with jax.named_scope('products'):
    # Every image row times every kernel row of the slot                        # [slots, 2·batch, 2·out]
    products = jnp.einsum('fbc,fnc->fbn', images_rows, kernel_rows)
  with jax.named_scope('transforms'):
    # y = Re Σ_f w_f Y_f e^{iθ} at the valid outputs                            # [outputs, batch, out]
    by_slot = products.reshape(slots, 2, batch, 2, features).transpose(0, 1, 3, 2, 4).reshape(4 * slots, batch, features)
    outputs = jnp.einsum('qf,fbo->qbo', matrices.inverse, by_slot, precision=_EXACT)
  return outputs, (images_rows, kernel_rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _spectral_correlation(phased: Array, phased_kernel: Array, grid: tuple) -> Array:
  """The Fourier form's transforms and products: phased images [positions, batch, s²c],
  phased kernel [taps, out, s²c] → valid outputs [outputs, batch, out]. Written with its
  own gradient so that every matmul of the backward pass is a plain (or right-transposed)
  one on position- or slot-major arrays: the automatic one contracted the batch axis of
  [rows, batch, s²c] arrays (a transposed-left matmul XLA:CPU leaves to a slower
  kernel) and moved the row axes innermost (docs/results.md, "CPU speed")."""
  return _spectral_forward(phased, phased_kernel, grid)[0]


def _spectral_correlation_bwd(grid, residuals, outputs_grad):
  images_rows, kernel_rows = residuals
  matrices = _fourier_matrices(*grid)
  slots, (_, batch, features) = images_rows.shape[0], outputs_grad.shape
  with jax.named_scope('transforms'):
    by_slot = jnp.einsum('fq,qbo->fbo', matrices.inverse.T, outputs_grad, precision=_EXACT)   # [slots·4, batch, out]
    products_grad = by_slot.reshape(slots, 2, 2, batch, features).transpose(0, 1, 3, 2, 4).reshape(
        slots, 2 * batch, 2 * features)                                                         # [slots, 2·batch, 2·out]
  with jax.named_scope('products'):
    images_rows_grad = jnp.einsum('fbn,fnc->fbc', products_grad, kernel_rows)          # [slots, 2·batch, s²c]
    kernel_rows_grad = jnp.einsum('fbn,fbc->fnc', products_grad, images_rows)          # [slots, 2·out, s²c]
  with jax.named_scope('transforms'):
    phased_grad = jnp.einsum('pf,fbc->pbc', matrices.images.T, images_rows_grad.reshape(2 * slots, batch, -1),
                             precision=_EXACT)                                                  # [positions, batch, s²c]
    kernel_grad = jnp.einsum('tf,foc->toc', matrices.kernel.T, kernel_rows_grad.reshape(2 * slots, features, -1),
                             precision=_EXACT)                                                  # [taps, out, s²c]
  return phased_grad, kernel_grad


_spectral_correlation.defvjp(_spectral_forward, _spectral_correlation_bwd)


def fourier_conv2d(images: Array, kernel: Array, stride: int) -> Array:
  """The convolution as a product in the frequency domain, every transform a matmul.

  Stride s is removed first: the s×s phases of the image (rows s·y + p) become channels
  and the kernel is split alike, leaving a stride-1 correlation of s²·c channels on a
  ⌈h/s⌉ × ⌈w/s⌉ grid. Its discrete Fourier transform turns the correlation into one
  complex [batch, s²c] × [s²c, out] product per frequency (Y = X · conj(K)): one real
  matmul of [2·batch, s²c] × [s²c, 2·out] per complex bin (its cos and sin rows on each
  side, `_fourier_matrices`), and one per pair of the self-conjugate bins, whose values are
  real; circular wrap-around never reaches the valid outputs, and only those are
  transformed back. For PrimaryCaps (9×9, stride 2, 256 → 256 on 20×20: 48 complex and 4
  real bins, 50 slots) that is 70 M multiply-adds per image at batch 128 instead of
  im2col's 191 M, which is why 'auto' picks it where the count says so
  (capsjax.formulations). The transforms run at
  HIGHEST precision (a TF32 DFT would lose digits on a GPU); values equal the direct
  convolution's to float32 rounding.
  """
  batch, height, width, channels = images.shape
  kernel_size, _, _, features = kernel.shape
  out_h, out_w = _output_size(images, kernel, stride)
  grid_h, grid_w, taps = -(-height // stride), -(-width // stride), -(-kernel_size // stride)
  phase_channels = stride * stride * channels
  # Phases as channels, position-major: [grid_h*grid_w, batch, (p_y, p_x, c)] from rows
  # s·y + p_y, columns s·x + p_x (each transform is then one left multiplication).
  phased = jnp.pad(images, ((0, 0), (0, grid_h * stride - height), (0, grid_w * stride - width), (0, 0)))
  phased = phased.reshape(batch, grid_h, stride, grid_w, stride, channels).transpose(1, 3, 0, 2, 4, 5)
  phased = phased.reshape(grid_h * grid_w, batch, phase_channels)
  # The kernel alike, out before in: [taps*taps, out, (p_y, p_x, c)], zero taps where s
  # does not divide k.
  pad = taps * stride - kernel_size
  phased_kernel = jnp.pad(kernel, ((0, pad), (0, pad), (0, 0), (0, 0)))
  phased_kernel = phased_kernel.reshape(taps, stride, taps, stride, channels, features).transpose(0, 2, 5, 1, 3, 4)
  phased_kernel = phased_kernel.reshape(taps * taps, features, phase_channels)
  outputs = _spectral_correlation(phased, phased_kernel, (grid_h, grid_w, taps, taps, out_h, out_w))
  return outputs.transpose(1, 0, 2).reshape(batch, out_h, out_w, features)   # [batch, out_h, out_w, out]


def space_to_depth_conv2d(images: Array, kernel: Array, stride: int, dot_inputs: str = 'float32',
                          member_convs: str = 'grouped') -> Array:
  """The VALID stride-s convolution as a unit-stride one, exactly: the kernel zero-padded to
  a multiple of s taps (K' = s·⌈k/s⌉), each s×s block of pixels folded into channels and
  each s×s block of taps likewise, y[o] = Σ_p X[o + p] · W[p] over blocks p < K'/s, where
  X[i] = x[i·s : i·s + s] and W[p] = w[p·s : p·s + s]. For PrimaryCaps (20×20×256, 9×9,
  stride 2): 10×10×1 024 ⊛ 5×5×1 024×256 → 6×6×256, 23 % more multiply-adds, no patch
  matrix, unit stride (XLA's convolution, forward and gradient). images [batch, h, w, in],
  kernel [k, k, in, out] → [batch, out_h, out_w, out]; `member_convs` as xla_conv2d's."""
  if stride == 1:
    return xla_conv2d(images, kernel, 1, dot_inputs, member_convs)
  batch, height, width, channels = images.shape
  size, features = kernel.shape[0], kernel.shape[3]
  out_h, out_w = (height - size) // stride + 1, (width - size) // stride + 1
  blocks = -(-size // stride)                                            # K'/s taps per block row
  taps = blocks * stride
  kernel = jnp.pad(kernel, ((0, taps - size), (0, taps - size), (0, 0), (0, 0)))   # [K', K', in, out]
  # Rows the blocks read: (out − 1 + K'/s) blocks; pixels past the image meet zero taps only.
  rows, columns = (out_h - 1 + blocks) * stride, (out_w - 1 + blocks) * stride
  images = jnp.pad(images[:, :rows, :columns], ((0, 0), (0, max(rows - height, 0)),
                                                 (0, max(columns - width, 0)), (0, 0)))
  folded_images = images.reshape(batch, rows // stride, stride, columns // stride, stride, channels)
  folded_images = folded_images.transpose(0, 1, 3, 2, 4, 5).reshape(     # [batch, rows/s, cols/s, s·s·in]
      batch, rows // stride, columns // stride, stride * stride * channels)
  folded_kernel = kernel.reshape(blocks, stride, blocks, stride, channels, features)
  folded_kernel = folded_kernel.transpose(0, 2, 1, 3, 4, 5).reshape(       # [K'/s, K'/s, s·s·in, out]
      blocks, blocks, stride * stride * channels, features)
  return xla_conv2d(folded_images, folded_kernel, 1, dot_inputs, member_convs)


def _valid_conv(images: Array, kernel: Array, stride: int, out_dtype) -> Array:
  # [batch, h, w, in] ⊛ [k, k, in, out] → [batch, out_h, out_w, out]
  return jax.lax.conv_general_dilated(images, kernel, window_strides=(stride, stride), padding='VALID',
                                      dimension_numbers=('NHWC', 'HWIO', 'NHWC'), preferred_element_type=out_dtype)


@functools.lru_cache(maxsize=None)
def member_conv(stride: int, out_dtype):
  """XLA's VALID convolution (images, kernel) → outputs whose vmap over ensemble members
  runs one dense convolution per member, forward and backward, where vmap's own rule makes
  one grouped convolution of all members (feature_group_count = members: cuDNN's grouped
  kernels; formulations.MEMBER_CONVS). Under vmap with the kernel shared, the members'
  images are merged into one batch; nested vmaps peel one axis per rule. Same values."""
  def plain(images, kernel):
    return _valid_conv(images, kernel, stride, out_dtype)

  @jax.custom_batching.custom_vmap
  def forward(images, kernel):
    return plain(images, kernel)

  @forward.def_vmap
  def forward_per_member(axis_size, in_batched, images, kernel):
    images_batched, kernel_batched = in_batched
    if not kernel_batched:   # one kernel: every member's images in one batch
      merged = forward(images.reshape((-1,) + images.shape[2:]), kernel)
      return merged.reshape(images.shape[:2] + merged.shape[1:]), True
    # [members, batch, out_h, out_w, out]
    return jnp.stack([forward(images[m] if images_batched else images, kernel[m]) for m in range(axis_size)]), True

  @jax.custom_batching.custom_vmap
  def backward(images, kernel, cotangent):
    return jax.vjp(plain, images, kernel)[1](cotangent)

  @backward.def_vmap
  def backward_per_member(axis_size, in_batched, images, kernel, cotangent):
    member = lambda value, batched, m: value[m] if batched else value
    parts = [backward(*(member(value, batched, m) for value, batched in zip((images, kernel, cotangent), in_batched)))
             for m in range(axis_size)]
    # Per-member cotangents of a shared input are summed by vmap (custom_vjp's batching).
    return tuple(jnp.stack(part) for part in zip(*parts)), (True, True)

  # custom_vmap has no reverse mode of its own: custom_vjp supplies it (the backward above).
  conv = jax.custom_vjp(forward)
  conv.defvjp(lambda images, kernel: (forward(images, kernel), (images, kernel)),
              lambda residuals, cotangent: backward(*residuals, cotangent))
  return conv


def xla_conv2d(images: Array, kernel: Array, stride: int, dot_inputs: str = 'float32',
               member_convs: str = 'grouped') -> Array:
  """XLA's VALID convolution, NHWC / HWIO, its matmul inputs as `dot_inputs` says, its
  output in the images' dtype; in a vmapped ensemble one grouped convolution or one per
  member, as `member_convs` says (formulations.MEMBER_CONVS; 'auto': the backend's)."""
  images_in, kernel_in = _dot_input(images, dot_inputs), _dot_input(kernel, dot_inputs)
  if formulations.resolve('member_convs', member_convs) == 'per_member':
    return member_conv(stride, jnp.dtype(images.dtype))(images_in, kernel_in)
  return _valid_conv(images_in, kernel_in, stride, images.dtype)


def conv2d(images: Array, kernel: Array, stride: int = 1, impl: str = 'auto',
           patches_inference: str = 'auto', dot_inputs: str = 'float32', member_convs: str = 'auto',
           patch_extraction: str = 'auto') -> Array:
  """VALID 2-D convolution, NHWC; kernel [kh, kw, in, out]; no bias. `patches_inference`
  ('chunked' | 'whole_batch' | 'auto'): how the patches form runs without gradients;
  `patch_extraction` ('slices' | 'gather' | 'auto'): how it builds its patch matrix;
  `member_convs` ('grouped' | 'per_member' | 'auto'): how XLA's forms run in a vmapped ensemble;
  `dot_inputs` ('float32' | 'bfloat16'): what the matmuls take in (outputs keep the
  images' dtype; the 'xla' form's gradients come out rounded to bfloat16 too, the
  patches form's stay float32)."""
  if dot_inputs not in CONV_INPUTS:
    raise ArgumentError(f'dot_inputs must be one of {CONV_INPUTS}, got {dot_inputs!r}')
  if kernel.shape[0] != kernel.shape[1]:
    raise ArgumentError(f'square kernels only, got {kernel.shape[:2]}')
  batch, height, width, channels = images.shape
  layer = formulations.ConvLayer(height, width, channels, kernel.shape[3], kernel.shape[0], stride, dot_inputs, batch)
  impl = resolve_conv_impl(impl, layer)
  if impl == 'fourier':
    problem = formulations.conv_inputs_problem(impl, dot_inputs)
    if problem:
      raise ArgumentError(problem)
    with jax.named_scope('fourier'):   # the profile's label (benchmarks/profile_step.py)
      return fourier_conv2d(images, kernel, stride)
  if impl == 'space_to_depth':
    with jax.named_scope('space_to_depth'):   # the profile's label
      return space_to_depth_conv2d(images, kernel, stride, dot_inputs, member_convs)
  if impl == 'xla':
    return xla_conv2d(images, kernel, stride, dot_inputs, member_convs)
  whole_batch = formulations.resolve('patches_inference', patches_inference, layer=layer) == 'whole_batch'
  chunk = batch_chunk_size(images.shape[0], PATCHES_CHUNK)
  inference_chunk = images.shape[0] if whole_batch else chunk
  if impl == 'kernel_rows':
    return kernel_rows_conv2d(images, kernel, stride, inference_chunk, chunk, dot_inputs)
  extraction = formulations.resolve('patch_extraction', patch_extraction)
  return patches_conv2d(images, kernel, stride, inference_chunk, dot_inputs, extraction)


def transposed_conv_padding(kernel_size: int, stride: int):
  """(before, after) padding of the input-dilated convolution equal to a transposed one with
  'SAME' padding (jax.lax.conv_transpose's rule): the output side is input side × stride."""
  total = kernel_size + stride - 2
  before = kernel_size - 1 if stride > kernel_size - 1 else -(-total // 2)
  return before, total - before


@functools.lru_cache(maxsize=None)
def _subpixel_taps(kernel_size: int, stride: int):
  """Where each kernel tap lands when a 'SAME' transposed convolution is split into its
  `stride` output phases: (selection [window, stride, kernel_size] of 0/1, window offset
  of the first window position). Output s·y + p sums x[y + d]·k[t] over the taps t with
  (p + t − before) divisible by s, d = (p + t − before) / s."""
  before, _ = transposed_conv_padding(kernel_size, stride)
  offsets = {(p, t): (p + t - before) // stride
             for p in range(stride) for t in range(kernel_size) if (p + t - before) % stride == 0}
  first, last = min(offsets.values()), max(offsets.values())
  selection = np.zeros((last - first + 1, stride, kernel_size), np.float32)
  for (p, t), d in offsets.items():
    selection[d - first, p, t] = 1.0
  return selection, first


def conv_transpose2d(images: Array, kernel: Array, stride: int, impl: str = 'auto',
                     patches_inference: str = 'auto', member_convs: str = 'auto',
                     patch_extraction: str = 'auto') -> Array:
  """Transposed 2-D convolution, NHWC, kernel [kh, kw, in, out], 'SAME' (output side = input
  side × stride), the kernel used as given: flax.linen.ConvTranspose(padding='SAME').

  'xla' is XLA's convolution with input dilation (lax.conv_transpose); the other forms
  split the output into its stride × stride phases (sub-pixel convolution): one stride-1
  `conv2d` in the form `impl` resolves to, whose output channels are the phases. Why:
  XLA:CPU's gradient of the input-dilated convolution was 11× its forward (the 128 px
  `images` decoder, docs/results.md); inserting the zeros explicitly instead made the
  forward 17× slower (3/4 of its products are with zeros). `member_convs`: the sub-pixel
  convolution's in a vmapped ensemble (conv2d's; lax.conv_transpose keeps vmap's own);
  `patch_extraction`: its patch matrix's (conv2d's).
  """
  kernel_size = kernel.shape[0]
  if resolve_conv_impl(impl) == 'xla':
    return jax.lax.conv_transpose(images, kernel, (stride, stride), 'SAME',
                                  dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
  # Sub-pixel form: one stride-1 convolution of the undilated input over the window of
  # input offsets any phase reads, with s·s·out output channels (each phase's taps placed
  # in a zero kernel), then the phases interleaved. No inserted zeros are multiplied.
  selection, first = _subpixel_taps(kernel_size, stride)
  window = selection.shape[0]
  # [window, window, in, s, s, out]: tap (t, u) of the kernel at window position (a, b) for phase (p, q)
  phase_kernel = jnp.einsum('apt,bqu,tuco->abcpqo', selection, selection, kernel)
  batch, height, width, _ = images.shape
  features = kernel.shape[-1]
  padded = jnp.pad(images, ((0, 0), (-first, window - 1 + first), (-first, window - 1 + first), (0, 0)))
  phases = conv2d(padded, phase_kernel.reshape(window, window, kernel.shape[2], stride * stride * features), 1,
                  impl, patches_inference, member_convs=member_convs,
                  patch_extraction=patch_extraction)                        # [batch, h, w, s*s*out]
  phases = phases.reshape(batch, height, width, stride, stride, features).transpose(0, 1, 3, 2, 4, 5)
  return phases.reshape(batch, height * stride, width * stride, features)
