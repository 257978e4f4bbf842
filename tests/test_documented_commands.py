"""Every command of README.md, BUILD.md and docs/ runs in the suite as written (tests/documented.py
finds them): a documented example that fails is a bug.

How each is run:
- training commands (`capsjax`, `python run.py`, docs/gpu.md's `gpu.sh leg NAME …`) and
  `capsjax-plan` through their own front ends in one process (tests/command_checks.py): the
  flags, the experiment, every override, validation and the model built, or the plan's
  target, devices and batch, in seconds; a real run of each program is its own test's;
- the benchmarks' commands: each script's own parser takes the documented flags;
- the commands of a trained run (figures, segmentation, predict, export, the explorer, the
  GPU steps) in the tests that already train one: they take the documented words from
  here (documented.command with a pattern, in their source), placeholders replaced, at a small size;
- `pip install`: the extras and pins they name exist; the test, site and wheel commands are
  the ones .ci/run runs.
"""
import configparser
import importlib.util
import os
import re

import numpy as np
from PIL import Image

import command_checks
import documented

ROOT = documented.ROOT

TRAINING = re.compile(r'^(capsjax|python run\.py|python -m capsjax|bash benchmarks/gpu\.sh leg \S+)( |$)')
PLAN = re.compile(r'^capsjax-plan ')
SCRIPT = re.compile(r'^python benchmarks/\w+\.py( |$)')
PIP = re.compile(r'^pip install ')
ENVIRONMENT = re.compile(r'^export ([A-Z_]+)=')
# Commands no test can run as written, and what checks them instead.
NOT_RUN = {
    r'^tensorboard ': "TensorBoard's own command: the event files it reads are test_images.py's "
                      '(test_events_hold_the_curves_and_reconstructions)',
    r'gpu\.sh carry$': 'downloads wheels for a GPU machine without internet; the wheels it '
                        "lists are the ones gpu.sh's environment() installs there",
    r'gpu\.sh suite$': 'runs this suite (on the GPU machine)',
    r'gpu\.sh report$': "device_report.py --out DIR, whose flags the benchmarks' check parses and whose "
                             'cells the speed rehearsal runs (test_gpu_readiness.py)',
}
# The documents' placeholders, as the checks replace them (a folder of images for DIR).
PLACEHOLDERS = {'TARGET': 'v5e:2x2', '--config.batch_size=8×DEVICES': '--config.batch_size=32',
                '--config.eval_batch_size=32×DEVICES': '--config.eval_batch_size=128'}


def _ways(command, claimed, ci_lines):
  """The ways the suite runs `command` (a test asserts there is at least one)."""
  text = command.text
  ways = [f'claimed by {name}' for pattern, name in claimed.items() if re.search(pattern, text)]
  ways += [f'not run: {why}' for pattern, why in NOT_RUN.items() if re.search(pattern, text)]
  for kind, pattern in (('training', TRAINING), ('plan', PLAN), ('script', SCRIPT), ('pip', PIP),
                        ('environment', ENVIRONMENT)):
    if pattern.search(text):
      ways.append(kind)
  if text in ci_lines:
    ways.append('.ci/run')
  return ways


def _ci_lines():
  return {line.strip() for line in open(os.path.join(ROOT, '.ci', 'run'))}


def test_every_documented_command_is_run_by_the_suite():
  claimed = documented.claimed_patterns()
  commands = documented.commands()
  assert len(commands) > 60 and {c.document for c in commands} >= {'README.md', 'docs/gpu.md', 'docs/planning.md',
                                                                      'docs/results.md', 'docs/serving.md'}
  unchecked = [str(c) for c in commands if not _ways(c, claimed, _ci_lines())]
  assert not unchecked, 'documented commands no test runs:\n' + '\n'.join(unchecked)
  for pattern in NOT_RUN:   # no stale entries
    assert any(re.search(pattern, c.text) for c in commands), pattern
  for pattern in claimed:   # each claim finds a documented command
    documented.commands_like(pattern)


def _image_folder(folder):
  """DIR of README's image-folder command: two classes of two 28×28 PNGs per split."""
  for split in ('train', 'test'):
    for name in ('circle', 'cross'):
      os.makedirs(folder / split / name)
      for k in range(2):
        Image.fromarray(np.full((28, 28), 60 * k + (100 if name == 'cross' else 0), np.uint8)).save(
            folder / split / name / f'{k}.png')
  return str(folder)


