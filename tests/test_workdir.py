"""Workdirs: checked before use, locked, bound to their config, metrics once per step,
wall time summed over resumes; checkpoint write failures stop the run with one line."""
import errno
import json
import os
import subprocess
import sys
import time

import orbax.checkpoint as ocp
import pytest

from capsjax import formulations, train
from capsjax.app.trained import TrainedModel, load_trained
from capsjax import stored_config
from capsjax import workdir as workdir_lib
from capsjax.errors import CheckpointError, ConfigError, DataError, RunStopped, WorkdirError
from helpers import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_py(*args, **kwargs):
  return subprocess.run([sys.executable, os.path.join(ROOT, 'run.py'), *args], capture_output=True,
                        text=True, timeout=kwargs.pop('timeout', 300), **kwargs)


# ----------------------------------------------------------------------------- prepare

def test_a_file_is_not_a_workdir(tmp_path):
  (tmp_path / 'file').write_text('x')
  with pytest.raises(WorkdirError, match='exists and is not a directory'):
    workdir_lib.prepare(str(tmp_path / 'file'))
  with pytest.raises(WorkdirError, match='is not usable'):
    workdir_lib.prepare(str(tmp_path / 'file' / 'below'))


def test_a_folder_where_a_file_belongs_is_refused_when_the_workdir_is_opened(tmp_path):
  (tmp_path / 'a' / 'config.json').mkdir(parents=True)
  with pytest.raises(WorkdirError, match=r'config.json is a folder where a run keeps its file \(its record\)'):
    workdir_lib.prepare(str(tmp_path / 'a'))
  (tmp_path / 'b').mkdir()
  (tmp_path / 'b' / 'checkpoints').write_text('')
  started = time.time()
  result = run_py('--experiment=mnist_smoke', f'--workdir={tmp_path / "b"}', f'--config.data_dir={tmp_path}/none')
  assert result.returncode == 2 and result.stderr.strip().splitlines() == [
      f'error: workdir {tmp_path / "b"}: checkpoints is a file where a run keeps its folder (checkpoints); '
      'move it away or use another --workdir'], result.stderr
  assert time.time() - started < 60


def test_tilde_is_expanded(tmp_path, monkeypatch):
  monkeypatch.setenv('HOME', str(tmp_path))
  monkeypatch.chdir(tmp_path)
  assert workdir_lib.prepare('~/runs/a') == str(tmp_path / 'runs' / 'a')
  assert (tmp_path / 'runs' / 'a').is_dir() and not (tmp_path / '~').exists()


def test_a_bucket_is_refused_as_a_workdir_from_python_too(tmp_path, monkeypatch):
  from capsjax import train  # pylint: disable=g-import-not-at-top
  from capsjax.errors import WorkdirError  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(tmp_path)
  with pytest.raises(WorkdirError, match=r"^workdir 's3://bucket/run': a bucket is not a workdir \(runs write files "):
    train.train_and_evaluate(tiny_config(str(tmp_path)), 's3://bucket/run')
  assert not os.listdir(tmp_path)


def test_cli_workdir_errors_are_one_line(tmp_path):
  (tmp_path / 'file').write_text('x')
  for workdir, message in [(tmp_path / 'file', 'exists and is not a directory'),
                           ('/proc/capsjax', 'is not usable')]:
    result = run_py('--experiment=mnist_smoke', f'--workdir={workdir}', f'--config.data_dir={tmp_path}')
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr


# ----------------------------------------------------------------------------- lock

def test_second_run_on_a_locked_workdir_names_the_holder(mnist_dir, tmp_path):
  with workdir_lib.Lock(str(tmp_path)):
    with pytest.raises(WorkdirError, match=f'in use by another run \\(pid {os.getpid()}\\)'):
      train.train_and_evaluate(tiny_config(mnist_dir), str(tmp_path))
  with workdir_lib.Lock(str(tmp_path)):   # released: free again
    pass


# ----------------------------------------------------------------------------- config binding

