"""Shared fixtures: the real MNIST folder beside the repository (../shared/data/mnist)."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MNIST_DIR = os.environ.get('CAPSJAX_MNIST_DIR', os.path.join(ROOT, '..', 'shared', 'data', 'mnist'))


@pytest.fixture(scope='session')
def mnist_dir():
  if not os.path.isdir(MNIST_DIR):
    pytest.fail(f'real MNIST IDX files are needed at {MNIST_DIR} (or set CAPSJAX_MNIST_DIR)')
  return MNIST_DIR
