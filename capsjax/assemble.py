"""Where a run's config becomes typed pieces: the one place below the programs that reads
a ConfigDict for the training path.

The jitted step, the objective, the model, the pipelines and the hooks take these pieces
(functions, modules, numbers), never the config, as big_vision builds `Model(**config.model)`
at its boundary and flax's `train_step` never sees a config.
"""
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import ml_collections
import optax

from capsjax import ensembles, formulations, losses, memory, optimization, sizing, steps
from capsjax.data import affine
from capsjax.data.datasets import DATASETS
from capsjax.data.pipeline import Pipeline, dataset_pipeline, described_preprocessing, images_on_demand
from capsjax.data.sources import Dataset, DataSpec, SourceInfo, open_source, with_image_size
from capsjax.data.tasks import TASKS, Splits, Task, at_most, hold_out
from capsjax.errors import ConfigError
from capsjax.keys import is_int
from capsjax.layout import moved_key_hint
from capsjax.models import MODELS, formulation_of, model_for_platform
from capsjax.objectives import OBJECTIVES, Objective, bound_objective
from capsjax.routing import ROUTINGS


def _objective_arguments(config) -> Tuple[str, int, Dict[str, Any]]:
  """(objective name, the model's class count, its options) of config.loss."""
  options = dict(config.loss)
  return options.pop('name'), int(config.model.num_classes), options   # (validation checked config.loss)


def objective(config) -> Objective:
  """config.loss's objective with its options bound (and the model's class count)."""
  return bound_objective(*_objective_arguments(config))


def optimization_of(config) -> optimization.Optimization:
  """The config's run length, optimizer and schedule keys as one typed piece (read once):
  each field from the key of its name, as its declared type."""
  return optimization.Optimization(**{field.name: field.type(config[field.name])
                                      for field in dataclasses.fields(optimization.Optimization)})


def schedule(config, num_steps: int = 0) -> optax.Schedule:
  """The run's learning rate per step; `num_steps`: the run's length (what 'cosine' and
  'linear' decay over; config.num_steps when not given)."""
  return optimization_of(config).schedule(num_steps)


def optimizer(config, num_steps: int = 0) -> optax.GradientTransformation:
  return optimization_of(config).transform(num_steps)


def model(config, platform: str = ''):
  """config.model's model, its formulation's 'auto' options chosen once for `platform`, the
  platform the run compiles for ('' : JAX's default backend; capsjax-plan: its target's), and
  for its members where config.ensemble has them."""
  return model_for_platform(config.model, platform, ensemble=bool(config.get('ensemble')))


def total_steps(config, num_train_examples: int) -> int:
  return optimization_of(config).length(num_train_examples)


def members(config) -> Optional[List[Dict[str, Any]]]:
  """The members of config.ensemble as dicts (seed, routing_iterations,
  reconstruction_weight; a recipe member also its name and RECIPE_KEYS' fields), or None
  for a single run.

  config.ensemble holds tuples `seeds`, `routing_iterations`, `reconstruction_weights`;
  the members are their product (an empty tuple = the config's own value). With
  `recipes`, the members are recipes × seeds (capsjax.ensembles).
  """
  spec = config.ensemble
  if not spec:
    return None
  seeds = tuple(spec.get('seeds') or (config.seed,))
  knobs = OBJECTIVES[config.loss.name].knobs   # what the objective reads per member
  recipe_list = recipes(config)
  if recipe_list:
    return [_recipe_member(config, name, recipe, int(seed), knobs) for name, recipe in recipe_list for seed in seeds]
  iterations = tuple(spec.get('routing_iterations') or ()) or (
      (config.model.routing_iterations,) if 'routing_iterations' in knobs else (0,))
  weights = tuple(spec.get('reconstruction_weights') or ()) or (
      (config.loss.reconstruction_weight,) if 'reconstruction_weight' in knobs else (0.0,))
  routing = config.model.get('routing')
  if spec.get('routing_iterations') and routing in ROUTINGS and not ROUTINGS[routing].iterative:
    raise ConfigError(f'config.ensemble.routing_iterations={tuple(spec.routing_iterations)}: routing {routing!r} does '
                      'not iterate, so every member would be the same model; vary seeds, or choose an iterative '
                      f'routing ({", ".join(name for name in ROUTINGS if ROUTINGS[name].iterative)})')
  if 'routing_iterations' in knobs and max(iterations) > config.model.routing_iterations:
    raise ConfigError(f'ensemble routing_iterations {iterations} exceed the model bound '
                      f'model.routing_iterations={config.model.routing_iterations}')
  return [dict(seed=int(s), routing_iterations=int(r), reconstruction_weight=float(w))
          for r in iterations for w in weights for s in seeds]


