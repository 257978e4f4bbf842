"""A real Slurm (Debian's slurm-wlm, one node: .ci/slurm_cluster): `srun --ntasks=2` of the
training command with `--config.distributed=True` (JAX reads the coordinator, the count and
the ids from the job's SLURM_* environment), stopped mid-way by `scancel --signal=TERM`,
checkpoints and exits 75; the same command started with explicit flags resumes it and ends
with the parameters of a one-process run."""
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from capsjax.app.trained import load_trained

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_STEPS = 40
# Float32 sums split over two processes round differently (test_sharding.py's tolerance).
TOLERANCE = 2e-5
# docs/hosts.md's command, on a tiny model (tests/helpers.py's tiny_config, as flags).
TRAINING = ['run.py', '--experiment=mnist_smoke', '--config.num_train_examples=256', '--config.num_test_examples=96',
            '--config.batch_size=32', f'--config.num_steps={NUM_STEPS}', '--config.model.conv1_channels=16',
            '--config.model.primary_types=4', '--config.model.decoder_hidden=(32,64)', '--config.log_every_steps=2',
            '--config.log_every_seconds=0', '--config.checkpoint_every_steps=2', '--config.eval_batch_size=96',
            '--config.model.formulation.conv_impl=space_to_depth']
JOB_NAME = f'capsjax-test-{os.getpid()}'


def _missing() -> str:
  if shutil.which('srun') is None or shutil.which('slurmctld', path=os.environ['PATH'] + ':/usr/sbin') is None:
    return 'needs Slurm: apt-get install slurm-wlm munge (.ci/run installs them)'
  if os.geteuid() != 0:
    return "needs root: a one-node Slurm's daemons start as root"
  return ''


@pytest.fixture(scope='module')
def slurm(tmp_path_factory):
  """The environment of a started one-node cluster (SLURM_CONF); stopped afterwards."""
  missing = _missing()
  if missing:
    if os.environ.get('CI', '').lower() == 'true':
      pytest.fail(missing)
    pytest.skip(missing)
  folder = tmp_path_factory.mktemp('slurm')
  script = os.path.join(ROOT, '.ci', 'slurm_cluster')
  started = subprocess.run([script, 'start', str(folder)], capture_output=True, text=True, timeout=120)
  assert started.returncode == 0, started.stderr
  conf = started.stdout.strip().splitlines()[-1].split('=', 1)[1]
  try:
    yield dict(os.environ, SLURM_CONF=conf, JAX_PLATFORMS='cpu', XLA_FLAGS='')
  finally:
    subprocess.run([script, 'stop', str(folder)], check=False, timeout=60)


def _params(workdir):
  _, _, params = load_trained(str(workdir))
  return [np.asarray(leaf) for leaf in jax.tree.leaves(params)]


def _srun(env, workdir, data_dir, log):
  return subprocess.Popen(['srun', '--ntasks=2', f'--job-name={JOB_NAME}', '--label', sys.executable, *TRAINING,
                           f'--workdir={workdir}', f'--config.data_dir={data_dir}', '--config.distributed=True'],
                          cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def test_srun_two_tasks_stopped_by_scancel_resume_and_train_like_one_process(slurm, mnist_dir, tmp_path):
  # The one-process run to compare with, beside the job (most of each is starting Python and JAX).
  one_log = tmp_path / 'one.log'   # a file, not a pipe: nothing reads it until the job is stopped
  one = subprocess.Popen([sys.executable, *TRAINING, f'--workdir={tmp_path / "one"}', f'--config.data_dir={mnist_dir}'],
                         cwd=ROOT, env=slurm, stdout=open(one_log, 'w'), stderr=subprocess.STDOUT)

  # The job stopped mid-run by Slurm: SIGTERM to both tasks, which agree on a step,
  # checkpoint there and exit 75.
  workdir, log_path = tmp_path / 'two', tmp_path / 'first.log'
  with open(log_path, 'w') as log:
    job = _srun(slurm, workdir, mnist_dir, log)
    deadline = time.time() + 300
    while 'step 10/' not in log_path.read_text():
      assert time.time() < deadline and job.poll() is None, log_path.read_text()[-3000:]
      time.sleep(0.2)
    job_id = subprocess.run(['squeue', '--noheader', '--format=%i', f'--name={JOB_NAME}'], env=slurm,
                            capture_output=True, text=True, check=True).stdout.split()
    assert len(job_id) == 1, job_id
    subprocess.run(['scancel', '--signal=TERM', job_id[0]], env=slurm, check=True, timeout=60)
    job.wait(timeout=300)
  first = log_path.read_text()
  one.wait(timeout=600)
  assert one.returncode == 0, one_log.read_text()[-3000:]
  # srun says it per task or for both at once ('tasks 0-1: Exited with exit code 75').
  assert re.findall(r'Exited with exit code (\d+)', first) in (['75'], ['75', '75']), first[-3000:]
  assert 'over 2 processes' in first, first[-3000:]
  assert '0: stopped at step' in first and '(preempted)' in first, first[-3000:]
  step = int(first.split('0: stopped at step')[1].split()[0])
  assert 10 <= step < NUM_STEPS, first[-3000:]

  # Resumed by the same command started with flags instead of srun (as on a cluster without
  # Slurm): the Slurm job's checkpoint is the run's, whoever starts it.
  port = _free_port()
  logs = [tmp_path / f'second_{i}.log' for i in range(2)]
  resumed = [subprocess.Popen([sys.executable, *TRAINING, f'--workdir={workdir}', f'--config.data_dir={mnist_dir}',
                               '--config.distributed=True', f'--config.coordinator_address=localhost:{port}',
                               '--config.num_processes=2', f'--config.process_id={i}'],
                              cwd=ROOT, env=slurm, stdout=open(log, 'w'), stderr=subprocess.STDOUT)
             for i, log in enumerate(logs)]
  for process in resumed:
    process.wait(timeout=600)
  second = [log.read_text() for log in logs]
  assert [process.returncode for process in resumed] == [0, 0], second[0][-3000:] + second[1][-3000:]
  assert f'resumed from checkpoint at step {step}' in second[0] and 'over 2 processes' in second[0], second[0]
  assert 'test accuracy' in second[0] and 'test accuracy' not in second[1]   # only process 0 reports
  for trained, alone in zip(_params(workdir), _params(tmp_path / 'one')):
    np.testing.assert_allclose(trained, alone, atol=TOLERANCE, rtol=0)


def _free_port():
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]
