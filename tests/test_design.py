"""The package's design, checked by reading its source (BUILD.md "Layers"):
no code compares a registered name to a string literal, imports run downward only, the
experiments are never imported by the library, and the config is read at the boundary."""
import ast
import importlib.util
import os

import pytest

from capsjax.app import launch   # registers every built-in program
from capsjax.data.sources import SOURCES
from capsjax.data.tasks import TASKS
from capsjax.models import MODELS
from capsjax.objectives import OBJECTIVES
from capsjax.routing import ROUTINGS
from helpers import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, 'capsjax')

# Lowest first; a module may import its own layer and the layers below it. The library
# (capsjax/ outside app/) is layers 0-8; the application (capsjax/app/) the layers above.
LAYERS = [
    ('errors', 'registry', 'keys', 'formulations', 'layout', 'ops', 'console', 'events', 'runtime', 'sharding',
     'memory', 'settings'),
    ('routing', 'losses', 'optimization'),
    ('layers',),
    ('models', 'sizing'),
    ('objectives',),
    ('data',),
    ('ensembles', 'steps', 'diagnostics', 'evaluators', 'hooks', 'checkpoints', 'reports', 'workdir'),
    ('assemble', 'experiment', 'defaults', 'validation'),
    ('train', 'stored_config'),
    ('app', 'app.cli', 'app.distributed', 'app.trained', 'app.plots', 'app.multimnist', 'app.serving'),
    ('app.predict', 'app.explorer', 'app.programs'),
    ('app.launch', 'app.plan', 'app.export'),
    ('app.commands',),
    # The package itself (capsjax/__init__.py: the public API, loaded lazily, which points
    # at library and application names alike) and `python -m capsjax`.
    ('', '__main__'),
]
LIBRARY_LAYERS = 9   # layers 0-8
# Modules (besides capsjax.app.programs.*) that may take a ConfigDict `config`: the boundary.
CONFIG_READERS = ('app.launch', 'app.plan', 'validation', 'keys', 'settings', 'assemble', 'experiment', 'train',
                  'stored_config')


def _modules():
  for folder, _, files in os.walk(PACKAGE):
    for name in sorted(files):
      if name.endswith('.py'):
        path = os.path.join(folder, name)
        module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, '.')
        yield module.removesuffix('.__init__'), ast.parse(open(path).read(), path)


def _part(module: str) -> str:
  """The name a module has in LAYERS: 'capsjax.data.idx' → 'data', 'capsjax.app.plan' →
  'app.plan', 'capsjax.app.explorer.server' → 'app.explorer', 'capsjax' → ''."""
  parts = module.split('.')[1:]
  return '.'.join(parts[:2]) if parts[:1] == ['app'] else '.'.join(parts[:1])


def _layer(module: str) -> int:
  part = _part(module)
  for index, names in enumerate(LAYERS):
    if part in names:
      return index
  raise AssertionError(f'{module}: in no layer of tests/test_design.py (add it to LAYERS and BUILD.md)')