def member_config(config, member: int) -> ml_collections.ConfigDict:
  """Member `member` of an ensemble run's config as a single model's: no ensemble, the
  member's seed, its recipe's settings where it has one, and what the program traced per
  member (routing iterations, reconstruction weight), so that it infers as its training
  evaluated it: a member of Table 1's grid that trained with 1 routing iteration is
  routed once, not model.routing_iterations (the program's bound) times."""
  settings = members(config)[member]
  single = (dict(recipes(config))[settings['recipe']] if 'recipe' in settings else config).to_dict()
  single.update(ensemble=None, seed=settings['seed'])
  knobs = OBJECTIVES[config.loss.name].knobs
  if 'routing_iterations' in knobs:
    single['model']['routing_iterations'] = settings['routing_iterations']
  if 'reconstruction_weight' in knobs:
    single['loss']['reconstruction_weight'] = settings['reconstruction_weight']
  return ml_collections.ConfigDict(single)


def _recipe_member(config, name: str, recipe, seed: int, knobs) -> Dict[str, Any]:
  fields = _recipe_fields(recipe)
  if 'routing_iterations' in knobs and fields['routing_iterations'] > config.model.routing_iterations:
    raise ConfigError(f'config.ensemble.recipes {name!r}: model.routing_iterations={fields["routing_iterations"]} '
                      f'exceeds the program\'s model.routing_iterations={config.model.routing_iterations} '
                      '(the bound of the shared model)')
  fields['routing_iterations'] = int(fields['routing_iterations']) if 'routing_iterations' in knobs else 0
  fields['reconstruction_weight'] = float(fields['reconstruction_weight'] or 0.0) if (
      'reconstruction_weight' in knobs) else 0.0
  reduction = fields['margin_reduction'] or 'sum'   # (objectives without a margin loss ignore it)
  fields['margin_scale'] = losses.margin_reduction_scale(reduction, int(config.model.num_classes))
  return dict(recipe=name, seed=seed, **fields)


def overridden(config, overrides: Dict[str, Any], what: str = 'override') -> ml_collections.ConfigDict:
  """A copy of `config` with `overrides` (dotted key → value) set; unknown keys refused
  (`what` names the override in the error: a sweep's, a recipe's). An integer given for a
  float key becomes that float, as on the command line; any other value is set as given,
  for validation to check by the key's rule (None, True for a number: refused there)."""
  # Not type-safe: a value of another type is set as given, for its key's rule to refuse.
  variant = ml_collections.ConfigDict(config.to_dict(), type_safe=False)
  for key, value in overrides.items():
    parts = key.split('.')
    node = variant
    for depth, part in enumerate(parts):
      if not part:
        raise ConfigError(f'{what} {key!r}: no such config key (a key path has no empty part)')
      if not hasattr(node, 'keys'):
        raise ConfigError(f'{what} {key!r}: no such config key ({".".join(parts[:depth])} is a value, not a section)')
      if part not in node:
        raise ConfigError(f'{what} {key!r}: no such config key' + moved_key_hint(key))
      if depth < len(parts) - 1:
        node = node[part]
    given = float(value) if isinstance(node[parts[-1]], float) and is_int(value) else value
    del node[parts[-1]]   # (ml_collections would turn True into 1.0 for a float key)
    node[parts[-1]] = given
  return variant


def recipes(config) -> List[Tuple[str, ml_collections.ConfigDict]]:
  """(name, the config with the recipe's overrides) per entry of config.ensemble.recipes
  (empty without). A key outside ensembles.RECIPE_KEYS, a repeated name, or recipes beside
  ensemble.routing_iterations / reconstruction_weights is refused in one line."""
  spec = config.ensemble or {}
  entries = tuple(spec.get('recipes') or ())
  if not entries:
    return []
  for other in ('routing_iterations', 'reconstruction_weights'):
    if spec.get(other):
      raise ConfigError(f'config.ensemble.{other}: not beside ensemble.recipes (a recipe sets '
                        f'{"model.routing_iterations" if other == "routing_iterations" else "loss.reconstruction_weight"})')
  parsed = [ensembles.parse_variant(entry, 'config.ensemble.recipes entry') for entry in entries]
  names = [name for name, _ in parsed]
  repeated = sorted({name for name in names if names.count(name) > 1})
  if repeated:
    raise ConfigError(f'config.ensemble.recipes: the name {repeated[0]!r} is given twice')
  out = []
  for name, overrides in parsed:
    recipe = overridden(config, overrides, f'config.ensemble.recipes {name!r}: override')   # unknown keys first
    fixed = [key for key in overrides if key not in ensembles.RECIPE_KEYS]
    if fixed:
      raise ConfigError(f'config.ensemble.recipes {name!r}: {fixed[0]} cannot differ between the members of one '
                        f'program (a recipe sets {", ".join(ensembles.RECIPE_KEYS)}); make it a sweep variant '
                        '(config.sweep.variants)')
    out.append((name, recipe))
  return out


