"""Each hook of the training loop alone, with a fake run: what it writes, when it fires,
when it stops the run."""
import os
import re
import signal
import time
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from capsjax import evaluators, hooks, steps
from capsjax.errors import NaNLossError
from capsjax.evaluators import Evaluation
from capsjax.runtime import StopRequests
from capsjax.workdir import MetricsLog


def fake_run(tmp_path, first_step=0, last_step=10, num_steps=10, evaluate=None):
  lines = []
  run = hooks.Run(state={'params': {'w': jnp.ones(2)}, 'step': jnp.asarray(first_step)},
                  first_step=first_step, last_step=last_step, num_steps=num_steps, steps_per_epoch=5,
                  batch_size=4, num_members=None, metrics=MetricsLog(str(tmp_path)), log=lines.append,
                  evaluate=evaluate or (lambda params: {'accuracy': 0.5, 'error': 0.5}))
  return run, lines


def metrics(loss=1.0, update_norm=0.1):
  return {'loss': jnp.asarray(loss), 'accuracy': jnp.asarray(0.25), 'update_norm': jnp.asarray(update_norm)}


class FakeCheckpoints:
  directory = '/ckpt'

  def __init__(self, fail_at=None, preempt_at=None):
    self.saved, self.waited, self.checks = [], 0, 0
    self.fail_at, self.preempt_at = fail_at, preempt_at

  def save(self, state, progress):
    self.saved.append((int(state['step']), progress))

  def check(self):
    self.checks += 1

  def wait(self):
    self.waited += 1

  def latest_step(self):
    return self.saved[-1][0] if self.saved else None

  def reached_preemption(self, step):
    return step == self.preempt_at


def test_divergence_guard_names_the_first_bad_step_only_when_checked(tmp_path):
  run, _ = fake_run(tmp_path)
  checkpoints = FakeCheckpoints()
  checkpoints.saved.append((2, {}))
  guard = hooks.DivergenceGuard(checkpoints)
  guard(run, 3, metrics())
  guard(run, 4, metrics(update_norm=float('nan')))
  guard(run, 5, metrics(loss=float('inf')))
  with pytest.raises(NaNLossError, match=r'at step 3; stopped \(last good checkpoint: step 2 in /ckpt\)'):
    guard.check()
  assert checkpoints.waited == 1
  guard.check()   # nothing pending: no error
  guard(run, 6, metrics())
  guard.end(run)


def test_divergence_guard_stops_a_loss_stuck_far_above_its_start(tmp_path):
  run, _ = fake_run(tmp_path)
  guard = hooks.DivergenceGuard()
  guard(run, 1, metrics(loss=0.9))
  for step in range(2, 2 + hooks.DivergenceGuard.STUCK_STEPS - 1):
    guard(run, step, metrics(loss=3.6))   # saturated capsules: finite, learning nothing
  guard(run, 300, metrics(loss=1.7))      # below 2 × 0.9: the count starts again
  guard.check()
  for step in range(301, 301 + hooks.DivergenceGuard.STUCK_STEPS):
    guard(run, step, metrics(loss=3.6))
  with pytest.raises(NaNLossError, match=r'the loss stayed above 2 × its first value \(0\.9\) for 200 steps, '
                                         r'now 3\.6 at step 499; stopped \(no checkpoint'):
    guard.check()
  ensemble = hooks.DivergenceGuard()   # per member: one member stuck is enough
  for step in range(1, 2 + hooks.DivergenceGuard.STUCK_STEPS):
    ensemble(run, step, metrics(loss=[0.9, 0.9] if step == 1 else [0.5, 3.0]))
  with pytest.raises(NaNLossError, match=r'diverged \(member 1\)'):
    ensemble.check()


