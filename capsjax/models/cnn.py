"""The paper's CNN baselines (sections 5 and 6.2) as a Flax module."""
import math
from typing import Annotated, List, Sequence

import flax.linen as nn

from capsjax.layers import Conv
from capsjax import formulations
from capsjax.keys import About, boolean, ints_at_least, number_in
from capsjax.models.base import INPUT_SHAPE, NUM_CLASSES, Array, check_input_images, check_module, register_model


def _cnn_problems(model, prefix: str) -> List[str]:
  if len(model.conv_channels) != len(model.conv_kernels):
    return [f'config.{prefix}conv_kernels={tuple(model.conv_kernels)!r}: allowed one kernel per '
            f'entry of conv_channels={tuple(model.conv_channels)!r}']
  return []


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