def _recipe_fields(recipe_config) -> Dict[str, Any]:
  """A recipe member's fields (ensembles.RECIPE_KEYS' names) from its config."""
  fields = {}
  for key, field in ensembles.RECIPE_KEYS.items():
    node = recipe_config
    for part in key.split('.'):
      node = node.get(part) if node is not None else None
    fields[field] = node
  fields['lr_staircase'] = bool(fields['lr_staircase'])
  fields['augment'] = {field.split('.', 1)[1]: float(fields.pop(field) or 0)
                       for field in [f for f in fields if f.startswith('augment.')]}
  return fields


def _state_arguments(config, listed: Optional[List[Dict[str, Any]]]) -> Tuple[Tuple[int, ...], int, Any, bool]:
  """(input shape, seed, the members' seeds or None, whether the state keeps an average of
  the parameters): what the fresh state is made from (steps.initial_state)."""
  seeds = None if listed is None else [member['seed'] for member in listed]
  ema = bool(config.ema_decay) or any(member.get('ema_decay') for member in listed or [])
  return tuple(config.model.input_shape), config.seed, seeds, ema


def initial_state(config, model_module, optimizer_transform):
  """The fresh state (stacked over the members of an ensemble)."""
  shape, seed, seeds, ema = _state_arguments(config, members(config))
  return steps.initial_state(model_module, optimizer_transform, shape, seed, seeds, ema=ema)


@dataclasses.dataclass(frozen=True)
class Training:
  """What a run's steps are built from, read from the config once
  (capsjax.experiment.build_program takes it; the steps never see the config)."""
  num_steps: int
  objective: Objective
  schedule: Callable[[int], Any]                   # step → the learning rate (recipe members: one each)
  optimizer: optax.GradientTransformation
  member_optimizer: Optional[Callable[..., Any]]   # recipe members: each its own (optimization.member_optimizer)
  members: Optional[List[Dict[str, Any]]]          # None: a single run
  seed: int
  ema_decay: float
  batch_size: int
  eval_batch_size: int
  shift_averaging: int
  # The fresh state (steps.initial_state, each member's from its seed): the input shape, and
  # whether the state keeps an average of the parameters.
  input_shape: Tuple[int, ...]
  averaged: bool
  # config.evals, read (capsjax.evaluators.build), and what its evaluators are built for.
  evals: Dict[str, Any]
  family: str
  has_decoder: bool


def training(config, num_train_examples: int, listed: Optional[List[Dict[str, Any]]] = None) -> Training:
  """The config's training, for a split of `num_train_examples` (the length in epochs);
  `listed`: its members as `members` gives them (None: read from the config)."""
  listed = members(config) if listed is None else listed
  settings = optimization_of(config)
  recipe_members = bool(listed) and 'recipe' in listed[0]
  by_recipe = {name: optimization_of(recipe) for name, recipe in recipes(config)} if recipe_members else {}
  objective_arguments, (shape, seed, _, averaged) = _objective_arguments(config), _state_arguments(config, listed)
  family, evals = config.model.name, config.evals.to_dict()
  decoder = MODELS[family].has_decoder(config.model)
  read = dict(seed=seed, ema_decay=config.ema_decay, batch_size=config.batch_size,
              eval_batch_size=config.eval_batch_size, shift_averaging=config.eval_shift_averaging)
  # The config is read: from here on, its pieces are built.
  run_objective = bound_objective(*objective_arguments)
  num_steps = settings.length(num_train_examples)
  if settings.warmup(num_steps) >= num_steps > 0:
    raise ConfigError(f'config.warmup_steps={settings.warmup_steps}: allowed below the run\'s {num_steps} steps '
                      f'({settings.num_epochs} epochs of {num_train_examples} examples): the run would end inside '
                      'the warm-up, below the configured learning rate (config.warmup_max_fraction < 1 caps it)')
  if recipe_members:   # each member's warm-up as long as this run allows
    listed = [dict(member, warmup_steps=optimization.warmup_length(member['warmup_steps'], member['warmup_max_fraction'],
                                                                   num_steps)) for member in listed]
  transform = settings.transform(num_steps)
  per_member = settings.member_transform(num_steps) if recipe_members else None
  run_schedule = settings.schedule(num_steps)
  if per_member:   # what each recipe member trains at, as metrics.jsonl records it
    by_step = {name: recipe.schedule(num_steps) for name, recipe in by_recipe.items()}
    run_schedule = lambda step: [by_step[member['recipe']](step) for member in listed]
  return Training(num_steps=num_steps, objective=run_objective, schedule=run_schedule, optimizer=transform,
                  member_optimizer=per_member, members=listed, input_shape=shape, averaged=averaged,
                  evals=evals, family=family, has_decoder=decoder, **read)