def _imports(tree):
  """(imported module, line) of every import, lazy ones inside functions and `__main__`
  blocks included (no circle: no program's `python -m` entry imports capsjax.app.launch)."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from ((alias.name, node.lineno) for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      yield from ((f'{node.module}.{alias.name}', node.lineno) for alias in node.names)


def test_imports_run_downward_and_never_reach_the_experiments():
  problems = []
  for module, tree in _modules():
    for imported, line in _imports(tree):
      if imported.split('.')[0] == 'experiments' or imported.startswith('capsjax.experiments'):
        problems.append(f'{module}:{line} imports {imported}')
      elif imported.startswith('capsjax.') and imported.split('.')[1] not in ('__version__',):
        if _layer(imported) > _layer(module):
          problems.append(f'{module}:{line} imports {imported} from a higher layer')
  assert not problems, '\n'.join(problems)


def test_the_library_never_imports_the_application():
  """capsjax/ outside app/ (what a researcher reads and changes) stands alone: no import of
  capsjax.app, lazy ones included; it is the larger part of the package's lines. (A bound
  on the share beyond the core was dropped when validation moved into the library: the
  structure, layers and no circles, is what is checked.)"""
  library_lines = application_lines = 0
  problems = []
  for module, tree in _modules():
    path = os.path.join(ROOT, *module.split('.'))
    lines = len(open(path + '.py' if os.path.isfile(path + '.py') else os.path.join(path, '__init__.py')).readlines())
    if _part(module).startswith('app') or module in ('capsjax', 'capsjax.__main__'):
      application_lines += lines
      continue
    library_lines += lines
    assert _layer(module) < LIBRARY_LAYERS, module
    problems += [f'{module}:{line} imports {imported}' for imported, line in _imports(tree)
                 if imported == 'capsjax.app' or imported.startswith('capsjax.app.')]
  assert not problems, '\n'.join(problems)
  assert library_lines > application_lines > 0


def _registered_names():
  names = set()
  for registry in (MODELS, OBJECTIVES, ROUTINGS, TASKS, SOURCES, launch.registered_programs()):
    names.update(registry.names())
  return names


def _literals(node):
  if isinstance(node, ast.Constant) and isinstance(node.value, str):
    yield node.value
  elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
    for element in node.elts:
      yield from _literals(element)


def test_no_code_compares_a_registered_name_to_a_literal():
  names = _registered_names()
  assert {'capsnet', 'dynamic', 'multimnist', 'classify', 'sigmoid_xent', 'tfds', 'sweep'} <= names
  problems = []
  for module, tree in _modules():
    for node in ast.walk(tree):
      if not isinstance(node, ast.Compare):
        continue
      sides = [node.left] + list(node.comparators)
      text = ast.unparse(node)
      for literal in (value for side in sides for value in _literals(side)):
        # 'train' is also the name of a split: only a comparison with a program counts.
        if literal in names and (literal != 'train' or 'program' in text):
          problems.append(f'{module}:{node.lineno}: {text}')
  assert not problems, 'ask the registry entry\'s capabilities instead:\n' + '\n'.join(problems)


def test_the_config_is_read_at_the_boundary_only():
  readers = set()
  for module, tree in _modules():
    if module.startswith('capsjax.app.programs.'):
      continue
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
          arg.arg == 'config' for arg in node.args.args + node.args.kwonlyargs):
        readers.add(_part(module))
  assert readers <= set(CONFIG_READERS), sorted(readers - set(CONFIG_READERS))


@pytest.mark.parametrize('module_name', ['steps', 'objectives', 'models', 'layers', 'routing', 'losses', 'hooks'])
def test_the_jitted_path_never_reads_a_config(module_name):
  folder = os.path.join(PACKAGE, module_name)   # a module, or a package's every file
  paths = ([os.path.join(folder, name) for name in sorted(os.listdir(folder)) if name.endswith('.py')]
           if os.path.isdir(folder) else [folder + '.py'])
  reads = [ast.unparse(node) for path in paths for node in ast.walk(ast.parse(open(path).read()))
           if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and 'config' in node.value.id]
  assert len(paths) >= 1 and not reads, reads


def test_the_wheel_lists_every_package_and_installs_the_experiments_under_capsjax():
  """setup.cfg names the packages (experiments/ is installed as capsjax.experiments, never
  as a top-level `experiments`): a new package folder must be added there too."""
  import configparser  # pylint: disable=g-import-not-at-top
  setup = configparser.ConfigParser()
  setup.read(os.path.join(ROOT, 'setup.cfg'))
  listed = set(setup['options']['packages'].split())
  folders = {os.path.relpath(folder, ROOT).replace(os.sep, '.') for folder, _, files in os.walk(PACKAGE)
             if '__init__.py' in files}
  assert listed == folders | {'capsjax.experiments'}
  assert setup['options']['package_dir'].split() == ['capsjax.experiments', '=', 'experiments']
  scripts = dict(line.split(' = ') for line in setup['options.entry_points']['console_scripts'].split('\n') if line)
  from capsjax.app import commands  # pylint: disable=g-import-not-at-top
  for script, target in scripts.items():
    module, function = target.split(':')
    assert module == 'capsjax.app.commands' and callable(getattr(commands, function)), script
    assert f'{script} ' in commands.__doc__, f'{script}: not in capsjax/app/commands.py\'s list'


def test_build_md_is_short_and_its_program_recipe_counts_the_files():
  import re  # pylint: disable=g-import-not-at-top
  text = open(os.path.join(ROOT, 'BUILD.md')).read()
  assert len(text.splitlines()) <= 450, 'BUILD.md: at most 450 lines (move measurements to docs/results.md)'
  stated = int(re.search(r'\*\*A program: (\d+) files\.\*\*', text).group(1))
  # Counted from the code: every built-in program with a config section of its own is
  # imported by launch (registration, which registers its section), and has an experiment.
  modules = dict(_modules())
  imports = {module: {imported for imported, _ in _imports(tree)} for module, tree in modules.items()}
  touched = {}
  for module, tree in modules.items():
    if module.startswith('capsjax.app.programs.') and 'in_base=False' in ast.unparse(tree):
      name = module.rsplit('.', 1)[1]
      importers = {importer for importer, imported in imports.items() if importer != module and module in imported}
      experiments = [f for f in os.listdir(os.path.join(ROOT, 'experiments')) if f.startswith(name)]
      touched[name] = 1 + len(importers & {'capsjax.app.launch'}) + bool(experiments)
  assert touched and set(touched.values()) == {stated}, (stated, touched)


def test_the_import_graph_has_no_cycle():
  modules = dict(_modules())

  def module_of(imported):   # 'capsjax.assemble.overridden' → 'capsjax.assemble'
    while imported and imported not in modules:
      imported = imported.rpartition('.')[0]
    return imported

  graph = {module: {module_of(imported) for imported, _ in _imports(tree) if module_of(imported)} - {module}
           for module, tree in modules.items()}
  # Strongly connected components (Tarjan), each of more than one module a cycle.
  index, low, stack, on_stack, cycles = {}, {}, [], set(), []

  def visit(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for other in graph[node]:
      if other not in index:
        visit(other)
        low[node] = min(low[node], low[other])
      elif other in on_stack:
        low[node] = min(low[node], index[other])
    if low[node] == index[node]:
      component = set()
      while True:
        member = stack.pop()
        on_stack.discard(member)
        component.add(member)
        if member == node:
          break
      if len(component) > 1:
        cycles.append(frozenset(component))

  for node in graph:
    if node not in index:
      visit(node)
  assert not cycles, [sorted(c) for c in cycles]


def test_the_library_s_longest_import_chain_is_short_and_the_workdir_keeps_the_directory():
  """The library (capsjax/ without app/) imported module by module: its longest chain of
  module-level imports (what importing the first loads through the others; a subpackage,
  data/ or routing/, counts once) is at most 9 modules (11 before the settings, the stored
  config and validation had modules of their own: issue 70); workdir.py keeps the
  directory (lock, status, files) in at most 300 lines."""
  import functools  # pylint: disable=g-import-not-at-top
  modules = {module: tree for module, tree in _modules() if not _part(module).startswith('app')
             and module not in ('capsjax', 'capsjax.__main__')}
  graph = {}
  for module, tree in modules.items():
    imported = set()
    for node in tree.body:   # module level: the imports a module's own import runs
      if isinstance(node, ast.Import):
        imported.update(alias.name for alias in node.names)
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        imported.update(f'{node.module}.{alias.name}' if f'{node.module}.{alias.name}' in modules else node.module
                        for alias in node.names)
    graph.setdefault(_part(module), set()).update(_part(name) for name in imported if name in modules)
  for part, edges in graph.items():
    edges.discard(part)

  @functools.lru_cache(maxsize=None)
  def longest(part):
    return max([(part,)] + [(part,) + longest(other) for other in sorted(graph[part])], key=len)
  chain = max((longest(part) for part in sorted(graph)), key=len)
  assert len(chain) <= 9, ' → '.join(chain)
  assert len(open(os.path.join(PACKAGE, 'workdir.py')).readlines()) <= 300


def test_the_trainer_is_short():
  """The loop and its concerns read in one sitting (big_vision's trainer: 518 lines)."""
  lines = sum(len(open(os.path.join(PACKAGE, name)).readlines()) for name in ('train.py', 'hooks.py'))
  assert lines <= 600, f'train.py + hooks.py: {lines} lines (at most 600)'


def test_no_config_read_repeats_a_declared_default():
  """A validated config holds every declared key: `config.get(key, default)` would repeat
  (and could contradict) the declaration. Only validation, which reads partial configs,
  may ask for a key that is missing, and then at its declared default."""
  problems = []
  for module, tree in _modules():
    if module == 'capsjax.validation':
      continue
    for node in ast.walk(tree):
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == 'get'
          and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)):
        receiver = ast.unparse(node.func.value)
        if 'config' in receiver or receiver.split('.')[-1] in ('model', 'section', 'evals'):
          problems.append(f'{module}:{node.lineno}: {ast.unparse(node)}')
  assert not problems, '\n'.join(problems)


