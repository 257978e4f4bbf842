"""The routing zoo: every routing algorithm on the same CapsNet, data order and seeds.

`run(config, workdir)` trains, for each name in config.routing_zoo.routings, config's
model with `model.routing=NAME` (and that routing's options from
config.routing_zoo.options) over config.routing_zoo.seeds as one vmapped program, in
workdir/NAME, with a held-out validation split (config.validation_examples). It then
writes routing.md and routing.json (per routing: parameters, test error at the end and at
the best validation evaluation, mean ± std over the seeds, training and inference
images/s) and routing_test_error.png (test error over steps, mean over the seeds).
"""
import json
import os
import time
from typing import Any, Dict

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from capsjax import train
from capsjax.trained import load_trained, select_member
from capsjax.errors import ConfigError
from capsjax.plots import pyplot, save_figure
from capsjax.reports import markdown_table, mean_std
from capsjax.routing import ROUTINGS
from capsjax.workdir import MetricsLog
from capsjax.programs import register_program

INFERENCE_REPEATS = 3


def routing_config(config, name: str) -> ml_collections.ConfigDict:
  """config's run with routing `name` (its options) over the zoo's seeds."""
  member = ml_collections.ConfigDict(config.to_dict())
  del member['routing_zoo']
  member.program = 'train'
  member.experiment = f'{config.experiment}/{name}'
  member.model.routing = name
  member.model.routing_options = ml_collections.ConfigDict(dict(config.routing_zoo.options.get(name, {})))
  member.ensemble = ml_collections.ConfigDict(dict(seeds=tuple(config.routing_zoo.seeds)))
  return member


def training_images_per_s(rows) -> float:
  """Median training throughput of the logged windows (metrics.jsonl's: per member)."""
  speeds = [row['images_per_s'] for row in rows if row.get('split') == 'train']
  return float(np.median(speeds)) if speeds else float('nan')


def inference_images_per_s(workdir: str, batch_size: int) -> float:
  """Test-time forward passes (class activations) per second of member 0, compiled first,
  median of INFERENCE_REPEATS timed batches of `batch_size` zeros."""
  config, model, params = load_trained(workdir)
  params = select_member(params, 0, workdir, bool(config.ensemble))
  forward = jax.jit(lambda p, x: model.apply({'params': p}, x, method='classify')[1])
  images = jnp.zeros((batch_size,) + tuple(config.model.input_shape), jnp.float32)
  forward(params, images).block_until_ready()
  times = []
  for _ in range(INFERENCE_REPEATS):
    start = time.perf_counter()
    forward(params, images).block_until_ready()
    times.append(time.perf_counter() - start)
  return batch_size / float(np.median(times))


def error_curve(rows):
  """(steps, test error mean over members) of the test rows."""
  test = [row for row in rows if row.get('split') == 'test']
  return [row['step'] for row in test], [float(np.mean(row['error'])) for row in test]


def _percent(values) -> str:
  mean, std = mean_std([100.0 * v for v in values])
  return f'{mean:.2f} ± {std:.2f}' if len(values) > 1 else f'{mean:.2f}'


def render(config, rows) -> str:
  seeds = ', '.join(map(str, config.routing_zoo.seeds))
  lines = [f'# Routing algorithms on the same CapsNet, `{config.experiment}`', '',
           f'Seeds {seeds} (one vmapped program per routing, the same data order); '
           f'{config.num_steps or config.num_epochs} {"steps" if config.num_steps else "epochs"} of batch '
           f'{config.batch_size} on {config.num_train_examples or "all"} training images, '
           f'{config.validation_examples} held out for validation; test on '
           f'{config.num_test_examples or "all"} test images; {config.model.routing_iterations} routing '
           'iterations where a routing iterates. Test error in %, mean ± sample std over the seeds; '
           '"at best validation": each seed\'s test error at its lowest validation error. '
           f'Images/s on {jax.devices()[0].device_kind} ({jax.default_backend()}): training counts every '
           'member\'s images; inference is one model at the evaluation batch size.', '']
  table = [(row['routing'], f'{row["num_params"]:,}', _percent(row['test_error']),
            _percent(row['test_error_at_best_validation']) if row['test_error_at_best_validation'] else '-',
            f'{row["train_images_per_s"]:.0f}', f'{row["infer_images_per_s"]:.0f}') for row in rows]
  lines += markdown_table([('routing', 'l'), ('parameters', 'r'), ('test error (%)', 'r'),
                           ('at best validation (%)', 'r'), ('train images/s', 'r'), ('infer images/s', 'r')],
                          table)
  return '\n'.join(lines) + '\n'


def plot(curves, path: str) -> None:
  figure, axis = pyplot().subplots(figsize=(6, 4))
  for name, (steps, errors) in curves.items():
    axis.plot(steps, [100 * e for e in errors], marker='o', label=name)
  axis.set_xlabel('training step')
  axis.set_ylabel('test error (%), mean over seeds')
  axis.set_yscale('log')
  axis.legend()
  axis.set_title('Routing algorithms: test error over training')
  save_figure(figure, path)


@register_program('routing_zoo', default_experiment='routing_zoo')
def run(config, workdir: str) -> Dict[str, Any]:
  names = tuple(config.routing_zoo.routings)
  unknown = [name for name in names if name not in ROUTINGS]
  if unknown or not names:
    raise ConfigError(f'config.routing_zoo.routings={names!r}: allowed names of {", ".join(ROUTINGS)}')
  if not config.validation_examples:
    raise ConfigError('the routing zoo reports the test error at the best validation step: set '
                      'config.validation_examples > 0')
  os.makedirs(workdir, exist_ok=True)
  rows, curves = [], {}
  for name in names:
    run_dir = os.path.join(workdir, name)
    result = train.train_and_evaluate(routing_config(config, name), run_dir)   # RunStopped: resumable
    metrics = MetricsLog(run_dir).read()
    selected = result.selected_by_validation
    rows.append({'routing': name, 'num_params': result.num_params,
                 'test_error': list(np.atleast_1d(result.test_error)),
                 'test_error_at_best_validation': list(np.atleast_1d(selected['test_error'])) if selected else None,
                 # metrics.jsonl's images/s counts one member's images
                 'train_images_per_s': training_images_per_s(metrics) * len(config.routing_zoo.seeds),
                 'infer_images_per_s': inference_images_per_s(run_dir, config.eval_batch_size)})
    curves[name] = error_curve(metrics)
  table = render(config, rows)
  with open(os.path.join(workdir, 'routing.md'), 'w') as f:
    f.write(table)
  summary = {'rows': rows, 'curves': {name: {'steps': s, 'test_error': e} for name, (s, e) in curves.items()},
             'completed': True}
  with open(os.path.join(workdir, 'routing.json'), 'w') as f:
    json.dump(summary, f, indent=2)
  plot(curves, os.path.join(workdir, 'routing_test_error.png'))
  print(table, flush=True)
  return summary


if __name__ == '__main__':
  from capsjax import launch  # pylint: disable=g-import-not-at-top
  launch.entry_point(program='routing_zoo')
