"""Every routing algorithm on the paper's MNIST CapsNet: same data order, 3 seeds each as one
vmapped program, a 5 000-image validation split; writes routing.md.

  python run.py --experiment=routing_zoo --workdir=W

Routings (capsjax.routing.ROUTINGS, docs/results.md): dynamic (the paper's Procedure 1), em (Hinton
et al. 2018, on vector poses), self_attention (Efficient-CapsNet, 2021),
inverted_dot_product (Tsai et al. 2020), self_routing (Hahn et al. 2019), variational_bayes
(Ribeiro et al. 2020), and the two
baselines without routing: uniform (every coupling 1/parents) and max_pooling.
"""
from capsjax import defaults
from capsjax.app.programs import routing_zoo as program   # declares routing_zoo.*


def get_config():
  config = defaults.base_config()
  config.experiment = 'routing_zoo'
  config.program = 'routing_zoo'
  config.validation_examples = 5000
  config.routing_zoo = defaults.section('routing_zoo', program)   # every routing, 3 seeds, options unchanged
  return config
