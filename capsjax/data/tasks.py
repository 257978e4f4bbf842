"""Tasks, registered: what a run learns from a source's splits (config.task).

A task turns the (train, test[, held-out validation]) splits of a source
(capsjax.data.sources) into the loop's pipelines (capsjax.data.pipeline: host batch,
evaluation batches, device batch). Each task is built with the values of the few config
keys it names in `keys` (capsjax.assemble.task reads them), never the config. Adding one
is a class and a decorator; capsjax.validation reads the names from TASKS.
"""
import types
from typing import Callable, Optional, Tuple

from capsjax.data import affine
from capsjax.data.pipeline import Pipeline, dataset_pipeline, multimnist_pipeline
from capsjax.data.sources import Dataset, SourceInfo
from capsjax.errors import ConfigError
from capsjax.keys import Across, key, int_at_least, registered, seed_value
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


class Task:
  """Pipelines from a source's splits. `keys`: the config keys the task reads; it is
  built with their values (dotted keys by their last part: Task(batch_size=…, …))."""
  keys: Tuple[str, ...] = ('batch_size', 'seed', 'num_test_examples')

  def __init__(self, **options):
    self.options = types.SimpleNamespace(**options)

  def check_input(self, info: SourceInfo, model_input_shape) -> None:
    """Refuses a model that cannot read what this task makes of `info`'s images."""

  def pipelines(self, info: SourceInfo, train: Dataset, test: Dataset, held_out: Optional[Dataset]) -> Splits:
    raise NotImplementedError

  def _test_subset(self, test: Dataset) -> Dataset:
    count = self.options.num_test_examples
    if count:
      test = test.take(at_most('num_test_examples', count, len(test), 'test examples'))
    return test

  def _check_batch(self, train: Dataset) -> None:
    if len(train) < self.options.batch_size:
      raise ConfigError(f'batch_size {self.options.batch_size} exceeds the {len(train)} training examples')


@register_task('classify', input_shape_from_data=True)
class Classify(Task):
  """One label per image: the source's images as they are (its preprocessing, training
  shifts of up to max_shift px)."""
  keys = Task.keys + ('max_shift', 'augment')

  def check_input(self, info, model_input_shape):
    if info.input_shape != tuple(model_input_shape):
      raise ConfigError(f'{info.name} gives the model inputs of shape {info.input_shape}; the model expects '
                        f'config.model.input_shape={tuple(model_input_shape)} (--experiment=images takes the '
                        'shape and classes from the data)')

  def pipelines(self, info, train, test, held_out):
    self._check_batch(train)
    options = self.options
    make = lambda data, training: dataset_pipeline(
        data, training, batch_size=options.batch_size, seed=options.seed, max_shift=options.max_shift,
        preprocessing=info.preprocessing, augmentation=options.augment)
    return make(train, True), make(self._test_subset(test), False), (make(held_out, False) if held_out else None)


@register_task('expanded')
class Expanded(Task):
  """Each digit placed at a random position of the model's larger canvas (section 5.2's
  40×40 training set); test placements fixed by expanded_test_seed."""
  keys = Task.keys + ('max_shift', 'expanded_test_seed', 'model.input_shape')

  def pipelines(self, info, train, test, held_out):
    self._check_batch(train)
    canvas = self.options.input_shape[0]
    place = lambda image, key: affine.random_place(image, key, canvas)
    seed = self.options.expanded_test_seed
    options = self.options
    make = lambda data, training, test_seed=0: dataset_pipeline(
        data, training, batch_size=options.batch_size, seed=options.seed, max_shift=options.max_shift,
        preprocessing=info.preprocessing, example_transform=place, test_seed=test_seed)
    return (make(train, True), make(self._test_subset(test), False, seed),
            make(held_out, False, seed + 1) if held_out else None)


@register_task('multimnist', labels_per_example=2, generates_examples=True, per_label_targets=True,
               single_images=False)
