"""Extending capsjax from outside the package: a routing, a model family with its
objective, and a data source, each registered from its own file with the documented
decorator, train through the unchanged loop and appear in validation's lists, with no
edit to any capsjax file (capsjax.registry)."""
import importlib.util
import sys
import textwrap

import numpy as np
import pytest

from capsjax import registry, train
from capsjax.data.sources import SOURCES
from capsjax.errors import ConfigError
from capsjax.models import MODELS
from capsjax.objectives import OBJECTIVES
from capsjax.routing import ROUTINGS, register_routing, route
from capsjax.validation import problems_of
from helpers import tiny_config

# Compiling many small programs is this module's time: XLA's cheap compilation (conftest.py).
pytestmark = pytest.mark.compile_bound

# A user's routing, as docs/routing.md gives it: one file, one decorator.
USER_ROUTING = '''
import jax.numpy as jnp
from capsjax.routing import register_routing, squash, vector_norm


@register_routing('uniform_mean', iterative=False)
def uniform_mean(prediction_vectors, input_activations, *, scale=1.0):
  """Every child couples equally to every parent: v_j = squash(scale · mean_i û_j|i)."""
  del input_activations   # not iterative: no loop arguments reach it
  parents = squash(scale * jnp.mean(prediction_vectors, axis=1))   # [batch, out, dim]
  return parents, vector_norm(parents)

'''

# A user's model family and objective: a linear classifier.
USER_FAMILY = '''
from typing import Sequence
import flax.linen as nn
import jax
import optax
from capsjax.models import register_model
from capsjax.objectives import register_objective


@register_model('linear', objectives=('linear_xent',))
class Linear(nn.Module):
  num_classes: int = 10
  input_shape: Sequence[int] = (28, 28, 1)

  @nn.compact
  def __call__(self, images, train: bool = False):
    return {'logits': nn.Dense(self.num_classes)(images.reshape(images.shape[0], -1))}


@register_objective('linear_xent', families=('linear',), probabilities=jax.nn.softmax)
def linear_xent(model, params, batch, train, knobs=None, *, num_classes):
  del train, knobs
  logits = model.apply({'params': params}, batch['images'])['logits']
  return optax.softmax_cross_entropy(logits, jax.nn.one_hot(batch['labels'], num_classes)), logits, {}
'''

# A user's data source: DIR/train.npz and DIR/test.npz of uint8 images and labels.
USER_SOURCE = '''
import os
import numpy as np
from capsjax.data.sources import Dataset, Source, SourceInfo, register_source


@register_source('npz_pair', datasets=('npz_digits',))
class NpzPair(Source):
  @classmethod
  def claims(cls, spec):
    return False   # served by name only

  def describe(self):
    with np.load(os.path.join(self.spec.data_dir, 'test.npz')) as data:
      shape = tuple(data['images'].shape[1:])
    return SourceInfo('npz_digits', shape, tuple(str(i) for i in range(10)))

  def load(self, split, on_demand=False):
    with np.load(os.path.join(self.spec.data_dir, f'{split}.npz')) as data:
      return Dataset(data['images'], data['labels'].astype(np.int32))
'''


def _import_file(path, name):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


@pytest.fixture
def user_modules(tmp_path):
  for name, text in (('user_routing', USER_ROUTING), ('user_family', USER_FAMILY),
                     ('user_source', USER_SOURCE)):
    (tmp_path / f'{name}.py').write_text(textwrap.dedent(text))
    _import_file(tmp_path / f'{name}.py', name)
  yield
  ROUTINGS.unregister('uniform_mean')
  MODELS.unregister('linear')
  OBJECTIVES.unregister('linear_xent')
  SOURCES.unregister('npz_pair')
  for name in ('user_routing', 'user_family', 'user_source'):
    sys.modules.pop(name, None)


def test_registry_entries_carry_declared_capabilities():
  things = registry.Registry('thing', fast=False)
  things.register('a', object(), fast=True)
  things.register('b', object())
  assert things['a'].fast and not things['b'].fast and things.names() == ('a', 'b')
  with pytest.raises(TypeError, match="unknown capabilities \\['quick'\\]"):
    things.register('c', object(), quick=True)
  with pytest.raises(ConfigError, match="unknown thing 'z'; registered: a, b"):
    things.get('z')


