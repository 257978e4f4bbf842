"""What a GPU run needs ready: the routing loop's formulations and their per-backend table,
the float32_matmuls marker, and the device report's whole code path (--smoke, on the CPU)."""
import argparse
import gzip
import importlib.util
import json
import os
import subprocess
import tarfile
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capsjax import formulations, ops
from capsjax.formulations import Formulation
from capsjax.models import CapsNet
from capsjax.routing import UNROLLED_INFERENCE, dynamic_routing
import documented
from helpers import SPEEDY_CONV_FLAG

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.float32_matmuls
@pytest.mark.compile_bound
@pytest.mark.parametrize('traced', [False, True])
def test_unrolled_routing_loop_equals_the_rolled_one_in_value_and_gradient(traced):
  u_hat = 0.3 * jax.random.normal(jax.random.key(0), (2, 12, 4, 5))
  iterations = jnp.asarray(2) if traced else 3
  bound = dict(max_iterations=3) if traced else {}

  def loss(u, unroll):
    return jnp.sum(jnp.sin(dynamic_routing(u, iterations, unroll=unroll, **bound).parents))

  rolled, unrolled = (jax.jit(lambda u, unroll=unroll: loss(u, unroll)) for unroll in (False, True))
  np.testing.assert_allclose(unrolled(u_hat), rolled(u_hat), rtol=1e-6)
  grad_of = lambda f: jax.jit(jax.grad(f))   # jitted: one program each, not one per operation
  rolled_grad = grad_of(lambda u: loss(u, False))
  np.testing.assert_allclose(grad_of(lambda u: loss(u, True))(u_hat), rolled_grad(u_hat), rtol=1e-5, atol=1e-7)
  # The unrolled program really has no loop left.
  assert 'while' not in jax.jit(lambda u: loss(u, True)).lower(u_hat).as_text()
  assert 'while' in jax.jit(lambda u: loss(u, False)).lower(u_hat).as_text()
  # 'inference' (routing_loop 'unrolled_inference', the CPU's auto): unrolled where nothing
  # differentiates the loop, the rolled loop's derivatives where something does; the same
  # values and gradients, under vmap too.
  inference = lambda u: loss(u, UNROLLED_INFERENCE)
  np.testing.assert_allclose(jax.jit(inference)(u_hat), rolled(u_hat), rtol=1e-6)
  np.testing.assert_allclose(grad_of(inference)(u_hat), rolled_grad(u_hat), rtol=1e-5, atol=1e-7)
  assert 'while' not in jax.jit(inference).lower(u_hat).as_text()
  assert 'while' in jax.jit(jax.grad(inference)).lower(u_hat).as_text()
  batched = jnp.stack([u_hat, 2 * u_hat])
  np.testing.assert_allclose(jax.jit(jax.vmap(jax.grad(inference)))(batched),
                             jax.jit(jax.vmap(jax.grad(lambda u: loss(u, False))))(batched), rtol=1e-5, atol=1e-7)


@pytest.mark.float32_matmuls
@pytest.mark.compile_bound
def test_capsnet_routing_loop_option_keeps_the_outputs():
  small = dict(conv1_channels=8, conv1_kernel=3, primary_types=2, primary_kernel=3, input_shape=(12, 12, 1),
               decoder_hidden=(16,))
  images = jax.random.uniform(jax.random.key(1), (2, 12, 12, 1))
  # float32 on any backend (a GPU's 'auto' is bfloat16): the tolerance is float32's.
  rolled, unrolled = (CapsNet(formulation=Formulation(conv_impl='patches', routing_loop=loop, dtype='float32'), **small)
                      for loop in ('rolled', 'unrolled'))
  params = jax.jit(rolled.init)(jax.random.key(2), images)['params']
  out_rolled = jax.jit(rolled.apply)({'params': params}, images)
  out_unrolled = jax.jit(unrolled.apply)({'params': params}, images)
  np.testing.assert_allclose(out_unrolled['capsules'], out_rolled['capsules'], rtol=1e-5, atol=1e-7)