def test_config_is_written_after_the_first_step_and_a_changed_config_is_refused(mnist_dir, tmp_path):
  config = tiny_config(mnist_dir, num_steps=4)
  with pytest.raises(DataError):   # fails before its first step: binds nothing
    train.train_and_evaluate(tiny_config(str(tmp_path / 'no_data'), num_steps=4, seed=9), str(tmp_path))
  assert not (tmp_path / 'config.json').exists()
  with pytest.raises(RunStopped, match=r'stopped at step 2 of 4 \(stop_at_step\); run again to resume'):
    train.train_and_evaluate(config, str(tmp_path), stop_at_step=2)   # the corrected run
  assert json.loads((tmp_path / 'config.json').read_text())['batch_size'] == 32
  loaded_config, _, params = load_trained(str(tmp_path))   # an unfinished run opens
  assert loaded_config.num_steps == 4 and params
  assert TrainedModel.from_workdir(str(tmp_path)).describe() == (   # and says it is unfinished
      f'{tmp_path} at step 2 of 4 (training not finished: this is an intermediate checkpoint)')

  changed = tiny_config(mnist_dir, num_steps=4, learning_rate=0.5, seed=3)
  with pytest.raises(ConfigError, match=r"another config \(learning_rate: 0.001 → 0.5; seed: 0 → 3\)"):
    train.train_and_evaluate(changed, str(tmp_path))
  # How a run is carried out may change: another log cadence, data folder, stop step.
  runtime_only = tiny_config(mnist_dir, num_steps=4, log_every_steps=1, checkpoint_every_steps=1)
  assert stored_config.bind_config(str(tmp_path), runtime_only) == []
  assert stored_config.bind_config(str(tmp_path), changed, allow_change=True) == ['learning_rate: 0.001 → 0.5',
                                                                                'seed: 0 → 3']
  stored_config.record_config(str(tmp_path), changed.to_dict())
  assert json.loads((tmp_path / 'config.json').read_text())['learning_rate'] == 0.5

  # Another model's shapes cannot continue the run, allowed or not; config.json stays.
  narrower = tiny_config(mnist_dir, num_steps=4, learning_rate=0.5, seed=3, allow_config_change=True)
  narrower.model.conv1_channels = 8
  with pytest.raises(CheckpointError) as raised:
    train.train_and_evaluate(narrower, str(tmp_path))
  assert str(raised.value) == (
      f'checkpoint step 2 in {tmp_path / "checkpoints"} holds params/conv1/bias of shape (16,); this '
      "config's model has (8,): a change of parameter shapes cannot continue this run (use another --workdir)")
  assert json.loads((tmp_path / 'config.json').read_text())['model']['conv1_channels'] == 16


def test_finished_results_are_not_overwritten_by_another_config(mnist_dir, tmp_path):
  train.train_and_evaluate(tiny_config(mnist_dir, num_steps=2), str(tmp_path))
  before = (tmp_path / 'results.json').read_text()
  result = run_py('--experiment=mnist_smoke', f'--workdir={tmp_path}', f'--config.data_dir={mnist_dir}',
                  '--config.learning_rate=0.5')
  assert result.returncode == 2 and 'holds a run with another config' in result.stderr
  assert (tmp_path / 'results.json').read_text() == before


# ----------------------------------------------------------------------------- metrics and wall time

def test_metrics_hold_each_step_once_and_wall_time_adds_up(mnist_dir, tmp_path):
  config = tiny_config(mnist_dir, num_steps=6, log_every_steps=1)
  with pytest.raises(RunStopped):
    train.train_and_evaluate(config, str(tmp_path), stop_at_step=2)
  manager = ocp.CheckpointManager(str(tmp_path / 'checkpoints'))
  first_wall = manager.restore(2)['progress']['wall_time_s']
  manager.close()
  assert first_wall > 0
  # A crashed invocation logged step 3 but never checkpointed it.
  with open(tmp_path / 'metrics.jsonl', 'a') as f:
    f.write(json.dumps({'split': 'train', 'step': 3, 'loss': 1.0}) + '\n')
  results = train.train_and_evaluate(config, str(tmp_path))
  steps = [json.loads(line)['step'] for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()
           if json.loads(line)['split'] == 'train']
  assert steps == [1, 2, 3, 4, 5, 6]
  assert results['wall_time_s'] > first_wall
  assert results['wall_time_s'] >= first_wall + 0.5   # the second invocation compiled again