def test_progress_logger_writes_every_n_steps_and_reports_the_first_at_once(tmp_path):
  run, lines = fake_run(tmp_path, last_step=7)
  logger = hooks.ProgressLogger(3)
  for step in range(1, 8):
    logger(run, step, metrics(loss=step))
  assert lines[0].startswith('step 1/10 epoch 0.20 | loss 1.0000') and 'first step (with compilation)' in lines[0]
  assert [row['step'] for row in run.metrics.read()] == [3, 6, 7]   # and the invocation's last
  assert all('img/s | ETA' in line for line in lines[1:]) and len(lines) == 4
  assert run.metrics.read()[0]['loss'] == 3.0 and run.metrics.read()[0]['epoch'] == 0.6


def test_progress_logger_also_writes_when_its_seconds_have_passed(tmp_path, monkeypatch):
  run, lines = fake_run(tmp_path, last_step=100, num_steps=100)
  clock = [1000.0]
  monkeypatch.setattr(hooks.time, 'time', lambda: clock[0])
  logger = hooks.ProgressLogger(50, every_seconds=15.0)
  for step in range(1, 12):
    clock[0] += 4.0   # a slow step: 4 s each
    logger(run, step, metrics(loss=step))
  # The first step at once, then every fourth step (16 s ≥ 15 s), long before step 50.
  assert [row['step'] for row in run.metrics.read()] == [5, 9]
  assert len(lines) == 3 and '1.0 img/s' in lines[1]   # 4 steps of 4 images in 16 s


def test_progress_logger_stops_on_divergence(tmp_path):
  run, _ = fake_run(tmp_path)
  guard = hooks.DivergenceGuard()
  run.check = guard.check   # as train.default_hooks wires it
  logger = hooks.ProgressLogger(2)
  guard(run, 1, metrics(loss=float('nan')))
  with pytest.raises(NaNLossError, match='at step 0; stopped \\(no checkpoint was written yet\\)'):
    logger(run, 1, metrics())


def test_evaluator_runs_periodically_and_at_the_end_with_its_evaluators(tmp_path):
  calls, pictures = [], []
  run, lines = fake_run(tmp_path, evaluate=lambda p: calls.append(1) or {'accuracy': 0.75, 'error': 0.25})
  run.metrics.images = lambda step, tag, images: pictures.append((step, tag))
  evaluator = evaluators.Evaluator(4, [Evaluation('probe', 0, lambda params: {'probe': [1.0, 2.0]}, False),
                                  Evaluation('sparse', 8, lambda params: {'sparse': 1}, False),   # its own cadence
                                  Evaluation('pictures', 0, lambda params: 'images', True)])
  for step in range(1, 11):
    evaluator(run, step, metrics())
  assert [row['step'] for row in run.metrics.read()] == [4, 8, 10]
  assert ['sparse' in row for row in run.metrics.read()] == [False, True, True]   # 8, and the last step
  assert pictures == [(4, 'test/pictures'), (8, 'test/pictures'), (10, 'test/pictures')]
  last = run.metrics.read()[-1]
  assert last.pop('eval_seconds') >= 0 and last.pop('time') > 0
  assert last == {'split': 'test', 'step': 10, 'epoch': 2.0, 'accuracy': 0.75, 'error': 0.25, 'probe': [1.0, 2.0],
                  'sparse': 1}
  assert run.last_eval_step == 10 and len(calls) == 3
  assert re.fullmatch(r'step 10 test: accuracy 0\.7500 \(error 25\.00%\) \(\d+\.\d s\)', lines[-1])
  assert lines[-2].startswith('step 10: evaluating')   # every evaluation is announced
  only_at_end = evaluators.Evaluator(0)
  run2, _ = fake_run(tmp_path / 'b')
  (tmp_path / 'b').mkdir()
  for step in range(1, 11):
    only_at_end(run2, step, metrics())
  assert [row['step'] for row in run2.metrics.read()] == [10]


