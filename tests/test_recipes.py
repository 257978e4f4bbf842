"""The authors' recipe as options (experiments/mnist_official.py), honest selection on a
held-out validation split, and mean ± std over seeds."""
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from PIL import Image

from capsjax import assemble, losses, reports, train
from capsjax.app.trained import load_trained
from capsjax.data.sources import Dataset
from capsjax.assemble import split_validation
from capsjax.errors import CapsjaxError, CheckpointError, ConfigError, RunStopped
from capsjax.app import predict as predict_main
from capsjax.app import export as export_main
from capsjax.app.explorer.backend import Explorer
from capsjax.app.predict import Predictor
from capsjax.data import load_dataset
from capsjax.app.trained import read_explorer_model
from capsjax.layers import PrimaryCaps
from capsjax.models import build_model
from capsjax.app.programs import sweep
from capsjax.app.programs.sweep import parse_variant, variant_config
from capsjax.validation import problems_of
from capsjax.experiments import mnist, mnist_official, mnist_seeds, recipes
from helpers import tiny_config

LENGTHS = jnp.array([[0.95, 0.5, 0.05, 0.3]])
TARGETS = jnp.array([[0.0, 1.0, 0.0, 0.0]])
# Per class: absent 0.5·(0.95 − 0.1)², present (0.9 − 0.5)², absent 0 (below m−), absent 0.5·(0.3 − 0.1)².
PER_CLASS = [0.5 * 0.85 ** 2, 0.4 ** 2, 0.0, 0.5 * 0.2 ** 2]


def test_margin_loss_reductions_hand_computed():
  np.testing.assert_allclose(losses.margin_loss(LENGTHS, TARGETS), [sum(PER_CLASS)], rtol=1e-6)
  official = losses.margin_loss(LENGTHS, TARGETS, reduction='official')
  np.testing.assert_allclose(official, [0.5 * sum(PER_CLASS) / 4], rtol=1e-6)   # 0.5·L_k, mean over classes
  with pytest.raises(ValueError, match='reduction'):
    losses.margin_loss(LENGTHS, TARGETS, reduction='mean')


def test_capsnet_loss_official_scaling_weighs_reconstruction_20x_more_for_10_classes():
  lengths = jnp.full((1, 10), 0.5)
  targets = jax.nn.one_hot(jnp.array([3]), 10)
  images = jnp.zeros((1, 1, 2, 2, 1))
  reconstructions = jnp.full((1, 1, 2, 2, 1), 0.5)          # squared error 4 × 0.25 = 1
  paper, parts = losses.capsnet_loss(lengths, targets, reconstructions, images, 0.0005)
  official, _ = losses.capsnet_loss(lengths, targets, reconstructions, images, 0.0005, reduction='official')
  margin = 0.4 ** 2 + 9 * 0.5 * 0.4 ** 2
  np.testing.assert_allclose(parts['reconstruction_loss'], [1.0], rtol=1e-6)
  np.testing.assert_allclose(paper, [margin + 0.0005], rtol=1e-6)
  np.testing.assert_allclose(official, [margin / 20 + 0.0005], rtol=1e-6)


def test_learning_rate_floor():
  config = mnist.get_config()
  schedule = assemble.schedule(config)
  np.testing.assert_allclose(schedule(0), 1e-3, rtol=1e-6)
  np.testing.assert_allclose(schedule(2000), 0.96e-3, rtol=1e-5)          # continuous decay
  np.testing.assert_allclose(schedule(500_000), 1e-3 * 0.96 ** 250, rtol=1e-3)   # ≈ 3.7e-8: no floor
  config.lr_min = 1e-6
  schedule = assemble.schedule(config)
  np.testing.assert_allclose(schedule(300_000), 1e-3 * 0.96 ** 150, rtol=1e-3)   # ≈ 2.2e-6, above it
  np.testing.assert_allclose(schedule(500_000), 1e-6, rtol=1e-6)


def _init(init_scheme):
  config = mnist.get_config().model
  config.conv1_channels, config.primary_types, config.routing_inputs = 32, 4, ('bias',)
  config.init_scheme = init_scheme
  model = build_model(**config)
  # Compiled: initialising the model op by op took most of this test's time.
  return jax.jit(lambda: model.init(jax.random.key(0), jnp.zeros((1, 28, 28, 1))))()['params']


def test_official_initialisation():
  params = _init('official')
  biases = {path: leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)
            if path[-1].key == 'bias'}
  assert len(biases) == 1 + 1 + 1 + 3      # conv1, primary, DigitCaps, three decoder layers
  for leaf in biases.values():
    np.testing.assert_array_equal(leaf, np.float32(0.1))
  for name, sigma in (('conv1', 0.05), ('primary_caps', 0.1), ('decoder', 0.1)):
    kernels = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params[name]) if path[-1].key == 'kernel']
    values = np.concatenate([np.ravel(k) for k in kernels])
    assert np.abs(values).max() <= 2 * sigma + 1e-7                # truncated at ±2σ
    np.testing.assert_allclose(values.std(), 0.8796 * sigma, rtol=0.05)   # std of a ±2σ-truncated normal
  weights = np.asarray(params['digit_caps']['weights'])
  np.testing.assert_allclose(weights.std(), 0.8796 * 0.1, rtol=0.02)
  default = _init('default')
  np.testing.assert_array_equal(default['conv1']['bias'], 0.0)
  np.testing.assert_allclose(np.asarray(default['digit_caps']['weights']).std(), 0.01, rtol=0.02)


