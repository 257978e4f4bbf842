"""Prints the MNIST IDX folder the tutorials read (capsjax.data.idx.find_mnist: the tests'
rule: $CAPSJAX_MNIST_DIR, ../shared/data/mnist beside the repository, else downloaded once
into ~/.cache/capsjax/mnist); offline without any, one `error:` line and exit 2."""
import os
import sys

from capsjax.data.idx import find_mnist
from capsjax.errors import DataError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if __name__ == '__main__':
  try:
    print(os.path.abspath(find_mnist([os.path.join(ROOT, '..', 'shared', 'data', 'mnist')])))
  except DataError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
