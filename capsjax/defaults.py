"""The base config: every key a run has, with the values of the paper's MNIST setup
(section 5). Experiments (experiments/NAME.py) start from `base_config()` and change what
they need; the library reads its defaults here (a workdir made before a key existed ran
with that key's default), never from an experiment.

Optimiser: Adam at 1e-3 with exponential decay ×0.96 every 2000 steps, batch 128, as in
the authors' released code (the paper says only "TensorFlow default Adam ... exponentially
decaying learning rate"); see BUILD.md.
"""
import ml_collections

from capsjax.data.augment import AUGMENT
from capsjax.data.datasets import dataset_info
from capsjax.routing import configurable_routing_options


def capsnet_config() -> ml_collections.ConfigDict:
  """The paper's CapsNet: 8,215,568 parameters (6,804,224 without the decoder)."""
  return ml_collections.ConfigDict(dict(
      name='capsnet',
      conv1_channels=256, conv1_kernel=9,
      primary_types=32, primary_dim=8, primary_kernel=9, primary_stride=2,
      num_classes=10, digit_dim=16, routing_iterations=3,
      digit_bias=False, learn_log_priors=False, leaky_routing=False,
      stop_gradient_predictions=False,
      decoder_hidden=(512, 1024), use_decoder=True,
      input_shape=(28, 28, 1),
      # Formulations of the same math; 'auto' = the backend's measured faster one
      # (capsjax/formulations.py): conv 'xla' | 'patches', the patches conv without
      # gradients 'chunked' | 'whole_batch', routing 'rolled' | 'unrolled'.
      conv_impl='auto',
      patches_inference='auto',
      routing_loop='auto',
      dtype='float32',
      # The convolutions' matmul inputs: 'float32', or 'bfloat16' accumulated in float32
      # (about twice the matmul rate on CPUs with AVX-512 BF16; not the same values).
      conv_inputs='float32',
      # The authors' released code (see experiments/mnist_official.py): 'official'
      # truncated-normal weights and 0.1 biases; PrimaryCaps pre-squash output ÷ types.
      init_scheme='default',
      primary_scale_by_types=False,
      # The routing algorithm (capsjax.routing.ROUTINGS: dynamic = the paper's Procedure 1,
      # em, self_attention, inverted_dot_product, …) and its options, a section per routing
      # at their defaults (--config.model.routing_options.em.inverse_temperature=2); the
      # model reads its routing's section only.
      routing='dynamic',
      routing_options=ml_collections.ConfigDict(configurable_routing_options()),
      # Class-capsule transforms: 'per_capsule' (the paper) or 'per_type' (one W per primary
      # type and class, shared over positions, with coordinate addition: its parameters do
      # not grow with the image; Procedure 1 then routes without materialising û).
      transforms='per_capsule',
      # per_type: 'factored' (Procedure 1 without û) or 'materialised' (û built first):
      # the same values, measured against each other in benchmarks/image_sizes.py.
      votes='factored',
      # 'none' (the paper) or 'strided': 3×3 stride-2 convolutions of stem_channels before
      # conv1, halving the image until it is at most 40 px.
      stem='none', stem_channels=32,
      # 'dense' (the paper's decoder_hidden widths) or 'deconv' (transposed convolutions:
      # its size does not grow with the image). transforms, stem and decoder may be
      # 'auto': chosen for the data's size and the memory (capsjax.sizing; `images` does).
      decoder='dense',
  ))


