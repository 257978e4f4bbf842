"""Every routing algorithm on the paper's MNIST CapsNet: same data order, 3 seeds each as one
vmapped program, a 5 000-image validation split; writes routing.md.

  python run.py --experiment=routing_zoo --workdir=W

Routings (capsjax.routing.ROUTINGS, docs/results.md): dynamic (the paper's Procedure 1), em (Hinton
et al. 2018, on vector poses), self_attention (Efficient-CapsNet, 2021),
inverted_dot_product (Tsai et al. 2020), self_routing (Hahn et al. 2019), variational_bayes
(Ribeiro et al. 2020), and the two
baselines without routing: uniform (every coupling 1/parents) and max_pooling.
"""
import ml_collections

from capsjax import defaults


def get_config():
  config = defaults.base_config()
  config.experiment = 'routing_zoo'
  config.program = 'routing_zoo'
  config.validation_examples = 5000
  config.routing_zoo = ml_collections.ConfigDict(dict(
      routings=('dynamic', 'em', 'self_attention', 'inverted_dot_product', 'self_routing', 'variational_bayes',
                'uniform', 'max_pooling'),
      seeds=(0, 1, 2),
      # Per routing, options over its model.routing_options section; none changed here.
      options=ml_collections.ConfigDict({}),
      # Speed, measured after training in interleaved rounds (every routing once per round):
      # the median and range per routing, so that the machine's load cannot reorder them.
      speed_rounds=5,
      speed_steps=5,   # training steps per timed sample
  ))
  return config
