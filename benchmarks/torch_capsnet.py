"""The PyTorch peer: the paper's MNIST CapsNet written in PyTorch, for timing capsjax against.

The same network, loss and optimizer as capsjax's `mnist` experiment (and the paper):
Conv1 256@9×9 + ReLU, PrimaryCaps 32×8D @9×9 stride 2 (capsules ordered row, column,
type, as capsjax holds them), DigitCaps 10×16D with W_ij [in, out, 16, 8] and 3 iterations
of Procedure 1, margin loss (m+ 0.9, m− 0.1, λ 0.5, summed over classes) + 0.0005 × the
summed squared reconstruction error of the 512-1024-784 decoder on the masked capsules,
Adam at 1e-3. `load_capsjax(params)` copies a capsjax model's parameters in: given the
same weights, it computes what capsjax computes (tests/test_torch_peer.py checks lengths,
reconstructions, loss and gradients). It is what a PyTorch user would run instead.

  python benchmarks/torch_capsnet.py --batch 128 --steps 5          # training images/s
  python benchmarks/torch_capsnet.py --batch 128 --steps 5 --infer  # inference images/s
  python benchmarks/torch_capsnet.py --device cuda --compile         # on a GPU, torch.compile'd
  python benchmarks/torch_capsnet.py --device cuda --precision bf16  # bf16 autocast (tf32 is the GPU default)
  python benchmarks/torch_capsnet.py --input_shape 64,64,3          # the paper's layers on larger images
  python benchmarks/torch_capsnet.py --infer --runtime onnxruntime   # exported to ONNX, run by ONNX Runtime

Prints one line: `torch_capsnet mode=train batch=128 ... images_per_s=42.8`. Needs torch
(the test extra pins the 2.13.0 CPU build); any CUDA build for --device cuda. The runtimes
a PyTorch user picks for speed: `eager`, `compile` (torch.compile, inductor: a C++
compiler on a CPU) and, for inference, `onnxruntime` (the model exported with
torch.onnx.export and run by ONNX Runtime; `pip install 'capsjax[peers]'`).
"""
import argparse
import time
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def squash(vectors: torch.Tensor) -> torch.Tensor:
  """v = s · |s| / (1 + |s|²), as capsjax.routing.squash."""
  squared_norm = (vectors * vectors).sum(-1, keepdim=True)
  return vectors * squared_norm.clamp_min(1e-30).sqrt() / (1.0 + squared_norm)


class CapsNet(nn.Module):
  """The paper's CapsNet; the sizes are capsjax's model keys (defaults: the paper's)."""

  def __init__(self, input_shape: Sequence[int] = (28, 28, 1), conv1_channels: int = 256, primary_types: int = 32,
               primary_dim: int = 8, num_classes: int = 10, digit_dim: int = 16,
               decoder_hidden: Sequence[int] = (512, 1024), routing_iterations: int = 3):
    super().__init__()
    height, width, channels = input_shape
    self.input_shape = tuple(input_shape)
    self.primary_types, self.primary_dim, self.iterations = primary_types, primary_dim, routing_iterations
    self.conv1 = nn.Conv2d(channels, conv1_channels, 9)
    self.primary = nn.Conv2d(conv1_channels, primary_types * primary_dim, 9, stride=2)
    grid = ((height - 8) - 9) // 2 + 1, ((width - 8) - 9) // 2 + 1
    in_caps = grid[0] * grid[1] * primary_types
    self.W = nn.Parameter(0.01 * torch.randn(in_caps, num_classes, digit_dim, primary_dim))
    sizes = [num_classes * digit_dim, *decoder_hidden, height * width * channels]
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
      layers += [nn.Linear(fan_in, fan_out), nn.ReLU() if i < len(sizes) - 2 else nn.Sigmoid()]
    self.decoder = nn.Sequential(*layers)

  def capsules(self, images: torch.Tensor) -> torch.Tensor:
    """Images [batch, h, w, c] (capsjax's layout) → digit capsules [batch, classes, dim]."""
    batch = images.shape[0]
    features = F.relu(self.conv1(images.permute(0, 3, 1, 2)))
    primary = self.primary(features).permute(0, 2, 3, 1)          # [batch, h, w, types·dim]
    u = squash(primary.reshape(batch, -1, self.primary_dim))         # [batch, in_caps, in_dim]
    u_hat = torch.einsum('ijdk,bik->bijd', self.W, u)                # [batch, in_caps, out_caps, out_dim]
    logits = torch.zeros(u_hat.shape[:3], device=images.device, dtype=u_hat.dtype)   # [batch, in, out]
    for iteration in range(self.iterations):
      couplings = logits.softmax(-1)                                 # over the parents
      v = squash(torch.einsum('bij,bijd->bjd', couplings, u_hat))   # [batch, out_caps, out_dim]
      if iteration < self.iterations - 1:
        logits = logits + torch.einsum('bijd,bjd->bij', u_hat, v)
    return v

  def forward(self, images: torch.Tensor, targets: torch.Tensor):
    """(capsule lengths [batch, classes], reconstructions [batch, h·w·c]) with the capsules
    of `targets` (one-hot [batch, classes]) unmasked."""
    v = self.capsules(images)
    lengths = v.norm(dim=-1)
    return lengths, self.decoder((v * targets[..., None]).flatten(1))


