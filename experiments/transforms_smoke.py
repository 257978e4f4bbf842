"""Per-capsule against per-type class-capsule transforms, and the dense against the
transposed-convolution decoder, at the `mnist_smoke` scale: 3 seeds each (one vmapped
program per variant), ranked on a 5 000-image validation split held out of training
(the test error beside it, never chosen on).

  python run.py --experiment=transforms_smoke --workdir=W --config.data_dir=../shared/data/mnist
"""
import ml_collections

from capsjax.experiments import mnist_smoke


def get_config():
  config = mnist_smoke.get_config()
  config.experiment = 'transforms_smoke'
  config.program = 'sweep'
  config.validation_examples = 5000
  config.ensemble = ml_collections.ConfigDict(dict(seeds=(0, 1, 2)))
  config.evals.routing_probe.enabled = False
  config.sweep = ml_collections.ConfigDict(dict(variants=(
      "paper: model.transforms='per_capsule'",
      "per_type: model.transforms='per_type'",
      "deconv_decoder: model.decoder='deconv'",
  )))
  return config