@pytest.mark.float32_matmuls
def test_primary_caps_scaled_by_types_divides_the_convolution_before_the_bias():
  features = jax.random.normal(jax.random.key(1), (2, 12, 12, 5))
  scaled = PrimaryCaps(num_types=4, dim=3, kernel_size=3, stride=2, scale_by_types=True)
  plain = PrimaryCaps(num_types=4, dim=3, kernel_size=3, stride=2)
  params = jax.jit(scaled.init)(jax.random.key(0), features)['params']
  params['conv']['bias'] = jnp.linspace(-0.5, 0.5, 12)
  divided = jax.tree.map(lambda x: x, params)
  divided['conv']['kernel'] = params['conv']['kernel'] / 4
  np.testing.assert_allclose(scaled.apply({'params': params}, features),
                             plain.apply({'params': divided}, features), atol=1e-6)


def test_official_experiment_turns_every_option_on():
  config = mnist_official.get_config()
  assert problems_of(config) == []
  assert (config.loss.margin_reduction, config.model.init_scheme) == ('official', 'official')
  assert config.model.routing_inputs == ('bias',) and config.model.primary_scale_by_types
  assert config.num_steps == 300_000 and config.lr_min == 1e-6 and config.batch_size == 128
  assert tuple(config.ensemble.seeds) == (0, 1, 2)
  paper = mnist.get_config()
  assert (paper.loss.margin_reduction, paper.model.init_scheme, paper.lr_min) == ('sum', 'default', 0.0)
  assert tuple(mnist_seeds.get_config().ensemble.seeds) == (0, 1, 2)
  base = recipes.get_config()
  for spec in base.sweep.variants:
    assert problems_of(variant_config(base, parse_variant(spec)[1])) == [], spec


def test_the_lease_experiment_is_four_recipes_by_three_seeds_and_refuses_what_cannot_be_traced():
  from capsjax.experiments import mnist_four_recipes  # pylint: disable=g-import-not-at-top
  config = mnist_four_recipes.get_config()
  assert problems_of(config) == []
  members = assemble.members(config)
  assert [(m['recipe'], m['seed']) for m in members][:4] == [('paper', 0), ('paper', 1), ('paper', 2), ('fast', 0)]
  assert len(members) == 12 and config.validation_examples == 10000 and config.eval_shift_averaging == 1
  by_recipe = {m['recipe']: m for m in members}
  assert by_recipe['fast_byerly']['augment']['squish'] == 7 and by_recipe['fast']['augment']['squish'] == 0
  assert by_recipe['fast_elastic']['augment']['elastic_alpha'] == 16.0 and by_recipe['fast']['augment']['elastic_alpha'] == 0
  assert by_recipe['fast_elastic']['augment']['scale'] == pytest.approx(0.12)
  config.ensemble.recipes += ('official: loss.margin_reduction="official", lr_min=1e-6',)   # the loss per member
  by_recipe = {m['recipe']: m for m in assemble.members(config)}
  assert by_recipe['official']['margin_scale'] == pytest.approx(0.05) and by_recipe['paper']['margin_scale'] == 1.0
  assert all(m['ema_decay'] == 0.999 for m in members)   # inherited from the base config
  config.ensemble.recipes = ('paper:', 'init: model.init_scheme="official"')
  (line,) = problems_of(config)
  assert "'init': model.init_scheme cannot differ between the members of one program" in line
  assert 'sweep variant' in line and '\n' not in line


@pytest.mark.parametrize('recipe, message', [
    # A recipe's value passes the rule of its key as on the command line (None, True for a number).
    ('warmup_steps=None', "'a': warmup_steps=None: allowed an integer >= 0"),
    ('lr_schedule=None', "'a': lr_schedule=None: allowed one of exponential, cosine, linear"),
    ('model.routing_iterations=None', "'a': model.routing_iterations=None: allowed an integer in [1, 100]"),
    ('lr_staircase=None', "'a': lr_staircase=None: allowed True or False"),
    ('loss.margin_reduction=None', "'a': loss.margin_reduction=None: allowed one of sum, official"),
    ('augment.squish=None', "'a': augment.squish=None: allowed an integer in [0, 16]"),
    ('augment.erase=None', "'a': augment.erase=None"),
    ('learning_rate=True', "'a': learning_rate=True: allowed a finite number > 0"),
    ('warmup_steps="x"', "'a': warmup_steps='x': allowed an integer >= 0"),
    # A path below a value, an empty part, a key the layout moved.
    ('learning_rate.x=1', "override 'learning_rate.x': no such config key (learning_rate is a value, not a section)"),
    ('batch_size.=1', "override 'batch_size.': no such config key (a key path has no empty part)"),
    ('model.conv_impl="xla"', "override 'model.conv_impl': no such config key (it is config.model.formulation."
                              "conv_impl now)"),
])
def test_a_bad_recipe_or_sweep_value_is_one_line_naming_it(recipe, message):
  from capsjax.experiments import mnist_four_recipes, sweep_smoke  # pylint: disable=g-import-not-at-top
  config = mnist_four_recipes.get_config()
  config.ensemble.recipes = ('paper:', f'a: {recipe}')
  (line,) = problems_of(config)
  assert line.startswith("config.ensemble.recipes 'a': ") and message in line, line
  config = sweep_smoke.get_config()
  config.sweep.variants = ('paper:', f'a: {recipe}')
  (line,) = problems_of(config)
  assert line.startswith("sweep variant 'a': ") and message.split(': ', 1)[1] in line, line
  config = mnist_four_recipes.get_config()
  config.ensemble.recipes = ('paper:', 'a: learning_rate=2')   # an int for a float key: that float
  assert assemble.recipes(config)[1][1].learning_rate == 2.0 and not problems_of(config)


