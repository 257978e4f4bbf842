"""capsjax.memory: the peak-memory estimate made before compiling, and the refusal of a run
that cannot fit."""
import os

import jax
import jax.numpy as jnp
import pytest

from capsjax import assemble, experiment, memory, ops, sharding, steps, train
from capsjax.errors import ConfigError
from tests.helpers import tiny_config

F32 = 4


def test_the_walk_frees_buffers_after_their_last_use_and_keeps_arguments():
  n = 1000

  def f(x):
    y = jnp.sin(x)
    z = jnp.cos(x)   # x is the caller's: y, z and x live together
    return y + z     # the sum takes y's buffer; z is freed

  peak = memory.traced_peak_bytes(jax.jit(f), jax.ShapeDtypeStruct((n,), jnp.float32))
  assert peak == 3 * n * F32

  # stop_gradient's output is its input's buffer; û's multiply-adds (an element-wise
  # sub-program) are written by the transpose that reads them: x, w, sin x, û transposed and
  # its scalar sum live together.
  def votes(x, w):
    frozen = jax.lax.stop_gradient(jnp.sin(x))                          # [n], x's size
    moved = jnp.transpose(ops.prediction_vectors(w, x.reshape(1, n, 1), 'multiply_adds'), (0, 2, 1, 3))
    return jnp.sum(moved) + frozen

  arguments = jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((n, 4, 2, 1), jnp.float32)
  assert memory.traced_peak_bytes(jax.jit(votes), *arguments) == (n + 8 * n + n + 8 * n + 1) * F32


def test_a_sub_program_adds_its_own_temporary():
  n = 100

  @jax.jit
  def inner(x):
    return jnp.sum(x[:, None] * x[None, :])   # an [n, n] temporary inside the nested jit

  def f(x):
    return jax.lax.fori_loop(0, 3, lambda i, total: total + inner(x), 0.0)

  peak = memory.traced_peak_bytes(jax.jit(f), jax.ShapeDtypeStruct((n,), jnp.float32))
  assert n * n * F32 <= peak < n * n * F32 + 10 * n * F32


def _compiled_bytes(jitted, *args):
  analysis = jitted.trace(*args).lower().compile().memory_analysis()
  return analysis.temp_size_in_bytes + analysis.argument_size_in_bytes


def test_the_estimate_is_close_to_what_xla_allocates_for_a_capsnet(mnist_dir):
  """Training and evaluation steps of a small CapsNet: within a factor of 1.5 of XLA's own
  buffer assignment (the estimate knows nothing of XLA)."""
  config = tiny_config(mnist_dir, eval_batch_size=100)
  mesh = sharding.data_mesh()
  built = experiment.start(config, mesh, resolved=True)
  program, model, test_split = built.steps, built.model, built.test
  estimates = program.memory_estimates(program.abstract_state)
  training, evaluation = (estimates[key][0] for key in sorted(estimates, key=lambda k: not k.startswith('train')))

  state = program.abstract_state
  xla_training = _compiled_bytes(program.jitted_step, *program.step_arguments(state, 0))
  eval_step = steps.make_eval_step(assemble.objective(config), model, test_split)
  host_batch, weights = next(steps.eval_batches(test_split, config.eval_batch_size, mesh))
  xla_evaluation = _compiled_bytes(eval_step, state['params'], sharding.replicate(test_split.source, mesh),
                                   host_batch, weights)
  assert xla_training / 1.5 < training < xla_training * 1.5, (training, xla_training)
  assert xla_evaluation / 1.5 < evaluation < xla_evaluation * 1.5, (evaluation, xla_evaluation)


def test_a_run_that_cannot_fit_is_refused_in_one_line_before_anything_is_allocated(mnist_dir, tmp_path, monkeypatch):
  monkeypatch.setattr(memory, 'available_bytes', lambda device=None: 2 * 10**9)
  config = tiny_config(mnist_dir, eval_batch_size=65536)
  allocated = []
  workdir = str(tmp_path / 'run')
  with monkeypatch.context() as patch:
    patch.setattr(experiment.RunSteps, 'initial_state', property(lambda self: allocated.append(1)))
    with pytest.raises(ConfigError) as refused:
      train.train_and_evaluate(config, workdir)
  message = str(refused.value)
  assert 'evaluation at eval_batch_size=65536 needs about' in message and '\n' not in message
  assert 'of memory available: lower config.eval_batch_size' in message
  assert not allocated and not os.path.exists(workdir)

  # --config.check_memory=False (the user's word: try anyway) and the header's estimate are
  # checked by test_train's finished-run test.
