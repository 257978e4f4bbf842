"""Training: it learns real MNIST, resumes exactly, stops on divergence, guards checkpoints."""
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from capsjax import memory, runtime, train
from capsjax import workdir as workdir_lib
from capsjax.errors import CheckpointError, NaNLossError, RunStopped
from capsjax.experiments import mnist
from helpers import SPEEDY_CONV, tiny_config


def _restore_params(workdir):
  manager = ocp.CheckpointManager(os.path.join(workdir, 'checkpoints'))
  restored = manager.restore(manager.latest_step())
  return manager.latest_step(), restored['state']['params']


def test_short_training_learns_real_mnist(mnist_dir, tmp_path):
  config = mnist.get_config()
  config.data_dir = mnist_dir
  config.model.conv1_channels = 32
  config.model.primary_types = 8
  config.model.formulation.conv_impl = SPEEDY_CONV
  config.num_train_examples = 3000
  config.num_test_examples = 2000   # held-out real test images
  config.batch_size = 50
  config.num_epochs = 3.0
  config.lr_decay_steps = 100
  config.log_every_steps = 20
  config.eval_every_steps = 0
  config.checkpoint_every_steps = 1000
  results = train.train_and_evaluate(config, str(tmp_path))
  assert results['test_accuracy'] >= 0.90, results['test_accuracy']
  saved = json.loads((tmp_path / 'results.json').read_text())
  for key in ('test_accuracy', 'test_error', 'num_params', 'steps', 'epochs', 'final_train_loss',
              'wall_time_s', 'config'):
    assert key in saved
  assert saved['steps'] == 180 and saved['epochs'] == 3.0
  assert abs(saved['test_error'] - (1 - saved['test_accuracy'])) < 1e-9
  records = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  train_losses = [r['loss'] for r in records if r['split'] == 'train']
  assert train_losses[-1] < 0.5 * train_losses[0]
  assert [r['split'] for r in records].count('test') == 1
  # The routing diagnostics of the trained model (capsjax.diagnostics), on the first 1 000
  # test images: Procedure 1 moved the couplings away from uniform, classes route alike.
  test_row = next(r for r in records if r['split'] == 'test')
  assert 0 < test_row['routing_coupling_movement'] < 1 and 0 < test_row['routing_coupling_entropy'] < 1
  assert test_row['routing_consistency_same_class'] > test_row['routing_consistency_other_class']
  assert 0 <= test_row['primary_capsules_inactive'] <= 1 and test_row['class_capsules_inactive'] == 0
  sweep = test_row['accuracy_by_routing_iterations']   # r = 1 … 5 at test time
  assert len(sweep) == 5 and sweep[2] >= 0.85 and all(0 <= a <= 1 for a in sweep)


def test_the_fresh_state_sits_where_the_step_puts_it(mnist_dir):
  # Placed elsewhere, the step's second call compiles the whole step again (benchmarks and
  # the zoo time from the second call on).
  from capsjax import experiment, sharding  # pylint: disable=g-import-not-at-top
  config = tiny_config(mnist_dir)
  program = experiment.start(config, sharding.data_mesh(), resolved=True).steps
  fresh = program.initial_state
  placed = jax.tree.map(lambda x: x.sharding, fresh)
  stepped, _ = program.train_step(fresh, 0)
  assert jax.tree.map(lambda x: x.sharding, stepped) == placed
  assert all(x.committed for x in jax.tree.leaves(stepped))


def test_resumed_run_equals_uninterrupted_run(mnist_dir, tmp_path):
  whole, parts = str(tmp_path / 'whole'), str(tmp_path / 'parts')
  config = tiny_config(mnist_dir, num_steps=12)  # crosses an epoch boundary (8 steps/epoch)
  train.train_and_evaluate(config, whole)
  with pytest.raises(RunStopped) as interrupted:
    train.train_and_evaluate(config, parts, stop_at_step=5)
  assert (interrupted.value.steps, interrupted.value.num_steps, interrupted.value.stop_reason) == (5, 12, 'stop_at_step')
  assert _restore_params(parts)[0] == 5
  train.train_and_evaluate(config, parts)
  (step_a, params_a), (step_b, params_b) = _restore_params(whole), _restore_params(parts)
  assert step_a == step_b == 12
  for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  results_a = json.loads(open(os.path.join(whole, 'results.json')).read())
  results_b = json.loads(open(os.path.join(parts, 'results.json')).read())
  assert results_a['test_accuracy'] == results_b['test_accuracy']
  assert results_a['devices'] == {'count': jax.device_count(), 'kind': jax.devices()[0].device_kind, 'processes': 1}