def _plan_can_run(command) -> bool:
  """A plan needs libtpu (a TPU target) or the CUDA plugin in .gpu-plan (a GPU target), as
  tests/test_plan.py's plans do: without them, outside CI, it is left out (under CI=true
  .ci/run installs both, and a missing one fails)."""
  if os.environ.get('CI', '').lower() == 'true':
    return True
  target = re.search(r'--target=(\S+)', command.text).group(1)
  if target == 'list':
    return True
  if re.match(r'h[12]00', target):
    return os.path.isdir(os.path.join(ROOT, '.gpu-plan'))
  return importlib.util.find_spec('libtpu') is not None


def _check_argv(command, placeholders):
  if PLAN.search(command.text):
    return ['plan', [word.replace('8×DEVICES', '32').replace('32×DEVICES', '128')
                     for word in command.args(placeholders)]]
  if SCRIPT.search(command.text):
    return ['script', [command.words[1], *command.args(placeholders)]]
  args = command.args(placeholders)
  if command.words[0] == 'bash':   # gpu.sh leg NAME RUN_FLAGS…: run.py RUN_FLAGS…
    args = args[2:]
  return ['training', args]


def test_documented_training_plan_and_benchmark_commands_check_as_written(mnist_dir, tmp_path):
  placeholders = dict(PLACEHOLDERS, DIR=_image_folder(tmp_path / 'images'))
  placeholders.update({'/path/to/mnist': mnist_dir, '../shared/data/mnist': mnist_dir})
  commands = [c for c in documented.commands() if TRAINING.search(c.text) or SCRIPT.search(c.text)
              or (PLAN.search(c.text) and _plan_can_run(c))]
  checks = [_check_argv(c, placeholders) for c in commands]
  assert {kind for kind, _ in checks} >= {'training', 'script'}
  env = dict(os.environ, CAPSJAX_GPU_PLAN=os.path.join(ROOT, '.gpu-plan'))   # .ci/run fills it
  results = command_checks.run(checks, cwd=tmp_path, env=env)
  failed = [f'{c}\n    {r["stderr"].strip()[-500:]}' for c, r in zip(commands, results) if r['status'] != 0]
  assert not failed, 'documented commands that fail as written:\n' + '\n'.join(failed)
  said = {c.text: r['stdout'] for c, r in zip(commands, results)}
  assert 'num_params=8215568' in said['capsjax --experiment=mnist --workdir=workdirs/mnist']   # the paper's 8.2M
  # The headline plan on a 256-chip slice plans the paper's batch of 128 at one example per chip.
  headline = 'capsjax-plan --experiment=mnist --target=v5e:16x16'
  if headline in said or os.environ.get('CI', '').lower() == 'true':   # (without libtpu, outside CI: left out)
    assert 'planned: batch 256 over 256 devices; config.batch_size=128 is smaller' in said[headline]


def test_documented_installs_name_extras_and_pins_that_exist():
  setup = configparser.ConfigParser()
  setup.read(os.path.join(ROOT, 'setup.cfg'))
  extras = set(setup['options.extras_require'])
  pins = dict(re.findall(r'^([\w.-]+)==(\S+)', open(os.path.join(ROOT, 'constraints.txt')).read(), re.M))
  installs = [c for c in documented.commands() if PIP.search(c.text)]
  assert len(installs) >= 5
  for install in installs:
    for named in re.findall(r'\[([\w,-]+)\]', install.text):
      assert set(named.split(',')) <= extras, install
    for package, version in re.findall(r'([\w.-]+)==(\S+)', install.text):
      assert pins.get(package) == version, (install, package, pins.get(package))
    assert '-c constraints.txt' not in install.text or os.path.exists(os.path.join(ROOT, 'constraints.txt'))
  # README's install for the tests is the one CI makes.
  ci_extras = re.search(r"-e '\.\[([\w,-]+)\]'", open(os.path.join(ROOT, '.ci', 'run')).read()).group(1)
  assert documented.command(r'^pip install -c constraints.txt -e ').text.endswith(f"'.[{ci_extras}]'")


def test_documented_test_site_and_wheel_commands_are_ci_s_and_its_variables_are_read():
  ci = [c for c in documented.commands() if c.text in _ci_lines()]
  assert {c.text for c in ci} >= {'python -m pytest -q -n 2 tests', 'make -C docs html', '.ci/check_wheel'}
  for command in documented.commands():
    variable = ENVIRONMENT.search(command.text)
    if variable:
      assert variable.group(1) in open(os.path.join(ROOT, 'tests', 'conftest.py')).read(), command