def test_eta_includes_the_evaluations_still_to_come(tmp_path):
  run, lines = fake_run(tmp_path, num_steps=20, last_step=20,
                        evaluate=lambda p: time.sleep(1.1) or {'accuracy': 0.5, 'error': 0.5})
  logger = hooks.ProgressLogger(2)
  evaluator = evaluators.Evaluator(8)
  run.evaluations_left = lambda step: evaluator.remaining(step, run.num_steps)   # as train wires it
  # From a step on, that step's own evaluation included (its progress line comes first).
  assert [evaluator.remaining(s, 20) for s in (0, 7, 8, 9, 15, 16, 17, 19, 20, 21)] == [3, 3, 3, 2, 2, 2, 1, 1, 1, 0]
  assert evaluators.Evaluator(5).remaining(0, 20) == 4 and evaluators.Evaluator(5).remaining(20, 20) == 1
  assert evaluators.Evaluator(0).remaining(3, 20) == 1 and evaluators.Evaluator(0).remaining(20, 20) == 1
  for step in range(1, 21):
    logger(run, step, metrics())
    evaluator(run, step, metrics())
  before = [line for line in lines if line.startswith('step 4/')][0]
  assert re.search(r'ETA \d+m\d+s$', before)   # one duration, evaluations included
  # The first evaluation says it compiles; its time (compilation included) is no estimate.
  assert 'step 8: evaluating; the first evaluation compiles its programs…' in lines and 'step 16: evaluating…' in lines
  assert run.last_eval_seconds >= 1.1 and run.eval_seconds_total >= 2.2
  # Training is instant here: the ETA is the evaluations left, 1.1 s each at least; the
  # last progress line's is the final evaluation's, which follows it.
  # (At step 10 only the first evaluation, compilation included, has been timed: the ETA
  # still estimates evaluations from the training speed.)
  for step, evaluations in ((20, 1),):
    line = [line for line in lines if line.startswith(f'step {step}/')][0]
    minutes, seconds = re.search(r'ETA (\d+)m(\d+)s$', line).groups()
    assert 60 * int(minutes) + int(seconds) >= evaluations, line
  # (the announced duration is the last evaluation's: ≈ 1 s, more on a loaded machine)
  announced = [line for line in lines if re.fullmatch(r'step 20: evaluating, ≈ \d+ s…', line)]
  assert lines.index([line for line in lines if line.startswith('step 20/')][0]) < lines.index(announced[0])


def test_eta_before_the_first_evaluation_estimates_it_from_the_training_speed(tmp_path):
  run, _ = fake_run(tmp_path, num_steps=20, last_step=20)   # batch 4
  run.evaluations_left = lambda step: 3
  run.eval_examples = 1000
  logger = hooks.ProgressLogger(2)
  # 16 steps × 4 images at 100 images/s = 0.64 s, and 3 evaluations of 1000 images at 100/s.
  assert logger.eta(run, 4, images_per_s=100.0) == '0m30s'
  run.last_eval_seconds = 2.0   # measured: 0.64 + 3 × 2 s
  assert logger.eta(run, 4, images_per_s=100.0) == '0m06s'


def test_early_stop_fires_on_a_fresh_evaluation_that_reaches_the_target(tmp_path):
  run, _ = fake_run(tmp_path)
  stop = hooks.EarlyStop(0.9)
  run.last_eval, run.last_eval_step = {'accuracy': 0.95}, 3
  stop(run, 4, metrics())          # the evaluation is not from this step
  assert run.stop_reason is None
  run.last_eval, run.last_eval_step = {'accuracy': 0.85}, 4
  stop(run, 4, metrics())
  assert run.stop_reason is None
  run.last_eval, run.last_eval_step = {'accuracy': 0.9}, 5
  stop(run, 5, metrics())
  assert (run.stop_reason, run.stopped_at) == ('early', 5)


