"""The public API (`import capsjax`): every exported name exists, is documented with its
shapes and a runnable example, and every example runs (doctest) and prints what it says."""
import doctest
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import capsjax
from capsjax import routing
from capsjax.data import idx

# Compiling many small programs is this module's time: XLA's cheap compilation (conftest.py).
pytestmark = pytest.mark.compile_bound

# Names that take or return arrays: their docstrings give the shapes ([batch, …]).
ARRAY_NAMES = ('squash', 'vector_norm', 'coupling_coefficients', 'dynamic_routing', 'route',
               'routing_logit_changes', 'register_routing', 'ROUTINGS', 'RoutingResult', 'margin_loss', 'reconstruction_loss',
               'capsnet_loss', 'PrimaryCaps', 'CapsuleLayer', 'Decoder', 'CapsNet', 'BaselineCNN',
               'capsule_lengths', 'make_objective', 'OBJECTIVES', 'load_trained', 'Predictor', 'load_dataset',
               'register_source')


def test_every_exported_name_exists_and_is_documented_with_an_example():
  assert len(capsjax.__all__) == len(set(capsjax.__all__)) >= 25
  problems = []
  for name in capsjax.__all__:
    value = getattr(capsjax, name)
    doc = value.__doc__ or ''
    if '>>> ' not in doc:
      problems.append(f'{name}: no example')
    if name in ARRAY_NAMES and '[' not in doc:
      problems.append(f'{name}: no shapes')
  assert not problems, problems
  assert set(ARRAY_NAMES) <= set(capsjax.__all__)
  assert capsjax.squash is capsjax.routing.squash and capsjax.CapsNet is capsjax.models.CapsNet
  with pytest.raises(AttributeError, match='no attribute'):
    capsjax.no_such_name  # pylint: disable=pointless-statement
  assert 'CapsNet' in dir(capsjax)


def test_import_capsjax_loads_no_jax():
  """The commands report a bad flag before anything heavy is imported."""
  code = 'import sys, capsjax; print(sorted(m for m in ("jax", "flax", "orbax") if m in sys.modules))'
  result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=60, check=True)
  assert result.stdout.strip() == '[]'


def test_a_known_silent_miscompile_is_guarded_after_import_capsjax():
  """jaxlib 0.10.2 sums a vmapped matrix-vector product wrongly on a CPU (JAX issue 39103's
  reproducer: 1 065 369 600 for 32 768² in float32); after `import capsjax` it is right on
  every installed jaxlib. A user's own value of the flag, and a file of flags, are left alone;
  capsjax's math at a batch of 8 192 agrees with a float64 NumPy Procedure 1."""
  from capsjax import console   # pylint: disable=g-import-not-at-top
  code = """import capsjax, jax, jax.numpy as jnp
n = 32769
x = jnp.zeros((n, 3), jnp.float32).at[:, 0].set(jnp.arange(n, dtype=jnp.float32))
print(int(jax.jit(jax.vmap(lambda r: jnp.sum((jnp.eye(3) @ r) ** 2)))(x)[-1]))"""
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120, check=True,
                          env=dict(env, JAX_PLATFORMS='cpu'))
  assert result.stdout.strip() == str(32768 ** 2), result.stdout
  own = {'XLA_FLAGS': '--xla_cpu_experimental_ynn_fusion_type=-dot'}
  assert console.guard_known_miscompiles(dict(own)) is None
  assert console.guard_known_miscompiles({'XLA_FLAGS': '/etc/my_xla_flags'}) is None
  added = {'XLA_FLAGS': '--xla_force_host_platform_device_count=2'}
  flag = console.guard_known_miscompiles(added)
  assert added['XLA_FLAGS'] == ('--xla_force_host_platform_device_count=2' + (f' {flag}' if flag else ''))
  # Procedure 1 at a batch past the miscompile's threshold, against float64 NumPy.
  votes = np.random.default_rng(0).normal(size=(8192, 8, 3, 4)).astype(np.float32)   # û [batch, in, out, dim]
  logits = np.zeros(votes.shape[:3])
  for _ in range(3):
    c = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)                      # [batch, in, out]
    s = np.einsum('bio,biod->bod', c, votes.astype(np.float64))                     # [batch, out, dim]
    norm = np.linalg.norm(s, axis=-1, keepdims=True)
    v = s * norm / (1 + norm ** 2)                                                   # squash
    logits = logits + np.einsum('biod,bod->bio', votes, v)                           # b += û·v
  with jax.default_matmul_precision('highest'):
    parents = capsjax.dynamic_routing(votes, 3).parents
  np.testing.assert_allclose(parents, v, atol=2e-5)


def test_every_docstring_example_runs(mnist_dir, tmp_path):
  """The examples in the order of `__all__`, sharing one namespace as a reader would
  (train_and_evaluate's run is the one load_trained and TrainedModel read)."""
  namespace = {'capsjax': capsjax, 'jax': jax, 'jnp': jnp, 'np': np, 'mnist_dir': mnist_dir,
               'workdir': str(tmp_path / 'run')}
  finder = doctest.DocTestFinder(recurse=False)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  documented = [(name, getattr(capsjax, name)) for name in capsjax.__all__] + [('find_mnist', idx.find_mnist),
                                                                             ('iterate', routing.iterate)]
  ran = 0
  for name, value in documented:
    for test in finder.find(value, name, globs={}):
      test.globs = namespace   # shared, as one reader's session
      ran += len(test.examples)
      runner.run(test, clear_globs=False)
  summary = runner.summarize(verbose=False)
  assert summary.failed == 0, f'{summary.failed} of {summary.attempted} examples failed (output above)'
  assert ran >= 3 * len(capsjax.__all__)


def test_the_api_reference_page_lists_every_exported_name():
  with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'docs', 'api.md')) as f:
    documented = set(re.findall(r'^\.\. auto(?:function|class|data):: capsjax\.(\w+)$', f.read(), re.M))
  assert documented == set(capsjax.__all__)