def run(config, platform: str = '', load=None) -> Tuple[Splits, Any, Training, Tuple[str, ...]]:
  """The run's typed pieces from its config, read once: its splits (read by `load`, default
  the config's source), its model (the formulation chosen for `platform`), its training,
  and a note for each formulation the config asks for that is measured slow there."""
  listed = members(config)   # once (an ensemble's): their rules run here, not in every piece that reads them
  module = model(config, platform)
  split = splits(config, load, listed)
  run_training = training(config, split[0].num_examples, listed)
  chosen = formulation_of(module)
  notes = tuple(formulations.slow_choices(chosen, platform)) if chosen is not None else ()
  return split, module, run_training, notes


# ----------------------------------------------------------------------------- data

def data_spec(config) -> DataSpec:
  """Where the run's data comes from: the config's data keys and nothing else."""
  return DataSpec(config.dataset, config.data_dir, config.tfds_data_dir,
                  config.image_size, config.image_background)


def task_options(config, keys) -> Dict[str, Any]:
  """The values of a task's `keys` (dotted keys under their last part; sub-configs as dicts)."""
  values = {}
  for key in keys:
    node = config
    for part in key.split('.'):
      node = node[part]
    values[key.split('.')[-1]] = node.to_dict() if isinstance(node, ml_collections.ConfigDict) else node
  return values


def source_info(config) -> SourceInfo:
  """A trained run's SourceInfo from its config alone (no data read): the shape its images
  were held in, its preprocessing and class names. What `capsjax.app.predict` converts a file
  to, as training converted the run's images."""
  described = DATASETS.get(config.dataset)
  names = tuple(config.class_names) or (
      described.class_names if described else tuple(str(i) for i in range(config.model.num_classes)))
  background = config.image_background   # upgraded workdirs: white, what runs before the key used
  if described is not None:
    info = SourceInfo(config.dataset, described.image_shape, names, described.preprocessing, background)
    return with_image_size(info, config.image_size)
  return SourceInfo(config.dataset, tuple(config.model.input_shape), names, background=background)


def pipeline(config, dataset: Dataset, training: bool) -> Pipeline:
  """A classification pipeline over `dataset` with the run's batch size, seed, shifts and
  its described dataset's preprocessing (for data that comes from no source)."""
  return dataset_pipeline(dataset, training, batch_size=config.batch_size, seed=config.seed,
                          max_shift=config.max_shift,
                          preprocessing=described_preprocessing(config.dataset))


def task(config, listed: Optional[List[Dict[str, Any]]] = None) -> Task:
  """config.task's task with its options; `listed`: the run's members (`members`; None:
  read from the config), whose recipes' augmentations it runs."""
  if config.task not in TASKS:
    raise ConfigError(f'config.task={config.task!r}: allowed one of {", ".join(TASKS)}')
  cls = TASKS.get(config.task)
  options = task_options(config, cls.keys)
  listed = members(config) if listed is None and config.ensemble else listed
  if listed and 'recipe' in listed[0] and options.get('augment') is not None:
    # The parts any recipe member runs, each at the largest strength a member uses; each
    # member's own strengths are its knobs.
    strongest = {name: max(member['augment'][name] for member in listed) for name in listed[0]['augment']}
    options['augment'] = dict(options['augment'], **strongest)
  return cls(**options)


def split_validation(config, train: Dataset) -> Tuple[Dataset, Optional[Dataset]]:
  """(training examples, held-out validation examples or None): config.validation_examples
  of the training split held out (capsjax.data.tasks.hold_out)."""
  return hold_out(config.task, train, config.validation_examples)


