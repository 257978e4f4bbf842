"""The paper's MultiMNIST CNN baseline (section 6.2): 24.56M parameters, sigmoid cross-entropy."""
import ml_collections

from capsjax import models
from capsjax.experiments import multimnist


def get_config():
  config = multimnist.get_config()
  config.experiment = 'multimnist_baseline'
  # Every key the family declares (its formulation too: --config.model.formulation.conv_impl).
  config.model = models.model_config('cnn')
  config.model.update(conv_channels=(512, 256), conv_kernels=(9, 5), pool=True, dense=(1024,), dropout_rate=0.0,
                      num_classes=10, input_shape=(36, 36, 1))
  config.loss = ml_collections.ConfigDict(dict(name='sigmoid_xent'))
  return config