def test_keep_best_checkpoint_follows_the_best_validation_step_per_member(tmp_path):
  kept = []
  checkpoints = SimpleNamespace(keep_steps=lambda steps: kept.append(sorted(steps)))
  run, _ = fake_run(tmp_path)
  # A resumed run: its rows so far (validation and test; the earlier tie wins).
  rows = [{'split': 'validation', 'step': 2, 'error': [0.3, 0.5]}, {'split': 'test', 'step': 2, 'error': [0.1, 0.1]},
          {'split': 'validation', 'step': 4, 'error': [0.3, 0.4]}]
  keep = hooks.KeepBestCheckpoint(checkpoints, rows)
  assert kept == [[2, 4]]
  run.last_validation, run.last_eval_step = {'error': np.array([0.2, 0.45])}, 6
  keep(run, 5, metrics())          # not an evaluation step: nothing changes
  assert kept == [[2, 4]]
  keep(run, 6, metrics())
  assert kept[-1] == [4, 6]        # member 0 improved at 6; member 1 keeps 4
  run.last_validation, run.last_eval_step = {'error': np.array([0.2, 0.45])}, 8
  keep(run, 8, metrics())          # ties: the earlier step stays
  assert kept[-1] == [4, 6]


def test_checkpoints_keep_the_named_steps_beside_the_latest(tmp_path):
  from capsjax.checkpoints import Checkpoints   # pylint: disable=g-import-not-at-top
  from capsjax.errors import CheckpointError    # pylint: disable=g-import-not-at-top
  template = {'params': {'w': np.zeros(2, np.float32)}, 'step': np.zeros((), np.int32)}
  with Checkpoints(str(tmp_path), keep=1) as checkpoints:
    for step in range(1, 6):
      if step == 3:
        checkpoints.keep_steps([2])
      checkpoints.save({'params': {'w': jnp.full(2, float(step))}, 'step': jnp.asarray(step)}, {'wall_time_s': 0.0})
      checkpoints.wait()
    assert checkpoints.all_steps() == [2, 5]
    state, _ = checkpoints.restore(template, step=2)
    np.testing.assert_array_equal(state['params']['w'], [2.0, 2.0])
    assert int(checkpoints.restore(template)[0]['step']) == 5    # the latest by default
    with pytest.raises(CheckpointError, match=r'no checkpoint of step 3 .*\(there are: 2, 5\)'):
      checkpoints.restore(template, step=3)


def test_a_reader_opens_checkpoints_read_only_and_leaves_a_save_in_flight(tmp_path):
  """A reader (predict, export, load_trained) beside a running training: a writer's start
  removes unfinished saves, a reader's must not (it once deleted the training's save in flight,
  which then stopped the training)."""
  from capsjax.checkpoints import Checkpoints   # pylint: disable=g-import-not-at-top
  template = {'params': {'w': np.zeros(2, np.float32)}, 'step': np.zeros((), np.int32)}
  with Checkpoints(str(tmp_path), keep=2) as writer:
    writer.save({'params': {'w': jnp.full(2, 3.0)}, 'step': jnp.asarray(3)}, {'wall_time_s': 0.0})
    writer.wait()
  in_flight = tmp_path / 'checkpoints' / '4.orbax-checkpoint-tmp-1234'
  (in_flight / 'state').mkdir(parents=True)
  before = sorted(str(path) for path in tmp_path.rglob('*'))
  with Checkpoints(str(tmp_path), read_only=True) as reader:
    assert reader.all_steps() == [3]
    np.testing.assert_array_equal(reader.restore(template)[0]['params']['w'], [3.0, 3.0])
  assert sorted(str(path) for path in tmp_path.rglob('*')) == before   # nothing created, nothing deleted
  with Checkpoints(str(tmp_path / 'elsewhere'), read_only=True) as reader:   # no run there: nothing created
    assert reader.latest_step() is None
  assert not (tmp_path / 'elsewhere').exists()


def test_a_state_of_another_optimizer_or_moving_average_is_named_not_taken_for_damage(tmp_path):
  from capsjax.checkpoints import Checkpoints   # pylint: disable=g-import-not-at-top
  from capsjax.errors import CheckpointError    # pylint: disable=g-import-not-at-top
  params = {'w': np.zeros(2, np.float32)}
  saved = {'params': params, 'opt_state': ({'mu': params},), 'step': np.zeros((), np.int32)}
  with Checkpoints(str(tmp_path), keep=2) as checkpoints:
    for step in (1, 2):
      checkpoints.save(dict(saved, step=jnp.asarray(step)), {'wall_time_s': 0.0})
      checkpoints.wait()
    for template, words in (
        (dict(saved, ema_params=params), 'the moving average of the parameters (config.ema_decay): the config adds it'),
        (dict(saved, opt_state=({'mu': params, 'nu': params},)), 'the optimizer state (config.optimizer, '
         'grad_clip_norm, weight_decay): the config changes its form')):
      with pytest.raises(CheckpointError, match=re.escape(f'cannot continue with this config: {words}')):
        checkpoints.restore_newest_intact(template, warn=pytest.fail)   # nothing set aside as damaged
    assert checkpoints.all_steps() == [1, 2]


