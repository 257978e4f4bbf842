"""Choosing a CapsNet for the data's image size and the machine's memory.

A model config may leave `transforms`, `stem` and `decoder` at 'auto' (the `images`
experiment does): once the data has said its shape, `choose` fills them in, each
with the paper's choice where the image is paper-sized and the scalable one where the
paper's would grow with the image:

  stem        'none' while the larger side is at most 40 px, else 'strided'
              (layers.StridedStem: halvings to at most 40 px before conv1)
  transforms  'per_capsule' on a paper-sized image (no stem, at most 4× the paper's 1152
              primary capsules), else 'per_type' (one W per primary type, shared over positions)
  decoder     'dense' while an image has at most 4× MNIST's 784 values, else 'deconv'

and then, if a training step at the run's batch size would not fit the memory available
(capsjax.memory's estimate of the traced step, nothing allocated), the scalable choice
for each key still 'auto', in the order transforms, stem, decoder, until it fits. Explicit values are never changed.
The chosen values are what the run records in its workdir: a resumed run keeps them
(assemble.choose_model is this on a run's config).
"""
from typing import Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import ml_collections

from capsjax import memory
from capsjax.layers import STEM_TARGET_SIDE, TRANSFORMS, stem_stages
from capsjax.models import DECODERS, STEMS, model_for_platform, primary_grid

AUTO = 'auto'
# key → (the paper's value, the scalable value), in the order memory pressure escalates.
CHOICES = {'transforms': TRANSFORMS, 'stem': STEMS, 'decoder': DECODERS}
PAPER_PRIMARY_CAPSULES = 1152   # 6 × 6 × 32 on MNIST
PAPER_PIXELS = 28 * 28


def open_keys(model) -> List[str]:
  """The model keys left to choose ('auto')."""
  return [key for key in CHOICES if model.get(key) == AUTO]


def primary_capsules(model, stem: str) -> int:
  """How many primary capsules the CapsNet `model` has on its input with `stem`."""
  rows, columns = primary_grid(model, stem)
  return rows * columns * model.primary_types


def by_size(model) -> Dict[str, Tuple[str, str]]:
  """key → (value, why) for the open keys of `model` from its input shape alone."""
  height, width, channels = model.input_shape
  chosen = {}
  if model.get('stem') == AUTO:
    large = max(height, width) > STEM_TARGET_SIDE
    chosen['stem'] = (('strided', f'{height}×{width} halved {stem_stages(height, width)}× to at most '
                       f'{STEM_TARGET_SIDE} px') if large else ('none', f'{height}×{width} is paper-sized'))
  stem = chosen['stem'][0] if 'stem' in chosen else model.stem
  if model.get('transforms') == AUTO:
    count = primary_capsules(model, stem)
    if stem == 'strided' or count > 4 * PAPER_PRIMARY_CAPSULES:
      chosen['transforms'] = ('per_type', f'{count:,} primary capsules on a larger-than-paper image: '
                              f'{model.primary_types * model.num_classes * model.digit_dim * model.primary_dim:,} '
                              'class-capsule parameters at any size')
    else:
      chosen['transforms'] = ('per_capsule', f'{count:,} primary capsules')
  if model.get('decoder') == AUTO:
    pixels = height * width * channels
    chosen['decoder'] = ('deconv' if pixels > 4 * PAPER_PIXELS else 'dense', f'{pixels:,} values per image')
  return chosen


def training_peak_bytes(model, batch_size: int, platform: str = '') -> int:
  """Estimated peak bytes of one training step of the CapsNet `model` (a resolved model
  config) at `batch_size` on `platform` (its formulation; '' : JAX's default backend): the
  traced forward and backward pass (capsjax.memory) plus the optimizer's two Adam moments
  and the updated parameters. Nothing is allocated."""
  module = model_for_platform(model, platform)
  shape = tuple(model.input_shape)
  params = jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.zeros((1,) + shape)))['params']
  images = jax.ShapeDtypeStruct((batch_size,) + shape, jnp.float32)
  masks = jax.ShapeDtypeStruct((batch_size, model.num_classes), jnp.float32)
  decodes = bool(model.get('use_decoder'))

  def loss(params, images, masks):
    outputs = module.apply({'params': params}, images, masks if decodes else None)
    return sum(jnp.sum(value) for value in jax.tree.leaves(outputs))

  param_bytes = sum(memory.array_bytes(leaf) for leaf in jax.tree.leaves(params))
  return memory.traced_peak_bytes(jax.jit(jax.grad(loss)), params, images, masks) + 3 * param_bytes


def choose(model, batch_size: int, available: int,
           platform: str = '') -> Tuple[ml_collections.ConfigDict, Optional[str]]:
  """(a copy of the model config `model` with its 'auto' keys chosen, one line saying what
  was chosen and why — None when nothing was open), for training at `batch_size` within
  `available` bytes on `platform` ('' : JAX's default backend)."""
  open_now = open_keys(model)
  if not open_now:
    return model, None
  model = ml_collections.ConfigDict(model.to_dict())
  chosen = by_size(model)
  for key, (value, _) in chosen.items():
    model[key] = value
  estimate = training_peak_bytes(model, batch_size, platform)
  for key in open_now:   # memory pressure: the scalable value of each open key in turn
    if estimate <= available:
      break
    scalable = CHOICES[key][1]
    if model[key] != scalable:
      model[key] = scalable
      chosen[key] = (scalable, 'to fit memory')
      estimate = training_peak_bytes(model, batch_size, platform)
  parts = [f'{key}={value} ({why})' for key, (value, why) in chosen.items()]
  against = (f'{available / 1e9:.1f} GB available' if available != float('inf')
             else 'chosen by size: several processes')
  line = (f'model chosen for {"×".join(map(str, model.input_shape))} images: {"; ".join(parts)}; '
          f'training ≈ {estimate / 1e9:.2f} GB at batch_size={batch_size} ({against}); '
          '--config.model.KEY=VALUE overrides a choice')
  return model, line


def keep_recorded(model, recorded_model: Optional[Dict]) -> ml_collections.ConfigDict:
  """The model config `model` with its open keys taken from `recorded_model` (the model
  config a workdir recorded, as a dict, or None): a resumed run keeps what its first
  invocation chose, on any machine."""
  if not recorded_model or not open_keys(model):
    return model
  model = ml_collections.ConfigDict(model.to_dict())
  for key in open_keys(model):
    if recorded_model.get(key) not in (None, AUTO):
      model[key] = recorded_model[key]
  return model