def test_truncate_after_drops_later_and_cut_off_rows(tmp_path):
  log = workdir_lib.MetricsLog(str(tmp_path))
  for step in (1, 2, 3):
    log.write(split='train', step=step)
  with open(log.path, 'a') as f:
    f.write('{"split": "train", "st')   # cut off by a crash
  log.truncate_after(2)
  assert [row['step'] for row in log.read()] == [1, 2]
  started = time.time()
  log.write(split='test', step=3)
  assert started - 1 <= log.read()[-1]['time'] <= time.time() + 1   # each row's wall clock


# ----------------------------------------------------------------------------- checkpoint failures

def test_failing_save_stops_the_run_and_keeps_the_last_good_checkpoint(mnist_dir, tmp_path, monkeypatch):
  calls = []
  real_save = ocp.CheckpointManager.save

  def save(self, step, *args, **kwargs):
    calls.append(step)
    if len(calls) == 2:
      raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    return real_save(self, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, 'save', save)
  with pytest.raises(CheckpointError, match=r'cannot write checkpoint step 4 .*\(Read-only file system\); '
                                            r'training stopped \(last good checkpoint: step 2\)'):
    train.train_and_evaluate(tiny_config(mnist_dir, num_steps=6), str(tmp_path))
  assert calls == [2, 4]
  monkeypatch.undo()
  _, _, params = load_trained(str(tmp_path))   # step 2 is intact
  assert params


def test_a_reader_beside_a_training_that_checkpoints_every_step_never_stops_it(mnist_dir, tmp_path):
  """load_trained in a loop beside a training (predict, export and the explorer read the same
  way): a reader once deleted the training's save in flight, which then stopped it."""
  import threading   # pylint: disable=g-import-not-at-top
  done, read_steps, errors = threading.Event(), [], []

  def read_in_a_loop():
    while not done.is_set():
      try:
        _, _, params = load_trained(str(tmp_path))
        read_steps.append(int(params is not None))
      except (CheckpointError, WorkdirError) as e:   # before the first checkpoint and config.json
        errors.append(str(e))
        time.sleep(0.01)

  reader = threading.Thread(target=read_in_a_loop, daemon=True)
  reader.start()
  try:
    result = train.train_and_evaluate(tiny_config(mnist_dir, num_steps=16, checkpoint_every_steps=1), str(tmp_path))
  finally:
    done.set()
    reader.join(timeout=60)
  assert result.steps == 16
  assert len(read_steps) >= 3, errors[-3:]
  assert not [e for e in errors if 'no checkpoint' not in e and 'config.json' not in e], errors


def _mount_tmpfs(path, size):
  os.makedirs(path, exist_ok=True)
  result = subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(path)],
                          capture_output=True, text=True)
  if result.returncode:
    pytest.skip(f'cannot mount a tmpfs here ({result.stderr.strip()}); the injected failure covers it')


def test_full_disk_is_one_line_through_run_py(mnist_dir, tmp_path):
  mount = tmp_path / 'small'
  # Room for the probe, config and one ~3.4 MB checkpoint of this model, not for two.
  _mount_tmpfs(mount, '5m')
  try:
    result = run_py('--experiment=mnist_smoke', f'--workdir={mount}/w', f'--config.data_dir={mnist_dir}',
                    '--config.model.conv1_channels=16', '--config.model.primary_types=4',
                    '--config.model.decoder_hidden=(32,64)', '--config.num_train_examples=256',
                    '--config.num_test_examples=100', '--config.batch_size=32', '--config.num_steps=6',
                    '--config.checkpoint_every_steps=2', '--config.keep_checkpoints=3', timeout=240)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert 'No space left on device' in lines[0], lines[0]
    if 'last good checkpoint' in lines[0]:   # the disk filled during a checkpoint write
      kept = int(lines[0].split('last good checkpoint: step ')[1].rstrip(')'))
      failed = int(lines[0].split('cannot write checkpoint step ')[1].split()[0])
      assert failed > kept >= 2 and str(kept) in os.listdir(mount / 'w' / 'checkpoints')
    else:   # under load another write (a metrics row, the config) can be the one that finds the disk full
      assert lines[0].startswith('error: ') and f'{mount}/w/' in lines[0], lines[0]   # it names its file
      assert any(int(step) >= 2 for step in os.listdir(mount / 'w' / 'checkpoints') if step.isdigit())
    assert not os.path.exists(mount / 'w' / 'results.json')
  finally:
    subprocess.run(['umount', '-l', str(mount)], check=False)