def test_preemption_stops_after_a_signal_or_the_service_notice(tmp_path):
  run, lines = fake_run(tmp_path)
  requests = StopRequests(install=False)
  preemption = hooks.Preemption(requests, FakeCheckpoints(), multi_process=False)
  preemption(run, 2, metrics())
  assert run.stop_reason is None
  requests.raised, requests.signal_name = True, 'SIGINT'
  preemption(run, 3, metrics())
  assert (run.stop_reason, run.stopped_at) == ('interrupted', 3)   # Ctrl-C is no preemption
  assert lines == ['SIGINT at step 3: saving a checkpoint and stopping']
  run, _ = fake_run(tmp_path)
  requests.signal_name = 'SIGTERM'
  preemption(run, 3, metrics())
  assert run.stop_reason == 'preempted'
  run, _ = fake_run(tmp_path)
  service = hooks.Preemption(StopRequests(install=False), FakeCheckpoints(preempt_at=6), multi_process=True)
  for step in range(1, 10):
    service(run, step, metrics())
  assert run.stopped_at == 6


def test_stop_requests_turn_real_sigterm_and_sigint_into_the_flag_and_restore_the_handlers():
  # What run.py does on one process (the end-to-end Ctrl-C run is tests/test_signals.py).
  before = {s: signal.getsignal(s) for s in StopRequests.SIGNALS}
  for signum, name in ((signal.SIGTERM, 'SIGTERM'), (signal.SIGINT, 'SIGINT')):
    with StopRequests() as requests:
      requests.arm()   # the loop's first step has compiled
      os.kill(os.getpid(), signum)   # delivered to the main thread before kill returns
      assert (requests.raised, requests.signal_name) == (True, name)
      if signum == signal.SIGINT:    # a second Ctrl-C quits at once, without saving
        with pytest.raises(KeyboardInterrupt):
          os.kill(os.getpid(), signal.SIGINT)
    assert {s: signal.getsignal(s) for s in StopRequests.SIGNALS} == before
  # Before the first step has compiled a Ctrl-C goes to the handler that was there before.
  seen = []
  previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
  try:
    with StopRequests() as requests:
      with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
      assert seen == [signal.SIGINT] and not requests.raised
      os.kill(os.getpid(), signal.SIGTERM)   # a preemption notice still waits for the step
      assert (requests.raised, requests.signal_name) == (True, 'SIGTERM')
  finally:
    signal.signal(signal.SIGINT, previous)
  with StopRequests(install=False) as requests:   # several processes: JAX's service owns SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM] and not requests.raised


def test_checkpointer_saves_by_steps_by_time_on_stop_and_at_the_end(tmp_path):
  now = [0.0]
  run, _ = fake_run(tmp_path, last_step=9)
  checkpoints = FakeCheckpoints()
  saver = hooks.Checkpointer(checkpoints, every_steps=4, every_secs=60.0,
                             clock=lambda: now[0])
  for step in range(1, 10):
    run.state = {'params': {}, 'step': jnp.asarray(step)}
    now[0] += 25.0 if step != 5 else 1.0
    if step == 7:
      run.request_stop('preempted', 7)
    saver(run, step, metrics())
  # 4 (steps), 7 (stop), 8 (steps); by time: 25+25+25 > 60 at step 3, then 4 resets the clock.
  assert [step for step, _ in checkpoints.saved] == [3, 4, 7, 8, 9]
  assert all('wall_time_s' in progress for _, progress in checkpoints.saved)
  assert checkpoints.checks == 9 and checkpoints.waited == 0
  saver.end(run)
  assert checkpoints.waited == 1


