"""Export a trained run: the explorer's (and predict's) files, or one ONNX, StableHLO or SavedModel.

  capsjax-export --workdir=W [--out=capsjax/app/explorer/assets] [--step=best|latest|N]
      [--member=K] [--num_images=1000] [--evaluate] [--data_dir=DIR]
  capsjax-export --format=onnx|stablehlo|savedmodel [--workdir=W] [--out=FILE] [--force]
      [--reconstructions] [--evaluate [--data_dir=DIR]]

--format=explorer (the default) writes the run's config, its parameters as float16 (no
optimiser state) and the first --num_images test images of its dataset: the files
`python -m capsjax.app.explorer` and `python -m capsjax.app.predict` use when they are
given no --workdir. Its --out is a new or empty folder, or one an export wrote (never a
run's workdir, whose config.json is the run's); the three files replace an earlier
export's together.

--format=onnx / stablehlo / savedmodel writes one self-contained file (a SavedModel: a
folder) with the inference function
(capsjax.app.serving): images uint8 [batch, h, w, c] → activations [batch, classes] and
capsules [batch, classes, dim] (with --reconstructions the decoder's image of the
predicted class too), the batch dynamic; of the run in --workdir, or of the shipped model
without one. ONNX through jax2onnx (the `export` extra), StableHLO through jax.export
(lowered for cpu, cuda and tpu), a TensorFlow SavedModel through jax2tf (with the
TensorFlow that tensorflow-datasets installs). An existing --out is refused unless --force; an
ensemble needs --member.

Which parameters: --step=best (the default) takes the checkpoint of the best validation
evaluation (results.json's `selected_by_validation`; the training loop keeps that
checkpoint), and of an ensemble the member with the lowest validation error there, unless
--member names one; a run without a validation split gives its latest checkpoint.
--step=latest, or a step number, takes that checkpoint. --evaluate then counts the test
error of what was written (read back; on the run's test split), beside the JAX model's
for an ONNX, StableHLO or SavedModel file. docs/results.md has the command that made the shipped files.
"""
import argparse
import importlib.util
import sys
from typing import Optional

import numpy as np

from capsjax import console
from capsjax.app import cli

# What the package ships: one file above this makes the wheel heavy.
MAX_SHIPPED_FILE_BYTES = 16 << 20
NUM_IMAGES = 1000   # the explorer's test sample


def step_argument(text: str) -> str:
  if text in ('best', 'latest') or (text.isdigit() and int(text) > 0):
    return text
  raise argparse.ArgumentTypeError(f"{text!r}: expected best, latest or a step number")


@cli.main_wrapper
def main(argv=None):
  from capsjax.app.serving import FORMATS  # pylint: disable=g-import-not-at-top
  parser = cli.ArgumentParser(prog='capsjax-export', description=__doc__.splitlines()[0])
  parser.add_argument('--format', choices=FORMATS, default='explorer',
                      help="explorer (the explorer's files, the default), onnx or stablehlo (one file), savedmodel "
                      '(a folder)')
  parser.add_argument('--workdir', default=None, type=cli.existing_workdir,
                      help='the run (for onnx, stablehlo and savedmodel, default: the shipped model)')
  parser.add_argument('--out', default=None, help='output folder (explorer; default: the package assets) or '
                      'file (onnx, stablehlo, savedmodel; default: EXPERIMENT.onnx / .stablehlo / _savedmodel here)')
  parser.add_argument('--num_images', type=cli.int_at_least(1), default=None,
                      help=f'test images written beside the model (explorer; default {NUM_IMAGES})')
  parser.add_argument('--member', type=cli.member, default=None,
                      help='ensemble member (explorer default: the best on validation; with --step=latest, the last)')
  parser.add_argument('--step', type=step_argument, default='best',
                      help='best (validation-selected, the default), latest, or a step number')
  parser.add_argument('--evaluate', action='store_true',
                      help="count the test error of what was written (onnx, stablehlo, savedmodel: beside the JAX "
                      "model's)")
  parser.add_argument('--force', action='store_true', help='replace an existing --out (onnx, stablehlo, savedmodel)')
  parser.add_argument('--reconstructions', action='store_true',
                      help="also output the decoder's image of the predicted class (onnx, stablehlo, savedmodel)")
  cli.add_data_flags(parser)   # where --evaluate (and the explorer's sample) reads the run's test split
  args = parser.parse_args(argv)
  if args.out is not None and not args.out.strip():
    cli.fail('--out is empty: give the path to write, or leave --out out for the default')
  if args.format == 'explorer':
    if not args.workdir:
      cli.fail('--workdir is required for --format=explorer (the shipped model is already its files)')
    if args.force or args.reconstructions:
      cli.fail(f'--{"force" if args.force else "reconstructions"} is for --format=onnx, stablehlo or savedmodel')
    return _explorer_files(args)
  if args.num_images is not None:
    cli.fail('--num_images is for --format=explorer (a test sample written beside the model)')
  return _one_file(args)


def _test_split(run, args, num_test_examples: Optional[int] = None):
  """The run's test split, read from --data_dir / --tfds_data_dir or the run's own
  source: as its evaluations counted it (its first num_test_examples)."""
  from capsjax.data.sources import load_dataset  # pylint: disable=g-import-not-at-top
  data = {'data_dir': run.data_dir, 'tfds_data_dir': run.tfds_data_dir, **cli.data_overrides(args)}
  test = load_dataset(run.dataset, 'test', **data)
  return test.take(min(num_test_examples, len(test))) if num_test_examples else test


