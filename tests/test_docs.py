"""Every ```python block of README.md, BUILD.md and the pages that hold Python runs as
written, copied alone into a fresh interpreter (every name it uses defined in the block): a
documented example that fails is a bug. Every relative link of the documents resolves, and
the version is one: setup.cfg's, the package's, the CHANGELOG's newest and the command's."""
import configparser
import os
import re
import subprocess
import sys
import textwrap

import jax
import pytest

from capsjax.routing import ROUTINGS, route

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENTS = ('README.md', 'BUILD.md', os.path.join('docs', 'index.md'), os.path.join('docs', 'library.md'),
             os.path.join('docs', 'routing.md'))


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
  registered = set(ROUTINGS.names())
  namespace = {}   # nothing given: a block copied alone runs (a README block once used names it never defined)
  try:
    exec(compile(code, document, 'exec'), namespace)  # pylint: disable=exec-used
    # What each block makes has the shape its comments say: parents [..., batch, out, dim].
    made = [namespace['parents'] if 'parents' in namespace else None,
            namespace['routed'].parents if 'routed' in namespace else None]
    made += [route(name, votes).parents for name in set(ROUTINGS.names()) - registered]   # a block's own routing
    made = [parents for parents in made if parents is not None]
    assert made and all(parents.shape[-3:-2] == (2,) and jax.numpy.all(jax.numpy.isfinite(parents))
                        for parents in made), (document, made)
  finally:
    for name in set(ROUTINGS.names()) - registered:   # a block's own routing: this test's only
      ROUTINGS.unregister(name)


def test_every_document_holds_a_python_block_the_test_found():
  assert {param.values[0] for param in _blocks()} == set(DOCUMENTS)


def _tracked_markdown():
  return subprocess.run(['git', 'ls-files', '*.md'], cwd=ROOT, capture_output=True, text=True,
                        check=True).stdout.split()


def _anchor(heading: str) -> str:
  """GitHub's (and MyST's) anchor of a heading: lower case, punctuation dropped, spaces as -."""
  return re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-')


def test_every_relative_link_resolves():
  broken = []
  for document in _tracked_markdown():
    if document.startswith('benchmarks/results/'):
      continue   # raw files, as written when measured
    text = re.sub(r'^ *```.*?^ *```', '', open(os.path.join(ROOT, document)).read(), flags=re.S | re.M)
    for target in re.findall(r'\]\(([^)\s]+)\)', text):
      if re.match(r'[a-z]+:', target) or target.startswith('#'):
        continue   # a web address; an anchor of the page itself
      path, _, anchor = target.partition('#')
      resolved = os.path.normpath(os.path.join(ROOT, os.path.dirname(document), path))
      if not os.path.exists(resolved):
        broken.append(f'{document}: {target}')
      elif anchor and resolved.endswith('.md'):
        headings = re.findall(r'^#+ (.*)$', open(resolved).read(), re.M)
        if anchor not in {_anchor(heading) for heading in headings}:
          broken.append(f'{document}: {target} (no such heading)')
  assert not broken, broken


def test_the_version_is_one_everywhere():
  import capsjax   # pylint: disable=g-import-not-at-top
  parser = configparser.ConfigParser()
  parser.read(os.path.join(ROOT, 'setup.cfg'))
  newest = re.search(r'^## \[(\d+\.\d+\.\d+)\]', open(os.path.join(ROOT, 'CHANGELOG.md')).read(), re.M).group(1)
  said = subprocess.run([sys.executable, os.path.join(ROOT, 'run.py'), '--version'], capture_output=True, text=True,
                        check=True, timeout=60).stdout.strip()
  assert parser['metadata']['version'] == capsjax.__version__ == newest and said == f'capsjax {newest}'
