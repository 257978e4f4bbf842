"""Vmapped ensembles (Table 1): a member trains like the same configuration alone."""
import os

import chex
import jax
import ml_collections
import numpy as np
import pytest

from capsjax import assemble, steps, train
from capsjax.app.trained import TrainedModel, load_trained
from capsjax.app.programs import ablation
from capsjax.errors import CheckpointError, ConfigError, RunStopped
from capsjax.models import build_model, count_params
from capsjax.experiments import ablation as ablation_experiment
from helpers import tiny_config

# Compiling many small programs is this module's time: XLA's cheap compilation (conftest.py).
pytestmark = pytest.mark.compile_bound


def member_config(config, member) -> ml_collections.ConfigDict:
  """The stand-alone config that trains exactly like `member` of config's ensemble."""
  single = ml_collections.ConfigDict(config.to_dict())
  single.ensemble = None
  single.seed = member['seed']
  if single.loss.name == 'capsnet':
    single.model.routing_iterations = member['routing_iterations']
    single.loss.reconstruction_weight = member['reconstruction_weight']
  return single


def _ensemble_config(data_dir, **ensemble):
  config = tiny_config(data_dir, num_steps=4)
  config.ensemble = ml_collections.ConfigDict(ensemble)
  return config


def test_members_are_the_product_of_the_grid(mnist_dir):
  config = _ensemble_config(mnist_dir, seeds=(0, 1, 2), routing_iterations=(1, 3),
                            reconstruction_weights=(0.0, 0.0005))
  members = assemble.members(config)
  assert len(members) == 12
  assert {(m['seed'], m['routing_iterations'], m['reconstruction_weight']) for m in members} == {
      (s, r, w) for s in (0, 1, 2) for r in (1, 3) for w in (0.0, 0.0005)}
  # Summed as one classifier only where members differ by seed alone (not an ablation's grid).
  assert not steps.seeds_alone(members) and steps.seeds_alone(members[:1])
  assert steps.seeds_alone([m for m in members if (m['routing_iterations'], m['reconstruction_weight']) == (3, 0.0)])
  config.ensemble.routing_iterations = (1, 5)   # beyond the model's static bound of 3
  with pytest.raises(ConfigError, match='exceed'):
    assemble.members(config)


@pytest.mark.float32_matmuls
def test_one_member_of_the_vmapped_ensemble_trains_like_the_run_alone(mnist_dir, tmp_path):
  # Two seeds × routing 1 and 3: the members differ in initialisation, data order,
  # shifts and (traced) routing iteration count, all inside one vmapped program.
  config = _ensemble_config(mnist_dir, seeds=(0, 1), routing_iterations=(1, 3),
                            reconstruction_weights=(0.0005,))
  config.model.formulation.dtype = 'float32'   # on any backend (a GPU's 'auto' is bfloat16): float32's tolerance
  together = train.train_and_evaluate(config, str(tmp_path / 'ensemble'))
  _, _, ensemble_params = load_trained(str(tmp_path / 'ensemble'))
  members = together['members']
  # Member 1 (seed 1, 1 of 3 iterations): its own seed and a traced count below the bound.
  for index in (1,):
    alone = train.train_and_evaluate(member_config(config, members[index]),
                                     str(tmp_path / f'alone{index}'))
    _, _, alone_params = load_trained(str(tmp_path / f'alone{index}'))
    # Batched and unbatched matmuls round differently on CPU; after 4 Adam steps the
    # parameters agree to ~1e-6 (different members differ by ~1e-2).
    member_params = jax.tree.map(lambda leaf: np.asarray(leaf)[index], ensemble_params)
    chex.assert_trees_all_close(member_params, alone_params, atol=1e-5, rtol=0)
    np.testing.assert_allclose(together['final_train_loss'][index], alone['final_train_loss'], rtol=1e-5)
    assert together['test_accuracy'][index] == pytest.approx(alone['test_accuracy'], abs=1e-9)
    # Read back as one model (predict, the explorer, export): the member is the run alone's
    # model, routed once, not model.routing_iterations (the program's bound, 3) times.
    member = TrainedModel.from_workdir(str(tmp_path / 'ensemble'), member=index)
    assert member.config.ensemble is None and member.config.model.routing_iterations == 1
    assert member.model == assemble.model(member_config(config, members[index]))
    chex.assert_trees_all_close(member.params, alone_params, atol=1e-5, rtol=0)
    assert member.describe().endswith(f"(finished), member {index} of the ensemble's 0..{len(members) - 1}")
  # Without --member: the last, and every command's model line says which (predict's included).
  assert TrainedModel.from_workdir(str(tmp_path / 'ensemble')).describe().endswith(
      f"member {len(members) - 1} of the ensemble's 0..{len(members) - 1} (the last; --member chooses)")
  # Members of another routing are compared, not pooled: no summed classifier to predict with.
  with pytest.raises(CheckpointError, match=r'^--member=all: the members of .* differ by routing_iterations besides'):
    TrainedModel.summed_seeds(str(tmp_path / 'ensemble'))
  other = np.asarray(jax.tree.leaves(ensemble_params)[0])
  assert np.max(np.abs(other[0] - other[3])) > 1e-3   # the members really differ