def test_a_full_disk_under_the_tensorboard_events_names_their_file(tmp_path, monkeypatch):
  # The events file, as the kernel answers a full disk (/dev/full: ENOSPC at the flush): a
  # buffered file's OSError names no file, and run.py's line was 'error: No space left on device'.
  from capsjax import events  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(events, 'open', lambda path, mode: open('/dev/full', mode), raising=False)
  writer = events.EventWriter(str(tmp_path))
  with pytest.raises(OSError) as raised:
    writer.scalars(1, 'train', {'loss': 0.5})
  assert raised.value.errno == errno.ENOSPC and raised.value.filename.startswith(f'{tmp_path}/events.out.tfevents.')


def test_read_only_workdir_fails_at_once(mnist_dir, tmp_path):
  mount = tmp_path / 'ro'
  _mount_tmpfs(mount, '1m')
  try:
    subprocess.run(['mount', '-o', 'remount,ro', str(mount)], check=True)
    result = run_py('--experiment=mnist_smoke', f'--workdir={mount}/w', f'--config.data_dir={mnist_dir}',
                    timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f'error: workdir {mount}/w is not usable: Read-only file system']
  finally:
    subprocess.run(['umount', '-l', str(mount)], check=False)


def test_a_config_json_that_is_not_a_config_is_one_error_and_a_refused_start_leaves_no_lock(tmp_path):
  from capsjax.experiments import mnist_smoke  # pylint: disable=g-import-not-at-top
  for text in ('[1, 2]', '{"model": 3}'):
    (tmp_path / 'config.json').write_text(text)
    for read in (lambda: stored_config.read_config(str(tmp_path)),
                 lambda: stored_config.bind_config(str(tmp_path), mnist_smoke.get_config())):
      with pytest.raises(WorkdirError, match='config.json is not a capsjax config'):
        read()
  # The run's lock in a folder it did not make: gone again when the start is refused
  # before the run recorded its config (the folder as it was), kept once it has.
  for refusal in (WorkdirError, ConfigError):
    with pytest.raises(refusal):
      with workdir_lib.Lock(str(tmp_path)):
        stored_config.bind_config(str(tmp_path), mnist_smoke.get_config()) if refusal is WorkdirError else None
        raise refusal('refused')
    assert sorted(os.listdir(tmp_path)) == ['config.json']
  (tmp_path / 'config.json').unlink()
  with pytest.raises(KeyboardInterrupt):
    with workdir_lib.Lock(str(tmp_path)):
      stored_config.record_config(str(tmp_path), mnist_smoke.get_config().to_dict())
      raise KeyboardInterrupt   # (a stop after the config was recorded)
  assert sorted(os.listdir(tmp_path)) == ['.lock', 'config.json']


