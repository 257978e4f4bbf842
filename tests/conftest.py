"""Shared fixtures: the real MNIST folder beside the repository (../shared/data/mnist), and
the `float32_matmuls` marker.

JAX runs float32 matmuls and convolutions as TF32 on a GPU by default (about 1e-3
relative error), full float32 on a CPU. A test that compares two formulations, ensemble
members or a plain reference at float32 tolerances carries the marker (on the test, or
`pytestmark` for a module, which also covers its module-scoped fixtures): it then runs with
`jax_default_matmul_precision='highest'` set globally, so that every thread (a test
server's too) computes at full float32 on any backend.
"""
import contextlib
import os

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MNIST_DIR = os.environ.get('CAPSJAX_MNIST_DIR', os.path.join(ROOT, '..', 'shared', 'data', 'mnist'))
MARKER = 'float32_matmuls'


def pytest_configure(config):
  config.addinivalue_line('markers', f'{MARKER}: run with full float32 matmuls and convolutions '
                          '(no TF32 on a GPU); for tests that compare formulations, members or a reference')


@contextlib.contextmanager
def float32_matmuls():
  """Full float32 matmuls for every thread (jax.default_matmul_precision is per thread)."""
  previous = jax.config.jax_default_matmul_precision
  jax.config.update('jax_default_matmul_precision', 'highest')
  try:
    yield
  finally:
    jax.config.update('jax_default_matmul_precision', previous)


def _marked(node) -> bool:
  return node is not None and node.get_closest_marker(MARKER) is not None


@pytest.fixture(autouse=True, scope='module')
def _module_float32_matmuls(request):
  with float32_matmuls() if _marked(request.node) else contextlib.nullcontext():
    yield


@pytest.fixture(autouse=True)
def _test_float32_matmuls(request):
  with float32_matmuls() if _marked(request.node) else contextlib.nullcontext():
    yield


@pytest.fixture(scope='session')
def mnist_dir():
  if not os.path.isdir(MNIST_DIR):
    pytest.fail(f'real MNIST IDX files are needed at {MNIST_DIR} (or set CAPSJAX_MNIST_DIR)')
  return MNIST_DIR
