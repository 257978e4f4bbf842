"""Tasks, registered: what a run learns from a source's splits (config.task).

A task turns the (train, test[, held-out validation]) splits of a source
(capsjax.data.sources) into the loop's pipelines (capsjax.data.pipeline: host batch,
evaluation batches, device batch). Each task takes its own sub-config: the few keys it
names in `keys`, copied out of the run's config, never the whole config. Adding one is
a class and a decorator; capsjax.validation reads the names from TASKS.
"""
from typing import Callable, Optional, Tuple

import ml_collections

from capsjax.data import affine
from capsjax.data.pipeline import Pipeline, dataset_pipeline, images_on_demand, multimnist_pipeline
from capsjax.data.sources import Dataset, DataSpec, SourceInfo, open_source
from capsjax.errors import ConfigError
from capsjax.models import MODELS
from capsjax.registry import Registry

# config.task → the Task class, and what callers ask of a task:
#   labels_per_example     labels of one example (2: MultiMNIST's pairs); predictions are
#                          the top-k classes
#   has_validation         a validation split can be held out of the training split
#   input_shape_from_data  the model reads the source's images as they are, so an open
#                          model.input_shape takes the data's
#   generates_examples     training examples are generated from the source's (the count
#                          of source images does not bound the batch)
#   per_label_targets      batches carry each label's own object (`digits`): segmentation
#   single_images          one object per image: predict applies
TASKS = Registry('task', labels_per_example=1, has_validation=True, input_shape_from_data=False,
                 generates_examples=False, per_label_targets=False, single_images=True)

Splits = Tuple[Pipeline, Pipeline, Optional[Pipeline]]


def register_task(name: str, **capabilities) -> Callable[[type], type]:
  def register(cls):
    cls.name = name
    return TASKS.register(name, **capabilities)(cls)
  return register


def sub_config(config: ml_collections.ConfigDict, keys) -> ml_collections.ConfigDict:
  """A copy of `config`'s `keys` (dotted keys are stored under their last part)."""
  values = {}
  for key in keys:
    node = config
    for part in key.split('.'):
      node = node[part]
    values[key.split('.')[-1]] = node.to_dict() if isinstance(node, ml_collections.ConfigDict) else node
  return ml_collections.ConfigDict(values)


class Task:
  """Pipelines from a source's splits. `keys`: the config keys the task reads."""
  keys: Tuple[str, ...] = ('batch_size', 'seed', 'num_test_examples')

  def __init__(self, task_config: ml_collections.ConfigDict):
    self.config = task_config

  def check_input(self, info: SourceInfo, model_input_shape) -> None:
    """Refuses a model that cannot read what this task makes of `info`'s images."""

  def pipelines(self, info: SourceInfo, train: Dataset, test: Dataset, held_out: Optional[Dataset]) -> Splits:
    raise NotImplementedError

  def _test_subset(self, test: Dataset) -> Dataset:
    count = self.config.num_test_examples
    if count:
      test = test.take(at_most('num_test_examples', count, len(test), 'test examples'))
    return test

  def _check_batch(self, train: Dataset) -> None:
    if len(train) < self.config.batch_size:
      raise ConfigError(f'batch_size {self.config.batch_size} exceeds the {len(train)} training examples')


@register_task('classify', input_shape_from_data=True)
class Classify(Task):
  """One label per image: the source's images as they are (its preprocessing, training
  shifts of up to max_shift px)."""
  keys = Task.keys + ('max_shift',)

  def check_input(self, info, model_input_shape):
    if info.input_shape != tuple(model_input_shape):
      raise ConfigError(f'{info.name} gives the model inputs of shape {info.input_shape}; the model expects '
                        f'config.model.input_shape={tuple(model_input_shape)} (--experiment=images takes the '
                        'shape and classes from the data)')

  def pipelines(self, info, train, test, held_out):
    self._check_batch(train)
    make = lambda data, training: dataset_pipeline(self.config, data, training, preprocessing=info.preprocessing)
    return make(train, True), make(self._test_subset(test), False), (make(held_out, False) if held_out else None)


@register_task('expanded')
class Expanded(Task):
  """Each digit placed at a random position of the model's larger canvas (section 5.2's
  40×40 training set); test placements fixed by expanded_test_seed."""
  keys = Task.keys + ('max_shift', 'expanded_test_seed', 'model.input_shape')

  def pipelines(self, info, train, test, held_out):
    self._check_batch(train)
    canvas = self.config.input_shape[0]
    place = lambda image, key: affine.random_place(image, key, canvas)
    seed = self.config.expanded_test_seed
    make = lambda data, training, test_seed=0: dataset_pipeline(self.config, data, training, place, test_seed,
                                                                 info.preprocessing)
    return (make(train, True), make(self._test_subset(test), False, seed),
            make(held_out, False, seed + 1) if held_out else None)


@register_task('multimnist', labels_per_example=2, has_validation=False, generates_examples=True,
               per_label_targets=True, single_images=False)
