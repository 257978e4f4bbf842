"""capsjax.app.plan: the run's own steps compiled for a TPU topology and for GPUs that are not
here, against hand counts; targets by their names; bad input as one line."""
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys

import jax
import pytest

from capsjax.app import plan as plan_lib
from capsjax.console import format_duration
from capsjax.errors import ConfigError
import command_checks
import documented

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_LIBTPU = importlib.util.find_spec('libtpu') is not None
needs_libtpu = pytest.mark.skipif(not HAVE_LIBTPU and os.environ.get('CI', '').lower() != 'true',
                                  reason="needs libtpu: pip install 'capsjax[tpu]'")
# JAX's CUDA plugin and ptxas, in a folder of their own that only the GPU plans put on their
# path (.ci/run fills it): installed beside JAX on a machine without a GPU driver, the
# plugin would log its failed start into every other test's output.
GPU_PLAN = os.path.join(ROOT, '.gpu-plan')
needs_gpu_plan = pytest.mark.skipif(
    not os.path.isdir(GPU_PLAN) and os.environ.get('CI', '').lower() != 'true',
    reason='needs the CUDA plugin in .gpu-plan: pip install -c constraints.txt --no-deps --target .gpu-plan '
           'jax-cuda12-plugin jax-cuda12-pjrt nvidia-cuda-nvcc-cu12')


def test_the_flops_of_a_lowered_program_by_the_public_call_and_by_the_private_fallback():
  # The private fallback (GPU targets, whose compile-only devices give no cost analysis)
  # reads jax._src: on every CI stack it must still count, not fall back to None.
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  lowered = jax.jit(lambda a, b: a @ b).lower(jnp.ones((64, 32)), jnp.ones((32, 16)))
  assert plan_lib._public_flops(lowered) == plan_lib._cpu_client_flops(lowered) == 2 * 64 * 32 * 16  # pylint: disable=protected-access


@pytest.mark.parametrize('name, topology, chips', [
    ('v5e:4x4', 'v5e:4x4', 16), ('v5litepod-16', 'v5e:4x4', 16), ('v5litepod-256', 'v5e:16x16', 256),
    ('v4-32', 'v4:2x2x4', 16), ('v5p-128', 'v5p:4x4x4', 64), ('v6e-256', 'v6e:16x16', 256),
    ('tpu7x:2x2x1', 'tpu7x:2x2x1', 4), ('v3-32', 'v3:4x4', 16),
    ('h100', 'h100:1x1', 1), ('H100:8', 'h100:1x8', 8), ('h200:4x8', 'h200:4x8', 32),
])
def test_targets_by_topology_by_accelerator_type_and_gpus(name, topology, chips):
  target = plan_lib.parse_target(name)
  assert (target.topology_name, target.chips) == (topology, chips)
  assert target.platform == ('gpu' if name.lower().startswith('h') else 'tpu')


@pytest.mark.parametrize('name, message', [
    ('v9:2x2', 'not a TPU topology'), ('v5litepod-12', 'knows no v5e slice of 12 chips'),
    ('v4-30', 'knows no v4 slice of 30 TensorCores'), ('v2:4x4', 'no published figures for its chip'),
    ('a100', 'not a TPU topology'), ('h100:16', 'a host holds 1 to 8 H100s'), ('h100:0', 'a host holds 1 to 8'), ('h200:0x8', 'needs at least one host'),
])
def test_unknown_targets_are_named(name, message):
  with pytest.raises(ConfigError, match=message):
    plan_lib.parse_target(name)