# ------------------------------------------------------------------------- validation split

def test_validation_split_holds_out_the_last_training_images():
  config = mnist.get_config()
  data = Dataset(np.arange(10, dtype=np.uint8).reshape(10, 1, 1, 1), np.arange(10))
  assert split_validation(config, data) == (data, None)
  config.validation_examples = 3
  train_part, held_out = split_validation(config, data)
  assert train_part.labels.tolist() == list(range(7)) and held_out.labels.tolist() == [7, 8, 9]
  config.validation_examples = 10
  with pytest.raises(ConfigError, match='fewer than the 10'):
    split_validation(config, data)
  config.validation_examples, config.task = 3, 'multimnist'   # its validation pairs: the held-out digits'
  assert split_validation(config, data)[1].labels.tolist() == [7, 8, 9]
  from capsjax.data.tasks import TASKS, Classify  # pylint: disable=g-import-not-at-top
  TASKS.register('no_validation', has_validation=False)(type('NoValidation', (Classify,), {}))
  try:   # a task of one's own without a validation split
    config.task = 'no_validation'
    with pytest.raises(ConfigError, match="a held-out validation split exists for the 'classify', 'expanded', "
                                          "'multimnist' tasks only"):
      split_validation(config, data)
  finally:
    TASKS.unregister('no_validation')


def test_selection_uses_validation_never_test():
  rows = [
      {'split': 'validation', 'step': 10, 'epoch': 1.0, 'error': 0.030},
      {'split': 'test', 'step': 10, 'epoch': 1.0, 'error': 0.010},    # the best test error: not chosen
      {'split': 'validation', 'step': 20, 'epoch': 2.0, 'error': 0.020},
      {'split': 'test', 'step': 20, 'epoch': 2.0, 'error': 0.025},
      {'split': 'validation', 'step': 30, 'epoch': 3.0, 'error': 0.020},  # a tie: the earlier wins
      {'split': 'test', 'step': 30, 'epoch': 3.0, 'error': 0.015},
      {'split': 'train', 'step': 30, 'loss': 0.1},
  ]
  assert reports.select_by_validation(rows) == {'step': 20, 'epoch': 2.0, 'validation_error': 0.020,
                                                'test_error': 0.025}
  members = [{**row, 'error': [row['error'], 0.05 - row['error']]} for row in rows if 'error' in row]
  selected = reports.select_by_validation(members)
  assert selected['step'] == [20, 10] and selected['test_error'] == [0.025, 0.05 - 0.010]
  assert reports.select_by_validation(rows[1::2]) is None   # no validation rows


def test_seed_groups_mean_and_sample_std():
  members = [dict(seed=s, routing_iterations=r, reconstruction_weight=0.0005) for r in (1, 3) for s in (0, 1, 2)]
  groups = reports.seed_groups(members, [0.003, 0.004, 0.005, 0.0025, 0.0025, 0.0025])
  assert [g['routing_iterations'] for g in groups] == [1, 3] and groups[0]['seeds'] == [0, 1, 2]
  np.testing.assert_allclose([groups[0]['mean'], groups[0]['std']], [0.004, 0.001])
  np.testing.assert_allclose([groups[1]['mean'], groups[1]['std']], [0.0025, 0.0], atol=1e-12)