def test_auto_formulations_come_from_the_one_table():
  paper_primary, paper_conv1 = formulations.ConvLayer(20, 20, 256, 256, 9, 2), formulations.ConvLayer(28, 28, 1, 256, 9, 1)
  for backend, entry in formulations.FASTEST.items():
    rule = entry['conv_impl']
    expected = rule.pick(paper_primary) if hasattr(rule, 'pick') else rule
    assert formulations.resolve('conv_impl', 'auto', backend, paper_primary) == expected
    assert formulations.resolve('routing_loop', 'auto', backend) == entry['routing_loop']
    rule = entry['patches_inference']
    expected = rule.pick(paper_conv1) if hasattr(rule, 'pick') else rule
    assert formulations.resolve('patches_inference', 'auto', backend, paper_conv1) == expected
    assert formulations.resolve('dtype', 'auto', backend) == entry['dtype']
  # FASTEST['gpu'], from the H200 of 2026-11-26: strided convolutions as space-to-depth,
  # unit-stride ones as patches (the H100 report), bfloat16 compute.
  assert formulations.resolve('conv_impl', 'auto', 'gpu', paper_primary) == 'space_to_depth'
  assert formulations.resolve('conv_impl', 'auto', 'gpu', paper_conv1) == 'patches'
  assert formulations.resolve('conv_impl', 'auto', 'gpu') == 'patches'   # without a layer: the unit-stride choice
  assert formulations.choices('conv_impl', 'gpu') == ('patches', 'space_to_depth')
  assert (formulations.resolve('dtype', 'auto', 'gpu'), formulations.resolve('dtype', 'auto', 'cpu')) == (
      'bfloat16', 'float32')
  assert formulations.resolve('routing_loop', 'unrolled', 'cpu') == 'unrolled'   # explicit values stay
  # The CPU: unrolled where nothing differentiates the loop, rolled in a training step.
  assert formulations.resolve('routing_loop', 'auto', 'cpu') == 'unrolled_inference'
  assert ops.resolve_conv_impl('auto', paper_primary) == formulations.resolve('conv_impl', 'auto', layer=paper_primary)
  with pytest.raises(ValueError, match='routing_loop must be one of'):
    formulations.resolve('routing_loop', 'twice')


@pytest.mark.float32_matmuls
def test_the_marker_pins_float32_in_every_thread():
  seen = []
  thread = threading.Thread(target=lambda: seen.append(jax.config.jax_default_matmul_precision))
  thread.start()
  thread.join()
  assert seen == ['highest']


def test_unmarked_tests_keep_jaxs_default_precision():
  assert jax.config.jax_default_matmul_precision is None