def test_table_rows_are_mean_and_sample_std_over_seeds():
  members = [dict(seed=s, routing_iterations=r, reconstruction_weight=w)
             for r in (1, 3) for w in (0.0, 0.0005) for s in (0, 1, 2)]
  errors = [0.010, 0.012, 0.014, 0.005, 0.005, 0.005, 0.02, 0.02, 0.02, 0.003, 0.004, 0.005]
  rows = ablation.summarize(members, errors)
  assert [(r['routing_iterations'], r['reconstruction']) for r in rows] == [
      (1, False), (1, True), (3, False), (3, True)]
  assert rows[0]['mean'] == pytest.approx(1.2)
  assert rows[0]['std'] == pytest.approx(0.2)       # sample std of 1.0, 1.2, 1.4
  assert rows[1]['std'] == pytest.approx(0.0)
  assert rows[3]['mean'] == pytest.approx(0.4)
  config = ablation_experiment.get_config()
  table = ablation.render_table(config, rows, [0.004, 0.004, 0.005])
  assert '| Baseline CNN | - | - | 0.43 ± 0.058 |' in table
  assert '| CapsNet | 3 | yes | 0.40 ± 0.100 | 0.30, 0.40, 0.50 | 0.25 ± 0.005 |' in table


def test_mnist_baseline_cnn_has_the_papers_parameter_count():
  model = build_model(**ablation_experiment.mnist_baseline_model())
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), np.zeros((1, 28, 28, 1), np.float32)))
  assert count_params(shapes['params']) == 35_445_522    # the paper: 35.4M


def test_ablation_command_writes_table_and_loss_figure(mnist_dir, tmp_path):
  config = ablation_experiment.get_config()
  tiny = _ensemble_config(mnist_dir)
  for key in ('data_dir', 'model', 'num_train_examples', 'num_test_examples', 'batch_size', 'num_steps',
              'log_every_steps', 'eval_every_steps', 'eval_batch_size', 'checkpoint_every_steps',
              'evals'):
    setattr(config, key, tiny[key])
  config.ensemble.seeds = (0, 1)
  config.ensemble.reconstruction_weights = (0.0005,)
  config.baseline.model.conv_channels = (4, 4, 4)
  config.baseline.model.dense = (16, 8)
  config.stop_at_step = 2   # an interrupted inner run: resumable, never a KeyError
  with pytest.raises(RunStopped, match='stopped at step 2 of 4'):
    ablation.run(config, str(tmp_path))
  config.stop_at_step = 0
  summary = ablation.run(config, str(tmp_path))   # the same workdir resumes to the table
  assert [(r['routing_iterations'], r['reconstruction']) for r in summary['rows']] == [(1, True), (3, True)]
  assert len(summary['baseline_errors_percent']) == 2
  with open(tmp_path / 'table1.md') as f:
    table = f.read()
  assert table.count('| CapsNet |') == 2 and table.count('| Baseline CNN |') == 1
  assert os.path.getsize(tmp_path / 'training_loss_routing.png') > 1000
