"""The PyTorch peer of the benchmarks (benchmarks/torch_capsnet.py) computes what capsjax
computes: given a capsjax CapsNet's parameters, the same capsule lengths,
reconstructions, loss and gradients, so that timing one against the other compares the
same work."""
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capsjax import assemble
from helpers import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Imported by the test, not at collection: PyTorch takes 5 s to import, which every test
# worker would pay.
pytestmark = [pytest.mark.float32_matmuls, pytest.mark.peers]


def _peer():
  spec = importlib.util.spec_from_file_location('torch_capsnet', os.path.join(ROOT, 'benchmarks', 'torch_capsnet.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_peer_equals_capsjax_for_the_same_weights():
  import torch  # pylint: disable=g-import-not-at-top
  peer = _peer()
  config = tiny_config('')
  config.model.formulation.dtype = 'float32'   # as the peer, on any backend (a GPU's 'auto' is bfloat16)
  model = assemble.model(config)
  rng = np.random.default_rng(0)
  images = rng.random((4, 28, 28, 1), np.float32)
  labels = np.array([3, 1, 4, 1])
  params = jax.jit(model.init)(jax.random.key(1), jnp.zeros((1, 28, 28, 1)))['params']
  objective = assemble.objective(config)
  batch = {'images': jnp.asarray(images), 'labels': jnp.asarray(labels)}

  def loss(params):
    per_example, activations, _ = objective(model, params, batch, True)
    return jnp.mean(per_example), activations
  (jax_loss, jax_lengths), jax_grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  targets = jax.nn.one_hot(labels, 10)
  jax_reconstructions = jax.jit(model.apply)({'params': params}, batch['images'], targets[:, None])['reconstructions']

  torch.manual_seed(0)
  capsnet = peer.load_capsjax(peer.CapsNet(input_shape=(28, 28, 1), conv1_channels=config.model.conv1_channels,
                                           primary_types=config.model.primary_types,
                                           decoder_hidden=config.model.decoder_hidden), params)
  torch_images, torch_targets = torch.from_numpy(images), torch.from_numpy(np.array(targets))   # (a writable copy)
  lengths, reconstructions = capsnet(torch_images, torch_targets)
  torch_loss = peer.loss_fn(lengths, reconstructions, torch_images, torch_targets)
  torch_loss.backward()

  np.testing.assert_allclose(lengths.detach().numpy(), jax_lengths, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(reconstructions.detach().numpy(), np.asarray(jax_reconstructions).reshape(4, -1),
                             rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(torch_loss.item(), float(jax_loss), rtol=1e-5)
  grads = {'digit_caps W': (capsnet.W.grad.numpy(), jax_grads['digit_caps']['weights']),
           'conv1 kernel': (capsnet.conv1.weight.grad.permute(2, 3, 1, 0).numpy(), jax_grads['conv1']['kernel']),
           'decoder Dense_0': (capsnet.decoder[0].weight.grad.T.numpy(), jax_grads['decoder']['Dense_0']['kernel'])}
  for name, (theirs, ours) in grads.items():
    scale = float(np.max(np.abs(ours)))
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4 * scale, err_msg=name)