@pytest.mark.peers
def test_the_gpu_speed_step_runs_every_row_on_the_cpu(tmp_path):
  # `gpu.sh speed --smoke`, docs/gpu.md's speed step rehearsed on the CPU (on a GPU
  # machine too): the primary convolution alone (gpu_speed.py), then every cell of the
  # device report's smoke (fp32 peer rows, shared processes; a budget above the smoke's own
  # 165 s: beside the suite's other worker it runs slower).
  speed = documented.command(r'gpu.sh speed$').words   # docs/gpu.md's step, --smoke
  done = subprocess.run([*speed, '--smoke'],
                        capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
                        env=dict(os.environ, JAX_PLATFORMS='cpu', OUT=str(tmp_path)))
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  assert done.stdout.startswith('environment: '), done.stdout[:500]   # what its first seconds print
  speed = json.loads((tmp_path / 'speed' / 'speed.json').read_text())
  cells = {(row['variant'], row['formulation'], row['dtype']) for row in speed['rows'] if 'error' not in row}
  assert cells == {('default', impl, dtype) for impl in ('patches', 'xla', 'space_to_depth')
                   for dtype in ('float32', 'bfloat16')} | {('no_triton_gemm', 'patches', 'float32')}, speed
  with tarfile.open(tmp_path / 'speed' / 'extras.tar.gz') as extras:   # (eight files in all)
    hlo_sizes = {member.name: member.size for member in extras.getmembers()}
  for row in speed['rows']:
    assert row['train']['tflops'] > 0 and 0 < row['infer']['share_of_peak']
    assert hlo_sizes[f'hlo/{row["variant"]}-{row["cell"]}-train.txt'] > 0
  assert len([path for path in tmp_path.rglob('*') if path.is_file()]) <= 8
  assert '| default | space_to_depth | float32 | 4 |' in (tmp_path / 'speed' / 'speed.md').read_text()
  last = done.stdout.strip().splitlines()[-1]
  assert last.startswith('device_report duration_s=') and 'skipped=0' in last, done.stdout[-3000:]
  out = tmp_path / 'speed_steps'
  report = json.loads((out / 'report.json').read_text())
  assert set(report) >= {'device', 'rows', 'profile'}
  assert report['device']['matmul_peak_tflops']['f32'] > 0 and report['device']['copy_gb_per_s'] > 0
  rows = report['rows']
  for row in rows:
    assert {'impl', 'mode', 'variant', 'images_per_s', 'peak_memory_bytes'} <= set(row)
    assert row['images_per_s'] > 0
  capsjax = {(r['mode'], r['variant']) for r in rows if r['impl'] == 'capsjax' and r['experiment'] == 'mnist'
             and r['members'] == 1 and r['batch'] == report['settings']['batch']}
  report_module = _device_report_module()
  for conv, dtype, loop in report_module.SMOKE_VARIANTS:   # every value of each choice (the GPU run: all 8)
    assert {('train', f'{conv} {dtype} {loop}'), ('infer', f'{conv} {dtype} {loop}')} <= capsjax
  assert any(r['members'] == 3 and r['mode'] == 'train' for r in rows)           # the vmapped seeds
  assert any(r['experiment'] == 'multimnist' and r['mode'] == 'train' for r in rows)
  assert any(r['mode'] == 'infer' and r['batch'] == report['settings']['large_batch'] for r in rows)
  assert [r['resolved']['patches_inference'] for r in rows if r['variant'].endswith('whole-batch inference')] == [
      'whole_batch']
  peers = {(r['variant'], r['mode']) for r in rows if r['impl'] == 'torch'}
  assert peers == {(f'{kind} fp32', mode) for kind in ('eager', 'compile') for mode in ('train', 'infer')}
  assert {r['compile_backend'] for r in rows if r['impl'] == 'torch'} == {None, 'aot_eager'}   # the smoke's capture
  fastest_peer = max(r['images_per_s'] for r in rows if r['impl'] == 'torch' and r['mode'] == 'train')
  for row in rows:   # ratios against the fastest peer row of the same mode, shares of the peak
    if row['impl'] == 'capsjax' and row['mode'] == 'train':
      assert row['vs_fastest_peer'] == pytest.approx(row['images_per_s'] / fastest_peer)
    assert row['share_of_peak'] > 0
    assert row['impl'] == 'torch' or row['peak_memory_bytes'] > 0   # the peer's is CUDA-only
  assert 0 < len(report['profile']) <= 15
  assert sum(op['share'] for op in report['profile']) <= 1.0 + 1e-9
  assert (out / 'profile_trace.json.gz').stat().st_size > 0
  markdown = (out / 'report.md').read_text()
  assert '| capsjax | train | patches float32 rolled |' in markdown and 'ms / step' in markdown