def test_collectives_are_counted_with_the_bytes_they_move():
  hlo = '\n'.join([
      '%all-reduce = f32[256,256]{1,0:T(8,128)} all-reduce(%fusion), channel_id=1, to_apply=%add',
      '%all-reduce.1 = (f32[10]{0}, bf16[4,8]{1,0}) all-reduce(%a, %b), channel_id=2',
      '%ars = ((f32[16]{0}), f32[16]{0}) all-reduce-start(%c), channel_id=3',
      '%ard = f32[16]{0} all-reduce-done(%ars)',
      '%ag = s32[8,2]{1,0} all-gather(%d), dimensions={0}',
      '%add = f32[] add(%x, %y)'])
  assert plan_lib.collectives(hlo) == {'all-reduce': (3, 256 * 256 * 4 + 10 * 4 + 4 * 8 * 2 + 16 * 4),
                                       'all-gather': (1, 8 * 2 * 4)}


def test_gpu_kernels_and_their_memory_traffic_are_counted_from_the_compiled_module():
  hlo = '\n'.join([
      'HloModule m',
      '%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {',
      '  %p = (s32[], f32[64]{0}) parameter(0)',
      '  %i = s32[] get-tuple-element(%p), index=0',
      '  %x = f32[64]{0} get-tuple-element(%p), index=1',
      '  %loop_add_fusion = f32[64]{0} fusion(%x), kind=kLoop, calls=%add',
      '  ROOT %t = (s32[], f32[64]{0}) tuple(%i, %loop_add_fusion)',
      '}',
      'ENTRY %main (a: f32[128,256], b: f32[256,10]) -> f32[128,10] {',
      '  %a = f32[128,256]{1,0} parameter(0)',
      '  %b = f32[256,10]{1,0} parameter(1)',
      '  %flat = f32[32768]{0} bitcast(%a)',
      '  %gemm_fusion_dot = f32[128,10]{1,0} fusion(%a, %b), kind=kCustom, calls=%dot',
      '  %pair = (f32[128,10]{1,0}, s32[128]{0}) fusion(%gemm_fusion_dot), kind=kInput, calls=%r',
      '  %w = (s32[], f32[64]{0}) while(%init), condition=%c, body=%body, '
      'backend_config={"known_trip_count":{"n":"3"}}',
      '  ROOT %copy = f32[128,10]{1,0} copy(%gemm_fusion_dot)',
      '}'])
  dot = 4 * (128 * 256 + 256 * 10 + 128 * 10)
  pair = 4 * 128 * 10 + (4 * 128 * 10 + 4 * 128)
  loop = 3 * 4 * (64 + 64)
  copy = 2 * 4 * 128 * 10
  assert plan_lib.kernel_traffic(hlo) == (1 + 1 + 3 + 1, dot + pair + loop + copy)


def test_the_gpu_target_describes_the_published_hopper_figures():
  text = plan_lib.gpu_target_config(plan_lib.GPUS['h200'])
  for field in ('core_count: 132', 'memory_bandwidth: 4800000000000', f'device_memory_size: {141 * 2 ** 30}',
                'cuda_compute_capability { major: 9 minor: 0 }', 'platform_name: "CUDA"',
                'device_description_str: "NVIDIA H200"'):
    assert field in text, field


def test_the_plans_stand_in_data_has_every_class_for_multimnist_pairs():
  import numpy as np  # pylint: disable=g-import-not-at-top
  from capsjax.data.datasets import dataset_info  # pylint: disable=g-import-not-at-top
  from capsjax.experiments import multimnist  # pylint: disable=g-import-not-at-top
  config = multimnist.get_config()
  test = plan_lib._zeros_loader(config)(dataset_info(config.dataset), 'test')  # pylint: disable=protected-access
  assert len(test.labels) == 10000 and not test.images.any()
  assert set(np.unique(test.labels)) == set(range(10))   # a pair needs two classes


def _tiny_config():
  from capsjax.experiments import mnist_smoke  # pylint: disable=g-import-not-at-top
  config = mnist_smoke.get_config()
  config.model.update(conv1_channels=16, primary_types=4, primary_dim=4, digit_dim=8, decoder_hidden=(32,))
  config.batch_size, config.eval_batch_size = 32, 64
  return config


