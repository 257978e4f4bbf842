"""Shared fixtures: the real MNIST folder beside the repository (../shared/data/mnist), and
the `float32_matmuls` marker.

JAX runs float32 matmuls and convolutions as TF32 on a GPU by default (about 1e-3
relative error), full float32 on a CPU. A test that compares two formulations, ensemble
members or a plain reference at float32 tolerances carries the marker (on the test, or
`pytestmark` for a module, which also covers its module-scoped fixtures): it then runs with
`jax_default_matmul_precision='highest'` set globally, so that every thread (a test
server's too) computes at full float32 on any backend.

Compilation dominates the suite's time on a CPU, and many tests (and the commands they
run in subprocesses) compile the same programs: one JAX persistent compilation cache per
suite run, in a fresh temporary folder that the pytest-xdist workers and every subprocess
inherit through the environment, removed at the end (what it saves: docs/results.md, "The
test suite in CI"). The same way they inherit glibc's huge-pages tunable (below).
"""
import atexit
import contextlib
import os
import shutil
import sys
import tempfile

if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:   # set before JAX reads its flags
  _cache_dir = tempfile.mkdtemp(prefix='capsjax-tests-jax-cache-')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _cache_dir
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)   # the process that made it

# Huge pages for the workers and subprocesses, as every capsjax command gives itself
# (capsjax.cli.huge_pages_environment; glibc reads the tunable at process start, so this
# process keeps 4 KiB pages; docs/results.md, "Huge pages").
from capsjax import cli as _cli  # pylint: disable=g-import-not-at-top,wrong-import-position
os.environ.update(_cli.huge_pages_environment() or {})
_cli.quiet_libtpu_environment()   # libtpu (the tpu extra, for capsjax.plan) silent on a machine without TPUs

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:   # benchmarks/ (not installed) is importable by tests, from any directory
  sys.path.insert(0, ROOT)

MNIST_DIR = os.environ.get('CAPSJAX_MNIST_DIR', os.path.join(ROOT, '..', 'shared', 'data', 'mnist'))
MARKER = 'float32_matmuls'


def pytest_configure(config):
  config.addinivalue_line('markers', f'{MARKER}: run with full float32 matmuls and convolutions '
                          '(no TF32 on a GPU); for tests that compare formulations, members or a reference')
  config.addinivalue_line('markers', 'slow: trains, compiles a paper-size model or runs a program end to end '
                          '(CI runs every test; `-m "not slow"` is the quick loop while editing)')


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
  """$CAPSJAX_MNIST_DIR, ../shared/data/mnist, else downloaded once (capsjax.data.idx.find_mnist).
  Without any (a clone offline), the tests that need MNIST skip, saying which variable to
  set; under CI=true they fail, as CI must run them."""
  from capsjax.data.idx import find_mnist  # pylint: disable=g-import-not-at-top
  from capsjax.errors import DataError  # pylint: disable=g-import-not-at-top
  try:
    return find_mnist([MNIST_DIR])
  except DataError as e:
    if os.environ.get('CI', '').lower() == 'true':
      pytest.fail(str(e))
    pytest.skip(f'needs the MNIST IDX files: set CAPSJAX_MNIST_DIR to a folder of them ({e})')