def test_a_run_recorded_before_model_formulation_reads_with_it_and_resumes_where_auto_computes_the_same(tmp_path):
  """Before 2026-11-26 the formulation options were flat model keys (model.conv_impl, …):
  a recorded config reads with each model's model.formulation section (a CNN's over the
  CNN's defaults), its sweep variants too; and model.dtype's default became 'auto'
  (bfloat16 on a GPU, float32 elsewhere) that day: the dtype 'auto' computes in here binds
  to today's config, the other does not; a formulation that computes the same values
  (conv_impl, routing_loop) does not bind. A flat key on the command line names where it lives now."""
  from capsjax import defaults  # pylint: disable=g-import-not-at-top
  from capsjax.app import launch  # pylint: disable=g-import-not-at-top
  from capsjax.models import model_config  # pylint: disable=g-import-not-at-top
  config = defaults.base_config()
  assert config.model.formulation.dtype == 'auto'
  old = config.to_dict()
  old['model'].update(old['model'].pop('formulation'), dtype='float32', conv_impl='xla')
  old['baseline'] = {'model': {'name': 'cnn', 'conv_impl': 'patches', 'patches_inference': 'chunked'}}
  old['sweep'] = {'variants': ['paper:', 'fast: model.conv_impl = patches, model.routing=em']}
  (tmp_path / 'config.json').write_text(json.dumps(old))
  read = stored_config.read_config(str(tmp_path))
  assert read.model.formulation.to_dict() == dict(config.model.formulation, dtype='float32', conv_impl='xla')
  assert 'conv_impl' not in read.model and 'conv_impl' not in read.baseline.model
  assert read.baseline.model.formulation.to_dict() == dict(model_config('cnn').formulation,
                                                           conv_impl='patches', patches_inference='chunked')
  assert list(read.sweep.variants) == ['paper:', 'fast: model.formulation.conv_impl = patches, model.routing=em']
  # What 'auto' computes in on this backend (float32 on a CPU, bfloat16 on a GPU) binds; the other does not.
  same = formulations.resolve('dtype', 'auto')
  other = 'bfloat16' if same == 'float32' else 'float32'
  del old['baseline'], old['sweep']
  old['model'].update(dtype=same, routing_loop='unrolled')   # and conv_impl 'xla': the same values as 'auto'
  (tmp_path / 'config.json').write_text(json.dumps(old))
  assert stored_config.bind_config(str(tmp_path), config) == []
  old['model']['dtype'] = other
  (tmp_path / 'config.json').write_text(json.dumps(old))
  with pytest.raises(ConfigError, match=f"model.formulation.dtype: '{other}' → 'auto'"):
    stored_config.bind_config(str(tmp_path), config)
  assert launch.unknown_key_problem(KeyError('conv_impl'), ['run.py', '--config.baseline.model.conv_impl=xla']) == (
      "unknown config key 'baseline.model.conv_impl' (it is config.baseline.model.formulation.conv_impl now)")


def test_a_config_recorded_with_the_layer_input_flags_reads_as_routing_inputs(tmp_path):
  """Before 2026-11-26 each capsule-layer input was a model flag named apart from the
  routing argument it enabled (digit_bias → bias, leaky_routing → leaky, …): a recorded
  config reads as today's model.routing_inputs, its sweep variants too, and the same run
  resumes without a reported change."""
  from capsjax import defaults  # pylint: disable=g-import-not-at-top
  config = defaults.base_config()
  config.model.routing_inputs = ('bias', 'leaky')
  old = config.to_dict()
  del old['model']['routing_inputs']
  old['model'].update(digit_bias=True, learn_log_priors=False, leaky_routing=True, stop_gradient_predictions=False)
  old['sweep'] = {'variants': ['paper:', 'official: lr_min=1e-6, model.digit_bias=True, model.leaky_routing=False']}
  (tmp_path / 'config.json').write_text(json.dumps(old))
  read = stored_config.read_config(str(tmp_path))
  assert tuple(read.model.routing_inputs) == ('bias', 'leaky') and 'digit_bias' not in read.model
  assert list(read.sweep.variants) == ['paper:', "official: lr_min=1e-6, model.routing_inputs=('bias',)"]
  (tmp_path / 'config.json').write_text(json.dumps({k: v for k, v in old.items() if k != 'sweep'}))
  assert stored_config.bind_config(str(tmp_path), config) == []


