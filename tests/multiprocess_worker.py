"""One process of a multi-process training run on localhost (used by test_sharding.py).

  python tests/multiprocess_worker.py --process_id=I --num_processes=N [--port=P]
      --workdir=W --data_dir=D [--num_steps=N] [--stop_at_step=S] [--out=PARAMS.npz]

With --num_processes=1 it is a plain single-process run (on however many local devices
XLA_FLAGS gives it).

Runs the same tiny MNIST training as `tiny_sharded_config` through jax.distributed and
`train.train_and_evaluate`; process 0 writes the final parameters to --out.
"""
import argparse


import jax  # pylint: disable=g-import-not-at-top
import numpy as np

from capsjax import sharding, train
from capsjax.app import distributed
from capsjax.data import pipeline
from capsjax.app.trained import load_trained
from capsjax.errors import RunStopped
from sharded_config import tiny_sharded_config


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--process_id', type=int, required=True)
  parser.add_argument('--num_processes', type=int, required=True)
  parser.add_argument('--port', type=int, default=0)
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--data_dir', required=True)
  parser.add_argument('--stop_at_step', type=int, default=0)
  parser.add_argument('--num_steps', type=int, default=0)
  parser.add_argument('--out', default='')
  args = parser.parse_args()
  config = tiny_sharded_config(args.data_dir)
  if args.num_steps:
    config.num_steps = args.num_steps
  if args.num_processes > 1:
    config.distributed = True
    config.coordinator_address = f'localhost:{args.port}'
    config.num_processes = args.num_processes
    config.process_id = args.process_id
  distributed.initialize_distributed(config.distributed, config.coordinator_address, config.num_processes,
                                 config.process_id, config.distributed_timeout_s)
  try:
    steps, completed = train.train_and_evaluate(config, args.workdir, stop_at_step=args.stop_at_step or None).steps, True
  except RunStopped as stopped:   # resumable: the test runs the same command again
    steps, completed = stopped.steps, False
  if completed and args.out:
    _, _, params = load_trained(args.workdir)   # collective: every process restores
    if sharding.is_main_process():
        np.savez(args.out, **{str(i): np.asarray(leaf) for i, leaf in enumerate(jax.tree.leaves(params))})
  print(f'process {jax.process_index()}/{jax.process_count()} devices {jax.device_count()} '
        f'steps {steps} completed {completed} '
        f'rows_on_demand {pipeline.images_on_demand(config.host_images)}', flush=True)


if __name__ == '__main__':
  main()
