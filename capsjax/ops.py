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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def patches_conv2d(images: Array, kernel: Array, stride: int, chunk: int) -> Array:
  """im2col convolution; without gradients it runs `chunk` images at a time.

  Why chunks: the whole batch's patch matrix (382 MB for PrimaryCaps at batch 128) is
  written once and read once, so its cost is memory traffic and fresh-page faults; per
  chunk it stays small and is reused: forward 533 → 325 ms (the bare matmul: 280 ms).
  Under differentiation the forward keeps the whole batch's patches instead, because
  the kernel gradient needs them again: chunking the backward as well measured slower
  (training step 94 → 67 images/s).
  """
  flat_kernel = kernel.reshape(-1, kernel.shape[-1])  # [kh*kw*in, out]

  def one_chunk(chunk_images):
    patches = extract_patches(chunk_images, kernel.shape[0], stride)
    # [chunk, out_h, out_w, out]
    return jnp.einsum('bhwk,ko->bhwo', patches, flat_kernel)

  if chunk >= images.shape[0]:   # one chunk: no loop around it
    return one_chunk(images)
  return _unchunked(jax.lax.map(one_chunk, _chunked(images, chunk)))


def _patches_conv2d_fwd(images, kernel, stride, chunk):
  del chunk
  patches, patches_transpose = jax.vjp(lambda x: extract_patches(x, kernel.shape[0], stride), images)
  # [batch, out_h, out_w, out]
  outputs = jnp.einsum('bhwk,ko->bhwo', patches, kernel.reshape(-1, kernel.shape[-1]))
  return outputs, (patches, patches_transpose, kernel)


def _patches_conv2d_bwd(stride, chunk, residuals, output_grad):
  del stride, chunk
  patches, patches_transpose, kernel = residuals
  flat_kernel = kernel.reshape(-1, kernel.shape[-1])  # [kh*kw*in, out]
  # dW = Pᵀ g                                             # [kh*kw*in, out]
  kernel_grad = jnp.einsum('bhwk,bhwo->ko', patches, output_grad)
  # dP = g Wᵀ, then col2im (the transpose of patch extraction)   # [batch, out_h, out_w, kh*kw*in]
  patches_grad = jnp.einsum('bhwo,ko->bhwk', output_grad, flat_kernel)
  return patches_transpose(patches_grad)[0], kernel_grad.reshape(kernel.shape)


patches_conv2d.defvjp(_patches_conv2d_fwd, _patches_conv2d_bwd)

# Images per chunk in `patches_conv2d` (inference); 8–32 measured alike.
PATCHES_CHUNK = 16


def conv2d(images: Array, kernel: Array, stride: int = 1, impl: str = 'auto',
           patches_inference: str = 'auto') -> Array:
  """VALID 2-D convolution, NHWC; kernel [kh, kw, in, out]; no bias. `patches_inference`
  ('chunked' | 'whole_batch' | 'auto'): how the patches form runs without gradients."""
  impl = resolve_conv_impl(impl)
  if kernel.shape[0] != kernel.shape[1]:
    raise ValueError(f'square kernels only, got {kernel.shape[:2]}')
  if impl == 'xla':
    return jax.lax.conv_general_dilated(
        images, kernel, window_strides=(stride, stride), padding='VALID',
        dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
  whole_batch = formulations.resolve('patches_inference', patches_inference) == 'whole_batch'
  chunk = images.shape[0] if whole_batch else batch_chunk_size(images.shape[0], PATCHES_CHUNK)
  return patches_conv2d(images, kernel, stride, chunk)