def test_an_evaluation_that_fails_never_loses_the_steps_before_it(tmp_path):
  def evaluate(params):
    raise MemoryError('RESOURCE_EXHAUSTED: out of memory while evaluating')
  run, lines = fake_run(tmp_path, evaluate=evaluate)
  checkpoints = FakeCheckpoints()
  saver = hooks.Checkpointer(checkpoints, every_steps=100)
  evaluator = evaluators.Evaluator(3, before=saver.save_before_evaluation)
  for step in (1, 2):
    run.state = {'params': {}, 'step': jnp.asarray(step)}
    evaluator(run, step, metrics())
    saver(run, step, metrics())
  run.state = {'params': {}, 'step': jnp.asarray(3)}
  with pytest.raises(MemoryError):
    evaluator(run, 3, metrics())
  assert [step for step, _ in checkpoints.saved] == [3]   # saved, then the evaluation failed
  assert lines == ['step 3: evaluating; the first evaluation compiles its programs…']
  saver(run, 3, metrics())   # had it succeeded: no second save of the same step
  assert len(checkpoints.saved) == 1


def test_shift_averaging_matches_a_plain_reference_per_member_and_summed():
  # A linear classifier on 6×6 images: the evaluation's shift-averaged count against the
  # views written here with np.pad (zero fill) and summed scores, per member and as one.
  rng = np.random.default_rng(0)
  images = rng.random((7, 6, 6, 1)).astype(np.float32)
  labels = rng.integers(0, 3, 7)
  weights = rng.normal(size=(2, 36, 3)).astype(np.float32)   # two members

  def objective(model, params, batch, training, knobs):
    scores = batch['images'].reshape(len(batch['images']), -1) @ params
    return jnp.zeros(len(scores)), scores, {}

  pipeline = SimpleNamespace(source=None, eval_batches=lambda size: iter([((images, labels), np.ones(7))]),
                             device_batch=lambda source, batch, key: {'images': batch[0], 'labels': batch[1]})

  def view(dy, dx):
    padded = np.pad(images, ((0, 0), (1, 1), (1, 1), (0, 0)))
    return padded[:, 1 - dy:7 - dy, 1 - dx:7 - dx].reshape(7, -1)   # content moved by (dy, dx)
  averaged = np.mean([view(dy, dx) @ weights for dy in (-1, 0, 1) for dx in (-1, 0, 1)], axis=0)  # [2, 7, 3]
  expected = [1 - np.mean(np.argmax(member, -1) == labels) for member in averaged]
  eval_step = steps.make_eval_step(objective, None, pipeline, ensemble=True, shift_averaging=1)
  found = steps.evaluate(eval_step, jnp.asarray(weights), pipeline, 7, knobs=jnp.zeros(2))
  np.testing.assert_allclose(found['shift_averaged_error'], expected)
  assert found['shift_averaged_ensemble_error'] == pytest.approx(1 - np.mean(np.argmax(averaged.sum(0), -1) == labels))
  plain = [1 - np.mean(np.argmax(images.reshape(7, -1) @ w, -1) == labels) for w in weights]
  np.testing.assert_allclose(found['error'], plain)
  assert np.asarray(found['shift_averaged_error']).tolist() != plain   # the views changed some answers
  single = steps.evaluate(steps.make_eval_step(objective, None, pipeline, shift_averaging=1), jnp.asarray(weights[0]),
                          pipeline, 7)
  assert single['shift_averaged_error'] == pytest.approx(expected[0])
  assert 'shift_averaged_error' not in steps.evaluate(steps.make_eval_step(objective, None, pipeline),
                                                      jnp.asarray(weights[0]), pipeline, 7)