def test_a_finished_run_says_so_and_reevaluates_only_when_asked(mnist_dir, tmp_path, capsys, monkeypatch):
  # No memory to speak of, but --config.check_memory=False: the run is tried anyway.
  monkeypatch.setattr(memory, 'available_bytes', lambda device=None: 1)
  config = tiny_config(mnist_dir, num_steps=4, check_memory=False)
  first = train.train_and_evaluate(config, str(tmp_path))
  header = capsys.readouterr().out
  assert f'; {jax.device_count()} × {runtime.device_name()}' in header
  assert '; model buffers at peak ≈ 0.' in header and " GB estimated (parameters, optimizer state, a step's " in header
  assert "the process adds JAX's runtime and the data) of 0.00 GB available" in header
  metrics = (tmp_path / 'metrics.jsonl').read_text()
  again = train.train_and_evaluate(config, str(tmp_path))
  out = capsys.readouterr().out
  assert again.results == json.loads((tmp_path / 'results.json').read_text())   # the finished run's results
  assert again['test_accuracy'] == first['test_accuracy'] and out.splitlines() == [
      f'{tmp_path} is complete (4 steps): results in {tmp_path / "results.json"}; '
      '--config.reevaluate=True evaluates it again']
  assert (tmp_path / 'metrics.jsonl').read_text() == metrics   # nothing evaluated or written
  # Answered from its files: no data is read (the data folder, a runtime key, is gone here).
  elsewhere = tiny_config(str(tmp_path / 'no_data_here'), num_steps=4)
  assert train.train_and_evaluate(elsewhere, str(tmp_path))['test_accuracy'] == first['test_accuracy']
  assert capsys.readouterr().out.startswith(f'{tmp_path} is complete (4 steps)')
  config.reevaluate = True   # a runtime key: the workdir's config still matches
  assert train.train_and_evaluate(config, str(tmp_path))['test_accuracy'] == first['test_accuracy']
  assert 'step 4: evaluating' in capsys.readouterr().out
  rows = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  tests = [row for row in rows if row['split'] == 'test']   # the new evaluation is logged after the old
  assert [row['step'] for row in tests] == [4, 4] and tests[1]['accuracy'] == tests[0]['accuracy']
  # Its checkpoints gone (emptied, then removed): re-evaluating it would train from scratch
  # and overwrite results.json. Refused with one line; not a byte of the workdir changes.
  finished = tmp_path.parent / f'{tmp_path.name}_no_checkpoints'
  shutil.copytree(tmp_path, finished, ignore=lambda folder, names: [n for n in names if folder.endswith('checkpoints')])
  for remove in (False, True):
    if remove:
      (finished / 'checkpoints').rmdir()
    before = {p: p.read_bytes() for p in finished.rglob('*') if p.is_file()}
    with pytest.raises(CheckpointError, match=r'reevaluate=True: .* finished at step 4 but it has no checkpoint'):
      train.train_and_evaluate(config, str(finished))
    assert {p: p.read_bytes() for p in finished.rglob('*') if p.is_file()} == before
    assert sorted(finished.rglob('*')) == sorted(set(before) | ({finished / 'checkpoints'} if not remove else set()))
  monkeypatch.undo()
  longer = tiny_config(mnist_dir, num_steps=6, allow_config_change=True)   # more steps: not complete
  assert train.train_and_evaluate(longer, str(tmp_path))['steps'] == 6


def test_divergence_stops_with_step_named_and_checkpoint_kept(mnist_dir, tmp_path):
  workdir = str(tmp_path)
  with pytest.raises(RunStopped):
    train.train_and_evaluate(tiny_config(mnist_dir, num_steps=4), workdir, stop_at_step=2)
  # A rate the check allows (finite) whose first update overflows float32: ‖update‖ is inf.
  diverging = tiny_config(mnist_dir, num_steps=4, learning_rate=1e30, allow_config_change=True)
  with pytest.raises(NaNLossError, match=r'at step 2; stopped \(last good checkpoint: step 2'):
    train.train_and_evaluate(diverging, workdir)
  step, params = _restore_params(workdir)
  assert step == 2
  assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(params))


def test_nan_from_the_first_step(mnist_dir, tmp_path, monkeypatch):
  from capsjax import losses  # pylint: disable=g-import-not-at-top
  original = losses.capsnet_loss   # a loss that is NaN from the start (a NaN option is refused by the check)
  monkeypatch.setattr(losses, 'capsnet_loss', lambda *args, **kwargs: (
      original(*args, **kwargs)[0] * float('nan'), original(*args, **kwargs)[1]))
  with pytest.raises(NaNLossError, match='at step 0; stopped \\(no checkpoint was written yet\\)'):
    train.train_and_evaluate(tiny_config(mnist_dir), str(tmp_path))