def loss_fn(lengths, reconstructions, images, targets):
  """The paper's loss, mean over the batch (capsjax's `capsnet` objective)."""
  margin = targets * F.relu(0.9 - lengths) ** 2 + 0.5 * (1 - targets) * F.relu(lengths - 0.1) ** 2
  squared_error = ((reconstructions - images.flatten(1)) ** 2).sum(-1)
  return (margin.sum(-1) + 0.0005 * squared_error).mean()


def load_capsjax(model: CapsNet, params) -> CapsNet:
  """Copies a capsjax CapsNet's parameters (its `params` tree, numpy or JAX arrays) in."""
  def tensor(array):
    return torch.from_numpy(np.array(array, np.float32))
  hwio_to_oihw = lambda kernel: tensor(kernel).permute(3, 2, 0, 1)
  with torch.no_grad():
    model.conv1.weight.copy_(hwio_to_oihw(params['conv1']['kernel']))
    model.conv1.bias.copy_(tensor(params['conv1']['bias']))
    model.primary.weight.copy_(hwio_to_oihw(params['primary_caps']['conv']['kernel']))
    model.primary.bias.copy_(tensor(params['primary_caps']['conv']['bias']))
    model.W.copy_(tensor(params['digit_caps']['weights']))
    linears = [layer for layer in model.decoder if isinstance(layer, nn.Linear)]
    for i, linear in enumerate(linears):
      linear.weight.copy_(tensor(params['decoder'][f'Dense_{i}']['kernel']).T)
      linear.bias.copy_(tensor(params['decoder'][f'Dense_{i}']['bias']))
  return model


def onnxruntime_forward(model: CapsNet, images: torch.Tensor, targets: torch.Tensor, device: torch.device):
  """`model`'s forward pass exported to ONNX (torch.onnx.export) and run by an ONNX Runtime
  session on `device`, called as the model is: (images, targets) → its outputs."""
  import contextlib  # pylint: disable=g-import-not-at-top
  import io  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  import onnxruntime  # pylint: disable=g-import-not-at-top
  path = os.path.join(tempfile.mkdtemp(prefix='torch_capsnet_onnx_'), 'capsnet.onnx')
  with contextlib.redirect_stdout(io.StringIO()):   # the exporter's progress lines
    torch.onnx.export(model, (images, targets), path, input_names=['images', 'targets'],
                      output_names=['lengths', 'reconstructions'])
  providers = ['CUDAExecutionProvider'] if device.type == 'cuda' else ['CPUExecutionProvider']
  session = onnxruntime.InferenceSession(path, providers=providers)
  return lambda x, t: session.run(None, {'images': x.cpu().numpy(), 'targets': t.cpu().numpy()})


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--batch', type=int, default=128)
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--infer', action='store_true')
  parser.add_argument('--input_shape', default='28,28,1', help='H,W,C of the images (the paper: 28,28,1)')
  parser.add_argument('--threads', type=int, default=0)
  parser.add_argument('--device', default='cpu')
  parser.add_argument('--runtime', default='eager', choices=['eager', 'compile', 'onnxruntime'],
                      help='eager PyTorch, torch.compile, or (inference) ONNX Runtime on the exported model')
  parser.add_argument('--compile', action='store_true', help='the same as --runtime compile')
  parser.add_argument('--compile_backend', default='inductor',
                      help="torch.compile's backend (inductor: what a PyTorch user picks for speed; a smoke on a "
                      'CPU rehearses the capture with aot_eager, which generates no code)')
  parser.add_argument('--precision', default='', choices=['', 'fp32', 'tf32', 'bf16'],
                      help='matmul/conv precision; default fp32 on CPU, tf32 on GPU (as JAX does)')
  args = parser.parse_args()
  runtime = 'compile' if args.compile else args.runtime
  if runtime == 'onnxruntime' and not args.infer:
    parser.error('--runtime onnxruntime runs inference only (--infer)')
  if args.threads:
    torch.set_num_threads(args.threads)
  torch.manual_seed(0)
  device = torch.device(args.device)
  torch.backends.cudnn.benchmark = True
  precision = args.precision or ('tf32' if device.type == 'cuda' else 'fp32')
  torch.backends.cuda.matmul.allow_tf32 = precision != 'fp32'
  torch.backends.cudnn.allow_tf32 = precision != 'fp32'
  autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == 'bf16')
  input_shape = tuple(int(side) for side in args.input_shape.split(','))
  model = CapsNet(input_shape).to(device)
  optimizer = torch.optim.Adam(model.parameters(), 1e-3)
  forward = torch.compile(model, backend=args.compile_backend) if runtime == 'compile' else model
  images = torch.rand(args.batch, *input_shape, device=device)
  targets = F.one_hot(torch.randint(0, 10, (args.batch,), device=device), 10).float()
  sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)
  if runtime == 'onnxruntime':
    forward = onnxruntime_forward(model.eval(), images, targets, device)

  def step():
    if args.infer:
      with torch.no_grad(), autocast:
        forward(images, targets)
      return
    with autocast:
      lengths, reconstructions = forward(images, targets)
      loss = loss_fn(lengths.float(), reconstructions.float(), images, targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

  for _ in range(3 if runtime != 'eager' or device.type == 'cuda' else 1):
    step()   # warm-up (and compilation)
  sync()
  start = time.perf_counter()
  for _ in range(args.steps):
    step()
  sync()
  seconds = (time.perf_counter() - start) / args.steps
  print(f"torch_capsnet mode={'infer' if args.infer else 'train'} batch={args.batch} device={device.type} "
        f"precision={precision} compile={runtime == 'compile'} runtime={runtime} "
        f"images_per_s={args.batch / seconds:.1f}")


if __name__ == '__main__':
  main()
