"""validate(config): every bad value is one line naming the key, the value and what is
allowed, before any data is read; through run.py it is `error: ...` and exit 2."""
import importlib
import os
import pathlib
import pkgutil
import re
import subprocess
import sys
import time
import warnings

import pytest

import command_checks
import capsjax.experiments as experiments
from capsjax.errors import ConfigError
from capsjax.app.launch import config_lines
from capsjax.validation import key_help, problems_of, validate
from capsjax.experiments import ablation, mnist, multimnist_baseline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize('name', sorted(m.name for m in pkgutil.iter_modules(experiments.__path__)))
def test_every_experiment_default_is_valid_and_every_key_is_described(name):
  config = importlib.import_module(f'capsjax.experiments.{name}').get_config()
  assert problems_of(config) == []
  for line in config_lines(config):   # what --help prints: a meaning and the allowed values
    key = line.split(' = ')[0]
    assert re.fullmatch(r'.+ \[.+\]', key_help(key, config)), key


def test_experiment_help_explains_each_key():
  result = subprocess.run([sys.executable, os.path.join(ROOT, 'run.py'), '--experiment=mnist', '--help'],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0
  assert ("  model.formulation.routing_loop = 'auto'  — the routing loop rolled, unrolled, or unrolled where nothing "
          'differentiates it (evaluation, predict) and rolled in training (same values; auto: faster on the backend; '
          'models with routing) [one of auto, rolled, unrolled, unrolled_inference]') in result.stdout.splitlines()


def _set(config, key, value):
  *parents, leaf = key.split('.')
  node = config
  for parent in parents:
    node = node[parent]
  node[leaf] = value


BAD_VALUES = [
    ('batch_size', 0, 'config.batch_size=0: allowed an integer >= 1'),
    ('batch_size', -4, 'config.batch_size=-4'),
    ('eval_batch_size', 0, 'config.eval_batch_size=0'),
    ('eval_batch_size', 10 ** 9, 'config.eval_batch_size=1000000000: allowed an integer in [1, 65536]'),
    ('log_every_steps', 0, 'config.log_every_steps=0: allowed an integer >= 1'),
    ('checkpoint_every_steps', 0, 'config.checkpoint_every_steps=0'),
    ('checkpoint_every_secs', -1.0, 'config.checkpoint_every_secs=-1.0'),
    ('seed', -1, 'config.seed=-1: allowed an integer in [0, 2147483647]'),
    ('seed', 2 ** 31, 'config.seed=2147483648: allowed an integer in [0, 2147483647]'),
    ('max_shift', -1, 'config.max_shift=-1: allowed an integer in [0, 7]'),
    ('max_shift', 100, 'config.max_shift=100: allowed an integer in [0, 7]'),
    ('learning_rate', -1.0, 'config.learning_rate=-1.0: allowed a finite number > 0'),
    ('learning_rate', float('nan'), 'config.learning_rate=nan'),
    ('lr_decay_rate', 0.0, 'config.lr_decay_rate=0.0'),
    ('lr_decay_steps', 0, 'config.lr_decay_steps=0'),
    ('num_steps', -5, 'config.num_steps=-5: allowed an integer >= 0'),
    ('num_epochs', 0.0, 'config.num_epochs=0.0: allowed a number > 0 (or give config.num_steps > 0)'),
    ('num_epochs', -1.0, 'config.num_epochs=-1.0'),
    ('num_test_examples', -1, 'config.num_test_examples=-1: allowed an integer >= 0'),
    ('num_train_examples', 100, 'config.batch_size=128: allowed at most num_train_examples=100'),
    ('keep_checkpoints', 0, 'config.keep_checkpoints=0: allowed an integer >= 1'),
    ('eval_every_steps', -1, 'config.eval_every_steps=-1: allowed an integer >= 0'),
    ('stop_at_step', -2, 'config.stop_at_step=-2'),
    ('task', 'bogus', "config.task='bogus': allowed one of classify, expanded, multimnist"),
    ('model.routing_iterations', 0, 'config.model.routing_iterations=0: allowed an integer in [1, 100]'),
    ('model.routing_iterations', 10 ** 6, 'config.model.routing_iterations=1000000: allowed an integer in [1, 100]'),
    ('evals.routing_probe.iterations', 101, 'config.evals.routing_probe.iterations=101: allowed an integer in [1, 100]'),
    ('model.formulation.routing_loop', 'sideways', "config.model.formulation.routing_loop='sideways': allowed one of auto, rolled, unrolled, unrolled_inference"),
    ('model.formulation.dtype', 'float99', "config.model.formulation.dtype='float99': allowed one of auto, float32, bfloat16, float16"),
    ('model.formulation.conv_impl', 'bogus', "config.model.formulation.conv_impl='bogus': allowed one of auto, xla, patches"),
    ('model.digit_dim', 0, 'config.model.digit_dim=0'),
    ('model.num_classes', 1, 'config.model.num_classes=1'),
    ('model.conv1_kernel', 27, 'config.model.input_shape=(28, 28, 1): images of 28×28 are too small'),
    ('loss.name', 'bogus', "config.loss.name='bogus': allowed one of capsnet, sigmoid_xent, softmax_xent"),
    ('loss.name', 'softmax_xent', "config.loss.name='softmax_xent': a 'capsnet' model is trained with the 'capsnet' loss"),
    ('loss.m_minus', 0.95, 'config.loss.m_minus=0.95: allowed a value below m_plus=0.9'),
    ('loss.reconstruction_weight', -0.1, 'config.loss.reconstruction_weight=-0.1'),
]


@pytest.mark.parametrize('key,value,message', BAD_VALUES, ids=[f'{k}={v}' for k, v, _ in BAD_VALUES])
def test_bad_values_are_named(key, value, message):
  config = mnist.get_config()
  _set(config, key, value)
  with pytest.raises(ConfigError) as raised:
    validate(config)
  assert message in str(raised.value)
  assert '\n' not in str(raised.value)


@pytest.mark.parametrize('seeds, message', [
    ((0, 2 ** 31), 'config.ensemble.seeds=(0, 2147483648): allowed a tuple of distinct integers in [0, 2147483647]'),
    ((3, 1, 3), 'config.ensemble.seeds=(3, 1, 3): allowed a tuple of distinct'),   # two identical members
    ((-1,), 'config.ensemble.seeds=(-1,)'),
])
def test_ensemble_seeds_are_distinct_and_in_range(seeds, message):
  from capsjax.experiments import mnist_seeds  # pylint: disable=g-import-not-at-top
  config = mnist_seeds.get_config()
  config.ensemble.seeds = seeds
  assert problems_of(config) == [message] if message.endswith(']') else problems_of(config)[0].startswith(message)
  config.ensemble.seeds = (0, 2 ** 31 - 1)
  assert problems_of(config) == []


def test_comparison_models_and_ensembles_are_checked():
  config = ablation.get_config()
  config.baseline.model.dropout_rate = 1.0
  assert problems_of(config) == ['config.baseline.model.dropout_rate=1.0: allowed a finite number in [0, 1)']
  config = ablation.get_config()
  config.ensemble.routing_iterations = (1, 5)
  assert 'allowed at most model.routing_iterations=3' in problems_of(config)[0]
  config = multimnist_baseline.get_config()
  config.model.conv_kernels = (9,)
  assert 'one kernel per entry of conv_channels' in problems_of(config)[0]
  config.loss.name = 'capsnet'
  config.model.conv_kernels = (9, 5)
  assert "a 'cnn' model is trained with the 'softmax_xent' or 'sigmoid_xent' loss" in problems_of(config)[0]


BAD_VALUES = [
    ('--config.batch_size=0', 'config.batch_size=0: allowed an integer >= 1'),
    ('--config.learning_rate=-1', 'config.learning_rate=-1.0'),
    ('--config.model.formulation.dtype=float99', "config.model.formulation.dtype='float99'"),
    ('--config.loss.name=bogus', "config.loss.name='bogus'"),
    ('--config.num_epochs=0', 'config.num_epochs=0.0'),
]


def _bad_value_command(override, folder):
  # No data folder exists at all: the error must come from validation, not from data.
  return ['--experiment=mnist', f'--workdir={folder}/w', f'--config.data_dir={folder}/no_data', override]


@pytest.fixture(scope='module')
def bad_value_results(tmp_path_factory):
  """Each command through capsjax's own front end, all in one process (tests/command_checks.py):
  the folder they were given, {override: result} ('--summary': a summary's validation)."""
  folder = tmp_path_factory.mktemp('bad_values')
  commands = {override: _bad_value_command(override, folder) for override, _ in BAD_VALUES}
  commands['--summary'] = ['--experiment=mnist', '--summary', '--config.model.digit_dim=0']
  results = command_checks.run([['capsjax', args] for args in commands.values()], cwd=folder, timeout=120)
  return folder, dict(zip(commands, results))


@pytest.mark.parametrize('override,message', BAD_VALUES)
def test_cli_rejects_bad_values_before_reading_data(override, message, bad_value_results):
  folder, results = bad_value_results
  result = results[override]
  assert result['status'] == 2, result
  assert result['stderr'].strip().splitlines() == [f'error: {result["stderr"].strip()[7:]}']
  assert message in result['stderr']
  assert not (folder / 'w').exists()


def test_a_bad_value_ends_the_command_before_reading_data(tmp_path):
  override, message = BAD_VALUES[0]
  started = time.time()
  result = subprocess.run([sys.executable, os.path.join(ROOT, 'run.py'), *_bad_value_command(override, tmp_path)],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 2
  assert result.stderr.strip() == f'error: {message}'
  assert time.time() - started < 60
  assert not (tmp_path / 'w').exists()


def test_summary_validates_too(bad_value_results):
  _, results = bad_value_results
  result = results['--summary']
  assert result['status'] == 2
  assert result['stderr'].strip() == 'error: config.model.digit_dim=0: allowed an integer >= 1'


@pytest.mark.parametrize('overrides,message', [
    (dict(distributed=True, coordinator_address='127.0.0.1'),
     "config.coordinator_address='127.0.0.1': allowed HOST:PORT, or empty (detected)"),
    (dict(num_processes=2), 'config.num_processes=2: used only with --config.distributed=True'),
    (dict(distributed=True, num_processes=2, process_id=5),
     'config.process_id=5: allowed below num_processes=2 (processes are numbered from 0)'),
])
def test_multi_host_mistakes_are_named_before_jax_starts(overrides, message):
  config = mnist.get_config()
  config.update(overrides)
  assert message in problems_of(config)[0]


def test_a_backend_jax_cannot_start_is_one_line(monkeypatch):
  import jax  # pylint: disable=g-import-not-at-top
  from capsjax.app import distributed  # pylint: disable=g-import-not-at-top

  def no_backend():
    raise AssertionError()   # what jax.devices() raises for JAX_PLATFORMS=cuda without a GPU
  monkeypatch.setattr(jax, 'devices', no_backend)
  monkeypatch.setenv('JAX_PLATFORMS', 'cuda')
  with pytest.raises(ConfigError, match="JAX cannot start the backend JAX_PLATFORMS='cuda' asks for"):
    distributed.check_backend()


def test_a_comma_separated_list_of_routings_on_the_command_line_is_the_tuple_of_them():
  from capsjax.experiments import routing_zoo  # pylint: disable=g-import-not-at-top
  from capsjax.validation import problems_of, split_name_lists  # pylint: disable=g-import-not-at-top
  config = routing_zoo.get_config()
  config.routing_zoo.routings = ('dynamic, self_routing',)   # what the flag parser makes of it
  split_name_lists(config)
  assert config.routing_zoo.routings == ('dynamic', 'self_routing') and not problems_of(config)
  config.routing_zoo.routings = ('dynamic,bogus',)
  split_name_lists(config)
  assert any("routing_zoo.routings=('dynamic', 'bogus')" in p for p in problems_of(config))
  config = mnist.get_config()   # a model key alike: the layer inputs a routing gets
  config.model.routing_inputs = ('bias,leaky',)
  split_name_lists(config)
  assert tuple(config.model.routing_inputs) == ('bias', 'leaky') and not problems_of(config)


def test_a_formulation_that_cannot_take_the_inputs_is_refused_before_the_model_is_built():
  config = mnist.get_config()
  config.model.formulation.conv_impl, config.model.formulation.conv_inputs = 'fourier', 'bfloat16'
  assert problems_of(config) == ["config.model.formulation.conv_inputs='bfloat16': conv_impl='fourier' computes in float32 "
                                 "(its transforms would lose digits); conv_inputs='bfloat16' needs 'patches', "
                                 "'kernel_rows' or 'xla'"]
  config.model.formulation.conv_impl = 'auto'   # auto picks fourier only for float32 inputs
  assert not problems_of(config)


@pytest.mark.parametrize('routings, options, message', [
    (('dynamic', 'em', 'dynamic'), {}, "config.routing_zoo.routings=('dynamic', 'em', 'dynamic'): allowed a tuple "
                                       "of distinct routing names"),
    (('dynamic', 'em'), {'bogus': {}}, "config.routing_zoo.options.bogus: 'bogus' is not among routing_zoo.routings"),
    (('dynamic', 'em'), {'uniform': {}}, "config.routing_zoo.options.uniform: 'uniform' is not among"),
    (('dynamic', 'em'), {'dynamic': {'nope': 1}}, "config.routing_zoo.options.dynamic.nope=1: routing 'dynamic' "
                                                  "has no options"),
    (('dynamic', 'em'), {'em': {'inverse_temperature': 0}},
     'config.routing_zoo.options.em.inverse_temperature=0: allowed a finite number > 0'),
    (('dynamic', 'em'), {'em': {'temperature': 2.0}}, "config.routing_zoo.options.em.temperature=2.0: routing "
                                                      "'em' has the options inverse_temperature, variance_epsilon"),
])
def test_the_routing_zoo_names_each_routing_once_and_only_options_it_takes(routings, options, message):
  from capsjax.experiments import routing_zoo  # pylint: disable=g-import-not-at-top
  config = routing_zoo.get_config()
  config.routing_zoo.routings = routings
  config.routing_zoo.options = options
  problems = problems_of(config)
  assert problems and problems[0].startswith(message), problems
  config.routing_zoo.routings, config.routing_zoo.options = ('dynamic', 'em'), {'em': {'inverse_temperature': 2.0}}
  assert not problems_of(config)
  # The option in model.routing_options of a routing the zoo trains beside model.routing:
  # its members' own section, checked by its rules (outside the zoo: another routing's).
  config.routing_zoo.options = {}
  config.model.routing_options.em.inverse_temperature = 2.0
  assert not problems_of(config)
  config.model.routing_options.em.inverse_temperature = 0.0
  assert problems_of(config) == ['config.model.routing_options.em.inverse_temperature=0.0: allowed a finite number > 0']
  config.model.routing_options.em.inverse_temperature = 2.0
  config.routing_zoo.routings = ('dynamic', 'uniform')
  assert problems_of(config)[0].startswith("config.model.routing_options.em.inverse_temperature=2.0: an option of "
                                           "routing 'em', but routing='dynamic'")


def test_the_library_refuses_what_the_command_refuses_before_touching_the_workdir(tmp_path):
  """From Python (the documented entry, a notebook's), each bad value raises the exported
  ConfigError whose message is the command's line, within seconds, and the workdir is
  never made; the builders check the model section the same way."""
  import capsjax  # pylint: disable=g-import-not-at-top
  from capsjax.experiments import mnist_smoke  # pylint: disable=g-import-not-at-top
  cases = {'batch_size': (0, 'config.batch_size=0: allowed an integer >= 1'),
           'learning_rate': (-1.0, 'config.learning_rate=-1.0: allowed a finite number > 0'),
           'model.routing': ('dynamical', "config.model.routing='dynamical': allowed one of dynamic, "),
           'model.routing_iterations': (0, 'config.model.routing_iterations=0: allowed an integer in [1, 100]'),
           'eval_batch_size': (-5, 'config.eval_batch_size=-5: allowed an integer in [1, 65536]'),
           # A key set from Python that the run never reads (a ConfigDict takes any new key):
           # the command's line for the override (tests/test_launch.py).
           'learning_rte': (0.1, "unknown config key 'learning_rte' (did you mean 'learning_rate'?)"),
           'augment.rotatoin': (10.0, "unknown config key 'augment.rotatoin' (did you mean 'augment.rotation'?)"),
           'conv_impl': ('xla', "unknown config key 'conv_impl'"),
           'routing_probe_iterations': (0, "unknown config key 'routing_probe_iterations' (it is "   # moved: the hint
                                        'config.evals.routing_probe.iterations now; 0 (off) is '     # the command gives
                                        '--config.evals.routing_probe.enabled=False)')}
  for key, (value, line) in cases.items():
    config = mnist_smoke.get_config()
    _set(config, key, value)
    workdir = tmp_path / key
    start = time.monotonic()
    with pytest.raises(capsjax.ConfigError) as raised:
      capsjax.train_and_evaluate(config, str(workdir))
    assert str(raised.value).startswith(line) and time.monotonic() - start < 10, (key, str(raised.value))
    assert not workdir.exists(), key   # (the command's own line for each: tests/test_launch.py)
  # The call's own arguments, before the data and the workdir: '' once trained into the
  # current folder, a dict and stop_at_step=-1 failed unnamed or after the data.
  config = mnist_smoke.get_config()
  for arguments, error, line in [
      ((config.to_dict(), str(tmp_path / 'd')), capsjax.ConfigError, 'a config is an ml_collections.ConfigDict'),
      ((config.model, str(tmp_path / 'm')), capsjax.ConfigError,   # a KeyError inside, once
       "a run's config lacks allow_config_change, augment, batch_size, check_memory and 51 more: this is "
       'config.model, one section; give the whole config'),
      ((config, ''), capsjax.CapsjaxError, "a workdir is required to train: a folder path, got ''"),
      ((config, None), capsjax.CapsjaxError, 'a workdir is required to train: a folder path, got None'),
      ((config, str(tmp_path / 's'), -1), capsjax.ConfigError, 'stop_at_step=-1: allowed an integer >= 0'),
      ((config, str(tmp_path / 's'), 1.5), capsjax.ConfigError, 'stop_at_step=1.5: allowed an integer >= 0')]:
    with pytest.raises(error) as raised:
      capsjax.train_and_evaluate(*arguments)
    assert str(raised.value).startswith(line), str(raised.value)
  assert not os.listdir(tmp_path)   # no workdir was made
  assert capsjax.build_model(config.model).routing == capsjax.build_model(**config.model).routing == 'dynamic'
  with pytest.raises(capsjax.ConfigError, match=r'^build_model takes the model section'):
    capsjax.build_model(config)
  with pytest.raises(capsjax.ConfigError, match=r'^config.model.conv1_channels=0: allowed an integer >= 1$'):
    capsjax.build_model('capsnet', conv1_channels=0)
  # The config's "from the data" values: a module built from them had no classes.
  with pytest.raises(capsjax.ConfigError, match=r'^config.model.num_classes=0 means the classes of the data'):
    capsjax.build_model('capsnet', num_classes=0)
  with pytest.raises(capsjax.ConfigError, match=r'^config.model.input_shape=\(\) means the image size of the data'):
    capsjax.build_model('capsnet', input_shape=())


def test_make_objective_and_register_routing_refuse_before_anything_is_bound():
  import capsjax  # pylint: disable=g-import-not-at-top
  from capsjax.routing import ROUTINGS  # pylint: disable=g-import-not-at-top
  # An unknown option once failed at trace time, a bad value never.
  for options, line in (({'mplus': 0.9}, "config.loss.mplus: not an option of the 'capsnet' objective (its options: "
                                         'm_plus, m_minus'),
                        ({'m_plus': 2.0}, 'config.loss.m_plus=2.0: allowed a finite number in (0, 1]'),
                        ({'m_minus': 0.95}, 'config.loss.m_minus=0.95: allowed a value below m_plus=0.9')):
    with pytest.raises(capsjax.ConfigError) as raised:
      capsjax.make_objective('capsnet', 10, **options)
    assert str(raised.value).startswith(line), str(raised.value)
  with pytest.raises(capsjax.ConfigError, match=r'^make_objective: num_classes=0: allowed an integer >= 1$'):
    capsjax.make_objective('capsnet', 0)
  # A refused registration under a built-in's name leaves the built-in, and warns of nothing.
  paper = ROUTINGS['dynamic'].value
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    with pytest.raises(capsjax.ConfigError, match=r"^routing 'dynamic' is registered iterative=True but takes no"):
      capsjax.register_routing('dynamic')(lambda votes, activations: None)
  assert ROUTINGS['dynamic'].value is paper


def test_load_dataset_refuses_what_the_command_refuses_before_reading():
  import capsjax  # pylint: disable=g-import-not-at-top
  for image_size in (-3, 1.5):   # once: numpy's "negative dimensions", a TypeError
    with pytest.raises(capsjax.ConfigError, match=rf'^config.image_size={image_size}: allowed an integer in \[0, 4096\]$'):
      capsjax.load_dataset('mnist', 'test', image_size=image_size)
  with pytest.raises(capsjax.CapsjaxError, match=r"^unknown split 'validation': allowed train, test$"):
    capsjax.load_dataset('mnist', 'validation')
  with pytest.raises(capsjax.CapsjaxError, match=r"^load_dataset: on_demand='no': allowed True or False$"):
    capsjax.load_dataset('mnist', 'test', on_demand='no')   # once: every image read on demand
  with pytest.raises(capsjax.CapsjaxError, match=r'^data directory /nonexistent does not exist$'):   # a pathlib folder passes the key's rule
    capsjax.load_dataset('mnist', 'test', data_dir=pathlib.Path('/nonexistent'))
  # load_trained's `data` (where the data is on this machine): another key was added to the config unread.
  with pytest.raises(capsjax.ConfigError, match=r"^data=\{'datadir': …\}: data names where the data is on this "
                                                r'machine, data_dir and tfds_data_dir$'):
    capsjax.load_trained('/nonexistent', data={'datadir': '/data'})
  for step in ('2', -1, 1.5, True):   # '2' once read "no checkpoint of step 2 … (there are: 2)"
    with pytest.raises(capsjax.ConfigError, match=rf"^step={step!r}: allowed an integer >= 0 \(a checkpoint's step\)"):
      capsjax.load_trained('/nonexistent', step=step)
  for member in ('1', 1.5, True):   # of an ensemble: a comparison's TypeError, x[1.5], x[True] (an extra axis)
    with pytest.raises(capsjax.ConfigError, match=rf"^--member={member!r}: allowed an integer >= 0 \(a member"):
      capsjax.TrainedModel.from_workdir('/nonexistent', member=member)


def test_modules_and_helpers_used_directly_refuse_what_build_model_refuses(tmp_path):
  """The Flax modules and helpers a researcher composes without a config: each bad field
  or argument is one line (a config key's words, the class for config.model) when the
  module is set up, traced only here; before, 0-D capsules built, an unknown transform ran
  as the paper's, and the others failed deep inside (a division by zero, XLA's MLIR error,
  an empty argmax)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import capsjax  # pylint: disable=g-import-not-at-top
  from capsjax import layers  # pylint: disable=g-import-not-at-top
  from capsjax.routing import LAYER_INPUTS  # pylint: disable=g-import-not-at-top
  primary, features, images = jnp.ones((2, 12, 8)), jnp.ones((2, 20, 20, 3)), jnp.ones((2, 28, 28, 1))
  for module, inputs, error, line in [
      (capsjax.CapsuleLayer(dim=0), primary, capsjax.ConfigError, 'CapsuleLayer.dim=0: allowed an integer >= 1'),
      (capsjax.CapsuleLayer(num_capsules=-1), primary, capsjax.ConfigError, 'CapsuleLayer.num_capsules=-1: allowed'),
      (capsjax.CapsuleLayer(transforms='per_types'), primary, capsjax.ConfigError,
       "CapsuleLayer.transforms='per_types': allowed one of per_capsule, per_type"),
      (capsjax.CapsuleLayer(transforms='per_type'), primary, ValueError,
       "CapsuleLayer transforms='per_type' takes types >= 1 (got 0) and the call's grid"),
      (capsjax.PrimaryCaps(num_types=0), features, capsjax.ConfigError, 'PrimaryCaps.num_types=0: allowed an integer'),
      (capsjax.PrimaryCaps(stride=0), features, capsjax.ConfigError, 'PrimaryCaps.stride=0: allowed an integer >= 1'),
      (capsjax.Decoder(hidden=(-3,)), primary, capsjax.ConfigError, 'Decoder.hidden=(-3,): allowed a tuple of integers'),
      (capsjax.Decoder(output_shape=(0, 28, 1)), primary, capsjax.ConfigError, 'Decoder.output_shape=(0, 28, 1)'),
      (capsjax.CapsNet(num_classes=1), images, capsjax.ConfigError, 'CapsNet.num_classes=1: allowed an integer >= 2'),
      (capsjax.CapsNet(num_classes=0), images, capsjax.ConfigError,
       'CapsNet.num_classes=0 means the classes of the data in a config; a module needs the number'),
      (capsjax.CapsNet(routing_inputs=('biases',)), images, capsjax.ConfigError,
       "CapsNet.routing_inputs=('biases',): allowed"),
      (capsjax.BaselineCNN(dropout_rate=1.5), images, capsjax.ConfigError, 'BaselineCNN.dropout_rate=1.5: allowed'),
      (capsjax.BaselineCNN(), images, ValueError,   # built for 36×36: once silently another model on 28×28
       'BaselineCNN expects images of shape [batch, 36, 36, 1], got [2, 28, 28, 1]'),
      # The building blocks below them (capsjax.layers): once a division by zero, an empty
      # min(), a concatenation error or 'not enough values to unpack'; a negative stem ran as none.
      (layers.Conv(0, 3), features, capsjax.ConfigError, 'Conv.features=0: allowed an integer >= 1'),
      (layers.Conv(4, 3, padding='same'), features, capsjax.ConfigError, "Conv.padding='same': allowed one of VALID"),
      (layers.Conv(4, 21), features, ValueError, 'Conv: images of 20×20 are smaller than its 21×21 kernel'),
      (layers.Conv(4, 3), features[0], ValueError, 'Conv takes images [batch, height, width, channels]; got shape'),
      (layers.StridedStem(-1), features, capsjax.ConfigError, 'StridedStem.stages=-1: allowed an integer >= 0'),
      (layers.TransposedConv(4, 3, 0), features, capsjax.ConfigError, 'TransposedConv.stride=0: allowed'),
      (layers.DeconvDecoder(output_shape=(28, 28)), primary, capsjax.ConfigError,
       'DeconvDecoder.output_shape=(28, 28): allowed a tuple of 3 integers >= 1 (height, width, channels)')]:
    with pytest.raises(error) as raised:
      jax.eval_shape(module.init, jax.random.key(0), inputs)
    assert str(raised.value).startswith(line) and len(str(raised.value).splitlines()) == 1, str(raised.value)
  assert 'bias' in LAYER_INPUTS   # (the name the mistyped one missed)
  with pytest.raises(capsjax.ConfigError, match=r"^Formulation.conv_impl='nope': allowed one of auto, xla, "):
    capsjax.Formulation(conv_impl='nope')   # when built, not where a layer is traced
  with pytest.raises(capsjax.ConfigError, match=r"^Formulation.dtype=<class 'jax.numpy.int32'>: allowed one of auto, "):
    capsjax.Formulation(dtype=jnp.int32)   # once the compute dtype of every convolution
  assert capsjax.Formulation(dtype=jnp.bfloat16).dtype == jnp.dtype('bfloat16')   # once failed when traced
  logits = jnp.zeros((3, 2, 12, 10))   # [iterations, batch, in, out]
  with pytest.raises(ValueError, match=r'^routing_logit_changes takes logits \[iterations, batch, in_caps, '):
    capsjax.routing_logit_changes(logits[0, 0])   # once: "tuple index out of range"
  with pytest.raises(ValueError, match=r'^routing_logit_changes: initial_logits of shape \(7,\) do not broadcast'):
    capsjax.routing_logit_changes(logits, jnp.zeros(7))
  assert capsjax.routing_logit_changes(logits, jnp.zeros((12, 10))).shape == (3,)   # log priors [in, out] broadcast
  with pytest.raises(ValueError, match=r"^a routing name must be a config key \(letters, digits and _, not a digit first "
                                       r"nor a Python keyword\), got 'my.routing'$"):
    capsjax.register_routing('my.routing')(lambda prediction_vectors, input_activations, routing_iterations: None)
  with pytest.raises(TypeError, match=r"^register_routing\('mine'\): learned\['scale'\] is \(a function of \(in_caps, "):
    capsjax.register_routing('mine', learned={'scale': 1.0})   # once registered, then failed in the layer
  assert 'my.routing' not in capsjax.ROUTINGS and 'mine' not in capsjax.ROUTINGS
  with pytest.raises(TypeError, match=r"^register_source: datasets takes a tuple of names, got 'mine' \(one name: "):
    capsjax.register_source('mine', datasets='mine')   # once: the datasets m, i, n, e
  with pytest.raises(TypeError, match=r'^register_source\(\'mine\'\) decorates a subclass of '):
    capsjax.register_source('mine')(lambda: None)
  assert 'mine' not in capsjax.SOURCES
  with pytest.raises(TypeError, match=r"^an evaluator name must be a non-empty string, got ''$"):
    capsjax.register_evaluator('')
  (tmp_path / 'file').write_text('')
  with pytest.raises(capsjax.CapsjaxError, match=r'/file is not a directory$'):   # the commands' --workdir words
    capsjax.load_trained(str(tmp_path / 'file'))
  assert 'importlib' not in dir(capsjax)


def test_routing_results_and_layers_of_the_wrong_shape_are_named_at_trace_time():
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import capsjax  # pylint: disable=g-import-not-at-top
  from capsjax.routing import ROUTINGS  # pylint: disable=g-import-not-at-top
  votes = jnp.ones((3, 6, 2, 4))   # û [batch, in, out, dim]

  def one_array(prediction_vectors, input_activations):   # the measured mistake: a bare array
    del input_activations
    return capsjax.squash(prediction_vectors.mean(axis=1))

  def short_parents(prediction_vectors, input_activations):
    del input_activations
    parents = capsjax.squash(prediction_vectors.mean(axis=1))
    return parents[:, :1], capsjax.vector_norm(parents)
  try:
    capsjax.register_routing('test_one_array', iterative=False)(one_array)
    capsjax.register_routing('test_short_parents', iterative=False)(short_parents)
    with pytest.raises(ValueError, match=r'returned one array of shape \(3, 2, 4\): a routing returns'):
      capsjax.route('test_one_array', votes)
    with pytest.raises(ValueError, match=r'returned parents \(3, 1, 4\) and activations \(3, 2\); expected '
                                         r'\(3, 2, 4\)'):
      capsjax.route('test_short_parents', votes)
  finally:
    ROUTINGS.unregister('test_one_array')
    ROUTINGS.unregister('test_short_parents')
  with pytest.raises(ValueError, match=r'input_activations \(3, 5\) do not match the votes \(3, 6, 2, 4\)'):
    capsjax.route('dynamic', votes, jnp.ones((3, 5)))
  # A routing's option by the config's rule (once computed with a negative temperature);
  # the layer's and dynamic_routing's inputs named where XLA named neither array.
  with pytest.raises(capsjax.ConfigError, match=r"^route\('em'\): inverse_temperature=-1.0: allowed a finite number > 0$"):
    capsjax.route('em', votes, inverse_temperature=-1.0)
  with pytest.raises(capsjax.ConfigError, match=r'^routing_options.em.inverse_temperature=0: allowed a finite number > 0'):
    jax.eval_shape(capsjax.CapsuleLayer(routing='em', routing_options={'em': {'inverse_temperature': 0}}).init,
                   jax.random.key(0), jnp.ones((3, 6, 4)))
  with pytest.raises(ValueError, match=re.escape("dynamic_routing: log_priors of shape (5, 2) does not broadcast to "
                                                 "the votes' [batch, in_caps, out_caps] (3, 6, 2)")):
    capsjax.dynamic_routing(votes, 3, log_priors=jnp.zeros((5, 2)))
  with pytest.raises(ValueError, match=re.escape("dynamic_routing: bias of shape (2, 5) does not broadcast to the "
                                                 "votes' [batch, out_caps, out_dim] (3, 2, 4)")):
    capsjax.dynamic_routing(votes, 3, bias=jnp.zeros((2, 5)))
  with pytest.raises(TypeError, match=r'read by name, result.parents and result.activations'):
    parents, activations = capsjax.route('dynamic', votes)  # pylint: disable=unused-variable
  with pytest.raises(ValueError, match=r'CapsuleLayer takes capsules \[batch, in_caps, in_dim\]; got shape '
                                       r'\(2, 28, 28, 1\)'):
    capsjax.CapsuleLayer(num_capsules=2, dim=4).init(jax.random.key(0), jnp.ones((2, 28, 28, 1)))
  primary = capsjax.PrimaryCaps(num_types=2, dim=4)
  with pytest.raises(ValueError, match=r'PrimaryCaps takes feature maps \[batch, height, width, channels\]; got '
                                       r'shape \(20, 20, 16\)'):
    jax.eval_shape(primary.init, jax.random.key(0), jnp.ones((20, 20, 16)))
  with pytest.raises(ValueError, match=r'PrimaryCaps: feature maps of 5×5 are smaller than its 9×9 kernel'):
    jax.eval_shape(primary.init, jax.random.key(0), jnp.ones((2, 5, 5, 16)))


def test_none_for_any_section_numpy_scalars_and_the_schedule_index_are_checked():
  """Holes a fault probe found: config.evals = None passed and failed after the data was
  read; margin_loss(scale=) took -1, NaN, inf and True; NumPy scalars skipped the argument
  rules (a NaN routing option passed) or failed them (a valid np.float32(2.0) refused); an
  out-of-range schedule index ran as 'linear', and a cosine rate of 0 divided by zero."""
  import jax.numpy as jnp   # pylint: disable=g-import-not-at-top
  import numpy as np   # pylint: disable=g-import-not-at-top
  import capsjax   # pylint: disable=g-import-not-at-top
  from capsjax import optimization   # pylint: disable=g-import-not-at-top
  from capsjax.validation import declared   # pylint: disable=g-import-not-at-top
  names = {name for name, _ in declared(mnist.get_config())}
  sections = {'.'.join(parts[:depth]) for parts in (name.split('.') for name in names)
              for depth in range(1, len(parts))} - names
  from capsjax.keys import lookup   # pylint: disable=g-import-not-at-top
  present = [section for section in sorted(sections) if lookup(mnist.get_config(), section)[0]]
  assert {'model', 'loss', 'evals', 'augment', 'model.formulation', 'evals.routing_probe'} <= set(present)
  for section in present:
    config = mnist.get_config()
    parent, _, last = section.rpartition('.')
    (lookup(config, parent)[1] if parent else config)[last] = None
    with pytest.raises(ConfigError, match=f'^config.{re.escape(section)}=None: allowed a section of its keys'):
      validate(config)
  lengths, targets = jnp.array([[0.9, 0.2]]), jnp.array([[1.0, 0.0]])
  for scale in (-1, float('nan'), float('inf'), True):
    with pytest.raises(ConfigError, match=re.escape(f'margin_loss: scale={scale!r}: allowed a finite number > 0')):
      capsjax.margin_loss(lengths, targets, scale=scale)
  np.testing.assert_allclose(capsjax.margin_loss(lengths, targets, scale=np.float32(0.5)), [0.0025])
  with pytest.raises(ConfigError, match=re.escape("route('em'): inverse_temperature=nan: allowed a finite number > 0")):
    capsjax.route('em', jnp.ones((1, 4, 2, 3)), inverse_temperature=np.float32('nan'))
  assert capsjax.build_model('capsnet', routing='em', routing_options={'em': {'inverse_temperature': np.float32(2.0)}})
  for kind in (7, -1, True):
    with pytest.raises(capsjax.CapsjaxError, match=r"^lr_schedule must be one of .* or its index 0 to 2, got"):
      optimization.learning_rate_at(10, 1e-3, 100, 0.9, False, 0.0, kind, 0, 100)
  assert float(optimization.learning_rate_at(10, 0.0, 100, 0.9, False, 0.0, 'cosine', 0, 100)) == 0.0