def test_registering_a_built_in_routing_s_name_warns_and_reimporting_capsjax_s_own_does_not():
  import importlib, warnings  # pylint: disable=g-import-not-at-top,multiple-imports
  uniform_module = sys.modules['capsjax.routing.uniform']
  built_in = ROUTINGS['uniform']
  try:
    with pytest.warns(UserWarning, match=r"register_routing\('uniform'\) replaces capsjax's built-in routing "
                                         r"'uniform' for this process \(config.model.routing='uniform' now runs "
                                         r".*\.mine\); register it under a name of its own"):
      @register_routing('uniform', iterative=False)
      def mine(prediction_vectors, input_activations):   # pylint: disable=unused-variable
        del input_activations
        return prediction_vectors.mean(axis=1), prediction_vectors.mean(axis=(1, 3))
      assert ROUTINGS['uniform'].value is mine   # replaced (for this process), and said so
  finally:
    ROUTINGS.register('uniform', built_in.value, **built_in.capabilities)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    importlib.reload(uniform_module)   # the same function registered again: no warning (an error here)
  assert ROUTINGS['uniform'].value is uniform_module.uniform


def test_a_routing_from_its_own_file_trains_and_is_listed(user_modules, mnist_dir, tmp_path):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  predictions = jnp.ones((2, 5, 3, 4))
  routed = route('uniform_mean', predictions, scale=0.5)
  parents, activations = routed.parents, routed.activations
  np.testing.assert_allclose(np.asarray(activations), 1.0 / 2.0, rtol=1e-6)   # |squash(0.5·(1,1,1,1))| = 1/2
  assert parents.shape == (2, 3, 4)
  config = tiny_config(mnist_dir, num_steps=4, eval_every_steps=0)
  config.model.routing = 'nonexistent'
  assert 'uniform_mean' in problems_of(config)[0]   # the allowed list names it
  config.model.routing = 'uniform_mean'
  config.model.routing_options = {'uniform_mean': {'scale': 2.0}}   # a section per routing
  assert problems_of(config) == []
  config.model.routing_options = {'uniform_mean': {'sclae': 2.0}}
  assert "routing_options.uniform_mean.sclae=2.0: routing 'uniform_mean' has the options scale" in problems_of(config)[0]
  config.model.routing_options = {'uniform_mean': {'scale': 2.0}, 'em': {'inverse_temperature': 3.0}}
  assert "an option of routing 'em', but routing='uniform_mean'" in problems_of(config)[0]   # unread
  config.model.routing_options = {'uniform_mean': {'scale': 2.0}}
  config.model.routing_inputs = ('leaky',)   # Procedure 1's input; this routing reads none
  assert 'leaky is an input of routing=dynamic only' in problems_of(config)[0]
  config.model.routing_inputs = ()
  # In the Python API a misspelt option is an error, not silently ignored, and routing_options
  # has the config's shape everywhere (a section per routing), checked the same way.
  import jax  # pylint: disable=g-import-not-at-top
  from capsjax import CapsNet, CapsuleLayer, ConfigError, build_model  # pylint: disable=g-import-not-at-top
  typo = CapsNet(conv1_channels=4, primary_types=2, routing='uniform_mean',
                 routing_options={'uniform_mean': {'sclae': 0.5}})
  with pytest.raises(ConfigError, match=r"routing_options.uniform_mean.sclae=0.5: routing 'uniform_mean' has the "
                                        r"options scale"):
    typo.init(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
  with pytest.raises(ConfigError, match=r"^config.model.routing_options.uniform_mean.sclae=0.5: routing"):
    build_model('capsnet', routing='uniform_mean', routing_options={'uniform_mean': {'sclae': 0.5}})
  flat = CapsuleLayer(num_capsules=3, dim=4, routing='uniform_mean', routing_options={'scale': 0.5})
  with pytest.raises(ConfigError, match=r"routing_options.scale=0.5: options are per routing, e.g. "
                                        r"routing_options.uniform_mean.scale"):
    flat.init(jax.random.key(0), jnp.ones((1, 6, 8)))
  built = build_model(**config.model)
  assert built.routing_options['uniform_mean'] == {'scale': 2.0}
  layer = CapsuleLayer(num_capsules=3, dim=4, routing='uniform_mean', routing_options=built.routing_options)
  capsules = jnp.ones((1, 6, 8))
  halved = CapsuleLayer(num_capsules=3, dim=4, routing='uniform_mean', routing_options={'uniform_mean': {'scale': 1.0}})
  params = layer.init(jax.random.key(0), capsules)
  assert not np.allclose(layer.apply(params, capsules).parents, halved.apply(params, capsules).parents)   # read
  # The registry keeps the function as written; it trains.
  assert ROUTINGS['uniform_mean'].value is sys.modules['user_routing'].uniform_mean
  results = train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert results['completed'] and results['steps'] == 4 and np.isfinite(results['test_loss'])
  # A routing that does not loop but declares the loop's arguments (the earlier protocol) is
  # refused in one line, as is a third returned value (couplings and logits go by name).
  with pytest.raises(ConfigError, match="^routing 'old' is registered iterative=False but takes routing_iterations, "
                                        "max_iterations: a routing that does not loop"):
    register_routing('old', iterative=False)(
        lambda prediction_vectors, input_activations, routing_iterations, *, max_iterations=None: None)
  assert 'old' not in ROUTINGS.names()
  with pytest.raises(ConfigError, match="^routing 'old' takes num_iterations: r is called routing_iterations "):
    register_routing('old')(lambda prediction_vectors, input_activations, num_iterations: None)
  register_routing('three_values', iterative=False)(
      lambda prediction_vectors, input_activations: (parents, routed.activations, parents))
  try:
    with pytest.raises(ValueError, match="^routing 'three_values' returned 3 values: a routing returns a RoutingResult"):
      route('three_values', predictions)
  finally:
    ROUTINGS.unregister('three_values')
  with pytest.raises(ConfigError, match="^routing 'looping' is registered iterative=True but takes no routing_iterations: "):
    register_routing('looping')(lambda prediction_vectors, input_activations: None)
  assert 'looping' not in ROUTINGS.names()
  with pytest.raises(ConfigError, match=r"layer_inputs \['digit_bias'\] are not inputs of the capsule layer"):
    register_routing('flagged', iterative=False, layer_inputs=('digit_bias',))


def test_a_family_and_a_source_from_their_own_files_train(user_modules, mnist_dir, tmp_path):
  from capsjax.data.sources import load_dataset  # pylint: disable=g-import-not-at-top
  data = tmp_path / 'npz'
  data.mkdir()
  for split, count in (('train', 512), ('test', 200)):
    real = load_dataset('mnist', split, mnist_dir).take(count)
    np.savez(data / f'{split}.npz', images=np.asarray(real.images), labels=np.asarray(real.labels))
  config = tiny_config(str(data), num_steps=60, eval_every_steps=0,
                       num_train_examples=0, num_test_examples=0)
  config.dataset = 'npz_digits'
  config.model = dict(name='linear', num_classes=10, input_shape=(28, 28, 1))
  config.loss = dict(name='linear_xent')
  assert problems_of(config) == []
  results = train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert results['num_params'] == 28 * 28 * 10 + 10
  assert results['num_train_examples'] == 512 and results['num_test_examples'] == 200
  assert results['test_accuracy'] > 0.6   # a linear classifier after 60 steps of 32


def test_unknown_family_names_are_refused():
  config = tiny_config('')
  config.model.name = 'linear'
  assert "config.model.name='linear': allowed one of capsnet, cnn" in problems_of(config)[0]


def test_help_of_a_users_config_file_lists_the_users_routing(tmp_path):
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  (tmp_path / 'user_routing.py').write_text(textwrap.dedent(USER_ROUTING))
  (tmp_path / 'my_config.py').write_text(textwrap.dedent('''
      import user_routing  # registers uniform_mean
      from capsjax.experiments import mnist_smoke

      def get_config():
        config = mnist_smoke.get_config()
        config.model.routing = 'uniform_mean'
        return config
      '''))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), root]))
  result = subprocess.run([sys.executable, os.path.join(root, 'run.py'), f'--config={tmp_path}/my_config.py',
                           '--help'], capture_output=True, text=True, timeout=120, env=env)
  assert result.returncode == 0, result.stderr[-2000:]
  routing_line = next(line for line in result.stdout.splitlines() if line.strip().startswith('model.routing ='))
  assert "'uniform_mean'" in routing_line and 'uniform_mean]' in routing_line
  assert 'model.routing_options.uniform_mean.scale = 1.0' in result.stdout


