"""The paper's MNIST figures from a trained run.

  python -m capsjax.app.programs.figures --workdir=W [--member=K] [--digits=3]

Writes into W:
  reconstructions.png  figure 3: inputs over reconstructions, captioned (l, p, r) = label,
                       prediction, reconstructed class; the last columns are failures,
                       reconstructed once from the label and once from the prediction.
  perturbations_N.png  figure 4: the correct capsule of test image N with each of its
                       dimensions tweaked by 0.05 steps over [−0.25, 0.25], one row per
                       dimension.
  routing_convergence.png  appendix A: mean |Δb| (logits) and mean |Δc| (coupling
                       coefficients) per routing iteration at every evaluation during
                       training (from metrics.jsonl) and, on a log scale, after training,
                       measured now on 100 test images with 10 iterations.
  figures.json         what was drawn, and the final per-iteration changes.
For an ensemble run (`ablation`), --member picks the member (default: the last).
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from capsjax import assemble
from capsjax.data.sources import load_dataset
from capsjax.data.pipeline import preprocess
from capsjax import console
from capsjax.app import cli
from capsjax.errors import CapsjaxError
from capsjax.app.plots import PERTURBATIONS, decode_class, draw_perturbations, image_grid, pyplot, save_figure
from capsjax.data.tasks import TASKS
from capsjax.models import MODELS
from capsjax.routing import ROUTINGS, coupling_changes, routing_logit_changes
from capsjax.app.trained import TrainedModel
from capsjax.stored_config import read_config


def classify(model, params, images, batch_size=500, show_progress=False):
  """Digit capsules [n, classes, dim] and predictions [n] (the most active capsule)."""
  apply = jax.jit(lambda p, x: model.apply({'params': p}, x, method='classify'))
  bar = console.progress(what='classifying', total=len(images), unit='images', disable=not show_progress)
  outputs = []
  for start in range(0, len(images), batch_size):
    outputs.append(jax.block_until_ready(apply(params, images[start:start + batch_size])))
    bar.update(len(outputs[-1][0]))
  bar.close()
  capsules = np.concatenate([np.asarray(c) for c, _ in outputs])
  activations = np.concatenate([np.asarray(a) for _, a in outputs])
  return capsules, np.argmax(activations, axis=-1)


def reconstruction_columns(labels, predictions, num_correct=5, num_failures=2):
  """Figure 3's columns: (index, l, p, r) for correct examples of different classes, then
  each failure twice (r = label, r = prediction)."""
  columns, seen = [], set()
  for i in np.flatnonzero(labels == predictions):
    if labels[i] not in seen and len(seen) < num_correct:
      seen.add(labels[i])
      columns.append((int(i), int(labels[i]), int(predictions[i]), int(labels[i])))
  for i in np.flatnonzero(labels != predictions)[:num_failures]:
    columns.append((int(i), int(labels[i]), int(predictions[i]), int(labels[i])))
    columns.append((int(i), int(labels[i]), int(predictions[i]), int(predictions[i])))
  return columns


def draw_reconstructions(model, params, images, labels, capsules, predictions, path, names=None):
  columns = reconstruction_columns(labels, predictions)
  outputs = [decode_class(model, params, capsules[index:index + 1], np.array([target]))[0]
             for index, _, _, target in columns]
  grid = np.stack([np.stack([images[index] for index, _, _, _ in columns]), np.stack(outputs)])  # [2, cols, h, w, c]
  name = (lambda c: names[c]) if names else str
  titles = [[f'({name(label)},{name(predicted)},{name(target)})' for _, label, predicted, target in columns],
            [''] * len(columns)]
  colors = [['black' if label == predicted else 'red' for _, label, predicted, _ in columns], ['black'] * len(columns)]
  image_grid(path, grid, titles, colors, row_labels=['input', 'output'], cell=(1.3, 1.5), fontsize=9)
  return columns


def final_routing_changes(model, params, images, iterations=10):
  """{'routing_logit_changes', 'coupling_changes'}: [iterations] lists on `images`."""
  logits = jax.jit(lambda p, x: model.apply({'params': p}, x, iterations, None, True, method='routed').logits)(
      params, jnp.asarray(images))
  return {'routing_logit_changes': np.asarray(routing_logit_changes(logits)).tolist(),
          'coupling_changes': np.asarray(coupling_changes(logits)).tolist()}


def draw_routing_convergence(metrics_path, final_changes, path):
  """Rows: mean |Δb| and mean |Δc|; columns: during training, after training."""
  plt = pyplot()
  records = []
  if os.path.isfile(metrics_path):
    with open(metrics_path) as f:
      records = [r for r in map(json.loads, f) if r.get('split') == 'test' and 'coupling_changes' in r]
  figure, axes = plt.subplots(2, 2, figsize=(10, 7))
  for row, (key, name) in enumerate((('routing_logit_changes', 'mean |Δb|'),
                                     ('coupling_changes', 'mean |Δc|'))):
    during, final = axes[row]
    if records:
      steps = [r['step'] for r in records]
      changes = np.asarray([r[key] for r in records])   # [evaluations, iterations]
      for t in range(changes.shape[1]):
        during.plot(steps, changes[:, t], marker='.', label=f'iteration {t + 1}')
      during.set_yscale('log')
      during.legend(fontsize=7)
    else:
      during.text(0.5, 0.5, 'not recorded in metrics.jsonl\n(evals.routing_probe.enabled = False)',
                  ha='center', va='center', transform=during.transAxes)
    during.set_xlabel('training step')
    during.set_ylabel(name)
    during.set_title(f'{name} per routing iteration during training')
    final.semilogy(np.arange(1, len(final_changes[key]) + 1), final_changes[key], marker='o')
    final.set_xlabel('routing iteration')
    final.set_ylabel(name)
    final.set_title(f'{name} after training (log scale)')
  save_figure(figure, path, dpi=110)


@cli.main_wrapper
def main(argv=None):
  parser = cli.ArgumentParser(prog='capsjax-figures', description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', required=True, type=cli.existing_workdir)
  parser.add_argument('--member', type=cli.member, default=None,
                      help='ensemble member (ablation runs; default: the last)')
  parser.add_argument('--digits', type=cli.int_at_least(1), default=3, help='images for the perturbation figure')
  parser.add_argument('--num', type=cli.int_at_least(1), default=2000, help='test images searched for examples')
  cli.add_data_flags(parser)
  args = parser.parse_args(argv)
  console.say(f'figures of {args.workdir}: loading the trained model…')
  config = read_config(args.workdir)   # checked before the checkpoint is read
  family = MODELS[config.model.name]
  if not (family.capsules and family.has_decoder(config.model)):
    raise CapsjaxError(f'{args.workdir} holds no CapsNet with a decoder')
  if not TASKS[config.task].input_shape_from_data:   # the test images as stored
    raise CapsjaxError(f'{args.workdir} holds a {config.task} run; its figures come from capsjax.app.programs.segmentation')
  trained = TrainedModel.from_workdir(args.workdir, args.member, cli.data_overrides(args))
  config, model, params = trained.config, trained.model, trained.params
  console.say(f'model: {trained.describe()}; reading {args.num} test images…')
  test = load_dataset(config.dataset, 'test', config.data_dir, config.tfds_data_dir,
                      image_size=config.image_size).take(args.num)
  names = assemble.source_info(config).class_names
  images = np.asarray(preprocess(jnp.asarray(test.images)))
  capsules, predictions = classify(model, params, images, show_progress=True)
  figures = console.progress(what='drawing figures', total=1 + args.digits + 1, unit='figures')
  columns = draw_reconstructions(model, params, images, test.labels, capsules, predictions,
                                 os.path.join(args.workdir, 'reconstructions.png'), names)
  figures.update()
  perturbed = [int(i) for i in np.flatnonzero(test.labels == predictions)[:args.digits]]
  for index in perturbed:
    label = int(test.labels[index])
    draw_perturbations(model, params, capsules[index, label], label,
                       os.path.join(args.workdir, f'perturbations_{index}.png'), names[label])
    figures.update()
  # The convergence figure reads routing logits (Procedure 1's); other routings have none.
  has_logits = ROUTINGS[config.model.routing].returns_logits
  final_changes = final_routing_changes(model, params, images[:100]) if has_logits else None
  if has_logits:
    draw_routing_convergence(os.path.join(args.workdir, 'metrics.jsonl'), final_changes,
                             os.path.join(args.workdir, 'routing_convergence.png'))
  figures.update(figures.total - figures.n)
  figures.close()
  summary = {'reconstruction_columns': [dict(zip(('index', 'label', 'prediction', 'reconstructed'), c))
                                        for c in columns],
             'perturbed_indices': perturbed, 'perturbations': PERTURBATIONS.tolist(),
             'final_routing_changes': final_changes,
             'test_accuracy_on_searched': float(np.mean(test.labels == predictions))}
  with open(os.path.join(args.workdir, 'figures.json'), 'w') as f:
    json.dump(summary, f, indent=2)
  print(f'figures written to {args.workdir}: reconstructions.png, '
        f'{", ".join(f"perturbations_{i}.png" for i in perturbed)}'
        + (', routing_convergence.png' if has_logits else ''))
  return 0


if __name__ == '__main__':
  cli.run_program(main)