class MultiMnist(Task):
  """Two digits of different classes overlaid on the model's canvas (section 6),
  generated on device from (seed, example index)."""
  keys = Task.keys + ('multimnist',)

  def pipelines(self, info, train, test, held_out):
    if self.config.num_test_examples:
      at_most('num_test_examples', self.config.num_test_examples,
              len(test) * self.config.multimnist.examples_per_digit, 'MultiMNIST test pairs')
    return (multimnist_pipeline(self.config, train, self.config.seed, 0, info.num_classes),
            multimnist_pipeline(self.config, test, self.config.multimnist.test_seed,
                                self.config.num_test_examples, info.num_classes), None)


def make_task(config) -> Task:
  if config.task not in TASKS:
    raise ConfigError(f'config.task={config.task!r}: allowed one of {", ".join(TASKS)}')
  cls = TASKS.get(config.task)
  return cls(sub_config(config, cls.keys))


def at_most(key: str, value: int, available: int, what: str) -> int:
  """config.KEY = value, refused when the data has fewer (never silently clamped)."""
  if value > available:
    raise ConfigError(f'config.{key}={value}: the data has {available} {what}; allowed at most that')
  return value


def split_validation(config, train: Dataset) -> Tuple[Dataset, Optional[Dataset]]:
  """(training examples, held-out validation examples or None): the last
  config.validation_examples images of the training split are held out, as the authors'
  `--validate` holds out the last 10 000 (50k/10k)."""
  held_out = config.validation_examples
  if not held_out:
    return train, None
  if not TASKS[config.task].has_validation:
    allowed = ', '.join(f"'{entry.name}'" for entry in TASKS.entries() if entry.has_validation)
    raise ConfigError(f'config.validation_examples: a held-out validation split exists for the {allowed} '
                      'tasks only')
  if held_out >= len(train):
    raise ConfigError(f'config.validation_examples={held_out}: allowed fewer than the {len(train)} '
                      'training examples')
  return (Dataset(train.images[:-held_out], train.labels[:-held_out]),
          Dataset(train.images[-held_out:], train.labels[-held_out:]))


def make_splits(config) -> Splits:
  """(train, test, validation or None) pipelines of config.task on config's source. With
  config.validation_examples, training never sees the held-out images."""
  task = make_task(config)
  source = open_source(DataSpec.from_config(config))
  info = source.describe()
  task.check_input(info, config.model.input_shape)
  on_demand = images_on_demand(config)
  train, test = source.load('train', on_demand), source.load('test', on_demand)
  train, held_out = split_validation(config, train)
  if config.num_train_examples:
    after = f' (after holding out {len(held_out)} for validation)' if held_out else ''
    train = train.take(at_most('num_train_examples', config.num_train_examples, len(train),
                               'training examples' + after))
  return task.pipelines(info, train, test, held_out)


def make_pipelines(config) -> Tuple[Pipeline, Pipeline]:
  """(train, test) pipelines; see make_splits."""
  train, test, _ = make_splits(config)
  return train, test


def affine_test_pipeline(config) -> Pipeline:
  """The MNIST test digits under random affine maps (config.affnist), fixed per index."""
  source = open_source(DataSpec.from_config(config))
  test = source.load('test', images_on_demand(config))
  if config.num_test_examples:
    test = test.take(config.num_test_examples)
  ranges = dict(config.affnist.ranges)
  transform = lambda image, key: affine.random_affine(image, key, ranges)[0]
  return dataset_pipeline(config, test, False, transform, config.affnist.test_seed,
                          source.describe().preprocessing)


def resolve_data(config) -> ml_collections.ConfigDict:
  """A copy of `config` with what the data says filled in: config.class_names (when
  empty), model.num_classes (when 0) and, for 'classify', model.input_shape (when ()).
  Values the config gives must agree with the data. Reads the source's description only
  (headers, TFDS builder info), so a run fails here within seconds on the wrong data."""
  task = make_task(config)
  info = open_source(DataSpec.from_config(config)).describe()
  config = ml_collections.ConfigDict(config.to_dict())
  model = config.model
  if 'class_names' in config and not config.class_names:
    config.class_names = tuple(info.class_names)
  if 'class_names' in config and len(config.class_names) != info.num_classes:
    raise ConfigError(f'config.class_names has {len(config.class_names)} names; {info.name} has '
                      f'{info.num_classes} classes')
  if model.get('num_classes') == 0:
    model.num_classes = info.num_classes
  elif TASKS[task.name].input_shape_from_data and model.get('num_classes') not in (None, info.num_classes):
    raise ConfigError(f'{info.name} has {info.num_classes} classes; the model has config.model.num_classes='
                      f'{model.num_classes} (--experiment=images takes the shape and classes from the data)')
  if 'input_shape' in model and not tuple(model.input_shape):
    if not TASKS[task.name].input_shape_from_data:
      raise ConfigError(f'config.model.input_shape=(): the {task.name} task needs the canvas size '
                        '(height, width, channels)')
    model.input_shape = tuple(info.input_shape)
    problems = MODELS[model.name].check(model, 'model.')
    if problems:   # e.g. the data's images, too small for the CapsNet
      raise ConfigError(problems[0])
  return config