def _device_report_module():
  spec = importlib.util.spec_from_file_location('device_report', os.path.join(ROOT, 'benchmarks', 'device_report.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_smoke_covers_every_value_of_each_choice_and_the_gpu_plan_every_variant(tmp_path):
  # (Each pair of formulation choices is compared in value by tests/test_models.py; the
  # smoke rehearses the report's code path, a GPU runs all 8.)
  report = _device_report_module()
  values = lambda variants: {(i, a) for v in variants for i, a in enumerate(v)}
  assert values(report.SMOKE_VARIANTS) == values(report.VARIANTS) and len(report.SMOKE_VARIANTS) == 2
  args = argparse.Namespace(smoke=False)
  planned = {cell['variant'] for cell in report.plan(args, 'gpu', report.SETTINGS['full'], str(tmp_path))
             if cell['kind'] == 'capsjax'}
  assert {' '.join(v) for v in report.VARIANTS} <= planned


def test_profile_summary_reads_a_gpu_trace_s_xla_ops_line(tmp_path):
  # The smoke can only profile a CPU; this is the shape of a GPU trace (Perfetto JSON).
  report = _device_report_module()
  events = [{'ph': 'M', 'name': 'process_name', 'pid': 1, 'args': {'name': '/device:GPU:0'}},
            {'ph': 'M', 'name': 'process_name', 'pid': 7, 'args': {'name': '/host:CPU'}},
            {'ph': 'M', 'name': 'thread_name', 'pid': 1, 'tid': 2, 'args': {'name': 'XLA Ops'}},
            {'ph': 'M', 'name': 'thread_name', 'pid': 1, 'tid': 3, 'args': {'name': 'XLA Modules'}},
            {'ph': 'X', 'pid': 1, 'tid': 2, 'name': 'fusion.12', 'dur': 300.0},
            {'ph': 'X', 'pid': 1, 'tid': 2, 'name': 'cublas-gemm.3', 'dur': 100.0},
            {'ph': 'X', 'pid': 1, 'tid': 2, 'name': 'fusion.12', 'dur': 200.0},
            {'ph': 'X', 'pid': 1, 'tid': 3, 'name': 'jit_train_step', 'dur': 2000.0},   # the module, not an op
            {'ph': 'X', 'pid': 7, 'tid': 9, 'name': 'PjitFunction', 'dur': 5000.0}]      # host work
  path = tmp_path / 'trace.json.gz'
  with gzip.open(path, 'wt') as f:
    json.dump({'traceEvents': events}, f)
  assert report.summarise_trace(str(path), steps=2) == [
      {'name': 'fusion.12', 'ms_per_step': 0.25, 'share': 500 / 600},
      {'name': 'cublas-gemm.3', 'ms_per_step': 0.05, 'share': 100 / 600}]


def test_a_gpu_training_leg_starts_is_waited_for_and_exported_on_the_cpu(mnist_dir, tmp_path):
  # docs/gpu.md's `leg`, `wait` and `export` steps, rehearsed with a small plain run (the legs'
  # own configs are checked as written by tests/test_documented_commands.py): the leg outlives
  # the command that started it, `wait` brings back its files, `export` the validation-selected
  # model with its measured test error.
  waits = documented.commands_like(r'gpu\.sh wait \w+ \d+$')
  exports = documented.commands_like(r'gpu\.sh export \w+$')
  script = waits[0].words[:2]   # bash benchmarks/gpu.sh
  assert all(c.words[:3] == [*script, 'wait'] for c in waits) and all(c.words[:3] == [*script, 'export'] for c in exports)
  env = dict(os.environ, JAX_PLATFORMS='cpu', OUT=str(tmp_path / 'out'), CAPSJAX_LEGS=str(tmp_path / 'legs'),
             CAPSJAX_MNIST_DIR=mnist_dir, CAPSJAX_LEG_POLL_S='1')
  small = ['--experiment=mnist_smoke', '--config.num_steps=4', '--config.batch_size=16', '--config.eval_every_steps=2',
           '--config.validation_examples=100', '--config.num_test_examples=100', '--config.model.conv1_channels=16',
           '--config.model.primary_types=4', SPEEDY_CONV_FLAG,
           '--config.evals.routing_probe.enabled=False', '--config.evals.routing_diagnostics.enabled=False',
           '--config.evals.reconstructions.enabled=False']
  run = lambda *args: subprocess.run([*script, *args], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
  started = run('leg', 'small', *small)
  assert started.returncode == 0 and started.stdout.startswith('leg small started (pid '), started.stderr[-2000:]
  waited = run('wait', 'small', '240')
  assert waited.returncode == 0 and waited.stdout.strip().endswith('leg small: stopped, finished: results.json'), (
      waited.stdout[-2000:])
  results = json.loads((tmp_path / 'out' / 'small' / 'results.json').read_text())
  assert results['steps'] == 4 and (tmp_path / 'out' / 'small' / 'run.log').stat().st_size > 0
  exported = run('export', 'small', '--num_images=20')
  assert exported.returncode == 0, exported.stdout[-2000:] + exported.stderr[-2000:]
  assert 'test error of the float16 parameters as written: ' in exported.stdout
  assert {'params.npz', 'test_sample.npz', 'config.json'} <= set(os.listdir(tmp_path / 'out' / 'small' / 'shipped'))
  missing = run('wait', 'nothing')
  assert missing.returncode == 2 and missing.stderr.strip() == 'error: no leg nothing on this machine (a leg lives on the machine that started it)'
  # `segment` (a MultiMNIST leg's figure 5) on this MNIST leg: capsjax-segmentation's one line.
  assert documented.commands_like(r'gpu\.sh segment \w+$')[0].words[:3] == [*script, 'segment']
  segmented = run('segment', 'small')
  assert segmented.returncode == 2 and segmented.stdout.strip().endswith(
      f'error: {tmp_path}/legs/small holds a mnist_smoke run, not a MultiMNIST one'), segmented.stdout[-2000:]
