"""run.py and `python -m capsjax` (the `capsjax` command): the summary, and one clear error
line (no traceback) for bad input."""
import importlib
import os
import subprocess
import sys

import pytest

from capsjax.app import cli, launch
import command_checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, cwd=ROOT, env=None):
  return subprocess.run([sys.executable, os.path.join(ROOT, 'run.py'), *args], cwd=cwd,
                        capture_output=True, text=True, timeout=300, env=env)


def test_summary_prints_the_paper_count_and_good_xla_flags_pass_through():
  result = run('--experiment=mnist', '--summary', env=dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=2'))
  assert result.returncode == 0, result.stderr
  lines = result.stdout.strip().splitlines()
  assert lines[-1] == 'num_params=8215568'
  assert any(line.startswith('digit_caps/weights') and '(1152, 10, 16, 8)' in line for line in lines)


SUMMARY_WITHOUT_DECODER = ['--experiment=mnist', '--summary', '--config.model.use_decoder=False']


def test_summary_follows_config_overrides(front_end):
  result = front_end[tuple(SUMMARY_WITHOUT_DECODER)]
  assert result['status'] == 0, result
  assert result['stdout'].strip().splitlines()[-1] == 'num_params=6804224'


# Each through the command's own front end, all in one process (tests/command_checks.py);
# a few as real commands below, for what only a process of its own shows.
BAD_ARGUMENTS = [
    (['--experiment=nope', '--workdir=/tmp/x'], "unknown experiment 'nope'"),
    (['--experiment=mnist', '--config.no_such_key=1', '--summary'], "error: unknown config key 'no_such_key'"),
    (['--experiment=mnist', '--config.learning_rte=1', '--summary'],
     "error: unknown config key 'learning_rte' (did you mean 'learning_rate'?)"),
    (['--experiment=mnist', '--config.model.rouitng=em', '--summary'],
     "error: unknown config key 'model.rouitng' (did you mean 'model.routing'?)"),
    (['--experiment=mnist', '--config.model.routing=em', '--config.model.routing_options.em.temperature=2',
      '--summary'],
     "error: unknown config key 'model.routing_options.em.temperature'; routing 'em' takes the options "
     "model.routing_options.em.inverse_temperature, model.routing_options.em.variance_epsilon"),
    (['--experiment=mnist', '--config.model.routing=em', '--config.model.routing_options.inverse_temperature=2',
      '--summary'],
     "error: unknown config key 'model.routing_options.inverse_temperature'; routing 'em' takes the options "
     "model.routing_options.em.inverse_temperature, model.routing_options.em.variance_epsilon"),
    (['--experiment=mnist', '--config.batch_size=abc', '--summary'],
     "error: config.batch_size='abc': allowed an integer >= 1"),
    (['--workdir=/tmp/x'], '--experiment=NAME is required'),
    (['--experiment=mnist', '--workdir=/tmp/x', '--config.ensemble.seeds=(0,1,2)'],
     "error: --config.ensemble.seeds: experiment 'mnist' has no 'ensemble' section (config.ensemble is None there); "
     'experiments with one: ablation, '),
    (['--experiment=mnist', '--workdir=/tmp/x', '--config.routing_probe_iterations=0'],
     "unknown config key 'routing_probe_iterations' (it is config.evals.routing_probe.iterations now; 0 (off) is "
     '--config.evals.routing_probe.enabled=False)'),
    (['--experiment=ablation', '--workdir=/tmp/x', '--config.program=nope'],
     "config.program='nope': allowed one of train, "),   # (then the programs in the order they registered)
    (['--experiment=sweep_smoke', '--workdir=/tmp/x', '--config.sweep.variants=("a: learning_rat=1",)'],
     "sweep override 'learning_rat': no such config key"),
    # A key path that is not made of Python names: ml_collections would end in a traceback.
    (['--experiment=mnist', '--config.batch-size=1', '--summary'],
     "error: unknown config key 'batch-size' (did you mean 'batch_size'?)"),
    (['--experiment=mnist', '--config.evals.routing-probe.enabled=False', '--summary'],
     "error: unknown config key 'evals.routing-probe.enabled' (did you mean 'evals.routing_probe.enabled'?)"),
    (['--experiment=mnist', '--config.model.routing_options.variational-bayes.prior_extra_dof=2', '--summary'],
     "error: unknown config key 'model.routing_options.variational-bayes.prior_extra_dof'"),
    (['--experiment=mnist_smoke', '--workdir=/tmp/x', '--config.warmup_steps=100', '--config.num_steps=2'],
     'error: config.warmup_steps=100: allowed below num_steps=2 (the run would end inside the warm-up'),
    # Finite in float64, infinite as the float32 the computation uses: refused, no warnings.
    (['--experiment=mnist', '--workdir=/tmp/x', '--config.loss.reconstruction_weight=1e300'],
     'error: config.loss.reconstruction_weight=1e+300: allowed a finite number >= 0'),
    (['--experiment=mnist', '--workdir=/tmp/x', '--config.lr_min=0.1'],
     'error: config.lr_min=0.1: allowed below learning_rate=0.001 (the exponential decay is floored at it'),
    # An ensemble over r with a routing that does not iterate: identical members, refused.
    (['--experiment=ablation', '--workdir=/tmp/x', '--config.model.routing=uniform'],
     "error: config.ensemble.routing_iterations=(1, 3): routing 'uniform' does not iterate, so every member would be "
     'the same model; vary seeds, or choose an iterative routing (dynamic, '),
    # A bucket (what TPU pods write to elsewhere): refused before any folder named gs: is made.
    (['--experiment=mnist_smoke', '--workdir=gs://bucket/runs/mnist'],
     "error: workdir 'gs://bucket/runs/mnist': a bucket is not a workdir (runs write files and lock them); mount it "
     '(gcsfuse --implicit-dirs BUCKET /mnt/BUCKET) and give the mounted path'),
]


@pytest.fixture(scope='module')
def front_end(tmp_path_factory):
  """This module's commands through capsjax's front end in one process: {argv: result}."""
  commands = [args for args, _ in BAD_ARGUMENTS] + [SUMMARY_WITHOUT_DECODER]
  folder = tmp_path_factory.mktemp('front_end')
  results = command_checks.run([['capsjax', args] for args in commands], cwd=folder)
  assert not os.listdir(folder)   # no workdir made, and no local folder named gs:
  return dict(zip(map(tuple, commands), results))


@pytest.mark.parametrize('args,message', BAD_ARGUMENTS)
def test_bad_arguments_give_one_line(args, message, front_end):
  result = front_end[tuple(args)]
  assert result['status'] == 2, result
  assert result['stderr'].strip().count('\n') == 0, result['stderr']
  assert message in result['stderr'] and 'Traceback' not in result['stderr']


@pytest.mark.parametrize('index', [0, 2, 15])   # the experiment's name, a key, a value: each a real command
def test_bad_arguments_end_the_command_with_one_line(index):
  args, message = BAD_ARGUMENTS[index]
  result = run(*args)
  assert result.returncode == 2
  assert result.stderr.strip().count('\n') == 0, result.stderr
  assert message in result.stderr and 'Traceback' not in result.stderr


MALFORMED_XLA_FLAGS = [
    ('--xla_force_host_platform_device_count=abc',
     'error: XLA_FLAGS: --xla_force_host_platform_device_count=abc: a value this XLA flag does not take'),
    ('--no_such_xla_flag=1', 'error: XLA_FLAGS: unknown XLA flag --no_such_xla_flag=1'),
    ('--xla_force_host_platform_device_count=2 8', "error: XLA_FLAGS: '8' is not an XLA flag"),
    ('flags.txt', "error: XLA_FLAGS='flags.txt': not flags (--name=value …) and not a file of flags"),
    ('   ', "error: XLA_FLAGS='   ': only white space; unset it or give flags"),
    ('\t', "error: XLA_FLAGS='\\t': only white space; unset it or give flags"),
]


@pytest.mark.parametrize('xla_flags, message', MALFORMED_XLA_FLAGS)
def test_malformed_xla_flags_are_one_line(xla_flags, message):
  # What every command checks before JAX starts (capsjax.app.cli.check_xla_flags); XLA
  # itself reads the names and values, in the probe process.
  assert f'error: {cli.xla_flags_problem(dict(os.environ, XLA_FLAGS=xla_flags))}'.startswith(message)


@pytest.mark.parametrize('command, case', [
    (['run.py', '--experiment=mnist', '--summary'], 1),   # XLA's own word, from the probe
    (['run.py', '--experiment=mnist', '--summary'], 2),   # the form
    (['-m', 'capsjax.app.predict', 'x.png'], 0),   # the other commands, through capsjax.app.cli.run_program
    (['-m', 'capsjax.app.predict', 'x.png'], 4),
])
def test_malformed_xla_flags_end_the_command_before_jax_starts(command, case):
  xla_flags, message = MALFORMED_XLA_FLAGS[case]
  result = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, XLA_FLAGS=xla_flags))
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr[-2000:]
  assert result.stderr.startswith(message), result.stderr


