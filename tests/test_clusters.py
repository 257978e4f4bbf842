"""Launching on clusters: the key that gives one process every GPU of its host, the plan's
launch lines, and the files a cluster user runs (clusters/: JobSets for a TPU slice and for
GPU hosts, a SkyPilot task, a Slurm batch script), parsed and checked against the launch
lines capsjax-plan prints."""
import os
import shlex

import jax
import pytest
import yaml

from capsjax.app.plan import launch_lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ' --config.batch_size=128'   # mnist's batch, which the plan keeps on these targets


def test_local_devices_all_hands_jax_every_visible_gpu_and_detected_leaves_them_to_jax(monkeypatch):
  # JAX gives a detected cluster's process only the GPU of its local rank (SLURM_LOCALID):
  # one process per host sees every GPU only when capsjax passes them.
  from capsjax.app import distributed  # pylint: disable=g-import-not-at-top
  from capsjax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  given = []
  monkeypatch.setattr(jax.distributed, 'initialize', lambda **kwargs: given.append(kwargs))
  monkeypatch.setenv('SLURM_LOCALID', '0')
  monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '0,1,2,3,4,5,6,7')   # what Slurm sets for --gpus-per-node=8
  distributed.initialize_distributed(True, local_devices='all')
  distributed.initialize_distributed(True)
  assert given[0]['local_device_ids'] == list(range(8)) and 'local_device_ids' not in given[1]
  monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '')
  with pytest.raises(ConfigError, match=r"^config.local_devices='all': this process sees no GPU "
                                        r"\(CUDA_VISIBLE_DEVICES=''\)$"):
    distributed.initialize_distributed(True, local_devices='all')


def test_local_devices_is_a_multi_host_key_with_two_values():
  from capsjax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from capsjax.experiments import mnist  # pylint: disable=g-import-not-at-top
  from capsjax.validation import validate  # pylint: disable=g-import-not-at-top
  config = mnist.get_config()
  config.local_devices = 'all'
  with pytest.raises(ConfigError, match=r"^config.local_devices='all': used only with --config.distributed=True"):
    validate(config)
  config.distributed, config.local_devices = True, 'each'
  with pytest.raises(ConfigError, match=r"local_devices.*one of detected, all"):
    validate(config)


def test_the_plans_launch_lines_use_every_gpu_of_a_host():
  lines = launch_lines('GPU', 4, 8, 'mnist', '/shared/mnist', ' --config.batch_size=256')
  command = 'python run.py --experiment=mnist --workdir=/shared/mnist --config.distributed=True --config.batch_size=256'
  assert lines[1] == f'  srun --nodes=4 --ntasks-per-node=8 --gpus-per-node=8 {command}'
  assert lines[3] == (f'  {command} --config.local_devices=all --config.coordinator_address=HOST0:1234 '
                      '--config.num_processes=4 --config.process_id=I')
  assert launch_lines('GPU', 1, 8, 'mnist', 'W', '')[1] == '  python run.py --experiment=mnist --workdir=W'


def _yaml(name):
  with open(os.path.join(ROOT, 'clusters', name)) as f:
    return list(yaml.safe_load_all(f))


def _pod(jobset):
  replicated, = jobset['spec']['replicatedJobs']
  job = replicated['template']['spec']
  return job, job['template']['spec']


def test_the_tpu_jobset_runs_the_plans_command_on_every_host_and_restarts_after_a_preemption():
  jobset, = _yaml('jobset-tpu.yaml')
  assert (jobset['apiVersion'], jobset['kind']) == ('jobset.x-k8s.io/v1alpha2', 'JobSet')
  job, pod = _pod(jobset)
  hosts, chips_per_host = 4, 4   # a v5e slice of 4x4 chips: 4 hosts of 4
  assert job['completionMode'] == 'Indexed' and job['completions'] == job['parallelism'] == hosts
  assert pod['nodeSelector'] == {'cloud.google.com/gke-tpu-accelerator': 'tpu-v5-lite-podslice',
                                 'cloud.google.com/gke-tpu-topology': '4x4'}
  container, = pod['containers']
  assert container['resources']['limits'] == {'google.com/tpu': chips_per_host}
  # SIGTERM → checkpoint → exit; the JobSet restarts the pods, which resume the run.
  assert jobset['spec']['failurePolicy']['maxRestarts'] >= 1 and pod['terminationGracePeriodSeconds'] >= 60
  line = launch_lines('TPU', hosts, chips_per_host, 'mnist', '/shared/mnist', FLAGS)[-1]
  assert container['command'] == shlex.split(line.split('cd capsjax && ')[1].rstrip('"'))
  # docs/hosts.md's xpk line starts the same command on every host of the slice.
  xpk, = [l for l in open(os.path.join(ROOT, 'docs', 'hosts.md')).read().splitlines() if l.startswith('xpk ')]
  assert '--tpu-type=v5litepod-16' in xpk and shlex.split(xpk.split('--command ')[1]) == [
      shlex.join(container['command'])]


def test_the_gpu_jobset_gives_each_host_pod_its_gpus_and_the_rights_jax_needs_to_find_the_others():
  account, role, binding, jobset = _yaml('jobset-gpu.yaml')
  job, pod = _pod(jobset)
  assert job['completionMode'] == 'Indexed' and job['completions'] == job['parallelism'] == 2
  assert jobset['spec']['network']['enableDNSHostnames'] is True   # the headless service JAX's coordinator needs
  assert pod['serviceAccountName'] == account['metadata']['name'] == binding['subjects'][0]['name']
  assert binding['roleRef']['name'] == role['metadata']['name']
  granted = {(group, resource, verb) for rule in role['rules'] for group in rule['apiGroups']
             for resource in rule['resources'] for verb in rule['verbs']}
  # What JAX's Kubernetes detection reads: its pod (by IP), its job, the headless service.
  assert {('', 'pods', 'list'), ('batch', 'jobs', 'get'), ('', 'services', 'list')} <= granted
  container, = pod['containers']
  assert container['resources']['limits'] == {'nvidia.com/gpu': 8}
  assert jobset['spec']['failurePolicy']['maxRestarts'] >= 1
  slurm = launch_lines('GPU', 2, 8, 'mnist', '/shared/mnist', FLAGS)[1]
  assert container['command'] == shlex.split(slurm.split('--gpus-per-node=8 ')[1]) + ['--config.local_devices=all']


def test_the_skypilot_task_and_the_slurm_script_run_the_plans_launch_lines():
  task, = _yaml('skypilot.yaml')
  assert task['num_nodes'] == 2 and task['resources']['accelerators'] == 'H100:8'
  elsewhere = launch_lines('GPU', 2, 8, 'mnist', '/shared/mnist', FLAGS)[3].strip()
  written = ' '.join(task['run'].replace('\\\n', ' ').split('\n', 1)[1].split())
  assert written == (elsewhere.replace('HOST0', '$COORDINATOR').replace('num_processes=2', 'num_processes='
                     '$SKYPILOT_NUM_NODES').replace('process_id=I', 'process_id=$SKYPILOT_NODE_RANK'))
  script = open(os.path.join(ROOT, 'clusters', 'slurm.sbatch')).read()
  srun = launch_lines('GPU', 2, 8, 'mnist', '/shared/mnist', FLAGS)[1].strip()
  assert '#SBATCH --nodes=2 --ntasks-per-node=8 --gpus-per-node=8' in script
  assert 'srun ' + srun.split('--gpus-per-node=8 ')[1] in script.splitlines()