@pytest.fixture(scope='module')
def tiny_plan():
  return plan_lib.plan_run(_tiny_config(), 'v5e:2x2', find_largest_batch=False)


@needs_libtpu
def test_the_runs_own_step_compiles_for_a_tpu_slice_and_matches_hand_counts(tiny_plan):
  from benchmarks.timing import capsnet_flops  # pylint: disable=g-import-not-at-top
  result = tiny_plan
  assert (result.devices, result.hosts, result.devices_per_chip, result.global_batch) == (4, 1, 1, 32)
  assert any(line.startswith('conv_impl') and line.endswith(' xla') for line in result.formulations)   # the TPU's
  assert not any(value in line for line in result.formulations if line.startswith('conv_impl')
                 for value in ('patches', 'fourier', 'kernel_rows'))
  # Arguments per device: the replicated state (parameters, Adam's two moments, two step
  # counters) and this device's quarter of the batch (uint8 images, int32 labels and
  # indices). A TPU pads each array to whole (8, 128) tiles: this model's many small
  # arrays (biases of 4–32 values) take up to 3 times their bytes.
  config = _tiny_config()
  state_bytes = 3 * result.param_bytes + 2 * 4
  batch_bytes = (32 // 4) * (28 * 28 * 1 + 4 + 4)
  training = result.training
  assert state_bytes + batch_bytes <= training['arguments'] <= 3.5 * (state_bytes + batch_bytes)
  # The donated state is updated in place: what the step returns beside it is its metrics.
  assert training['aliased'] >= state_bytes and training['outputs'] - training['aliased'] < 65536
  # The gradient all-reduce moves the parameters' bytes (plus the metrics' scalars).
  count, reduced = training['collectives']['all-reduce']
  assert count >= 1 and result.param_bytes <= reduced <= result.param_bytes + 4096
  # FLOPs per device: the project's count for 8 images (direct-form convolutions, as XLA's
  # on a TPU), within what it leaves out (elementwise work, the squash, the loss).
  flops = capsnet_flops(config.model, 'tpu', batch=8)['train'] * 8
  assert 0.9 * flops <= training['flops'] <= 1.6 * flops, (training['flops'], flops)
  assert result.fits(training) and result.fits(result.evaluation)
  estimate = result.estimate()
  assert estimate['step_s'] == pytest.approx(max(estimate['compute_s'], estimate['memory_s']) + estimate['allreduce_s'])
  lines = plan_lib.report(result, 'mnist_smoke')
  estimated = [i for i, line in enumerate(lines) if line.startswith('ESTIMATE (not a measurement)')]
  assert len(estimated) == 1 and lines[estimated[0] + 1].startswith(   # no TPU measured: a floor, said so
      '  (no TPU has run capsjax against this estimate: take it as a floor; on GPUs the measured steps took 2.6–6.3×')
  assert re.search(rf"\); the run's {result.num_steps:,} steps take at least \S+, ≈ .* if the GPUs' factors held",
                   lines[estimated[0] + 1]), lines[estimated[0] + 1]   # the run's length, as for a GPU
  assert any('--worker=all' in line for line in lines)


def test_the_largest_batch_is_found_where_the_compiled_memory_meets_the_hbm(tiny_plan_shape, monkeypatch):
  # Compiled memory of 1 GB + 0.1 GB per example (what _training_memory would return),
  # on a 16 GB chip: the line through 8 and 16 per device meets it at 150; the step-down
  # rule never needs more than the third compilation.
  compiled = []
  monkeypatch.setattr(plan_lib, '_training_memory', lambda config, mesh, platform, per_device, *_: (
      compiled.append(per_device) or {'total': 1e9 + 1e8 * per_device}))
  largest = plan_lib._largest_batch(None, None, 'tpu', tiny_plan_shape, 10000, lambda line: None)
  assert compiled == [16, 144] and largest == {'per_device': 144, 'total': 1e9 + 1e8 * 144, 'tried': [8, 16, 144],
                                                'fits': True, 'capped': False, 'analysis': {'total': 1e9 + 1e8 * 144}}
  compiled.clear()   # an epoch of 100 examples per device caps it
  assert plan_lib._largest_batch(None, None, 'tpu', tiny_plan_shape, 100, lambda line: None)['per_device'] == 96
  assert compiled == [16, 96]
  # Memory that grows slower than the first line says (a compiler that reuses buffers at
  # large batches): each further compilation refits the line, until within 10 % of the HBM.
  memory = lambda per_device: 1e9 + 1e8 * 8 * (per_device / 8) ** 0.6
  monkeypatch.setattr(plan_lib, '_training_memory', lambda config, mesh, platform, per_device, *_: {'total': memory(per_device)})
  largest = plan_lib._largest_batch(None, None, 'tpu', tiny_plan_shape, 10 ** 6, lambda line: None)
  assert 0.9 * 16e9 <= largest['total'] <= 16e9 and largest['fits']
  assert len(largest['tried']) <= 7 and largest['per_device'] % 8 == 0
  # The TPU compiler refuses a program whose temporaries exceed the HBM (on v5e:2x2 at
  # --config.batch_size=3, the line through 1 and 2 per device overshot to 8632: once a
  # traceback): that batch does not fit, and the search steps below it.
  def refusing(config, mesh, platform, per_device, *_):
    if per_device > 100:
      raise _REFUSAL
    return {'total': 1e9 + 1e8 * per_device}
  monkeypatch.setattr(plan_lib, '_training_memory', refusing)
  lines = []
  largest = plan_lib._largest_batch(None, None, 'tpu', tiny_plan_shape, 10000, lines.append)
  assert 144 in largest['tried'] and largest['fits'] and 16 < largest['per_device'] <= 100, largest
  assert f'  at 144 per device: the compiler refused it, DOES NOT FIT ({_REFUSAL_LINE})' in lines


_REFUSAL_LINE = ('RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (22.10G) '
                 'exceeds available HBM (15.75G).')
_REFUSAL = jax.errors.JaxRuntimeError(_REFUSAL_LINE)


@pytest.fixture
def tiny_plan_shape():
  """A Plan of 4 v5e devices at 8 per device whose training step took 1.8 GB (no compiler)."""
  target = plan_lib.parse_target('v5e:2x2')
  return plan_lib.Plan(target, 4, 1, 1, 32, 64, 1000, 4000, [], {'total': 1e9 + 1e8 * 8}, {'total': 1e8}, 0.0)


@needs_libtpu
def test_a_run_that_cannot_fit_is_one_line(tiny_plan, monkeypatch, capsys):
  small = plan_lib.Chip('TPU v5 lite', 1e5, 819e9, 197e12, 2e11, 'a 100 kB chip')
  assert not dataclass_replace(tiny_plan, small).fits(tiny_plan.training)
  monkeypatch.setitem(plan_lib.CHIPS, 'v5e', small)
  from absl import flags  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(plan_lib, 'plan_run', lambda *a, **k: dataclass_replace(tiny_plan, small))
  fake = type('Flags', (), {'target': 'v5e:2x2', 'config': _tiny_config(), 'experiment': 'mnist_smoke',
                            'find_largest_batch': False})
  monkeypatch.setattr(flags, 'FLAGS', fake)
  with pytest.raises(SystemExit) as exited:
    plan_lib.main(['capsjax-plan'])
  assert exited.value.code == 2
  assert capsys.readouterr().err.strip().splitlines() == [
      'error: the run does not fit v5e:2x2: lower config.batch_size or config.eval_batch_size']


@needs_libtpu
def test_a_batch_the_compiler_refuses_is_one_line(monkeypatch):
  # `capsjax-plan --experiment=mnist --target=v5e:2x2 --config.batch_size=40000`: once a
  # traceback (the compiler's RESOURCE_EXHAUSTED); the compilation refused at once here.
  def refuse(lowered, what, show=True):
    raise _REFUSAL
  monkeypatch.setattr(plan_lib, '_compile', refuse)
  with pytest.raises(ConfigError) as raised:
    plan_lib.plan_run(_tiny_config(), 'v5e:2x2', find_largest_batch=False)
  assert str(raised.value) == ('the run does not fit v5e:2x2: the compiler refused the training step at 8 per device '
                               f'({_REFUSAL_LINE}); lower config.batch_size')
  # plan_run's own arguments from Python, before anything compiles ('no' once ran the search).
  for arguments, line in [((None,), '--target=None: a target is a name such as v5e:4x4'),
                          (('v5e:2x2', 'no'), "plan_run: find_largest_batch='no': allowed True or False"),
                          (('v5e:2x2', False, 5), 'plan_run: log=5: allowed a function')]:
    with pytest.raises(ConfigError, match=f'^{line}'):
      plan_lib.plan_run(_tiny_config(), *arguments)


_GPU_PLAN_SCRIPT = """
import dataclasses, json, sys
from capsjax.app import cli
cli.start_jax_quietly()
from capsjax.app import plan
from capsjax.experiments import mnist_smoke
config = mnist_smoke.get_config()
# The GPU's unrolled loop compiles 3× longer; float32 compute for the hand count of the
# all-reduce (the GPU's auto bfloat16 reduces its convolutions' gradients in bfloat16).
config.model.update(conv1_channels=16, primary_types=4, primary_dim=4, digit_dim=8, decoder_hidden=(32,))
config.model.formulation.update(routing_loop='rolled', dtype='float32')
config.batch_size, config.eval_batch_size = 32, 64
result = plan.plan_run(config, 'h100:2x2', find_largest_batch=False)
print(json.dumps({'shape': [result.devices, result.hosts, result.global_batch], 'param_bytes': result.param_bytes,
                  'formulations': result.formulations, 'training': result.training,
                  'evaluation_kernels': result.evaluation['kernels'], 'hbm': result.hbm_per_device,
                  'estimate': result.estimate(2.0), 'report': plan.report(result, 'mnist_smoke'),
                  'largest': plan.largest_batch_lines(dataclasses.replace(result, largest_batch=dict(
                      per_device=64, total=2 ** 30, tried=[8, 16, 64], capped=False, analysis=result.training)))}))
"""


@pytest.mark.slow
@needs_gpu_plan
def test_the_runs_own_step_compiles_for_gpus_on_two_hosts_and_matches_hand_counts():
  from benchmarks.timing import capsnet_flops  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=os.pathsep.join([GPU_PLAN, ROOT]))
  result = subprocess.run([sys.executable, '-c', _GPU_PLAN_SCRIPT], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  assert not result.stderr, result.stderr[-2000:]   # the plugin's driver probe stays quiet
  found = json.loads(result.stdout.strip().splitlines()[-1])
  assert found['shape'] == [4, 2, 32]
  assert any(line.startswith('conv_impl') and line.endswith(' patches') for line in found['formulations'])  # the GPU's
  training = found['training']
  # The gradient all-reduce moves the parameters' bytes (plus the metrics' scalars), the
  # space-to-depth PrimaryCaps' kernel as its zero-padded 10×10 taps (the GPU's form for
  # strided convolutions): 19 taps more × 16 channels × 16 features × 4 bytes.
  count, reduced = training['collectives']['all-reduce']
  padding = (10 ** 2 - 9 ** 2) * 16 * 16 * 4
  assert count >= 1 and found['param_bytes'] + padding <= reduced <= found['param_bytes'] + padding + 4096
  # FLOPs per device: the project's count for 8 images (patches compute the direct form),
  # within what it leaves out (elementwise work, the squash, the loss).
  flops = capsnet_flops(_tiny_config().model, 'gpu', batch=8)['train'] * 8
  assert 0.9 * flops <= training['flops'] <= 1.6 * flops, (training['flops'], flops)
  # Kernels read their operands and write their results: at least the state that the
  # step reads and returns (parameters, Adam's two moments: read and written).
  assert training['kernels'] > 10 and found['evaluation_kernels'] > 3
  assert training['bytes_accessed'] >= 2 * 3 * found['param_bytes']
  assert found['hbm'] == pytest.approx(0.75 * 80 * 2 ** 30)
  # Two hosts: the all-reduce crosses each GPU's 400 Gb/s adapter, not NVLink.
  estimate = found['estimate']
  assert estimate['allreduce_s'] == pytest.approx(2 * 3 / 4 * reduced / 50e9)
  report = '\n'.join(found['report'])
  assert 'target: h100:2x2 = h100:2x2: 4 GPUs of NVIDIA H100 80GB HBM3, 4 devices' in report
  assert 'ESTIMATE (not a measurement)' in report and '--config.num_processes=2' in report
  # Under it, what the H100 and H200 measured against such estimates, applied to this step and
  # to the run's 936 steps (mnist_smoke's 6 epochs of 5 000 images at 32).
  step = estimate['step_s']
  assert (f'the estimate is a floor: measured steps took 2.6–6.3× it (an H100 on 2026-11-25 and an H200 on '
          f'2026-11-28; docs/results.md), so expect ≈ {2.6e3 * step:.2f}–{6.3e3 * step:.2f} ms a step; the run\'s '
          f'936 steps ≈ {format_duration(2.6 * step * 936)}–') in report, report
  # The largest batch's estimate (its own line) is no more than a floor either, said so.
  assert found['largest'][0] == ('largest per-device batch that fits: 64 (256 global; 1.07 GB of 64.42 GB compiled; '
                                 'from compilations at 8, 16, 64 per device)')
  assert found['largest'][1].startswith('ESTIMATE at that batch (not a measurement): a training step ≈ ')
  assert found['largest'][2] == ('  a floor too: the measured 2.6–6.3× (an H100 on 2026-11-25 and an H200 on 2026-11-28) '
                                 'were steps at the batch a single model trains at (128), not at this one; no larger '
                                 'batch has run against its estimate')


@pytest.mark.slow
@pytest.mark.parametrize('pattern, devices, launch', [
    pytest.param(r'^capsjax-plan --experiment=mnist --target=v5e:16x16$', 256,
                 'launch (every host of the slice runs the same command):', marks=needs_libtpu),
    pytest.param(r'^capsjax-plan --experiment=mnist --target=h100:8$', 8, "launch (one process sees all the host's GPUs):",
                 marks=needs_gpu_plan),
])
def test_the_default_experiment_plans_as_documented_and_its_launch_line_keeps_the_overrides(pattern, devices, launch,
                                                                                          tmp_path):
  # docs/planning.md's commands compiled at a small model's size (every documented plan is
  # checked up to its compilation by tests/test_documented_commands.py): mnist's evaluation
  # batch of 500 does not divide by 256 devices (padded, as the run pads it). GPU plans find
  # the CUDA plugin in the folder $CAPSJAX_GPU_PLAN names (docs/hosts.md's install, next to this
  # environment). The TPU slice has more devices than the batch has examples (as the
  # headline v5e:16x16 has for mnist's 128; here a batch of 8): planned at one example
  # per device, and said so.
  batch = 8 if devices == 256 else 128
  overrides = ['--config.model.conv1_channels=16', '--config.model.primary_types=4', '--config.model.digit_dim=8',
               '--config.model.decoder_hidden=(32,)', '--config.num_test_examples=600',
               '--config.model.formulation.routing_loop=rolled', f'--config.batch_size={batch}']
  # A user's persistent cache: the plan writes nothing into it (its executables cannot be
  # read back; the next plan warned "Error reading persistent compilation cache entry").
  cache = tmp_path / 'jax_cache'
  env = dict(os.environ, CAPSJAX_GPU_PLAN=GPU_PLAN, JAX_COMPILATION_CACHE_DIR=str(cache))
  as_documented = documented.command(pattern).args()
  result = subprocess.run([sys.executable, '-m', 'capsjax.app.plan', *as_documented, '--nofind_largest_batch',
                           *overrides],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  assert not cache.exists() or not os.listdir(cache), os.listdir(cache)
  lines = result.stdout.splitlines()
  planned = max(batch, devices)
  assert (f'batch: {planned} global, {planned // devices} per device (evaluation: 500 global, {-(-500 // devices)} '
          'per device)' in result.stdout)
  assert (result.stdout + result.stderr).count(   # said once, as the plan starts (it was said twice)
      'config.batch_size=8 is smaller than the 256 devices of the slice: planned at 256 (one example per device') == (
          devices == 256)
  # Printed as it was known, before the report.
  assert any(line.startswith(f'the training step at {planned // devices} per device: ') and ', fits; ' in line
             for line in lines[:lines.index(launch)])
  command = ('python run.py --experiment=mnist --workdir=/mnt/shared/mnist '
             + ('--config.distributed=True ' if devices == 256 else '')
             + ' '.join(map(shlex.quote, overrides[:-1])) + f' --config.batch_size={planned}')
  assert command in lines[lines.index(launch) + (2 if devices == 256 else 1)]


@needs_libtpu
def test_a_plan_after_other_compilations_reads_no_cache_entry_it_cannot_load():
  # In a process that caches (this worker: tests/conftest.py's folder) and has compiled
  # before, a plan's compilations still go through JAX's persistent cache: the second of two
  # identical ones found the first's entry, which no compile-only device can load, and
  # warned. The caller's setting stays as it is (capsjax-plan turns the cache off in its own
  # process: the documented plan's test).
  import warnings  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()
  caching = jax.config.jax_enable_compilation_cache
  mesh = Mesh(plan_lib.compile_only_devices(plan_lib.parse_target('v5e:2x2')), ('data',))
  rows = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec('data')))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    for _ in range(2):
      plan_lib._compile(jax.jit(lambda x: (2 * x).sum()).lower(rows), 'a sum', show=False)
  assert not [w for w in caught if 'persistent compilation cache' in str(w.message)], [str(w.message) for w in caught]
  assert jax.config.jax_enable_compilation_cache == caching