def test_corrupt_checkpoint_is_reported_and_left_in_place(mnist_dir, tmp_path):
  config = tiny_config(mnist_dir, num_steps=4)
  with pytest.raises(RunStopped):
    train.train_and_evaluate(config, str(tmp_path), stop_at_step=2)
  step_dir = tmp_path / 'checkpoints' / '2'
  for root, _, files in os.walk(step_dir):
    for name in files:
      if 'metadata' not in name:
        with open(os.path.join(root, name), 'wb') as f:
          f.write(b'corrupt')
  before = sorted(os.listdir(step_dir))
  with pytest.raises(CheckpointError, match='cannot restore checkpoint step 2'):
    train.train_and_evaluate(config, str(tmp_path))
  assert sorted(os.listdir(step_dir)) == before
  # Every program that restores says so in exactly one line: no orbax / tensorstore noise
  # from interpreter teardown after it (it came in 3 of 5 runs, up to 40 lines).
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for command in ([os.path.join(root, 'run.py'), '--experiment=mnist', f'--workdir={tmp_path}',
                   f'--config.data_dir={mnist_dir}', *[f'--config.{k}={v}' for k, v in (
                       ('model.conv1_channels', 16), ('model.primary_types', 4), ('model.decoder_hidden', '(32,64)'),
                       ('model.formulation.conv_impl', SPEEDY_CONV),
                       ('num_train_examples', 256), ('num_test_examples', 100), ('batch_size', 32),
                       ('num_steps', 4), ('log_every_steps', 2), ('eval_every_steps', 0),
                       ('eval_batch_size', 100), ('checkpoint_every_steps', 2),
                       ('evals.routing_diagnostics.enabled', False))]],
                  ['-m', 'capsjax.app.programs.figures', f'--workdir={tmp_path}']):
    result = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=120, cwd=root)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: cannot restore checkpoint step 2'), result.stderr[-3000:]


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes_from_an_intact_one(mnist_dir, tmp_path,
                                                                                        capsys):
  config = tiny_config(mnist_dir, num_steps=6)
  with pytest.raises(RunStopped):
    train.train_and_evaluate(config, str(tmp_path), stop_at_step=4)   # checkpoints 2 and 4
  files = [os.path.join(root, name) for root, _, names in os.walk(tmp_path / 'checkpoints' / '4') for name in names]
  largest = max(files, key=os.path.getsize)
  with open(largest, 'r+b') as f:   # truncated, as a full disk or a killed copy leaves it
    f.truncate(os.path.getsize(largest) // 2)
  capsys.readouterr()
  results = train.train_and_evaluate(config, str(tmp_path))
  out = capsys.readouterr().out
  warnings = [line for line in out.splitlines() if line.startswith('warning:')]
  assert len(warnings) == 1 and 'checkpoint step 4 cannot be read' in warnings[0], out[-2000:]
  assert warnings[0].endswith(f'moved to {tmp_path}/damaged_checkpoints/4, resuming from step 2')
  assert 'resumed from checkpoint at step 2' in out and results.steps == 6
  assert os.path.isdir(tmp_path / 'damaged_checkpoints' / '4')   # set aside, never deleted
  assert _restore_params(str(tmp_path))[0] == 6


@pytest.mark.parametrize('previous, step, num_steps, reevaluate, status', [
    ({}, None, 10, False, 'fresh'),
    ({}, 4, 10, False, 'resume'),
    ({'completed': True, 'steps': 10}, 10, 10, False, 'finished'),
    ({'completed': True, 'steps': 10}, 10, None, False, 'finished'),         # the length it ran to
    ({'completed': True, 'steps': 10}, 10, 20, False, 'resume'),             # asked to train longer
    ({'completed': True, 'steps': 6, 'stopped_early': True}, 6, 10, False, 'finished'),
    ({'completed': True, 'steps': 10}, 10, 10, True, 'reevaluate'),
    ({'completed': True, 'steps': 10}, 8, 10, False, 'resume'),              # final checkpoint gone
])
def test_run_status_from_results_checkpoint_and_length(previous, step, num_steps, reevaluate, status):
  assert workdir_lib.run_status('W', reevaluate, previous, step, num_steps) == status


@pytest.mark.parametrize('step, num_steps, reason, evaluated, status', [
    (4, 10, None, None, 'stopped'),                # stop_at_step
    (4, 10, 'preempted', 4, 'stopped'),            # saved and evaluated, still short of its length
    (10, 10, None, 10, 'finished'),
    (10, 10, None, None, 'unevaluated'),           # a finished run resumed: evaluate it now
    (10, 10, 'interrupted', 8, 'stopped'),         # Ctrl-C during the last evaluation
    (6, 6, 'early', 6, 'finished'),                # early stop: the length became the step
])
def test_the_end_of_an_invocation_is_a_run_status_too(step, num_steps, reason, evaluated, status):
  assert workdir_lib.end_status(step, num_steps, reason, evaluated) == status


@pytest.mark.parametrize('step, restored, found', [
    (None, False, 'it has no checkpoint'), (8, False, 'its newest checkpoint is of step 8'),
    (8, True, 'restored step 8')])
def test_run_status_refuses_reevaluating_without_the_final_checkpoint(step, restored, found):
  with pytest.raises(CheckpointError, match=f'finished at step 10 but {found}, so its final parameters'):
    workdir_lib.run_status('W', True, {'completed': True, 'steps': 10}, step, 10, restored=restored)
