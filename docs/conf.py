"""Sphinx configuration of capsjax's documentation site (`make -C docs html`).

Sphinx + MyST-NB, as flax and optax build theirs: the pages are Markdown (README.md,
BUILD.md and docs/*.md as they are in the repository), the API reference is generated
from the docstrings of `capsjax.__all__`, and the tutorials are MyST Markdown notebooks
executed at every build (their figures are the executed cells' outputs). Warnings are
errors (the Makefile passes -W).
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import capsjax  # noqa: E402  pylint: disable=wrong-import-position
from capsjax.app import cli as _cli  # noqa: E402  pylint: disable=wrong-import-position

_cli.quiet_libtpu_environment()   # the executed notebooks' kernels inherit it: libtpu silent without TPUs

project = 'capsjax'
author = 'the capsjax developers'
copyright = '2026, the capsjax developers'   # pylint: disable=redefined-builtin
release = version = capsjax.__version__

extensions = [
    'myst_nb',                  # Markdown pages and executed MyST notebooks
    'sphinx.ext.autodoc',       # the API reference, from the docstrings
    'sphinx.ext.autosummary',
    'sphinx.ext.napoleon',      # Google-style Args/Returns sections
    'sphinx.ext.viewcode',
]
exclude_patterns = ['_build', 'jupyter_execute', '.jupyter_cache', 'Thumbs.db', '.DS_Store']

# MyST: $…$ maths, ::: fences, heading anchors for the repository's [text](FILE.md#anchor) links.
myst_enable_extensions = ['dollarmath', 'colon_fence', 'deflist']
myst_heading_anchors = 3

# Tutorials run at every build; a cell that raises fails the build (no stale outputs).
nb_execution_mode = 'force'
# Per cell, in seconds: generous, as a training cell takes minutes on a busy 2-core machine;
# CAPSJAX_DOCS_CELL_TIMEOUT=S sets another (-1: none).
nb_execution_timeout = int(os.environ.get('CAPSJAX_DOCS_CELL_TIMEOUT', '3600'))
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True

# README.md and BUILD.md are pages of the site as they are in the repository, with their
# links rewritten to the site's pages (written here at every build; git ignores them).
SITE_PAGES = {'README.md': ('readme.md', 'capsjax (README)'), 'BUILD.md': ('design.md', 'The design (BUILD.md)'),
              'CHANGELOG.md': ('changelog.md', 'Changelog')}


REPOSITORY_FILES = 'https://github.com/capsjax/capsjax/tree/main/'


def site_links(text: str) -> str:
  """The repository's relative links as links between the site's pages; a link to a file
  outside the site (the raw results under benchmarks/) goes to the repository."""
  text = text.replace('](docs/', '](')
  for folder in ('benchmarks/', 'experiments/', 'capsjax/', 'tests/', 'clusters/'):
    text = text.replace(f'](../{folder}', f']({REPOSITORY_FILES}{folder}').replace(f']({folder}', f']({REPOSITORY_FILES}{folder}')
  for source, (page, _) in SITE_PAGES.items():
    text = text.replace(f'](../{source}', f']({page}').replace(f']({source}', f']({page}')
  return text


for _source, (_page, _title) in SITE_PAGES.items():
  with open(os.path.join(ROOT, _source)) as _f:
    _body = _f.read().split('\n', 1)[1]   # the page's own title replaces the first line
  _text = f'# {_title}\n{site_links(_body)}'
  _path = os.path.join(os.path.dirname(os.path.abspath(__file__)), _page)
  if not os.path.isfile(_path) or open(_path).read() != _text:   # unchanged: Sphinx keeps its cache
    with open(_path, 'w') as _f:
      _f.write(_text)



# The reference pages generated from the code at every build (written only when changed;
# git ignores them): every config key from its declaration, and every command's --help.
HERE = os.path.dirname(os.path.abspath(__file__))
COMMANDS = ('capsjax', 'capsjax-predict', 'capsjax-explorer', 'capsjax-export', 'capsjax-figures',
            'capsjax-segmentation', 'capsjax-multimnist', 'capsjax-plan')


def _write_if_changed(name: str, text: str) -> None:
  path = os.path.join(HERE, name)
  if not os.path.isfile(path) or open(path).read() != text:
    with open(path, 'w') as f:
      f.write(text)


def _config_reference() -> str:
  from capsjax.app.launch import config_lines, registered_programs  # pylint: disable=g-import-not-at-top
  from capsjax.experiments import mnist  # pylint: disable=g-import-not-at-top
  from capsjax.validation import key_help  # pylint: disable=g-import-not-at-top
  registered_programs()   # the programs' sections are declared with the run's keys
  config = mnist.get_config()
  cell = lambda text: text.replace('|', '\\|')
  rows = [f'| `{key}` | `{cell(value)}` | {cell(key_help(key, config))} |'
          for key, _, value in (line.partition(' = ') for line in config_lines(config))]
  return '\n'.join([
      '# Config keys', '',
      "Every key of the `mnist` experiment's config (the paper's model and recipe), with its default, what",
      'it does and the values it allows, generated from the declarations the command checks them by.',
      'Override one as `--config.KEY=VALUE`, or from Python as `config.KEY = VALUE` before',
      '`capsjax.train_and_evaluate`; `capsjax --experiment=NAME --help` lists the keys of another',
      'experiment (the programs and the other model families have sections of their own).', '',
      '| key | default | what it does [allowed values] |', '| --- | --- | --- |', *rows, ''])


def _commands_reference() -> str:
  import subprocess  # pylint: disable=g-import-not-at-top
  parts = ['# Commands', '', "Every command capsjax installs, with what its `--help` prints (generated at every build).", '']
  for command in COMMANDS:
    module = {'capsjax': 'capsjax', 'capsjax-plan': 'capsjax.app.plan'}.get(command)
    argv = ([sys.executable, '-m', module] if module else
            [sys.executable, '-c', f'from capsjax.app import commands; commands.{command.split("-", 1)[1]}()'])
    shown = subprocess.run([*argv, '--help'], capture_output=True, text=True, timeout=120, cwd=ROOT,
                           env=dict(os.environ, COLUMNS='100')).stdout
    shown = shown.replace(os.path.basename(sys.executable) + ' -c', command)
    parts += [f'## `{command}`', '', '```text', shown.rstrip(), '```', '']
  return '\n'.join(parts)


_write_if_changed('config.md', _config_reference())
_write_if_changed('commands.md', _commands_reference())

autodoc_member_order = 'bysource'
autodoc_typehints = 'none'   # the docstrings say the shapes; flax's dataclass signatures are noise
autodoc_default_options = {'members': False}
autosummary_generate = False



def _source_links(app, docname, source):
  del app, docname
  source[0] = site_links(source[0])


# The docstrings are plain text with shape notation (|v|, [batch, …], a * b): escape what
# reStructuredText would read as markup, outside the examples (doctest blocks).
_MARKUP = str.maketrans({'|': r'\|', '*': r'\*'})


def _plain_docstring(app, what, name, obj, options, lines):
  del app, what, name, obj, options
  in_example = False
  for index, line in enumerate(lines):
    stripped = line.strip()
    if stripped.startswith('>>>'):
      in_example = True
    elif not stripped:
      in_example = False
    if not in_example and not stripped.startswith('..'):
      lines[index] = line.translate(_MARKUP)


def setup(app):
  app.connect('source-read', _source_links)
  app.connect('autodoc-process-docstring', _plain_docstring, priority=600)   # after napoleon


html_theme = 'sphinx_book_theme'
html_title = 'capsjax'
html_theme_options = {
    'show_toc_level': 2,
    'repository_url': 'https://github.com/capsjax/capsjax',
    'use_repository_button': False,
}