def base_config() -> ml_collections.ConfigDict:
  """Every key a run has, at its default: the paper's MNIST CapsNet and training setup
  (section 5). Experiments (`capsjax.experiments.NAME.get_config()`) start from it; `capsjax
  --experiment=NAME --help` explains each key and its allowed values.

  Example:
    >>> config = capsjax.base_config()
    >>> config.batch_size, config.model.routing_iterations, config.loss.m_plus, config.loss.m_minus
    (128, 3, 0.9, 0.1)
  """
  config = ml_collections.ConfigDict()
  config.experiment = 'mnist'
  config.task = 'classify'        # 'classify' (one label per image) or 'multimnist'
  # Data (capsjax.data.sources): a TFDS name (TFDS downloads and prepares it on first
  # use), or 'image_folder' for the folder in data_dir; data_dir = a folder of LeCun IDX
  # files instead of TFDS (offline use of the MNIST family) or the image folder.
  config.dataset = 'mnist'
  config.data_dir = ''
  config.tfds_data_dir = ''
  config.image_size = 0           # > 0: every image resized to N×N (capsjax.data.images)
  # What transparent pixels of image files become: 'white' or 'black' (capsjax.data.images).
  config.image_background = 'white'
  config.class_names = ()         # () = the data's (filled in when the run starts)
  # Host memory: 'memory' loads each split whole (uint8); 'rows' reads only the rows of
  # each batch this process feeds its devices (TFDS array_record or an uncompressed IDX
  # file; capsjax.data.rows); 'auto' = 'rows' on several processes (multi-host).
  config.host_images = 'auto'
  config.num_train_examples = 0   # 0 = the whole split
  config.num_test_examples = 0
  # > 0: the last N training images are held out as a validation split, evaluated next
  # to the test set; results.json then reports the test error at the best validation
  # evaluation too. The project never selects on the test set.
  config.validation_examples = 0
  config.max_shift = 2            # training images shifted by up to ±2 px, zero padding
  # Training augmentation beyond the shifts (capsjax.data.augment.AUGMENT: all off, the paper).
  config.augment = ml_collections.ConfigDict(dict(AUGMENT))
  # Optimisation.
  config.seed = 0
  config.batch_size = 128
  config.num_epochs = 50.0
  config.num_steps = 0            # > 0 overrides num_epochs
  config.learning_rate = 1e-3
  config.lr_decay_rate = 0.96
  config.lr_decay_steps = 2000
  config.lr_staircase = False
  config.lr_min = 0.0             # floor of the decayed learning rate (authors' code: 1e-6)
  # Beyond the paper (capsjax.steps): the schedule's shape, a linear warm-up, the optimizer,
  # its decoupled weight decay, gradient clipping. The defaults are the paper's recipe.
  config.lr_schedule = 'exponential'
  config.warmup_steps = 0
  config.optimizer = 'adam'
  config.weight_decay = 0.0
  config.grad_clip_norm = 0.0     # > 0: gradients scaled to at most this global norm
  config.ema_decay = 0.0          # > 0: a moving average of the parameters, evaluated beside them
  config.loss = ml_collections.ConfigDict(dict(
      name='capsnet', m_plus=0.9, m_minus=0.1, negative_weight=0.5, reconstruction_weight=0.0005,
      # 'sum' over classes (paper, eq. 4) or 'official' (authors' code: 0.5 × mean over classes).
      margin_reduction='sum'))
  config.model = capsnet_config()
  # Bookkeeping.
  config.log_every_steps = 50
  config.eval_every_steps = 468   # one epoch: 60 000 // 128 steps
  config.eval_batch_size = 500
  config.checkpoint_every_steps = 468
  config.keep_checkpoints = 3
  config.checkpoint_every_secs = 600.0   # also save every 10 minutes of wall time (0: off)
  config.stop_at_step = 0         # > 0: checkpoint and exit there (as a preemption would)
  # > 0: the run is complete at the first evaluation with this test accuracy (affNIST).
  config.stop_at_test_accuracy = 0.0
  # A workdir is bound to the config it was started with; True continues it with another.
  config.allow_config_change = False
  # Running a finished workdir again says so and exits at once; True evaluates it again.
  config.reevaluate = False
  # The run's peak memory is estimated before compiling (capsjax.memory) and shown in the
  # header; a run that cannot fit is refused with one line. False: try anyway.
  config.check_memory = True
  # The function that runs the experiment (see run.py): 'train', or a program of
  # capsjax.programs that calls the training loop itself.
  config.program = 'train'
  # Several configurations trained as one vmapped program (capsjax.ensembles): a dict of
  # tuples seeds / routing_iterations / reconstruction_weights, or None.
  config.ensemble = None
  # Multi-host (capsjax.sharding): every process runs the same command; on Cloud TPU the
  # coordinator is found automatically, elsewhere give address, count and id.
  config.distributed = False
  config.coordinator_address = ''
  config.num_processes = 0
  config.process_id = -1
  # How long a process waits for the coordinator (and JAX for all processes) before
  # giving up with one error line.
  config.distributed_timeout_s = 120
  # Routing convergence (appendix A): mean |Δb| per iteration at every evaluation.
  config.routing_probe_iterations = 6
  config.routing_probe_examples = 100
  # Routing diagnostics at every evaluation (capsjax.diagnostics): coupling entropy and
  # movement, per-class consistency, capsule activity, accuracy for r = 1 … iterations.
  config.routing_diagnostics = True
  config.routing_diagnostics_examples = 1000   # the first test images (0: the whole split)
  config.routing_diagnostics_iterations = 5    # the test-time sweep's largest r (0: no sweep)
  return config


def dataset_config(name: str) -> ml_collections.ConfigDict:
  """This recipe on dataset `name` (capsjax.data.datasets): the experiment of that name,
  the model's input shape and class count taken from the dataset's description."""
  config = base_config()
  info = dataset_info(name)
  config.experiment = config.dataset = name
  config.model.input_shape = info.input_shape
  config.model.num_classes = info.num_classes
  return config