def splits(config, load: Optional[Callable[[Any, str], Dataset]] = None,
           listed: Optional[List[Dict[str, Any]]] = None) -> Splits:
  """(train, test, validation or None) pipelines of config.task on config's source. With
  config.validation_examples, training never sees the held-out images. `load(info, split)`:
  the split's Dataset in place of the source's (capsjax.app.plan: zeros of the split's shape);
  `listed`: the run's members (`members`; None: read from the config)."""
  spec, input_shape, host_images = data_spec(config), config.model.input_shape, config.host_images
  task_name, validation_examples, num_train_examples = config.task, config.validation_examples, config.num_train_examples
  run_task = task(config, listed)
  source = open_source(spec)
  info = source.describe()
  run_task.check_input(info, input_shape)
  on_demand = images_on_demand(host_images)
  load = load or (lambda _, split: source.load(split, on_demand))
  train, test = load(info, 'train'), load(info, 'test')
  train, held_out = hold_out(task_name, train, validation_examples)
  if num_train_examples:
    after = f' (after holding out {len(held_out)} for validation)' if held_out else ''
    train = train.take(at_most('num_train_examples', num_train_examples, len(train), 'training examples' + after))
  return run_task.pipelines(info, train, test, held_out)


def pipelines(config) -> Tuple[Pipeline, Pipeline]:
  """(train, test) pipelines; see splits."""
  train, test, _ = splits(config)
  return train, test


def affine_test_pipeline(config) -> Pipeline:
  """The MNIST test digits under random affine maps (config.affnist), fixed per index."""
  source = open_source(data_spec(config))
  test = source.load('test', images_on_demand(config.host_images))
  count = config.affnist.num_examples or config.num_test_examples
  if count:   # (20 000 of MNIST's 10 000 was silently 10 000)
    key = 'affnist.num_examples' if config.affnist.num_examples else 'num_test_examples'
    test = test.take(at_most(key, count, len(test), 'test examples'))
  ranges = dict(config.affnist.ranges)
  transform = lambda image, key: affine.random_affine(image, key, ranges)[0]
  return dataset_pipeline(test, False, batch_size=config.batch_size, seed=config.seed,
                          preprocessing=source.describe().preprocessing, example_transform=transform,
                          test_seed=config.affnist.test_seed)


def resolve_data(config) -> ml_collections.ConfigDict:
  """A copy of `config` with what the data says filled in: config.class_names (when
  empty), model.num_classes (when 0) and, for 'classify', model.input_shape (when ()).
  Values the config gives must agree with the data. Reads the source's description only
  (headers, TFDS builder info), so a run fails here within seconds on the wrong data."""
  run_task = TASKS[config.task]
  info = open_source(data_spec(config)).describe()
  config = ml_collections.ConfigDict(config.to_dict())
  model = config.model
  if 'class_names' in config and not config.class_names:
    config.class_names = tuple(info.class_names)
  if 'class_names' in config and len(config.class_names) != info.num_classes:
    raise ConfigError(f'config.class_names has {len(config.class_names)} names; {info.name} has '
                      f'{info.num_classes} classes')
  if model.get('num_classes') == 0:
    model.num_classes = info.num_classes
  elif run_task.input_shape_from_data and model.get('num_classes') not in (None, info.num_classes):
    raise ConfigError(f'{info.name} has {info.num_classes} classes; the model has config.model.num_classes='
                      f'{model.num_classes} (--experiment=images takes the shape and classes from the data)')
  if 'input_shape' in model and not tuple(model.input_shape):
    if not run_task.input_shape_from_data:
      raise ConfigError(f'config.model.input_shape=(): the {run_task.name} task needs the canvas size '
                        '(height, width, channels)')
    model.input_shape = tuple(info.input_shape)
    problems = MODELS[model.name].check(model, 'model.')
    if problems:   # e.g. the data's images, too small for the CapsNet
      raise ConfigError(problems[0])
  return config


def choose_model(config, recorded=None, available: Optional[int] = None,
                 platform: str = '') -> Tuple[ml_collections.ConfigDict, Optional[str]]:
  """(a copy of `config` whose model's 'auto' keys (stem, transforms, decoder) are chosen
  for its input shape and batch size within `available` bytes (default: this machine's)
  on `platform` ('' : JAX's default backend),
  one line saying what and why, or None where nothing was open). `recorded`: the config
  dict a workdir recorded; a resumed run keeps its choices (capsjax.sizing)."""
  if not sizing.open_keys(config.model):
    return config, None
  if available is None:
    # Every process of a multi-host run must build the same model: there the choice is
    # by size alone (processes may see different free memory).
    available = memory.available_bytes() if jax.process_count() == 1 else float('inf')
  model = sizing.keep_recorded(config.model, (recorded or {}).get('model'))
  model, line = sizing.choose(model, config.batch_size, available, platform)
  config = ml_collections.ConfigDict(config.to_dict())
  config.model = model
  return config, line