# A model key and a routing option, each one annotated declaration in the user's one file.
USER_DECLARATIONS = '''
from typing import Annotated, Sequence
import flax.linen as nn
import jax.numpy as jnp
from capsjax.keys import About, int_at_least, positive_number
from capsjax.models import register_model
from capsjax.routing import register_routing, squash, vector_norm


@register_model('hidden_linear')
class HiddenLinear(nn.Module):
  hidden: Annotated[int, About(int_at_least(1), 'hidden units before the logits')] = 16
  num_classes: int = 10
  input_shape: Sequence[int] = (28, 28, 1)

  @nn.compact
  def __call__(self, images, train: bool = False):
    features = nn.relu(nn.Dense(self.hidden)(images.reshape(images.shape[0], -1)))
    return {'logits': nn.Dense(self.num_classes)(features)}


@register_routing('scaled_mean', iterative=False)
def scaled_mean(prediction_vectors, input_activations, *,
                scale: Annotated[float, About(positive_number(), 'multiplies the mean vote')] = 1.0):
  del input_activations
  parents = squash(scale * jnp.mean(prediction_vectors, axis=1))   # [batch, out, dim]
  return parents, vector_norm(parents)
'''


@pytest.fixture
def user_declarations(tmp_path):
  (tmp_path / 'user_declarations.py').write_text(USER_DECLARATIONS)
  _import_file(tmp_path / 'user_declarations.py', 'user_declarations')
  yield
  MODELS.unregister('hidden_linear')
  ROUTINGS.unregister('scaled_mean')
  sys.modules.pop('user_declarations', None)