def test_a_config_recorded_with_flat_routing_options_reads_as_sections(tmp_path):
  """Before 2026-11-25 config.json held every routing's options in one flat dict (em's and
  variational_bayes's `inverse_temperature` were one key), and the evaluators' options as
  run-level keys: the recorded routing's values become its section, the evaluators' theirs
  (a probe of 0 iterations: off), and the same run resumes without a reported change."""
  from capsjax import defaults  # pylint: disable=g-import-not-at-top
  config = defaults.base_config()
  config.model.routing = 'em'
  config.model.routing_options.em.inverse_temperature = 2.0
  config.evals.routing_probe.enabled = False
  config.evals.routing_diagnostics.examples = 200
  old = config.to_dict()
  old['model']['routing_options'] = {'inverse_temperature': 2.0, 'variance_epsilon': 1e-8, 'prior_extra_dof': 1.0}
  del old['evals']
  old.update(routing_probe_iterations=0, routing_probe_examples=100, routing_diagnostics=True,
             routing_diagnostics_examples=200, routing_diagnostics_iterations=5)
  (tmp_path / 'config.json').write_text(json.dumps(old))
  read = stored_config.read_config(str(tmp_path))
  sections = read.model.routing_options.to_dict()
  assert sections == {'em': {'inverse_temperature': 2.0, 'variance_epsilon': 1e-8},
                      'variational_bayes': {'inverse_temperature': 1.0, 'prior_extra_dof': 1.0}}
  assert read.evals.to_dict() == config.evals.to_dict() and 'routing_probe_iterations' not in read
  assert stored_config.bind_config(str(tmp_path), config) == []
  config.model.routing_options.em.inverse_temperature = 3.0
  assert stored_config.bind_config(str(tmp_path), config, allow_change=True) == [
      'model.routing_options.em.inverse_temperature: 2.0 → 3.0']


def test_recipes_compare_as_what_they_set_and_a_start_ending_in_a_traceback_leaves_no_workdir(tmp_path, monkeypatch):
  from capsjax import assemble  # pylint: disable=g-import-not-at-top
  from capsjax.experiments import mnist_four_recipes  # pylint: disable=g-import-not-at-top
  config = mnist_four_recipes.get_config()
  saved = json.loads(json.dumps(config.to_dict()))
  name, _, assignments = config.ensemble.recipes[2].partition(':')
  reordered = f'{name}:  ' + ', '.join(reversed([part.strip() for part in assignments.split(',')]))
  config.ensemble.recipes = config.ensemble.recipes[:2] + (reordered,) + config.ensemble.recipes[3:]
  assert stored_config.config_differences(saved, config) == []   # spacing and order are the writer's
  config.ensemble.recipes = config.ensemble.recipes[:2] + (reordered.replace('3e-3', '2e-3'),) + config.ensemble.recipes[3:]
  assert [line.split(':')[0] for line in stored_config.config_differences(saved, config)] == ['ensemble.recipes']
  # Keys added since a run started count as their defaults, tuples among them (JSON's lists
  # once made `model.routing_inputs: () → []` a change that refused the resume).
  del saved['model']['routing_inputs'], saved['model']['decoder_hidden']
  assert stored_config.config_differences(stored_config.upgraded(saved), mnist_four_recipes.get_config()) == []
  # A CNN baseline's too, from its family's defaults (recorded before its config had a formulation).
  from capsjax.experiments import ablation, affnist, multimnist_baseline  # pylint: disable=g-import-not-at-top
  for config, section in ((multimnist_baseline.get_config(), ()), (ablation.get_config(), ('baseline',)),
                          (affnist.get_config(), ('cnn',))):
    saved = json.loads(json.dumps(config.to_dict()))
    model = saved
    for key in (*section, 'model'):
      model = model[key]
    del model['formulation']
    assert stored_config.config_differences(saved, config) != []
    assert stored_config.config_differences(stored_config.upgraded(saved), config) == []

  def bug(config):   # an error no check foresaw, after the workdir was made
    raise OverflowError('Python integer 2147483648 out of bounds for int32')
  monkeypatch.setattr(assemble, 'resolve_data', bug)
  with pytest.raises(OverflowError):
    train.train_and_evaluate(mnist_four_recipes.get_config(), str(tmp_path / 'w'))
  assert not os.path.exists(tmp_path / 'w')
