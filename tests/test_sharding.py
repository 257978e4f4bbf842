"""Data parallelism: 16 simulated devices train like 1 device (2 processes under a real
Slurm: tests/test_slurm.py).

Every run here is a subprocess: the device count is fixed when JAX starts, and
jax.distributed needs one process per participant.
"""
import gzip
import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from capsjax import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, 'tests', 'multiprocess_worker.py')
NUM_STEPS = 40
# Float32 sums split over devices round differently: after 40 Adam steps the parameters
# of the tiny model agree to ~1e-6 (its largest parameters are ~0.5).
TOLERANCE = 2e-5


def _env(devices=1):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={devices}' if devices > 1 else ''
  return env


def _free_port():
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _start(workdir, data_dir, process_id=0, num_processes=1, port=0, devices=1, out='', log=None):
  """A worker process (tests/multiprocess_worker.py), with the coordinator's flags."""
  command = [sys.executable, WORKER, f'--process_id={process_id}', f'--num_processes={num_processes}',
             f'--port={port}', f'--workdir={workdir}', f'--data_dir={data_dir}',
             f'--num_steps={NUM_STEPS}', f'--out={out}']
  return subprocess.Popen(command, env=_env(devices), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def _finish(processes, logs, timeout=240):
  try:
    for process in processes:
      process.wait(timeout=timeout)
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
  texts = []
  for log in logs:
    log.flush()
    with open(log.name) as f:
      texts.append(f.read())
  for process, text in zip(processes, texts):
    assert process.returncode == 0, text[-3000:]
  return texts


def _run(tmp_path, name, data_dir, num_processes=1, devices=1):
  """A complete run; returns (final params, logs)."""
  port = _free_port()
  out = str(tmp_path / f'{name}.npz')
  logs = [open(tmp_path / f'{name}_{i}.log', 'w') for i in range(num_processes)]
  processes = [_start(str(tmp_path / name), data_dir, i, num_processes, port, devices, out, logs[i])
               for i in range(num_processes)]
  texts = _finish(processes, logs)
  return np.load(out), texts


def _assert_same_params(a, b):
  assert sorted(a.files) == sorted(b.files)
  for key in a.files:
    np.testing.assert_allclose(a[key], b[key], atol=TOLERANCE, rtol=0)


@pytest.fixture(scope='module')
def mnist_files(tmp_path_factory, mnist_dir):
  """Uncompressed copies of the MNIST files: on several processes (host_images 'auto')
  they are memory-mapped and each process reads only its rows of every batch; one
  process loads them whole."""
  folder = tmp_path_factory.mktemp('mnist_idx')
  for name in os.listdir(mnist_dir):
    if name.endswith('.gz'):
      with gzip.open(os.path.join(mnist_dir, name)) as source, open(folder / name[:-3], 'wb') as target:
        shutil.copyfileobj(source, target)
  return str(folder)


def _test_metrics(workdir):
  with open(os.path.join(workdir, 'results.json')) as f:
    results = json.load(f)
  return results['test_accuracy'], results['test_loss']


@pytest.fixture(scope='module')
def one_device_run(tmp_path_factory, mnist_files):
  folder = tmp_path_factory.mktemp('one')
  params, logs = _run(folder, 'one', mnist_files)
  assert 'rows_on_demand False' in logs[0]   # one process loads the splits whole
  return params, _test_metrics(folder / 'one')


def test_sixteen_simulated_devices_train_and_evaluate_like_one(one_device_run, mnist_files, tmp_path):
  # The default evaluation batch (500) does not divide by 16: padded to 512, the padding
  # weighs nothing, and the test metrics are one device's.
  params, logs = _run(tmp_path, 'sixteen', mnist_files, devices=16)
  assert 'devices 16' in logs[0]
  _assert_same_params(params, one_device_run[0])
  accuracy, loss = _test_metrics(tmp_path / 'sixteen')
  assert accuracy == pytest.approx(one_device_run[1][0], abs=1e-9)   # the same examples right
  assert loss == pytest.approx(one_device_run[1][1], rel=1e-4)


def test_batch_that_does_not_divide_by_the_devices_is_one_clear_error(mnist_dir, tmp_path):
  result = subprocess.run(
      [sys.executable, 'run.py', '--experiment=mnist_smoke', f'--workdir={tmp_path}',
       f'--config.data_dir={mnist_dir}', '--config.batch_size=30'],
      env=_env(8), cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      'error: global batch_size 30 does not divide by the 8 devices of the data mesh; use a multiple of 8']


def test_process_rows_split_a_batch_evenly():
  # In this (single) process the share is the whole batch; the arithmetic is per process.
  assert sharding.process_rows(32) == slice(0, 32)


@pytest.mark.parametrize('flags,message', [
    ([], 'error: config.distributed=True: coordinator_address should be defined; outside Cloud TPU, SLURM and '
         'Open MPI give --config.coordinator_address=HOST:PORT --config.num_processes=N --config.process_id=I '
         'to every process'),
    (['--config.coordinator_address=127.0.0.1:{port}', '--config.num_processes=2', '--config.process_id=1',
      '--config.distributed_timeout_s=2'],
     'error: the coordinator 127.0.0.1:{port} did not answer within 2 s (Connection refused): start process 0 '
     'first, or check --config.coordinator_address'),
    # Process 0 alone: JAX would wait, then abort with a C++ stack; the watchdog ends it first.
    (['--config.coordinator_address=127.0.0.1:{port}', '--config.num_processes=2', '--config.process_id=0',
      '--config.distributed_timeout_s=2'],
     'error: the 2 processes of the run did not all join 127.0.0.1:{port} within config.distributed_timeout_s=2 s; '
     'start every process with the same command (its own --config.process_id)'),
    (['--config.coordinator_address=no-such-host.invalid:1234', '--config.num_processes=2', '--config.process_id=0'],
     "error: config.coordinator_address='no-such-host.invalid:1234': the host 'no-such-host.invalid' does not "
     'resolve (Name or service not known)'),
])
def test_distributed_start_up_problems_are_one_line(flags, message, mnist_dir, tmp_path):
  # A hang (JAX waiting for a coordinator forever) is caught by the generous timeout.
  port = _free_port()   # nothing listens there
  result = subprocess.run(
      [sys.executable, 'run.py', '--experiment=mnist_smoke', f'--workdir={tmp_path}', f'--config.data_dir={mnist_dir}',
       '--config.distributed=True', *[flag.format(port=port) for flag in flags]],
      env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [message.format(port=port)]