def test_a_model_key_and_a_routing_option_are_one_declaration_each(user_declarations, capsys):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from capsjax.defaults import base_config  # pylint: disable=g-import-not-at-top
  from capsjax.app.launch import print_keys  # pylint: disable=g-import-not-at-top
  from capsjax.models import build_model, model_config  # pylint: disable=g-import-not-at-top
  config = base_config()
  assert config.model.routing_options.scaled_mean.to_dict() == {'scale': 1.0}   # the option, at its default
  config.baseline = dict(model=model_config('hidden_linear').to_dict())
  assert config.baseline.model.hidden == 16                                         # the key, at its default
  assert problems_of(config) == []
  print_keys(config, 'keys')                                                        # --help
  shown = capsys.readouterr().out
  assert ('baseline.model.hidden = 16  — hidden units before the logits [an integer >= 1]' in shown
          and 'model.routing_options.scaled_mean.scale = 1.0  — multiplies the mean vote [a finite number > 0]'
          in shown)
  config.baseline.model.hidden, config.model.routing_options.scaled_mean.scale = 0, -1.0   # validation
  assert problems_of(config)[:2] == ['config.model.routing_options.scaled_mean.scale=-1.0: allowed a finite '
                                     'number > 0', 'config.baseline.model.hidden=0: allowed an integer >= 1']
  config.baseline.model.hidden = 24                                                 # the built model
  params = jax.jit(build_model(**config.baseline.model).init)(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
  assert params['params']['Dense_0']['kernel'].shape == (784, 24)
  config.model.update(routing='scaled_mean', conv1_channels=8, primary_types=2, use_decoder=False)
  images = jax.random.uniform(jax.random.key(1), (2, 28, 28, 1))
  lengths = {}
  for scale in (1.0, 4.0):
    config.model.routing_options.scaled_mean.scale = scale
    model = build_model(**config.model)
    variables = jax.jit(model.init)(jax.random.key(0), images)
    lengths[scale] = jax.jit(model.apply)(variables, images)['lengths']   # (op by op: a compilation each)
  # squash: |v| = |s|² / (1 + |s|²), so |s| = sqrt(|v| / (1 − |v|)); the option scales |s| by 4.
  norm = lambda v: jnp.sqrt(v / (1 - v))
  assert jnp.allclose(norm(lengths[4.0]), 4 * norm(lengths[1.0]), rtol=1e-3)

