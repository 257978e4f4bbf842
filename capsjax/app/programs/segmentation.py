"""MultiMNIST figure 5 and pixel segmentation from a trained run.

  python -m capsjax.app.programs.segmentation --workdir=W [--member=K] [--num=N] [--rows=8]

Writes W/multimnist_reconstructions.png (figure 5 of the paper: input over the two
reconstructions in red and green, captioned L:(labels) R:(reconstructed classes); the
last rows reconstruct a capsule that is neither a label nor a prediction, marked *) and
W/segmentation.json with the measured IoU of the pixel segmentation.

Segmentation: the pixels where a digit's reconstruction (from its labelled capsule) exceeds
`threshold` form that digit's mask; IoU is measured against the ink (> threshold) of the
digit's own shifted image, the one that went into the overlay. For an ensemble run
(`multimnist_two_recipes`), --member picks the member (default: the last).
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from capsjax import console
from capsjax.app import cli
from capsjax import assemble
from capsjax.data.tasks import TASKS
from capsjax.models import MODELS
from capsjax.app.plots import image_grid
from capsjax.errors import CapsjaxError
from capsjax.app.trained import TrainedModel
from capsjax.stored_config import read_config


def reconstruct_pairs(model, params, images, masks):
  """Lengths [b, classes] and one reconstruction per mask: masks [b, k, classes] → [b, k, h, w, c]."""
  outputs = model.apply({'params': params}, images, masks)
  return outputs['activations'], outputs['reconstructions']


def mask_iou(predicted: np.ndarray, true: np.ndarray) -> np.ndarray:
  """IoU per mask over the trailing pixel axes."""
  axes = tuple(range(1, predicted.ndim))
  intersection = np.sum(predicted & true, axis=axes)
  union = np.sum(predicted | true, axis=axes)
  return np.where(union > 0, intersection / np.maximum(union, 1), 1.0)


def overlay(red: np.ndarray, green: np.ndarray) -> np.ndarray:
  return np.clip(np.stack([red, green, np.zeros_like(red)], -1), 0, 1)


MAX_FIGURE_EXAMPLES = 64


def iou_report(ious: np.ndarray, ious_correct: np.ndarray, threshold: float) -> dict:
  """segmentation.json from the IoUs [pairs, 2] and those of the pairs predicted right."""
  return {'num_examples': int(len(ious)), 'threshold': threshold, 'mean_iou': float(ious.mean()),
          # no right pair: None (once NaN, after NumPy's empty-mean warning)
          'mean_iou_when_pair_correct': float(ious_correct.mean()) if len(ious_correct) else None,
          'pair_accuracy': float(len(ious_correct) / len(ious))}


@cli.main_wrapper
def main(argv=None):
  parser = cli.ArgumentParser(prog='capsjax-segmentation', description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', required=True, type=cli.existing_workdir)
  parser.add_argument('--member', type=cli.member, default=None,
                      help='ensemble member (multimnist_two_recipes runs; default: the last)')
  parser.add_argument('--num', type=cli.int_at_least(1), default=None,
                      help="test pairs for the IoU (default: the run's own, config.num_test_examples)")
  # (1 000 took 100 s to draw, a figure too wide to read)
  parser.add_argument('--rows', type=cli.int_in(1, MAX_FIGURE_EXAMPLES), default=8,
                      help=f'examples in the figure (its columns; at most {MAX_FIGURE_EXAMPLES})')
  parser.add_argument('--threshold', type=cli.number_between(0.0, 1.0), default=0.1)
  cli.add_data_flags(parser)
  args = parser.parse_args(argv)
  console.say(f'segmentation of {args.workdir}: loading the trained model…')
  config = read_config(args.workdir)   # checked before the checkpoint is read
  if not TASKS[config.task].per_label_targets:
    raise CapsjaxError(f'{args.workdir} holds a {config.experiment} run, not a MultiMNIST one')
  family = MODELS[config.model.name]
  if not (family.capsules and family.has_decoder(config.model)):
    raise CapsjaxError(f'{args.workdir} holds a {config.model.name} model without capsules to reconstruct; '
                       'segmentation needs a CapsNet with its decoder (e.g. --experiment=multimnist)')
  trained = TrainedModel.from_workdir(args.workdir, args.member, cli.data_overrides(args))
  config, model, params = trained.config, trained.model, trained.params
  run_pairs = config.num_test_examples   # the pairs the run itself was evaluated on
  pairs = args.num or run_pairs
  console.say(f'model: {trained.describe()}; generating {pairs} test pairs ('
              + ('the run\'s own, config.num_test_examples' if pairs == run_pairs else
                 f'--num; the run was evaluated on {run_pairs}') + ')…')
  config.num_test_examples = pairs
  _, test = assemble.pipelines(config)
  bar = console.progress(what='reconstructing', total=test.num_examples, unit='pairs')

  num_classes = config.model.num_classes
  # The parameters are an argument, not constants of the program (XLA would fold them).
  compiled = jax.jit(lambda params, images, masks: reconstruct_pairs(model, params, images, masks))
  apply = lambda images, masks: compiled(params, images, masks)
  ious, ious_correct, examples = [], [], []
  for host_batch, weights in test.eval_batches(config.eval_batch_size):
    batch = test.device_batch(test.source, host_batch, None)
    masks = jax.nn.one_hot(batch['labels'], num_classes)          # [b, 2, classes]
    lengths, recon = apply(batch['images'], masks)
    valid = weights > 0
    digits = np.asarray(batch['digits'])[valid, ..., 0]
    recon = np.asarray(recon)[valid, ..., 0]
    labels = np.asarray(batch['labels'])[valid]
    predicted = np.asarray(jax.lax.top_k(lengths, 2)[1])[valid]
    iou = mask_iou(recon > args.threshold, digits > args.threshold)   # [b, 2]
    ious.append(iou)
    correct = np.array([set(p) == set(l) for p, l in zip(predicted, labels)])
    ious_correct.append(iou[correct])
    if len(examples) < args.rows:
      examples.extend(zip(np.asarray(batch['images'])[valid, ..., 0], labels, predicted))
    bar.update(int(valid.sum()))
  bar.close()
  report = iou_report(np.concatenate(ious), np.concatenate(ious_correct), args.threshold)
  with open(os.path.join(args.workdir, 'segmentation.json'), 'w') as f:
    json.dump(report, f, indent=2)

  # Figure 5: rows of (input, R overlay); the last two rows reconstruct (label, other).
  examples = examples[:args.rows]
  images = jnp.asarray(np.stack([e[0] for e in examples]))[..., None]
  chosen = []
  for k, (_, labels, predicted) in enumerate(examples):
    if k >= len(examples) - 2:  # a capsule that is neither a label nor a prediction
      other = next(c for c in range(num_classes) if c not in set(labels) | set(predicted))
      chosen.append((labels[0], other))
    else:
      chosen.append(tuple(predicted))
  _, recon = apply(images, jax.nn.one_hot(jnp.asarray(chosen), num_classes))
  recon = np.asarray(recon)[..., 0]
  inputs = [np.repeat(image[..., None], 3, axis=-1) for image, _, _ in examples]   # grey as RGB
  overlays = [overlay(recon[k, 0], recon[k, 1]) for k in range(len(examples))]
  titles = [[f'L:({labels[0]},{labels[1]})' for _, labels, _ in examples],
            [f'R:({a},{b}{"*" if k >= len(examples) - 2 else ""})' for k, (a, b) in enumerate(chosen)]]
  path = os.path.join(args.workdir, 'multimnist_reconstructions.png')
  image_grid(path, np.stack([np.stack(inputs), np.stack(overlays)]), titles, cell=(1.6, 2.1), fontsize=9,
             suptitle_fontsize=8,
             suptitle='MultiMNIST: input (top), reconstructions red/green (bottom); * = neither label nor prediction')
  right = report['mean_iou_when_pair_correct']
  print(f'mean IoU {report["mean_iou"]:.3f} over {report["num_examples"]} test examples '
        + (f'({right:.3f} where the pair is right)' if right is not None else '(no pair is right)')
        + f'; figure: {path}')


if __name__ == '__main__':
  cli.run_program(main)
