"""Convolution written two ways with identical math, so each backend gets its fast one.

XLA's CPU backend computes the input gradient of a strided 9×9 convolution (PrimaryCaps)
about 30× slower than the same convolution written as strided slices (im2col) plus one
einsum; on an H100 the im2col form also trained faster. Which one 'auto' picks per
backend is capsjax.formulations' table. Both take the same [kh, kw, in, out] kernel, so
parameters are shared.
"""
import functools

import jax
import jax.numpy as jnp

from capsjax import formulations

Array = jax.Array
CONV_IMPLS = formulations.CONV_IMPLS
CONV_INPUTS = formulations.CONV_INPUTS


def resolve_conv_impl(impl: str) -> str:
  """'auto' → the backend's entry in capsjax.formulations.FASTEST (measured there)."""
  return formulations.resolve('conv_impl', impl)


def extract_patches(images: Array, kernel_size: int, stride: int) -> Array:
  """VALID im2col: [batch, h, w, c] → [batch, out_h, out_w, kh*kw*c] (kh, kw, c order)."""
  _, height, width, _ = images.shape
  out_h = (height - kernel_size) // stride + 1
  out_w = (width - kernel_size) // stride + 1
  # One strided slice per kernel offset; concatenated in (kh, kw, c) order to match the
  # row order of kernel.reshape(kh*kw*c, out).
  slices = [
      images[:, dy:dy + stride * (out_h - 1) + 1:stride, dx:dx + stride * (out_w - 1) + 1:stride, :]
      for dy in range(kernel_size) for dx in range(kernel_size)
  ]
  return jnp.concatenate(slices, axis=-1)  # [batch, out_h, out_w, kh*kw*c]


def batch_chunk_size(batch: int, target: int) -> int:
  """The largest divisor of `batch` that is ≤ target (so chunks tile the batch exactly)."""
  return max(d for d in range(1, min(batch, max(target, 1)) + 1) if batch % d == 0)


def _chunked(images: Array, chunk: int) -> Array:
  return images.reshape((images.shape[0] // chunk, chunk) + images.shape[1:])


def _unchunked(chunks: Array) -> Array:
  return chunks.reshape((chunks.shape[0] * chunks.shape[1],) + chunks.shape[2:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def patches_conv2d(images: Array, kernel: Array, stride: int, chunk: int, dot_inputs: str = 'float32') -> Array:
  """im2col convolution; without gradients it runs `chunk` images at a time.

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
    patches = extract_patches(_dot_input(chunk_images, dot_inputs), kernel.shape[0], stride)
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


def _patches_conv2d_fwd(images, kernel, stride, chunk, dot_inputs):
  del chunk
  patches = extract_patches(_dot_input(images, dot_inputs), kernel.shape[0], stride)
  flat_kernel = _dot_input(kernel.reshape(-1, kernel.shape[-1]), dot_inputs)
  outputs = _dot('bhwk,ko->bhwo', patches, flat_kernel, images.dtype)   # [batch, out_h, out_w, out]
  return outputs, (patches, flat_kernel, images, kernel)


def _patches_conv2d_bwd(stride, chunk, dot_inputs, residuals, output_grad):
  del chunk
  patches, flat_kernel, images, kernel = residuals
  output_grad_in = _dot_input(output_grad, dot_inputs)
  # dW = Pᵀ g                                             # [kh*kw*in, out]
  kernel_grad = _dot('bhwk,bhwo->ko', patches, output_grad_in, kernel.dtype)
  # dP = g Wᵀ, then col2im (the transpose of patch extraction)   # [batch, out_h, out_w, kh*kw*in]
  patches_grad = _dot('bhwo,ko->bhwk', output_grad_in, flat_kernel, images.dtype)
  col2im = jax.linear_transpose(lambda x: extract_patches(x, kernel.shape[0], stride),
                                jax.ShapeDtypeStruct(images.shape, images.dtype))
  return col2im(patches_grad)[0], kernel_grad.reshape(kernel.shape)


patches_conv2d.defvjp(_patches_conv2d_fwd, _patches_conv2d_bwd)

# Images per chunk in `patches_conv2d` (inference); 8–32 measured alike.
PATCHES_CHUNK = 16


def conv2d(images: Array, kernel: Array, stride: int = 1, impl: str = 'auto',
           patches_inference: str = 'auto', dot_inputs: str = 'float32') -> Array:
  """VALID 2-D convolution, NHWC; kernel [kh, kw, in, out]; no bias. `patches_inference`
  ('chunked' | 'whole_batch' | 'auto'): how the patches form runs without gradients;
  `dot_inputs` ('float32' | 'bfloat16'): what the matmuls take in (outputs keep the
  images' dtype; the 'xla' form's gradients come out rounded to bfloat16 too, the
  patches form's stay float32)."""
  impl = resolve_conv_impl(impl)
  if dot_inputs not in CONV_INPUTS:
    raise ValueError(f'dot_inputs must be one of {CONV_INPUTS}, got {dot_inputs!r}')
  if kernel.shape[0] != kernel.shape[1]:
    raise ValueError(f'square kernels only, got {kernel.shape[:2]}')
  if impl == 'xla':
    return jax.lax.conv_general_dilated(
        _dot_input(images, dot_inputs), _dot_input(kernel, dot_inputs), window_strides=(stride, stride),
        padding='VALID', dimension_numbers=('NHWC', 'HWIO', 'NHWC'), preferred_element_type=images.dtype)
  whole_batch = formulations.resolve('patches_inference', patches_inference) == 'whole_batch'
  chunk = images.shape[0] if whole_batch else batch_chunk_size(images.shape[0], PATCHES_CHUNK)
  return patches_conv2d(images, kernel, stride, chunk, dot_inputs)
