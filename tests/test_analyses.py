"""The paper's analyses: figures 3/4 helpers and command, the sweep's parsing."""
import json
import os

import numpy as np
import pytest

from capsjax import console, train, workdir as workdir_lib
from capsjax.app import plots
from capsjax.app.programs import figures, sweep
from capsjax.errors import ConfigError, RunStopped
from capsjax.experiments import sweep_smoke
import documented
from helpers import tiny_config


def test_perturbation_grid_changes_one_dimension_by_0_05_steps():
  capsule = np.arange(16, dtype=np.float32) / 16
  grid = plots.perturb(capsule)
  assert grid.shape == (16, 11, 16)
  np.testing.assert_allclose(plots.PERTURBATIONS, np.linspace(-0.25, 0.25, 11), atol=1e-9)
  difference = grid - capsule
  for d in range(16):
    np.testing.assert_allclose(difference[d, :, d], plots.PERTURBATIONS, atol=1e-6)
    np.testing.assert_allclose(np.delete(difference[d], d, axis=-1), 0.0, atol=1e-7)


def test_reconstruction_columns_show_each_failure_from_label_and_prediction():
  labels = np.array([1, 2, 2, 3, 5, 7])
  predictions = np.array([1, 2, 2, 8, 5, 1])
  columns = figures.reconstruction_columns(labels, predictions, num_correct=3, num_failures=2)
  assert columns[:3] == [(0, 1, 1, 1), (1, 2, 2, 2), (4, 5, 5, 5)]   # distinct classes
  assert columns[3:] == [(3, 3, 8, 3), (3, 3, 8, 8), (5, 7, 1, 7), (5, 7, 1, 1)]


def test_figures_command_on_a_trained_run(mnist_dir, tmp_path, capsys, monkeypatch):
  config = tiny_config(mnist_dir, num_steps=4)
  config.eval_every_steps = 2                # the routing probe runs at every evaluation
  config.evals.routing_probe.enabled = True
  workdir = str(tmp_path / 'run')
  train.train_and_evaluate(config, workdir)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    probes = [r for r in map(json.loads, f) if r['split'] == 'test']
  assert len(probes) == 2 and len(probes[0]['coupling_changes']) == config.evals.routing_probe.iterations
  # The run's data folder is gone (another machine, offline): this machine's is a flag, spelled
  # as run.py's error lines spell it; it does not change the run's config.json.
  stored = json.loads(open(os.path.join(workdir, 'config.json')).read())
  stored['data_dir'] = str(tmp_path / 'moved')
  workdir_lib.write_json(os.path.join(workdir, 'config.json'), stored)
  capsys.readouterr()
  monkeypatch.setattr(console, 'PROGRESS_DELAY_S', 0)   # bars even for quick work
  # README's command and docs/results.md's, for 2 digits and 200 images.
  readme = documented.command(r'^capsjax-figures --workdir=workdirs/mnist$').args({'workdirs/mnist': workdir})
  results = documented.command(r'^capsjax-figures --workdir=W_OF').args({'W_OF_A_TRAINED_MNIST_RUN': workdir})
  assert readme == results
  assert figures.main([*readme, '--digits', '2', '--num', '200', f'--config.data_dir={mnist_dir}']) == 0
  said = capsys.readouterr()   # what it does, first; then bars with counts (stderr)
  assert said.out.splitlines()[:2] == [f'figures of {workdir}: loading the trained model…',
                                       f'model: {workdir} at step 4 of 4 (finished); reading 200 test images…']
  assert 'classifying: 100%' in said.err and '200/200' in said.err and 'drawing figures: 100%' in said.err
  assert json.loads(open(os.path.join(workdir, 'config.json')).read())['data_dir'] == str(tmp_path / 'moved')
  for name in ('reconstructions.png', 'routing_convergence.png', 'figures.json'):
    assert os.path.getsize(os.path.join(workdir, name)) > 1000
  with open(os.path.join(workdir, 'figures.json')) as f:
    summary = json.load(f)
  assert len(summary['perturbed_indices']) == 2
  assert len(summary['final_routing_changes']['routing_logit_changes']) == 10
  with pytest.raises(SystemExit) as exited:   # one clear error
    figures.main(['--workdir', str(tmp_path / 'nothing')])
  assert exited.value.code == 2