class MultiMnist(Task):
  """Two digits of different classes overlaid on the model's canvas (section 6),
  generated on device from (seed, example index). With validation_examples, the validation
  pairs are overlays of the held-out training digits only (as many as the test pairs, from
  seed test_seed + 1): training never sees those digits."""
  keys = Task.keys + ('multimnist',)

  def pipelines(self, info, train, test, held_out):
    options, pairs = self.options, self.options.multimnist   # multimnist: {examples_per_digit, test_seed}
    if options.num_test_examples:
      at_most('num_test_examples', options.num_test_examples,
              len(test) * pairs['examples_per_digit'], 'MultiMNIST test pairs')
    make = lambda data, seed, count: multimnist_pipeline(
        data, seed, count, batch_size=options.batch_size, examples_per_digit=pairs['examples_per_digit'],
        num_classes=info.num_classes)
    validation = make(held_out, pairs['test_seed'] + 1, options.num_test_examples) if held_out else None
    return make(train, options.seed, 0), make(test, pairs['test_seed'], options.num_test_examples), validation


KEYS = (
    key('task', 'classify', registered(TASKS.names), 'classify one label per image, expanded (digits placed on a '
        'larger canvas) or multimnist (two overlaid digits)'),
    key('num_train_examples', 0, int_at_least(0), 'use the first N training examples (0: all)'),
    key('num_test_examples', 0, int_at_least(0), 'evaluate on the first N test examples (0: all)'),
    # The project never selects on the test set: a held-out split is what results select by.
    key('validation_examples', 0, int_at_least(0), 'hold out the last N training images as a validation split, '
        'evaluated beside the test set (results.json: the test error at the best validation evaluation too)'),
    key('expanded_test_seed', 2, seed_value(), "seed of the expanded task's fixed test placements"),
    # multimnist: MultiMNIST pair generation (task=multimnist)
    key('multimnist.examples_per_digit', 1000, int_at_least(1), 'MultiMNIST pairs per source digit (the paper: 1000)',
        in_base=False),
    key('multimnist.test_seed', 1, seed_value(), "seed of MultiMNIST's fixed test pairs", in_base=False),
)


def _examples_problem(num_train_examples, batch_size, task):
  if not num_train_examples or (task in TASKS and TASKS[task].generates_examples) or num_train_examples >= batch_size:
    return None
  return f'config.batch_size={batch_size!r}: allowed at most num_train_examples={num_train_examples}'


def _augmentation_problem(augmentation, task):
  if augmentation is None or task not in TASKS or 'augment' in TASKS.get(task).keys:
    return None
  used = [f'augment.{name}={value!r}' for name, value in augmentation.items() if name != 'elastic_sigma' and value]
  if not used:
    return None
  readers = ', '.join(name for name in TASKS if 'augment' in TASKS.get(name).keys)
  return (f'config.{used[0]}: the augmentation beyond shifts applies to task={readers}; task={task!r} makes its '
          'own examples')


# The rules across these keys (capsjax.keys.Across), checked by validation.
RULES = (Across(('num_train_examples', 'batch_size', 'task'), _examples_problem),
         Across(('augment', 'task'), _augmentation_problem))


def hold_out(task: str, train: Dataset, count: int) -> Tuple[Dataset, Optional[Dataset]]:
  """(training examples, held-out validation examples or None): the last `count`
  (config.validation_examples) images of `task`'s training split are held out, as the
  authors' `--validate` holds out the last 10 000 (50k/10k)."""
  if not count:
    return train, None
  if not TASKS[task].has_validation:
    allowed = ', '.join(f"'{entry.name}'" for entry in TASKS.entries() if entry.has_validation)
    raise ConfigError(f'config.validation_examples: a held-out validation split exists for the {allowed} '
                      'tasks only')
  if count >= len(train):
    raise ConfigError(f'config.validation_examples={count}: allowed fewer than the {len(train)} '
                      'training examples')
  return (Dataset(train.images[:-count], train.labels[:-count]),
          Dataset(train.images[-count:], train.labels[-count:]))


def at_most(key: str, value: int, available: int, what: str) -> int:
  """config.KEY = value, refused when the data has fewer (never silently clamped)."""
  if value > available:
    raise ConfigError(f'config.{key}={value}: the data has {available} {what}; allowed at most that')
  return value
