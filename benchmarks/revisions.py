"""Training and inference images/s of this checkout against another git revision, in turns.

  python benchmarks/revisions.py --base HEAD~1                  # the paper's model, batch 128
  python benchmarks/revisions.py --base 65a3f58 --rounds 5 --batch 64

A change's effect is smaller than one CPU's drift between runs (docs/results.md: the same
program measured 10–20 % apart an hour later), so two separate runs of
benchmarks/throughput.py cannot show it. Here one worker process per side (the revision
checked out into a temporary git worktree, each side importing its own capsjax and its own
benchmarks/throughput.py) compiles the experiment's training step and inference call once;
then the two are timed in alternating rounds, and the per-round ratios are printed with
their median. Both sides run with the same huge-pages environment and nothing else.
"""
import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT = os.path.dirname(HERE)


def worker(experiment: str, batch: int, steps: int) -> None:
  """Compiles this side's timers, says 'ready', then answers each mode read from stdin with
  its images/s (one JSON line each)."""
  sys.path.insert(0, os.path.join(os.getcwd(), 'benchmarks'))
  import throughput  # pylint: disable=g-import-not-at-top
  config = importlib.import_module(f'capsjax.experiments.{experiment}').get_config()
  if hasattr(throughput, 'jax_programs'):   # the programs apart from their timers
    timers, _ = throughput.jax_timers(throughput.jax_programs(config, batch), batch, steps)
  else:   # revisions before that (e.g. 29e4a0c)
    timers, _ = throughput.jax_timers(config, batch, steps)
  for timer in timers.values():
    timer()   # compile and warm up
  print(json.dumps({'ready': True}), flush=True)
  for mode in sys.stdin:
    print(json.dumps({'images_per_s': timers[mode.strip()]()}), flush=True)


def start(side_dir: str, args) -> subprocess.Popen:
  env = dict(os.environ, PYTHONPATH=side_dir)
  command = [sys.executable, os.path.join(HERE, 'revisions.py'), '--worker', '--experiment', args.experiment,
             '--batch', str(args.batch), '--steps', str(args.steps)]
  return subprocess.Popen(command, cwd=side_dir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def ask(process: subprocess.Popen, mode: str = '') -> dict:
  if mode:
    process.stdin.write(mode + '\n')
    process.stdin.flush()
  line = process.stdout.readline()
  if not line:
    raise SystemExit(f'error: a worker ended early (exit {process.wait()}); its errors are above')
  return json.loads(line)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--base', help='the git revision to compare this checkout with (required)')
  parser.add_argument('--experiment', default='mnist', help='config module in capsjax.experiments')
  parser.add_argument('--batch', type=int, default=128)
  parser.add_argument('--steps', type=int, default=8, help='timed calls per round')
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    worker(args.experiment, args.batch, args.steps)
    return
  if not args.base:
    raise SystemExit('error: --base=REV is required: the git revision to compare this checkout with')
  for name in ('batch', 'steps', 'rounds'):   # before two sides compile for minutes
    if getattr(args, name) < 1:
      raise SystemExit(f'error: --{name}={getattr(args, name)}: allowed an integer >= 1')
  sys.path.insert(0, CHECKOUT)
  from capsjax.app import cli  # pylint: disable=g-import-not-at-top
  cli.use_huge_pages()   # restarts this process once; the workers inherit it
  with tempfile.TemporaryDirectory() as scratch:
    base_dir = os.path.join(scratch, 'base')
    added = subprocess.run(['git', '-C', CHECKOUT, 'worktree', 'add', '--detach', base_dir, args.base],
                           capture_output=True, text=True)
    if added.returncode:
      raise SystemExit(f'error: --base={args.base!r}: {added.stderr.strip().splitlines()[-1]}')
    try:
      sides = {'base': start(base_dir, args), 'this': start(CHECKOUT, args)}
      for process in sides.values():
        ask(process)   # compiled
      rates = {(side, mode): [] for side in sides for mode in ('train', 'infer')}
      for _ in range(args.rounds):
        for side, process in sides.items():
          for mode in ('train', 'infer'):
            rates[side, mode].append(ask(process, mode)['images_per_s'])
      for process in sides.values():
        process.stdin.close()
        process.wait()
    finally:
      subprocess.run(['git', '-C', CHECKOUT, 'worktree', 'remove', '--force', base_dir], capture_output=True)
  print(f'{args.experiment}, batch {args.batch}, {args.rounds} alternating rounds of {args.steps} calls; '
        f'base {args.base} against this checkout')
  for mode in ('train', 'infer'):
    base, this = np.array(rates['base', mode]), np.array(rates['this', mode])
    ratios = this / base
    print(f'{mode}: base {np.median(base):.1f} images/s ({base.min():.1f}–{base.max():.1f}), this '
          f'{np.median(this):.1f} ({this.min():.1f}–{this.max():.1f}); this ÷ base per round '
          f'{", ".join(f"{r:.3f}" for r in ratios)}: median {np.median(ratios):.3f}')


if __name__ == '__main__':
  main()
