"""capsjax's linen layers and routing inside a Flax NNX model (flax.nnx.bridge.ToNNX), trained
with nnx.Optimizer: the same code as docs/nnx.md shows."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
import pytest

import capsjax

# Compiling many small programs is this module's time: XLA's cheap compilation (conftest.py).
pytestmark = pytest.mark.compile_bound


class NnxCapsNet(nnx.Module):
  """An NNX model: NNX's own convolution, then capsjax's PrimaryCaps and CapsuleLayer
  (Procedure 1) through the linen bridge."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, (9, 9), padding='VALID', rngs=rngs)
    self.primary = nnx.bridge.ToNNX(capsjax.PrimaryCaps(num_types=8, dim=8), rngs=rngs)
    self.digits = nnx.bridge.ToNNX(capsjax.CapsuleLayer(num_capsules=10, dim=16, routing_iterations=3), rngs=rngs)

  def __call__(self, images):                               # [batch, 28, 28, 1]
    primary = self.primary(nnx.relu(self.conv1(images)))    # [batch, 6·6·8, 8]
    lengths = self.digits(primary).activations              # [batch, 10]
    return lengths


def test_an_nnx_model_with_capsjax_layers_trains(mnist_dir):
  train = capsjax.load_dataset('mnist', 'train', data_dir=mnist_dir).take(512)
  images = jnp.asarray(train.images, jnp.float32) / 255.0
  targets = jax.nn.one_hot(train.labels, 10)
  model = NnxCapsNet(nnx.Rngs(0))
  nnx.bridge.lazy_init(model, images[:1])                   # creates the linen layers' parameters
  names = {'/'.join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  assert 'digits/weights' in names and 'primary/conv/kernel' in names
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, images, targets):
    def loss_fn(model):
      return capsjax.margin_loss(model(images), targets).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  @nnx.jit
  def accuracy(model, images, labels):
    return jnp.mean(jnp.argmax(model(images), -1) == labels)

  before = float(accuracy(model, images, train.labels))
  losses = [float(train_step(model, optimizer, images[i:i + 64], targets[i:i + 64]))
            for _ in range(3) for i in range(0, 512, 64)]
  after = float(accuracy(model, images, train.labels))
  assert np.mean(losses[-4:]) < 0.5 * np.mean(losses[:4]), losses
  assert after > max(0.6, before + 0.3), (before, after)
