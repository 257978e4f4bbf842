"""MNIST with every choice of the authors' released code (tensorflow/models research/capsules),
where it differs from the paper's text (experiments/mnist.py keeps the paper's).

- Length and learning rate: 300 000 steps of 128 (≈ 640 epochs, the code's README
  command); Adam at 1e-3 × 0.96^(step / 2000), continuous, floored at 1e-6.
- Margin loss: 0.5·L_k averaged over the 10 classes (`loss.margin_reduction='official'`),
  20× lighter than the paper's sum; the reconstruction term stays 0.0005 × the summed
  squared error per image, so it weighs ≈ 20× more relative to the margin.
- Initialisation: truncated normals, σ 0.05 for conv1 and 0.1 elsewhere; every bias 0.1,
  the decoder's too (`model.init_scheme='official'`).
- DigitCaps bias, added to s_j in every routing iteration (`model.routing_inputs=('bias',)`).
- PrimaryCaps: the convolution ÷ 32 before its bias (`model.primary_scale_by_types=True`),
  from the code's one routing pass over the 32 capsule types with uniform couplings.
- Shifts: the code reads all 25 integer shifts within ±2 px through a shuffle buffer;
  uniform random ±2 px shifts per image (as here) draw from the same distribution.
- Selection: the code evaluates its newest checkpoint; so does this one (final test
  error). `--config.validation_examples=10000` holds out the last 10 000 training images
  like the code's `--validate` and also reports the test error at the best validation step.
  Three seeds (0, 1, 2) train as one vmapped program; results.json and table.md give
  mean ± std.
"""
import ml_collections

from capsjax.experiments import mnist


def get_config():
  config = mnist.get_config()
  config.experiment = 'mnist_official'
  config.num_steps = 300000
  config.lr_min = 1e-6
  config.loss.margin_reduction = 'official'
  config.model.init_scheme = 'official'
  config.model.routing_inputs = ('bias',)
  config.model.primary_scale_by_types = True
  config.eval_every_steps = 4680      # every 10 epochs: 64 evaluations over the run
  config.checkpoint_every_steps = 4680
  config.ensemble = ml_collections.ConfigDict(dict(seeds=(0, 1, 2)))   # the paper's 3 trials
  return config