def test_seeds_with_validation_train_as_one_program_and_report_mean_std(mnist_dir, tmp_path, capsys):
  # keep_checkpoints=1: the latest checkpoint, and each member's best validation step's
  # and test-time shift averaging (±1 px) reported on both splits, per member and summed.
  config = tiny_config(mnist_dir, num_steps=6, eval_every_steps=3, validation_examples=200, keep_checkpoints=1,
                       eval_shift_averaging=1)
  config.ensemble = ml_collections.ConfigDict(dict(seeds=(0, 1)))
  workdir = str(tmp_path / 'run')
  results = train.train_and_evaluate(config, workdir)
  assert len(results['test_error']) == 2 and len(results['validation_error']) == 2
  for split in ('test', 'validation'):
    assert len(results[f'{split}_shift_averaged_error']) == 2 and 0 <= results[f'{split}_shift_averaged_error'][0] <= 1
    assert 0 <= results[f'{split}_shift_averaged_ensemble_error'] <= 1
  assert results['num_validation_examples'] == 200
  selected = results['selected_by_validation']
  assert all(step in (3, 6) for step in selected['step'])
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  by_step = {(r['split'], r['step']): r for r in rows}
  for member, step in enumerate(selected['step']):
    assert selected['test_error'][member] == by_step[('test', step)]['error'][member]
    other = 3 if step == 6 else 6
    assert by_step[('validation', step)]['error'][member] <= by_step[('validation', other)]['error'][member]
  (setting,) = results['test_error_by_setting']
  np.testing.assert_allclose(setting['mean'], np.mean(results['test_error']))
  np.testing.assert_allclose(setting['std'], np.std(results['test_error'], ddof=1))
  with open(os.path.join(workdir, 'table.md')) as f:
    table = f.read()
  assert 'test error at best validation' in table and '| 0, 1 |' in table and '±' in table
  kept = sorted(int(name) for name in os.listdir(os.path.join(workdir, 'checkpoints')) if name.isdigit())
  assert kept == sorted(set(selected['step']) | {6})

  # --member=all: the members summed as the one classifier the run reported (its final
  # step is the latest checkpoint), each member alone as the run reported it.
  test = load_dataset('mnist', 'test', data_dir=mnist_dir)
  images, labels = test.images[:config.num_test_examples], test.labels[:config.num_test_examples]
  summed = Predictor.from_workdir(workdir, member='all')
  assert summed.trained.describe() == (f"{workdir} at step 6 of 6 (finished), the ensemble's 2 members (0..1, "
                                       'differing by seed alone) summed')
  error = lambda predicted: np.mean([r['class_index'] for r in predicted] != labels)
  together = summed.predict(images)
  assert error(together) == pytest.approx(results['ensemble_test_error'], abs=1e-9)
  apart = [Predictor.from_workdir(workdir, member=k).predict(images) for k in (0, 1)]
  assert [error(a) for a in apart] == pytest.approx(results['test_error'], abs=1e-9)
  for i, result in enumerate(together):   # the members' activations averaged
    np.testing.assert_allclose(list(result['activations'].values()),
                               np.mean([list(a[i]['activations'].values()) for a in apart], 0), rtol=1e-5, atol=1e-6)
    if all(a[i]['class'] == result['class'] for a in apart):   # each member decodes the same class
      np.testing.assert_allclose(result['reconstruction'], np.mean([a[i]['reconstruction'] for a in apart], 0),
                                 atol=1e-5)
  with pytest.raises(CheckpointError, match=r'^the explorer takes one model, not the 2 members of .* summed'):
    Explorer(summed.trained, images, labels)
  with pytest.raises(CapsjaxError, match=r"^member='ALL': allowed an integer >= 0 .*, 'all' "):
    Predictor.from_workdir(workdir, member='ALL')
  file = str(tmp_path / 'digit.png')
  Image.fromarray(images[0, ..., 0]).save(file)
  capsys.readouterr()
  assert predict_main.main(['--workdir', workdir, '--json', file]) == 0   # a seed ensemble's default: all
  out, err = capsys.readouterr()
  assert json.loads(out)['class'] == together[0]['class'] and 'summed' in err

  # The validation-selected model is what export writes: the best member at its best step.
  out = tmp_path / 'shipped'
  assert export_main.main(['--workdir', workdir, '--out', str(out), '--num_images', '5', '--evaluate']) == 0
  printed = capsys.readouterr().out
  member = int(np.argmin(selected['validation_error']))
  assert f'member {member} at its best validation step {selected["step"][member]}' in printed
  assert 'test error of the float16 parameters as written' in printed and 'of 100 test images' in printed
  _, _, params = load_trained(workdir, step=selected['step'][member])
  _, exported = read_explorer_model(str(out))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, np.float16(b[member]), rtol=1e-3), exported, params)


def test_sweep_ranks_by_validation_when_there_is_a_split():
  config = recipes.get_config()
  row = lambda name, validation, test: dict(name=name, overrides={}, test_error=test, test_error_std=0.001,
                                            validation_error=validation, validation_error_std=0.001, seeds=3,
                                            final_train_loss=0.01, wall_time_s=1.0, steps=10)
  table = sweep.render_table(config, [row('paper', 0.004, 0.003), row('better_on_test', 0.005, 0.002),
                                      row('better_on_validation', 0.003, 0.004)])
  assert 'Lowest validation error: `better_on_validation`' in table
  assert 'never used to choose' in table


def _optax_schedule(kind, rate, decay, every, staircase, floor, warmup, total):
  """The reference: each schedule as optax writes it (capsjax.optimization.learning_rate_at is the
  one definition both a run and a recipe member use)."""
  import optax  # pylint: disable=g-import-not-at-top
  length = max(total - warmup, 1)
  if kind == 'exponential':
    decayed = optax.exponential_decay(rate, every, decay, staircase=staircase, end_value=floor or None)
  elif kind == 'cosine':
    decayed = optax.cosine_decay_schedule(rate, length, alpha=floor / rate)
  else:
    decayed = optax.linear_schedule(rate, floor, length)
  return optax.join_schedules([optax.linear_schedule(0.0, rate, warmup), decayed], [warmup]) if warmup else decayed