def test_a_stop_request_ends_an_evaluation_between_its_batches(tmp_path):
  calls = []

  def eval_step(params, source, host_batch, weights, knobs):
    calls.append(1)
    return {'correct': jnp.sum(weights), 'digits_correct': jnp.sum(weights), 'loss': jnp.zeros(()),
            'count': jnp.sum(weights)}

  pipeline = SimpleNamespace(source=None, eval_batches=lambda size: iter([((None,), np.ones(4))] * 5))
  requested = []
  with pytest.raises(steps.EvaluationInterrupted):
    steps.evaluate(eval_step, {}, pipeline, 4, should_stop=lambda: bool(requested) or requested.append(1))
  assert len(calls) == 1   # the request after the first batch ended it: 4 batches never ran
  assert steps.evaluate(eval_step, {}, pipeline, 4, should_stop=lambda: False)['accuracy'] == 1.0

  def evaluate(params, should_stop=None):
    if should_stop():
      raise steps.EvaluationInterrupted()
  run, lines = fake_run(tmp_path, evaluate=evaluate)
  checkpoints = FakeCheckpoints()
  saver = hooks.Checkpointer(checkpoints, every_steps=100)
  evaluator = evaluators.Evaluator(3, before=saver.save_before_evaluation, should_stop=lambda: True)
  run.state = {'params': {}, 'step': jnp.asarray(3)}
  evaluator(run, 3, metrics())
  assert (run.stop_reason, run.stopped_at, run.last_eval_step) == ('preempted', 3, None)
  assert lines[-1].startswith('stop requested during the evaluation at step 3: ended it')
  assert [step for step, _ in checkpoints.saved] == [3]   # the steps before it are safe


def test_checkpointer_never_saves_after_a_non_finite_step(tmp_path):
  run, _ = fake_run(tmp_path)
  guard = hooks.DivergenceGuard()
  run.check = guard.check
  checkpoints = FakeCheckpoints()
  saver = hooks.Checkpointer(checkpoints, every_steps=2)
  guard(run, 1, metrics())
  guard(run, 2, metrics(loss=np.nan))
  with pytest.raises(NaNLossError):
    saver(run, 2, metrics())
  assert checkpoints.saved == []


def test_an_evaluation_with_non_finite_scores_says_so(tmp_path):
  run, lines = fake_run(tmp_path, evaluate=lambda params: {'accuracy': 0.5, 'error': 0.5, 'non_finite_examples': 3.0})
  evaluators.Evaluator(5)(run, 5, metrics())
  assert lines[-1] == ('warning: step 5 test: 3 examples with NaN or infinite class scores (counted wrong): '
                       'the parameters or inputs hold non-finite values')


def test_an_evaluation_says_its_progress_at_the_training_cadence(tmp_path, capfd, monkeypatch):
  """A long evaluation (a minute for an ensemble's first) once said nothing between its
  announcement and its result: console.progress's line, batches done and an ETA."""
  from capsjax import console   # pylint: disable=g-import-not-at-top
  def eval_step(params, source, host_batch, weights, knobs):
    return {'correct': jnp.sum(weights), 'digits_correct': jnp.sum(weights), 'loss': jnp.zeros(()),
            'count': jnp.sum(weights)}

  pipeline = SimpleNamespace(source=None, num_examples=20, eval_batches=lambda size: iter([((None,), np.ones(4))] * 5))
  monkeypatch.setattr(console, 'PROGRESS_DELAY_S', 0.0)   # (2 s: a quick evaluation stays quiet)
  run, lines = fake_run(tmp_path, evaluate=lambda params, on_batch: steps.evaluate(eval_step, params, pipeline, 4,
                                                                                       on_batch=on_batch))
  evaluators.Evaluator(5, every_seconds=1e-9)(run, 5, metrics())
  said = capfd.readouterr().err
  assert 'step 5: evaluating test: ' in said and '5/5' in said, said
  assert lines[-1].startswith('step 5 test: accuracy 1.0000')
  run, lines = fake_run(tmp_path, evaluate=lambda params: {'accuracy': 0.5, 'error': 0.5})
  evaluators.Evaluator(5)(run, 5, metrics())   # every_seconds 0: no progress, no callback passed
  assert 'evaluating test:' not in capfd.readouterr().err
