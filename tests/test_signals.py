"""Ctrl-C (SIGINT) saves a checkpoint and exits like SIGTERM, within seconds; the same
command resumes. A Ctrl-C before the first step has compiled is one line, exit 130."""
import json
import os
import signal
import subprocess
import sys
import time

from capsjax import train
from capsjax.app import cli
from helpers import SPEEDY_CONV_FLAG

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--config.model.conv1_channels=16', '--config.model.primary_types=4',
        '--config.model.decoder_hidden=(32,64)', '--config.num_train_examples=256',
        '--config.num_test_examples=100', '--config.batch_size=32', '--config.log_every_steps=1',
        '--config.checkpoint_every_steps=100000', SPEEDY_CONV_FLAG]


def _start(workdir, mnist_dir, log, *extra):
  return subprocess.Popen(
      [sys.executable, '-u', os.path.join(ROOT, 'run.py'), '--experiment=mnist_smoke', f'--workdir={workdir}',
       f'--config.data_dir={mnist_dir}', '--config.num_steps=2000', *TINY, *extra],
      stdout=log, stderr=subprocess.STDOUT, text=True)


def _wait_for(path, text, process, timeout=180):
  deadline = time.time() + timeout
  while text not in open(path).read():
    assert time.time() < deadline and process.poll() is None, open(path).read()[-3000:]
    time.sleep(0.1)


def test_ctrl_c_saves_and_the_run_resumes(mnist_dir, tmp_path):
  workdir = tmp_path / 'w'
  with open(tmp_path / 'first.log', 'w') as log:
    process = _start(workdir, mnist_dir, log)
    _wait_for(log.name, 'step 3/2000', process)
    logged = [int(line.split()[1].split('/')[0]) for line in open(log.name).read().splitlines()
              if line.startswith('step ') and '/2000 ' in line]
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=300) == cli.EXIT_RESUMABLE   # stopped by a signal, resumable: 75
  text = open(tmp_path / 'first.log').read()
  assert 'Traceback' not in text
  assert 'saving a checkpoint after this step' in text
  saved = [line for line in text.splitlines() if line.startswith('interrupted at step')]   # Ctrl-C, not preemption
  assert saved, text[-2000:]
  step = int(saved[0].split()[3].rstrip(':'))
  # Acted on at the next step: the host runs at most train.RUN_AHEAD_STEPS ahead of the
  # steps logged (one line a step here) when the signal came.
  assert 3 <= step <= max(logged) + train.RUN_AHEAD_STEPS + 2, (step, logged)
  assert sorted(os.listdir(workdir / 'checkpoints')) == [str(step)]
  with open(tmp_path / 'second.log', 'w') as log:
    process = _start(workdir, mnist_dir, log, f'--config.stop_at_step={step + 2}')
    assert process.wait(timeout=300) == cli.EXIT_RESUMABLE   # stopped again, resumable
  assert f'resumed from checkpoint at step {step}' in open(tmp_path / 'second.log').read()


def test_ctrl_c_before_training_is_one_line(mnist_dir, tmp_path):
  # While the data is read, and while the first step compiles (the training loop's own
  # handler is installed but not yet armed): one line, exit 130, and no wait for the compile.
  for moment in ('reading the data', 'compiling the training step'):
    with open(tmp_path / 'log', 'w') as log:
      process = subprocess.Popen(
          [sys.executable, '-u', os.path.join(ROOT, 'run.py'), '--experiment=mnist', f'--workdir={tmp_path}/w',
           f'--config.data_dir={mnist_dir}'], stdout=log, stderr=subprocess.STDOUT, text=True)
      try:
        _wait_for(log.name, moment, process)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=300) == 130, open(log.name).read()[-2000:]
      finally:
        process.kill()   # never left running beside the rest of the suite
    text = open(tmp_path / 'log').read()
    assert text.strip().splitlines()[-1] == 'error: interrupted' and 'Traceback' not in text, text[-2000:]


def test_sigterm_outside_a_training_loop_is_one_line():
  # Every command's main is a cli.main_wrapper: a SIGTERM (`kill`, a scheduler's or a
  # service manager's stop) while it reads, converts or exports is one line and exit 143,
  # not a silent end. (Inside the loop it saves first: test_hooks.py, test_sharding.py.)
  program = (
      'import os, signal, sys, time\n'
      'from capsjax.app import cli\n'
      '@cli.main_wrapper\n'
      'def main(argv):\n'
      '  print("working", flush=True)\n'
      '  os.kill(os.getpid(), signal.SIGTERM)\n'
      '  time.sleep(30)\n'
      '  return 0\n'
      'cli.run_program(main)\n')
  done = subprocess.run([sys.executable, '-c', program], capture_output=True, text=True, timeout=60,
                        env=dict(os.environ, CAPSJAX_HUGE_PAGES='0'))
  assert (done.returncode, done.stdout, done.stderr) == (128 + signal.SIGTERM, 'working\n',
                                                          'error: stopped by SIGTERM\n')



def test_an_evaluation_stopped_by_sigterm_or_ctrl_c_is_run_again_on_resume(mnist_dir, tmp_path, monkeypatch):
  """SIGTERM in the evaluation at step 2, Ctrl-C in the final one at step 4: each resume
  evaluates its restored checkpoint first, so the run selects and reports what an
  uninterrupted run of the same config does (it once skipped the interrupted step's evaluation)."""
  import pytest   # pylint: disable=g-import-not-at-top
  from capsjax import evaluators   # pylint: disable=g-import-not-at-top
  from capsjax.errors import RunStopped   # pylint: disable=g-import-not-at-top
  from helpers import tiny_config   # pylint: disable=g-import-not-at-top
  config = lambda: tiny_config(mnist_dir, num_steps=4, eval_every_steps=2, validation_examples=64,
                               checkpoint_every_steps=100)
  reference = train.train_and_evaluate(config(), str(tmp_path / 'uninterrupted'))
  real_metrics = evaluators.Evaluator._metrics
  stops = {2: signal.SIGTERM, 4: signal.SIGINT}

  def metrics_with_a_signal(self, run, step):
    if step in stops:   # arrives as the evaluation starts: it ends between two batches
      os.kill(os.getpid(), stops.pop(step))
    return real_metrics(self, run, step)

  monkeypatch.setattr(evaluators.Evaluator, '_metrics', metrics_with_a_signal)
  workdir = str(tmp_path / 'stopped')
  for stopped_at, reason in ((2, 'preempted'), (4, 'interrupted')):
    with pytest.raises(RunStopped) as stopped:
      train.train_and_evaluate(config(), workdir)
    assert (stopped.value.steps, stopped.value.stop_reason) == (stopped_at, reason)
  result = train.train_and_evaluate(config(), workdir)
  assert result.selected_by_validation == reference.selected_by_validation
  assert result.test_error == reference.test_error and result.final_train_loss == reference.final_train_loss
  evaluated = [(row['split'], row['step']) for row in map(json.loads, open(os.path.join(workdir, 'metrics.jsonl')))
               if row['split'] != 'train']
  assert evaluated == [('validation', 2), ('test', 2), ('validation', 4), ('test', 4)]