def _explorer_files(args) -> int:
  from capsjax.app.trained import SHIPPED, check_explorer_folder, choose_checkpoint, write_explorer_model  # pylint: disable=g-import-not-at-top
  from capsjax.workdir import is_explorer_model  # pylint: disable=g-import-not-at-top
  from capsjax.stored_config import read_config  # pylint: disable=g-import-not-at-top
  if is_explorer_model(args.workdir):
    cli.fail(f'{args.workdir} holds an exported model already (the explorer\'s files); copy the folder, or give '
             '--format=onnx, stablehlo or savedmodel')
  out = check_explorer_folder(args.out or SHIPPED)   # before the data is read
  config = read_config(args.workdir)
  step, member, why = choose_checkpoint(args.workdir, args.step, args.member)
  console.say(f'exporting {args.workdir}: {why}; reading the test images…')
  test = _test_split(config, args)
  num_images = args.num_images or NUM_IMAGES
  sample = test.take(min(num_images, len(test)))
  summary = write_explorer_model(args.workdir, out, np.asarray(sample.images), np.asarray(sample.labels), member, step)
  total = sum(summary['bytes'].values())
  asked = f' (all of them: --num_images={num_images} asked for more)' if num_images > len(sample) else ''
  print(f'{why}: {summary["num_params"]:,} parameters and {len(sample)} test images{asked}, '
        f'{total / 2**20:.2f} MiB in {out}')
  for name, size in summary['bytes'].items():
    if size > MAX_SHIPPED_FILE_BYTES:
      print(f'warning: {name} is {size / 2**20:.2f} MiB, above the {MAX_SHIPPED_FILE_BYTES >> 20} MiB a shipped '
            'file may be', file=sys.stderr)
  if args.evaluate:
    from capsjax.app.predict import Predictor  # pylint: disable=g-import-not-at-top
    from capsjax.app.trained import TrainedModel  # pylint: disable=g-import-not-at-top
    predictor = Predictor(TrainedModel.exported(out))
    test = _test_split(config, args, config.get('num_test_examples'))
    wrong = int(np.sum(predictor.classify(test.images, 'evaluating the float16 parameters')
                       != np.asarray(test.labels)))
    print(f'test error of the float16 parameters as written: {100 * wrong / len(test):.2f} % '
          f'({wrong} of {len(test)} test images)')
  return 0


def _one_file(args) -> int:
  from capsjax.app import serving  # pylint: disable=g-import-not-at-top
  from capsjax.app.trained import SHIPPED, TrainedModel, choose_checkpoint  # pylint: disable=g-import-not-at-top
  from capsjax.workdir import is_explorer_model  # pylint: disable=g-import-not-at-top
  from capsjax.stored_config import read_config  # pylint: disable=g-import-not-at-top
  if args.format == 'onnx' and importlib.util.find_spec('jax2onnx') is None:   # before any JAX loads
    cli.fail(f'--format=onnx needs the jax2onnx converter: {serving.EXTRA}')
  if args.out:
    serving.check_output(args.out, args.force, args.format)   # before the model is read
  exported = args.workdir and is_explorer_model(args.workdir)   # the explorer's files of a run: one model, as shipped
  config = read_config(args.workdir or SHIPPED)
  if args.evaluate:   # read before the model and the conversion: data that cannot be read is said at once
    test = _test_split(config, args, config.get('num_test_examples'))
  if exported:
    if args.member is not None or args.step != 'best':
      cli.fail(f'--member and --step choose within a run\'s workdir; {args.workdir} holds an exported model (one '
               'model, no checkpoints)')
    console.say(f'exporting the exported model in {args.workdir}…')
    trained = TrainedModel.exported(args.workdir)
  elif args.workdir:
    from capsjax import assemble  # pylint: disable=g-import-not-at-top
    if config.ensemble and args.member is None:
      members = len(assemble.members(config))
      cli.fail(f'{args.workdir} holds an ensemble of {members} models: name the one to export with '
               f'--member=K (0 to {members - 1})')
    step, member, why = choose_checkpoint(args.workdir, args.step, args.member)
    console.say(f'exporting {args.workdir}: {why}…')
    trained = TrainedModel.from_workdir(args.workdir, member, step=step)
  else:
    if args.member is not None or args.step != 'best':
      cli.fail('--member and --step choose within a --workdir (without one: the shipped model)')
    console.say('exporting the shipped model…')
    trained = TrainedModel.shipped()
  path = args.out or serving.default_path(trained, args.format)
  serving.check_output(path, args.force, args.format)   # before the conversion's minute
  console.say(f'converting {trained.describe()} to {args.format}…')
  summary = serving.write_file(trained, args.format, path, args.reconstructions, args.force)
  for line in serving.describe(summary, path, trained):
    print(line)
  if args.evaluate:
    from capsjax.app.predict import Predictor  # pylint: disable=g-import-not-at-top
    images, labels = np.asarray(test.images), np.asarray(test.labels)
    own = Predictor(trained).classify(images, 'the JAX model')
    console.say(f'running the {args.format} file on {len(images)} test images…')
    activations = serving.run_file(path, images, format_name=args.format)[0]
    exported = np.argmax(activations, -1)
    print(f'test error on {len(labels)} test images: {args.format} file {100 * np.mean(exported != labels):.2f} %, '
          f'JAX model {100 * np.mean(own != labels):.2f} %; the predicted classes differ on '
          f'{int(np.sum(exported != own))}')
  return 0


if __name__ == '__main__':
  cli.run_program(main)