@pytest.mark.parametrize('module', ['capsjax.app.predict', 'capsjax.app.explorer', 'capsjax.app.export',
                                    'capsjax.app.programs.figures', 'capsjax.app.programs.segmentation',
                                    'capsjax.app.multimnist'])
def test_a_backend_jax_cannot_start_is_one_line_for_every_command(module, tmp_path):
  args = {'capsjax.app.predict': ['x.png'], 'capsjax.app.multimnist': [f'--out={tmp_path}/pairs.npz']}.get(
      module, [f'--workdir={tmp_path}'])
  result = subprocess.run([sys.executable, '-m', module] + args, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS='tpu'))
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr[-2000:]
  assert result.stderr.startswith("error: JAX cannot start the backend JAX_PLATFORMS='tpu' asks for"), result.stderr


def test_python_m_capsjax_is_run_py_from_any_directory(tmp_path):
  """`python -m capsjax` (what the installed `capsjax` command runs) finds the experiments
  as the package capsjax.experiments, from outside the checkout too."""
  listed = subprocess.run([sys.executable, '-m', 'capsjax', '--help'], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
  assert listed.returncode == 0, listed.stderr
  experiments = {name[:-3] for name in os.listdir(os.path.join(ROOT, 'experiments')) if not name.startswith('_')}
  assert experiments == {line.split()[0] for line in listed.stdout.split('Experiments')[1]
                                                 .splitlines()[1:] if line.startswith('  ')}
  bad = subprocess.run([sys.executable, '-m', 'capsjax', '--experiment=nope'], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
  assert bad.returncode == 2 and bad.stderr.startswith("error: unknown experiment 'nope'; available: ablation")
  gone = subprocess.run([sys.executable, '-c', 'import experiments'], cwd=tmp_path, capture_output=True, text=True)
  assert gone.returncode != 0 and 'ModuleNotFoundError' in gone.stderr


def test_missing_data_dir_gives_one_line_and_leaves_no_workdir(tmp_path):
  (tmp_path / 'a_file').write_text('')
  for data_dir, problem in (('missing', 'does not exist'), ('a_file', 'is a file, not a directory')):
    result = run('--experiment=mnist_smoke', f'--workdir={tmp_path}/w', f'--config.data_dir={tmp_path}/{data_dir}')
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f'error: data directory {tmp_path}/{data_dir} {problem}']
    assert not os.path.exists(tmp_path / 'w')   # a failed start removes the workdir it created


@pytest.mark.parametrize('experiment,lines', [
    # conv1 9·9·3·64+64, primary 9·9·64·96+96, W 1024·10·8·6, decoder 80→512→1024→3072.
    ('svhn', ['num_params=4720480']),
    # conv1 9·9·3·256+256, primary 9·9·256·512+512, W 1024·10·16·8, no decoder; 7 members.
    ('cifar10_ensemble', ['ensemble: 7 models × 11,990,528 = 83,933,696 parameters', 'num_params=11990528']),
])
def test_summary_of_the_other_datasets_models(experiment, lines, capsys):
  config = importlib.import_module(f'capsjax.experiments.{experiment}').get_config()
  launch.print_summary(config)
  assert capsys.readouterr().out.strip().splitlines()[-len(lines):] == lines


def test_a_program_stopped_inside_a_run_exits_75(mnist_dir, tmp_path):
  # The sweep's first variant stops at step 2 (as a preemption would): exit 75, one line
  # saying where, no traceback.
  common = ['--experiment=sweep_smoke', f'--workdir={tmp_path}/w', f'--config.data_dir={mnist_dir}',
            '--config.model.conv1_channels=8', '--config.model.primary_types=2',
            '--config.model.decoder_hidden=(16,32)', '--config.num_train_examples=128',
            '--config.num_test_examples=50', '--config.eval_batch_size=50', '--config.num_steps=3',
            '--config.checkpoint_every_steps=1', '--config.sweep.variants=("base:","fast: learning_rate=3e-3")']
  stopped = run(*common, '--config.stop_at_step=2')
  assert stopped.returncode == 75, stopped.stderr[-2000:]
  assert 'Traceback' not in stopped.stdout + stopped.stderr and not stopped.stderr.strip()
  assert 'stopped at step 2 of 3 (stop_at_step); run again to resume' in stopped.stdout
  # (Resuming the same workdir to the finished table: tests/test_analyses.py, in process.)


@pytest.mark.parametrize('environ, thp_mode, libc, expected', [
    ({}, 'always [madvise] never', ('glibc', '2.36'), 'glibc.malloc.hugetlb=1'),
    ({'GLIBC_TUNABLES': 'glibc.malloc.arena_max=2'}, 'always [madvise] never', ('glibc', '2.35'),
     'glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1'),
    ({'CAPSJAX_HUGE_PAGES': '0'}, 'always [madvise] never', ('glibc', '2.36'), None),          # declined
    ({'CAPSJAX_HUGE_PAGES': ' False'}, 'always [madvise] never', ('glibc', '2.36'), None),
    ({'CAPSJAX_HUGE_PAGES': 'no'}, 'always [madvise] never', ('glibc', '2.36'), None),
    ({'CAPSJAX_HUGE_PAGES': 'yes'}, 'always [madvise] never', ('glibc', '2.36'), 'glibc.malloc.hugetlb=1'),
    ({'GLIBC_TUNABLES': 'glibc.malloc.hugetlb=0'}, 'always [madvise] never', ('glibc', '2.36'), None),   # theirs
    ({}, '[always] madvise never', ('glibc', '2.36'), None),    # every large mapping has them already
    ({}, 'always madvise [never]', ('glibc', '2.36'), None),
    ({}, 'always [madvise] never', ('glibc', '2.31'), None),    # no such tunable before 2.35
    ({}, 'always [madvise] never', ('', ''), None),             # musl
])
def test_huge_pages_are_asked_for_only_where_they_change_something(environ, thp_mode, libc, expected):
  from capsjax.app import cli  # pylint: disable=g-import-not-at-top
  environment = cli.huge_pages_environment(environ, thp_mode, libc)
  assert (environment or {}).get('GLIBC_TUNABLES') == expected
  if environment is not None:   # the rest of the environment is kept
    assert {k: v for k, v in environment.items() if k != 'GLIBC_TUNABLES'} == {
        k: v for k, v in environ.items() if k != 'GLIBC_TUNABLES'}


def test_commands_keep_what_they_compile_in_the_user_s_cache_folder(tmp_path):
  # JAX's persistent compilation cache for predict, the explorer, figures, segmentation and
  # export: their next start reuses what this one compiled (docs/results.md, "CPU speed").
  from capsjax.app import cli  # pylint: disable=g-import-not-at-top
  folder = str(tmp_path / 'xdg' / 'capsjax' / 'xla' / cli.cpu_folder_name())
  assert cli.compilation_cache_environment({'XDG_CACHE_HOME': str(tmp_path / 'xdg')}) == {
      'JAX_COMPILATION_CACHE_DIR': folder, 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0'}
  assert os.path.isdir(folder)
  assert cli.compilation_cache_environment({'HOME': str(tmp_path / 'home')})['JAX_COMPILATION_CACHE_DIR'].startswith(
      f'{tmp_path}/home/.cache/capsjax/xla/')
  (tmp_path / 'file').touch()   # a cache folder that cannot be made: none, no warning
  for declined in ({'JAX_COMPILATION_CACHE_DIR': '/elsewhere'}, {'CAPSJAX_COMPILATION_CACHE': 'off'},
                   {'XDG_CACHE_HOME': str(tmp_path / 'file')}):
    assert cli.compilation_cache_environment(declined) == {}
  with pytest.raises(cli.ConfigError, match=r"^CAPSJAX_COMPILATION_CACHE='later': allowed 1/true/yes/on or "):
    cli.compilation_cache_environment({'CAPSJAX_COMPILATION_CACHE': 'later'})
  # A command (run_program) sets it before JAX reads its flags.
  env = {k: v for k, v in os.environ.items() if k not in ('JAX_COMPILATION_CACHE_DIR', 'XLA_FLAGS')}
  program = ('import jax; from capsjax.app import cli; cli.run_program(lambda: print(jax.config.jax_compilation_cache_dir, '
             'jax.config.jax_persistent_cache_min_compile_time_secs) or 0)')
  result = subprocess.run([sys.executable, '-c', program], capture_output=True, text=True, timeout=60,
                          env=dict(env, XDG_CACHE_HOME=str(tmp_path / 'xdg'), CAPSJAX_HUGE_PAGES='0'))
  assert result.returncode == 0 and result.stdout.split() == [folder, '0.0'], result.stderr[-2000:]


def test_a_huge_pages_switch_of_another_word_is_one_line():
  result = subprocess.run([sys.executable, '-m', 'capsjax.app.predict', 'x.png'], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, CAPSJAX_HUGE_PAGES='garbage'))
  assert result.returncode == 2 and result.stderr.strip().splitlines() == [
      "error: CAPSJAX_HUGE_PAGES='garbage': allowed 1/true/yes/on or 0/false/no/off"], result.stderr[-2000:]


def test_a_command_restarts_once_with_huge_pages_keeping_its_arguments():
  from capsjax.app import cli  # pylint: disable=g-import-not-at-top
  env = {k: v for k, v in os.environ.items() if k not in ('GLIBC_TUNABLES', 'CAPSJAX_HUGE_PAGES')}
  expected = (cli.huge_pages_environment(env) or {}).get('GLIBC_TUNABLES')   # this machine's answer
  program = ('import os, sys; from capsjax.app import cli; print("start", flush=True); cli.as_program(); '
             'print(os.getpid(), os.environ.get("GLIBC_TUNABLES"), sys.argv[1:])')
  result = subprocess.run([sys.executable, '-c', program, 'a', '--b=c d'], capture_output=True, text=True,
                          timeout=60, env=env, check=True)
  lines = result.stdout.strip().splitlines()
  _, tunables, arguments = lines[-1].split(' ', 2)
  assert tunables == str(expected) and arguments == "['a', '--b=c d']"
  assert lines.count('start') == (2 if expected else 1)   # restarted once, in the same process


def test_python_m_of_a_program_module_names_the_command_that_runs_it():
  import importlib  # pylint: disable=g-import-not-at-top
  from capsjax.app.programs import EXPERIMENTS_OF  # pylint: disable=g-import-not-at-top
  names = sorted(name[:-3] for name in os.listdir(os.path.join(ROOT, 'experiments')) if not name.startswith('_'))
  running = {}
  for name in names:
    program = importlib.import_module(f'capsjax.experiments.{name}').get_config().get('program', 'train')
    if program != 'train':
      running.setdefault(program, set()).add(name)
  assert running == {program: set(experiments) for program, experiments in EXPERIMENTS_OF.items()}
  result = subprocess.run([sys.executable, '-m', 'capsjax.app.programs.affnist'], capture_output=True, text=True,
                          timeout=120)
  assert result.returncode == 2 and result.stderr.strip().splitlines() == [
      'error: python -m capsjax.app.programs.affnist is not a command: the affnist program runs as an experiment, '
      'capsjax --experiment=affnist --workdir=W (or python run.py …; experiments running it: affnist, '
      'affnist_smoke)'], result.stderr


_ALARMS = """E0000 00:00:1 slow_operation_alarm.cc:73] 
********************************
[Compiling module jit_step] Very slow compile? If you want to file a bug, run with envvar XLA_FLAGS=--xla_dump_to=/tmp/foo and attach the results.
********************************
kept: a native line of its own
E0000 00:00:2 slow_operation_alarm.cc:140] The operation took 2m12.8s
Constant folding an instruction is taking > 1s:

  %pad.0 = f32[10,10,256,256]{3,2,1,0} pad(f32[9,9,256,256]{3,2,1,0} %p, f32[] %c)

This isn't necessarily a bug; constant-folding is inherently a trade-off between compilation time and speed.

If you'd like to file a bug, run with envvar XLA_FLAGS=--xla_dump_to=/tmp/foo and attach the results.
"""


def test_xla_slow_operation_banners_stay_out_of_a_compilation_s_output(capfd):
  from capsjax import console  # pylint: disable=g-import-not-at-top
  assert console.without_xla_alarms(_ALARMS) == 'kept: a native line of its own\n'
  with console.xla_alarms_dropped():
    os.write(2, _ALARMS.encode())          # XLA, from C++, while it compiles
    print('error: a line of ours', file=sys.stderr)   # Python's own: at once, never held
  err = capfd.readouterr().err
  assert err == 'error: a line of ours\nkept: a native line of its own\n'


@pytest.mark.parametrize('overrides, message', [
    # Python keywords in a key path: ml_collections' own parser would end in a traceback.
    (['--config.lambda=1'], "unknown config key 'lambda'"),
    (['--config.model.class=1'], "unknown config key 'model.class'"),
    (['--config.None=1'], "unknown config key 'None'"),
    # A tuple given twice would be joined into one ((0, 1) then (5,) → (0, 1, 5)).
    (['--config.ensemble.seeds=(0,1)', '--config.ensemble.seeds=(5,)'], '--config.ensemble.seeds is given twice'),
])
def test_keys_ml_collections_would_misread_are_one_line(overrides, message):
  assert launch.malformed_key_problem(['run.py', '--experiment=mnist_seeds'] + overrides, 'mnist_seeds') == (
      message if 'twice' not in message else message + ': give it once')
  assert launch.malformed_key_problem(['run.py', '--config.lambda_=1', '--config.seed=1'], 'mnist') is None


def test_an_unknown_key_that_another_experiment_has_names_those_experiments(monkeypatch):
  monkeypatch.setattr(launch, '_EXPERIMENTS_DIR', launch.installed_experiments_dir())
  line = launch.unknown_key_problem(KeyError("'recipes'"), ['run.py', "--config.ensemble.recipes=('a:',)"], 'mnist_seeds')
  assert line == "unknown config key 'ensemble.recipes' in experiment 'mnist_seeds'; experiments with it: mnist_final, mnist_four_recipes, multimnist_two_recipes"