def test_a_recipe_member_s_traced_schedule_equals_the_run_s_own():
  from capsjax import optimization, steps  # pylint: disable=g-import-not-at-top
  settings = [dict(kind='exponential', rate=1e-3, decay=0.96, every=20, staircase=False, floor=0.0, warmup=0),
              dict(kind='exponential', rate=2e-3, decay=0.5, every=7, staircase=True, floor=3e-4, warmup=5),
              dict(kind='cosine', rate=3e-3, decay=0.96, every=20, staircase=False, floor=1e-5, warmup=10),
              dict(kind='linear', rate=1e-3, decay=0.96, every=20, staircase=False, floor=0.0, warmup=0)]
  total, counts = 60, np.arange(0, 70)
  for s in settings:
    own = optimization.learning_rate_schedule(s['rate'], s['every'], s['decay'], s['staircase'], s['floor'], kind=s['kind'],
                                       warmup_steps=s['warmup'], total_steps=total)
    knobs = steps.member_knobs([dict(seed=0, routing_iterations=3, reconstruction_weight=0.0, recipe='r',
                                         learning_rate=s['rate'], lr_schedule=s['kind'], lr_decay_rate=s['decay'],
                                         lr_decay_steps=s['every'], lr_staircase=s['staircase'], lr_min=s['floor'],
                                         warmup_steps=s['warmup'], weight_decay=0.0, ema_decay=0.0, margin_scale=1.0,
                                         augment={'rotation': 0.0})])
    member = jax.tree.map(lambda v: v[0], knobs)
    traced = jax.vmap(lambda c: optimization.member_learning_rate(c, member, total))(counts)
    reference = _optax_schedule(s['kind'], s['rate'], s['decay'], s['every'], s['staircase'], s['floor'],
                                s['warmup'], total)
    expected = [float(reference(c)) for c in counts]
    np.testing.assert_allclose(traced, expected, rtol=1e-5, atol=1e-12, err_msg=str(s))   # float32 rounding
    np.testing.assert_allclose([own(c) for c in counts], expected, rtol=1e-5, atol=1e-12, err_msg=str(s))


@pytest.mark.float32_matmuls
def test_recipes_as_one_program_equal_each_recipe_alone_and_resume_bit_for_bit(mnist_dir, tmp_path):
  # Two recipes × one seed in one vmapped program against each recipe trained alone with
  # the same seed: the schedule, warm-up, margin reduction, EMA and augmentation traced per
  # member. Stated tolerance: parameters within 2e-5 absolute after 4 steps (measured 2.5e-6:
  # vmapped and plain programs round differently; the two recipes alone differ by 9e-3).
  base = tiny_config(mnist_dir, num_steps=4, checkpoint_every_steps=100)
  base.model.formulation.dtype = 'float32'   # on any backend (a GPU's 'auto' is bfloat16): float32's tolerance
  base.ensemble = ml_collections.ConfigDict(dict(seeds=(0,), recipes=(
      'paper:',
      'fast: learning_rate=3e-3, lr_schedule="cosine", lr_min=1e-5, warmup_steps=2, augment.rotation=10.0, '
      'loss.margin_reduction="official", ema_decay=0.5')))
  assert problems_of(base) == []
  joint = train.train_and_evaluate(base, str(tmp_path / 'joint'))
  assert [g['recipe'] for g in joint['test_error_by_setting']] == ['paper', 'fast']
  assert len(joint['recipe_ensemble_test_error']) == 2   # each recipe's seeds as one classifier (here one seed)
  np.testing.assert_allclose(joint['recipe_ensemble_test_error'], joint['test_error'])
  np.testing.assert_allclose(joint['best_test_evaluation_error'], joint['test_error'])   # one evaluation
  table = (tmp_path / 'joint' / 'table.md').read_text()
  assert '| fast | 0 |' in table and 'seed ensemble test error' in table and 'never used to choose' in table
  _, _, joint_params = load_trained(str(tmp_path / 'joint'))
  joint_rates = _logged_learning_rates(tmp_path / 'joint')   # one per member: each its own schedule's
  assert joint_rates and all(len(rates) == 2 for rates in joint_rates.values())
  for member, (name, recipe) in enumerate(assemble.recipes(base)):
    recipe.ensemble = None
    train.train_and_evaluate(recipe, str(tmp_path / name))
    _, _, alone = load_trained(str(tmp_path / name))
    jax.tree.map(lambda j, a: np.testing.assert_allclose(j[member], a, atol=2e-5, err_msg=name), joint_params, alone)
    assert {step: rates[member] for step, rates in joint_rates.items()} == _logged_learning_rates(tmp_path / name)
  # Stopped at step 2 and resumed: the same parameters, bit for bit.
  resumed = str(tmp_path / 'resumed')
  with pytest.raises(RunStopped, match='stopped at step 2 of 4'):
    train.train_and_evaluate(base, resumed, stop_at_step=2)
  train.train_and_evaluate(base, resumed)
  _, _, resumed_params = load_trained(resumed)
  jax.tree.map(np.testing.assert_array_equal, resumed_params, joint_params)


def _logged_learning_rates(workdir):
  rows = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  return {row['step']: row['learning_rate'] for row in rows if row.get('split') == 'train' and 'learning_rate' in row}


