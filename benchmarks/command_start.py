"""Wall seconds of a command's whole start, with JAX's compilation cache declined
(CAPSJAX_COMPILATION_CACHE=0), empty, and warm (capsjax.app.cli.compilation_cache_environment):
`capsjax-predict FILE` with the shipped model, and `capsjax-explorer --port=0` until it
prints its URL.

  python benchmarks/command_start.py FILE [--repeats=3]

The cache of the measure is a fresh folder of its own ($XDG_CACHE_HOME in a temporary
folder), removed at the end.
"""
import argparse
import os
import shutil
import subprocess
import tempfile
import time


def predict_seconds(path: str, env: dict) -> float:
  started = time.time()
  subprocess.run(['capsjax-predict', path], env=env, capture_output=True, check=True)
  return time.time() - started


def explorer_seconds(env: dict) -> float:
  """Until the explorer's URL line (the page can be opened), then stopped."""
  started = time.time()
  process = subprocess.Popen(['capsjax-explorer', '--port=0'], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
  try:
    for line in process.stdout:
      if 'http://' in line:
        return time.time() - started
    raise SystemExit(f'error: capsjax-explorer ended without a URL line (exit {process.wait()})')
  finally:
    process.terminate()
    process.wait()


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('file', help='an image file for capsjax-predict')
  parser.add_argument('--repeats', type=int, default=3)
  args = parser.parse_args()
  base = {k: v for k, v in os.environ.items() if k not in ('JAX_COMPILATION_CACHE_DIR', 'CAPSJAX_COMPILATION_CACHE')}
  folder = tempfile.mkdtemp(prefix='capsjax-command-start-')
  try:
    declined, cached = dict(base, CAPSJAX_COMPILATION_CACHE='0'), dict(base, XDG_CACHE_HOME=folder)
    for name, seconds in (('capsjax-predict', lambda env: predict_seconds(args.file, env)),
                          ('capsjax-explorer', explorer_seconds)):
      without = [seconds(declined) for _ in range(args.repeats)]
      empty = seconds(cached)
      warm = [seconds(cached) for _ in range(args.repeats)]
      print(f'{name}: no cache {", ".join(f"{s:.2f}" for s in without)} s; cache empty {empty:.2f} s; '
            f'warm {", ".join(f"{s:.2f}" for s in warm)} s', flush=True)
  finally:
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == '__main__':
  main()