def test_every_module_s_keys_are_collected_by_the_fixed_lists():
  """Run-level keys are data (a module's `KEYS`), collected by name: the library's by
  defaults.SECTIONS, the experiment programs' sections as their programs register
  (defaults.registered_sections). A module whose KEYS no list names would have keys that
  no config, rule or --help knows."""
  from capsjax import defaults  # pylint: disable=g-import-not-at-top
  declaring = {module for module, tree in _modules()
               if any(isinstance(node, ast.Assign) and any(getattr(t, 'id', None) == 'KEYS' for t in node.targets)
                      for node in tree.body)}
  collected = {module.__name__ for module in defaults.SECTIONS + defaults.registered_sections()}
  assert declaring == collected, (sorted(declaring - collected), sorted(collected - declaring))
  assert len(defaults.run_keys(defaults.registered_sections())) > 60


def test_the_config_from_the_training_entry_point_reaches_few_modules_in_one_pass(mnist_dir, tmp_path):
  """BUILD.md's config boundary: the config (or a piece of it), followed from
  train_and_evaluate through every capsjax function entered with it, reaches at most 9
  modules (its check, capsjax.validation, and its settings, capsjax.settings, among them)
  and comes back to one it had left at most 5 times (benchmarks/design_report.py
  prints the path)."""
  from capsjax import train  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location('design_report', os.path.join(ROOT, 'benchmarks', 'design_report.py'))
  report = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(report)
  with report.config_probe() as path:
    train.train_and_evaluate(tiny_config(mnist_dir, num_steps=2), str(tmp_path))
  assert len(set(path)) <= 9 and report.returns(path) <= 5, ' → '.join(path)


def test_no_library_function_is_over_80_lines():
  """A function of the library (capsjax/ outside app/) reads in one screen: at most 80 lines,
  its docstring included (issue 97: train's loop and Procedure 1 were 94 and 98)."""
  long = [f'{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines' for module, tree in _modules()
          if not _part(module).startswith('app') for node in ast.walk(tree)
          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80]
  assert not long, long