@needs_libtpu
def test_a_stopped_plan_says_so_in_one_line():
  # libtpu's own SIGTERM handler would print a crash dump; the plan's says it stopped. The
  # estimate and the launch line come before the largest-batch search: a stop inside it
  # (a compilation on the worker thread) keeps them.
  # (Batches of 8: what is stopped is the same; the TPU compiles before the search take half
  # as long as at 128 and 500.)
  small = ['--config.model.conv1_channels=16', '--config.model.primary_types=4', '--config.model.digit_dim=8',
           '--config.model.decoder_hidden=(32,)', '--config.model.formulation.routing_loop=rolled',
           '--config.batch_size=8', '--config.eval_batch_size=8']
  plan = subprocess.Popen([sys.executable, '-m', 'capsjax.app.plan', '--experiment=mnist', '--target=v5e:2x2', *small],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    assert plan.stdout.readline().startswith('compiling the training step and an evaluation batch for v5e:2x2')
    said = []
    while not said or not said[-1].startswith('searching for the largest batch that fits'):
      said.append(plan.stdout.readline())
      assert said[-1], said
    plan.send_signal(signal.SIGTERM)
    _, err = plan.communicate(timeout=300)
  finally:
    plan.kill()
  assert any(line.startswith('ESTIMATE (not a measurement)') for line in said)
  assert any(line.startswith('launch (every host of the slice runs the same command):') for line in said)
  assert plan.returncode == 128 + signal.SIGTERM
  assert err.strip().splitlines()[-1] == 'error: capsjax-plan stopped by SIGTERM before the plan was complete'
  assert 'SIGTERM received' not in err and 'Traceback' not in err


def dataclass_replace(result, chip):
  import dataclasses  # pylint: disable=g-import-not-at-top
  return dataclasses.replace(result, target=dataclasses.replace(result.target, chip=chip), largest_batch=None)


BAD_PLANS = [
    (['--experiment=mnist', '--target=v9:2x2'], "error: --target='v9:2x2': not a TPU topology"),
    (['--experiment=mnist', '--target=v5e:2x2', '--config.batch_size=30'],
     'error: global batch_size 30 does not divide by the 4 devices'),
    (['--experiment=mnist'], 'error: --target=NAME is required'),
    (['--experiment=ablation', '--target=v5e:2x2'], 'error: --experiment=ablation: its program (ablation)'),
    (['--target=list'], None),
]


@pytest.fixture(scope='module')
def bad_plan_results():
  """capsjax-plan's front end for each of BAD_PLANS, all in one process (tests/command_checks.py)."""
  results = command_checks.run([['plan', args] for args, _ in BAD_PLANS], cwd=ROOT, timeout=120)
  return {tuple(args): result for (args, _), result in zip(BAD_PLANS, results)}


def _expected(args, message):
  if ('batch_size=30' in ' '.join(args) or message is None) and not HAVE_LIBTPU:
    return 'error: planning for a TPU needs libtpu'
  return message


@pytest.mark.parametrize('args, message', BAD_PLANS)
def test_bad_plans_are_one_line(args, message, bad_plan_results):
  result, message = bad_plan_results[tuple(args)], _expected(args, message)
  if message is None:   # the topologies this libtpu describes, without an experiment
    assert result['status'] == 0 and 'v5e:4x4        16 chips,   16 devices,   4 hosts' in result['stdout'], result
    assert not result['stderr'], result['stderr']
    return
  assert result['status'] == 2, result['stderr']
  assert result['stderr'].strip().splitlines() == [result['stderr'].strip()], result['stderr']
  assert result['stderr'].startswith(message), result['stderr']


def test_a_bad_plan_ends_the_command_with_one_line():
  args, message = BAD_PLANS[1]
  result = subprocess.run([sys.executable, '-m', 'capsjax.app.plan'] + args, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr[-2000:]
  assert result.stderr.startswith(_expected(args, message)), result.stderr


def test_without_libtpu_the_plan_names_the_extra(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name == 'libtpu' else real(name, *a))
  with pytest.raises(ConfigError, match=r"needs libtpu, which is not installed: pip install 'capsjax\[tpu\]'"):
    plan_lib.compile_only_devices(plan_lib.parse_target('v5e:2x2'))



def test_flops_come_from_jax_s_public_cost_analysis_else_the_cpu_client_s_else_unknown(monkeypatch):
  """The lowered program's FLOPs: `Lowered.cost_analysis()` (public), else the CPU client's
  analysis of its HLO (private to JAX: the CUDA plugin's compile-only devices give no
  public one), else 0 (unknown) where a JAX has moved the private names."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  lowered = jax.jit(lambda a, b: a @ b).lower(jnp.ones((8, 16)), jnp.ones((16, 4)))
  assert plan_lib._hlo_flops(lowered, 2) == 8 * 16 * 4 * 2 / 2   # 2 FLOPs per multiply-add, per device

  class NoPublicAnalysis:   # as a compile-only GPU's lowering
    _lowering = lowered._lowering  # pylint: disable=protected-access

    def cost_analysis(self):
      raise RuntimeError('no cost analysis on this backend')
  assert plan_lib._hlo_flops(NoPublicAnalysis(), 1) == 8 * 16 * 4 * 2   # the CPU client's
  monkeypatch.delattr(NoPublicAnalysis, '_lowering')
  assert plan_lib._hlo_flops(NoPublicAnalysis(), 1) == 0.0   # unknown, not a traceback