def test_a_fast_recipe_runs_briefly_as_written_its_warm_up_capped_at_a_quarter_of_the_run():
  from capsjax import optimization  # pylint: disable=g-import-not-at-top
  from capsjax.experiments import images_fast, mnist_fast, mnist_four_recipes  # pylint: disable=g-import-not-at-top
  assert [optimization.warmup_length(100, 0.25, n) for n in (80, 400, 1000, 0)] == [20, 100, 100, 100]
  assert optimization.warmup_length(100, 1.0, 80) == 100
  for experiment in (mnist_fast, images_fast, mnist_four_recipes):
    config = experiment.get_config()
    config.num_steps = 80
    assert problems_of(config) == [], experiment.__name__
  config = mnist_four_recipes.get_config()
  config.num_steps = 80
  members = assemble.training(config, 50000).members   # each member's warm-up as this run allows
  assert {m['recipe']: m['warmup_steps'] for m in members} == {'paper': 0, 'fast': 20, 'fast_byerly': 20,
                                                                'fast_elastic': 20}
  config = mnist.get_config()   # an explicit warm-up without the cap: as long as the run, refused
  config.num_steps, config.warmup_steps = 80, 100
  assert problems_of(config)[0].startswith('config.warmup_steps=100: allowed below num_steps=80 (the run would end')
  rates = optimization.learning_rate_schedule(3e-3, 2000, 0.96, kind='cosine', total_steps=80,
                                       warmup_steps=optimization.warmup_length(100, 0.25, 80))
  assert float(rates(10)) == pytest.approx(1.5e-3) and float(rates(20)) == pytest.approx(3e-3)


def test_schedules_hand_computed_at_chosen_steps():
  config = mnist.get_config()
  config.learning_rate, config.lr_min, config.warmup_steps = 1e-3, 1e-5, 100
  expected = {   # step → (cosine, linear): warm-up to step 100, then 900 steps of decay to lr_min
      0: (0.0, 0.0), 50: (5e-4, 5e-4), 100: (1e-3, 1e-3),
      325: (1e-5 + 9.9e-4 * 0.5 * (1 + np.cos(np.pi / 4)), 1e-3 - 9.9e-4 * 0.25),
      550: (5.05e-4, 5.05e-4), 1000: (1e-5, 1e-5), 5000: (1e-5, 1e-5)}
  for index, kind in enumerate(('cosine', 'linear')):
    config.lr_schedule = kind
    schedule = assemble.schedule(config, num_steps=1000)
    for step, values in expected.items():
      np.testing.assert_allclose(schedule(step), values[index], rtol=1e-5, atol=1e-12, err_msg=f'{kind} {step}')
  config.lr_schedule, config.lr_min = 'exponential', 0.0   # the paper's decay, after the warm-up
  np.testing.assert_allclose(assemble.schedule(config)(100 + 2000), 0.96e-3, rtol=1e-5)


def test_optimizers_weight_decay_and_clipping_against_hand_updates():
  params = {'w': jnp.array([2.0, -4.0])}
  zero = {'w': jnp.zeros(2)}
  config = mnist.get_config()
  config.learning_rate, config.lr_decay_rate = 0.1, 1.0
  for name in ('adamw', 'lion'):   # with no gradient, only the decoupled decay moves: p − lr·wd·p
    config.optimizer, config.weight_decay = name, 0.5
    optimizer = assemble.optimizer(config)
    updates, _ = optimizer.update(zero, optimizer.init(params), params)
    np.testing.assert_allclose(updates['w'], -0.1 * 0.5 * params['w'], rtol=1e-6, err_msg=name)
  # Clipping to a global norm of 1 scales a gradient of norm 10 by 1/10 before Adam.
  config.optimizer, config.weight_decay, config.grad_clip_norm = 'adam', 0.0, 1.0
  clipped = assemble.optimizer(config)
  config.grad_clip_norm = 0.0
  plain = assemble.optimizer(config)
  grads = {'w': jnp.array([6.0, 8.0])}
  got, _ = clipped.update(grads, clipped.init(params), params)
  want, _ = plain.update({'w': grads['w'] / 10}, plain.init(params), params)
  np.testing.assert_allclose(got['w'], want['w'], rtol=1e-6)
  config.weight_decay = 0.1   # Adam has no decoupled decay: refused rather than ignored
  assert problems_of(config) == ['config.weight_decay=0.1: Adam has no decoupled weight decay; use '
                                 '--config.optimizer=adamw (or lion)']
  config.weight_decay, config.lr_schedule, config.lr_min = 0.0, 'cosine', 0.5
  assert problems_of(config)[0].startswith('config.lr_min=0.5: allowed below learning_rate=0.1')
  config.lr_schedule = 'exponential'   # optax's floor would raise the rate to lr_min from step 0
  assert problems_of(config)[0].startswith('config.lr_min=0.5: allowed below learning_rate=0.1 (the exponential')
  config.lr_min, config.warmup_steps, config.num_steps = 0.0, 10, 10
  assert problems_of(config)[0].startswith('config.warmup_steps=10: allowed below num_steps=10')


