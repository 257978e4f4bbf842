"""Every ```python block of README.md, BUILD.md and docs/index.md runs as written: a
documented example that fails is a bug. The arrays a block routes but does not make (the
votes û of a capsule layer, their activations) are given, small."""
import os
import re
import textwrap

import jax
import pytest

from capsjax.routing import ROUTINGS, route

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENTS = ('README.md', 'BUILD.md', os.path.join('docs', 'index.md'))


def _blocks():
  for document in DOCUMENTS:
    text = open(os.path.join(ROOT, document)).read()
    for found in re.finditer(r'^ *```python\n(.*?)^ *```', text, re.S | re.M):
      if 'onnxruntime.InferenceSession' in found.group(1):
        continue   # the serving snippet: run without JAX by tests/test_export.py
      yield pytest.param(document, textwrap.dedent(found.group(1)),
                         id=f'{document}:{text[:found.start()].count(chr(10)) + 1}')


@pytest.mark.parametrize('document, code', list(_blocks()))
def test_every_documented_python_block_runs(document, code):
  votes = jax.random.normal(jax.random.key(0), (2, 6, 3, 4))   # [batch, in, out, dim]
  given = {'prediction_vectors': votes, 'votes': votes, 'input_activations': jax.numpy.ones((2, 6))}
  registered = set(ROUTINGS.names())
  namespace = dict(given)
  try:
    exec(compile(code, document, 'exec'), namespace)  # pylint: disable=exec-used
    # What each block makes has the shape its comments say: parents [batch, out, dim].
    made = [namespace['parents'] if 'parents' in namespace else None,
            namespace['routed'].parents if 'routed' in namespace else None]
    made += [route(name, votes).parents for name in set(ROUTINGS.names()) - registered]   # a block's own routing
    made = [parents for parents in made if parents is not None]
    assert made and all(parents.shape == (2, 3, 4) for parents in made), (document, made)
  finally:
    for name in set(ROUTINGS.names()) - registered:   # a block's own routing: this test's only
      ROUTINGS.unregister(name)


def test_every_document_holds_a_python_block_the_test_found():
  assert {param.values[0] for param in _blocks()} == set(DOCUMENTS)