def test_sweep_variants_parse_and_reject_bad_keys():
  assert sweep.parse_variant('base:') == ('base', {})
  assert sweep.parse_variant('fast: learning_rate=3e-3, model.routing_iterations=1') == (
      'fast', {'learning_rate': 0.003, 'model.routing_iterations': 1})
  config = sweep_smoke.get_config()
  variant = sweep.variant_config(config, {'learning_rate': 3e-3, 'model.routing_iterations': 1})
  assert variant.learning_rate == 0.003 and variant.model.routing_iterations == 1
  assert config.learning_rate == 1e-3                         # the base is untouched
  with pytest.raises(ConfigError, match='no such config key'):
    sweep.variant_config(config, {'learning_rat': 1.0})
  with pytest.raises(ConfigError, match='no such config key'):
    sweep.variant_config(config, {'modl.routing_iterations': 1})
  with pytest.raises(ConfigError, match='key=value'):
    sweep.parse_variant('x: learning_rate')
  with pytest.raises(ConfigError, match='Python literal'):
    sweep.parse_variant('x: learning_rate=fast')
  with pytest.raises(ConfigError, match=r"^sweep variant 'x': 'fashion_mnist' is not a Python literal \(a string is "
                                        r"quoted: dataset='fashion_mnist'\)$"):
    sweep.parse_variant('x: dataset=fashion_mnist')
  with pytest.raises(ConfigError, match=r"^sweep variant 'x': seed is given twice: give it once$"):
    sweep.parse_variant('x: seed=1, seed=2')   # (the last one silently won)
  # Validation checks each variant as the config it trains, before any variant runs.
  from capsjax.validation import problems_of  # pylint: disable=g-import-not-at-top
  assert problems_of(config) == []
  config.sweep.variants = ('base:', 'slow: learning_rate=-1.0', 'odd: learnig_rate=1.0')
  problems = problems_of(config)
  assert problems[0].startswith("sweep variant 'slow': config.learning_rate=-1.0: allowed "), problems
  assert problems[1].startswith("sweep variant 'odd': sweep override 'learnig_rate': no such config key"), problems
  config.sweep.variants = ('a:', 'a: learning_rate=2e-3')
  assert problems_of(config) == ["config.sweep.variants: variant names repeat: ['a', 'a']"]
  config.sweep.variants = ('a:', 'b: distributed=True', "c: experiment='mnist'")   # (silently ignored; renamed)
  assert problems_of(config) == [
      "sweep variant 'b': distributed is the same for every variant of a sweep; set --config.distributed for the "
      'whole sweep',
      "sweep variant 'c': experiment is the same for every variant of a sweep; each variant trains under the sweep's "
      'own --experiment']


def test_sweep_command_trains_every_variant_and_ranks_them(mnist_dir, tmp_path):
  config = tiny_config(mnist_dir, num_steps=4)
  config.sweep = sweep_smoke.get_config().sweep
  config.sweep.variants = ('base:', 'fast: learning_rate=3e-3')
  config.stop_at_step = 2   # an interrupted variant: resumable, never a KeyError
  with pytest.raises(RunStopped, match='stopped at step 2 of 4'):
    sweep.run(config, str(tmp_path))
  config.stop_at_step = 0
  summary = sweep.run(config, str(tmp_path))   # the same workdir resumes to the table
  assert [row['name'] for row in summary['rows']] == ['base', 'fast']
  with open(tmp_path / 'sweep.md') as f:
    table = f.read()
  assert '| base | (base) |' in table and '| fast | learning_rate=0.003 |' in table
  assert os.path.getsize(tmp_path / 'sweep.png') > 1000
  # Two variants really trained differently.
  assert summary['rows'][0]['final_train_loss'] != summary['rows'][1]['final_train_loss']