def test_a_run_with_the_recipe_options_resumes_bit_identical(mnist_dir, tmp_path):
  options = dict(lr_schedule='cosine', warmup_steps=3, lr_min=1e-5, optimizer='adamw', weight_decay=1e-4,
                 grad_clip_norm=1.0, ema_decay=0.9, num_steps=6, num_test_examples=50, eval_batch_size=50)
  whole, parts = str(tmp_path / 'whole'), str(tmp_path / 'parts')
  config = tiny_config(mnist_dir, **options)
  config.augment.update(rotation=10.0, scale=0.1, shear=0.1, elastic_alpha=8.0)
  result = train.train_and_evaluate(config, whole)
  assert 0.0 <= result['ema_test_error'] <= 1.0   # the moving average, evaluated beside the parameters
  with pytest.raises(train.RunStopped):
    train.train_and_evaluate(config, parts, stop_at_step=3)
  train.train_and_evaluate(config, parts)
  restored = [load_trained(workdir)[2] for workdir in (whole, parts)]
  for a, b in zip(jax.tree.leaves(restored[0]), jax.tree.leaves(restored[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  rows = [json.loads(line) for line in open(os.path.join(parts, 'metrics.jsonl')) if '"train"' in line]
  rates = {row['step']: row['learning_rate'] for row in rows}
  np.testing.assert_allclose(rates[2], 1e-3 * 2 / 3, rtol=1e-5)   # warming up


def test_the_moving_average_is_the_hand_update_of_the_parameters(mnist_dir):
  from capsjax import experiment, sharding, steps  # pylint: disable=g-import-not-at-top
  config = tiny_config(mnist_dir, ema_decay=0.75)
  program = experiment.start(config, sharding.data_mesh(), resolved=True).steps
  before = jax.tree.map(np.asarray, program.initial_state)
  np.testing.assert_array_equal(*(np.concatenate([x.ravel() for x in jax.tree.leaves(before[k])])
                                  for k in ('params', 'ema_params')))   # it starts at the parameters
  after, _ = program.train_step(program.initial_state, 0)
  want = jax.tree.map(lambda a, p: 0.75 * a + 0.25 * np.asarray(p), before['ema_params'], after['params'])
  for got, expected in zip(jax.tree.leaves(after['ema_params']), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-7)
  assert steps.ema_update({'w': 2.0}, {'w': 4.0}, 0.9) == {'w': 2.0 * 0.9 + 4.0 * 0.1}


def _dot(side=29, row=14, col=20):
  image = np.zeros((side, side, 1), np.float32)
  image[row, col] = 1.0
  return jnp.asarray(image)


def test_affine_augmentation_moves_a_drawn_pixel_where_the_geometry_says():
  from capsjax.data import augment  # pylint: disable=g-import-not-at-top
  brightest = lambda image: np.unravel_index(np.argmax(np.asarray(image)[..., 0]), image.shape[:2])
  # 29×29, centre (14, 14); the pixel 6 to the right of it.
  assert brightest(augment.affine_warp(_dot(), 90.0, 1.0, 0.0)) == (20, 14)   # a quarter turn: 6 below
  assert brightest(augment.affine_warp(_dot(), 0.0, 2.0, 0.0)) == (14, 26)    # twice as far
  sheared = augment.affine_warp(_dot(row=20, col=14), 0.0, 1.0, 0.5)          # x += 0.5·y: 6 below → 3 right
  assert brightest(sheared) == (20, 17)
  images = jnp.stack([_dot(), _dot(row=3, col=9)])
  same = augment.random_affine(images, jax.random.key(0), 0.0, 0.0, 0.0)      # all ranges 0: unchanged
  np.testing.assert_allclose(np.asarray(same), np.asarray(images), atol=1e-6)
  turned = augment.random_affine(images, jax.random.key(0), 30.0, 0.0, 0.0)   # at most 30°: 6 px moves ≤ 3.1 px
  row, col = brightest(turned[0])
  assert np.hypot(row - 14, col - 20) <= 3.2 and (row, col) != (14, 20)


def test_elastic_distortion_displaces_smoothly_and_keeps_the_ink():
  from capsjax.data import augment  # pylint: disable=g-import-not-at-top
  smoothing = augment.gaussian_smoothing_matrix(28, 4.0)
  np.testing.assert_allclose(smoothing[14].sum(), 1.0, rtol=1e-5)             # away from the edges: weights sum to 1
  np.testing.assert_allclose(smoothing[14, 14 + 4] / smoothing[14, 14], np.exp(-0.5), rtol=1e-5)   # σ = 4
  digit = np.zeros((1, 28, 28, 1), np.float32)
  digit[0, 8:20, 12:16] = 1.0                                                  # a bar well inside
  still = augment.elastic_distortion(jnp.asarray(digit), jax.random.key(1), 0.0, 4.0)
  np.testing.assert_allclose(np.asarray(still), digit, atol=1e-6)             # α = 0: no displacement
  # The field: uniform noise (std 1/√3) smoothed by a unit-sum Gaussian keeps a std of
  # 1/√3 · 1/(2σ√π) per axis (away from the edges), times α: 1.38 px for Simard's 34 and 4.
  fields = np.asarray(augment.displacement_fields(jax.random.key(2), (16, 64, 64), 34.0, 4.0))[:, :, 16:48, 16:48]
  expected = 34.0 / np.sqrt(3) / (2 * 4.0 * np.sqrt(np.pi))
  assert 0.75 * expected <= fields.std() <= 1.25 * expected, (fields.std(), expected)
  neighbours = np.corrcoef(fields[..., :-1].ravel(), fields[..., 1:].ravel())[0, 1]
  assert neighbours > 0.9   # smooth: a pixel moves with its neighbours
  # Its noise is drawn as a vector (compiled faster): the numbers of the [batch, 2, h, w] draw.
  noise = jax.random.uniform(jax.random.key(3), (2, 2, 6, 5), minval=-1.0, maxval=1.0)
  by_hand = 3.0 * jnp.einsum('hi,bdij,wj->bdhw', augment.gaussian_smoothing_matrix(6, 1.0), noise,
                             augment.gaussian_smoothing_matrix(5, 1.0))
  assert np.array_equal(np.asarray(augment.displacement_fields(jax.random.key(3), (2, 6, 5), 3.0, 1.0)), np.asarray(by_hand))
  moved = np.asarray(augment.elastic_distortion(jnp.asarray(digit), jax.random.key(1), 34.0, 4.0))[0, ..., 0]
  rows, cols = np.nonzero(digit[0, ..., 0])
  centre = np.array([np.average(np.arange(28), weights=moved.sum(1)), np.average(np.arange(28), weights=moved.sum(0))])
  assert not np.allclose(moved, digit[0, ..., 0]) and np.hypot(*(centre - [rows.mean(), cols.mean()])) < 3.0


def _orientation_from_vertical(image) -> float:
  """Degrees between the ink's principal axis (intensity-weighted moments) and the vertical."""
  ink = np.asarray(image)[..., 0]
  rows, cols = np.indices(ink.shape)
  weights = ink / ink.sum()
  r, c = (weights * rows).sum(), (weights * cols).sum()
  crr, ccc, crc = (weights * (rows - r) ** 2).sum(), (weights * (cols - c) ** 2).sum(), (weights * (rows - r) * (cols - c)).sum()
  return np.degrees(0.5 * np.arctan2(2 * crc, crr - ccc))   # 0 for a vertical bar


def test_byerly_augmentation_on_drawn_images():
  from capsjax.data import augment  # pylint: disable=g-import-not-at-top
  bars = np.zeros((64, 28, 28, 1), np.float32)
  bars[:, 6:22, 12:16] = 1.0                          # a vertical bar; margins 6 above and below, 12 beside
  # As their code draws it (BMCNNwHFCs, python/input/): rotation from a normal of 10°,
  # clipped at ±30°, on a random half of the images.
  # Each function jitted (op by op, every operation compiled on its own took seconds).
  jitted = lambda f: jax.jit(f, static_argnums=2)
  turned = np.asarray(jitted(augment.random_normal_rotation)(jnp.asarray(bars), jax.random.key(0), 10.0))
  unchanged = np.all(np.abs(turned - bars) < 1e-6, axis=(1, 2, 3))
  assert 16 <= unchanged.sum() <= 48, unchanged.sum()
  angles = np.array([_orientation_from_vertical(image) for image in turned[~unchanged]])
  assert np.all(np.abs(angles) <= 31.0) and np.abs(angles).max() > 2.0, angles
  # A shift by a half-normal share (× 1/2 here) of the free margin: whole pixels, the ink inside.
  shifted = np.asarray(jitted(augment.random_margin_shift)(jnp.asarray(bars), jax.random.key(1), 0.5))
  np.testing.assert_allclose(shifted.sum(axis=(1, 2, 3)), bars[0].sum())   # nothing cut off, nothing blurred
  tops = np.array([np.nonzero(image[..., 0].any(axis=1))[0][0] for image in shifted])
  lefts = np.array([np.nonzero(image[..., 0].any(axis=0))[0][0] for image in shifted])
  assert tops.min() >= 3 and tops.max() <= 9 and lefts.min() >= 6 and lefts.max() <= 18   # ±½ of 6 and of 12
  assert len(set(tops)) > 2 and len(set(lefts)) > 2
  margins = np.asarray(jax.jit(augment.ink_margins)(jnp.asarray(bars[0])))
  assert margins.tolist() == [6, 6, 12, 12]
  # A horizontal squish by 1 … 8 px, fewer more often (their half-normal share: a mean of
  # about 3 px here, 4.5 if uniform): a wide bar's ink shrinks by (28 − k) / 28, its rows stay.
  wide = np.zeros((64, 28, 28, 1), np.float32)
  wide[:, 10:18, 2:26] = 1.0
  squished = np.asarray(jitted(augment.random_squish)(jnp.asarray(wide), jax.random.key(2), 8))
  pixels = 28 * (1 - squished.sum(axis=(1, 2, 3)) / wide[0].sum())
  assert pixels.min() >= 0.5 and pixels.max() <= 8.5 and np.ptp(pixels) > 3, pixels
  assert 2.0 < pixels.mean() < 4.0, pixels.mean()
  np.testing.assert_array_equal(squished[..., 0].any(axis=2), wide[..., 0].any(axis=2))   # the same rows
  # One random 4×4 square erased, its corner 4 … 22 px from the top left as theirs.
  erased = np.asarray(jitted(augment.random_erase)(jnp.ones((64, 28, 28, 1)), jax.random.key(3), 4))
  corners = []
  for image in erased[..., 0]:
    rows, cols = np.nonzero(image == 0)
    assert len(rows) == 16 and np.ptp(rows) == 3 and np.ptp(cols) == 3
    corners += [rows.min(), cols.min()]
  assert min(corners) == 4 and max(corners) == 22, (min(corners), max(corners))
  # Through the config's keys (all four at once), as a training batch takes them.
  options = dict(augment.AUGMENT, rotation_std=10.0, margin_shift=0.5, squish=7, erase=4)
  out = jax.jit(lambda x, k: augment.augment(x, k, options))(jnp.asarray(bars), jax.random.key(4))
  assert out.shape == bars.shape and bool(jnp.all(jnp.isfinite(out)))
  assert not np.allclose(np.asarray(out), bars)
