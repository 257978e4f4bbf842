"""Runs commands' own front ends in one process (`run`; used by
tests/test_documented_commands.py for the documented commands, and by the tests of bad
arguments): a JSON list of [kind, argv] on stdin, a JSON list of {status, stdout, stderr}
on stdout's last line.

  training  `capsjax ARGS --summary`: capsjax's flag parsing, the experiment's config with
            the overrides, the command's validation and the model built (its parameter
            table), through the functions the command itself calls; nothing trains.
  capsjax   `capsjax ARGS` as written, through the same functions, up to the start of the
            run: a command that gets that far (past its flags, config and validation)
            stops there with status 3 ('would start the run'); nothing trains.
  plan    `capsjax-plan ARGS` up to its first compilation: its flags, checks, target,
          compile-only devices and the batch it would compile (capsjax.app.plan.configure);
          the compilations themselves are tests/test_plan.py's, at a small model's size.
  script  `python benchmarks/NAME.py ARGS`: the script runs until its argparse parser has
          parsed ARGS (its imports and flags as written), then stops before it measures.

One process for all of them: a command's start (imports) costs more than its checks.
What only a process of its own shows (its exit status as the shell sees it, what C++ or
the interpreter's teardown print) stays with a few cases run as real commands.
"""
import argparse
import contextlib
import io
import json
import os
import runpy
import subprocess
import sys

from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Parsed(Exception):
  pass


class _WouldRun(Exception):
  pass


def run(checks, cwd=None, env=None, timeout=600):
  """[{status, stdout, stderr}] of each [kind, argv] in `checks`, in one new process."""
  done = subprocess.run([sys.executable, os.path.abspath(__file__)], input=json.dumps(checks),
                        capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
  if done.returncode != 0:
    raise AssertionError(f'tests/command_checks.py ended with status {done.returncode}:\n{done.stderr[-3000:]}')
  return json.loads(done.stdout.splitlines()[-1])


def _forget_flags():
  """The previous command's own flags: its config file flag and overrides, the plan's."""
  for name in list(flags.FLAGS):
    if name in ('config', 'target', 'find_largest_batch') or name.startswith('config.'):
      delattr(flags.FLAGS, name)
  flags.FLAGS.unparse_flags()


def _training(argv):
  _capsjax([*argv, '--summary'])


def _capsjax(argv):
  from absl import app  # pylint: disable=g-import-not-at-top
  from capsjax.app import distributed, launch  # pylint: disable=g-import-not-at-top
  launch.set_experiments_dir(os.path.join(ROOT, 'experiments'))
  _forget_flags()

  def would_run(*args, **kwargs):
    del args, kwargs
    raise _WouldRun()

  initialize = distributed.initialize_distributed
  distributed.initialize_distributed = would_run   # launch.main's first step of a run
  try:
    argv = ['capsjax', *argv]
    app.run(launch.main, argv=launch.parse_flags(argv))
  except _WouldRun:
    print('command_checks: would start the run', file=sys.stderr)
    raise SystemExit(3) from None
  finally:
    distributed.initialize_distributed = initialize


def _plan(argv):
  from capsjax.app import cli, plan  # pylint: disable=g-import-not-at-top
  _forget_flags()

  def configured_only(config, target, *args, **kwargs):
    del args, kwargs
    _, devices, _, planned, note = plan.configure(config, target)
    print(f'planned: batch {planned.batch_size} over {len(devices)} devices' + (f'; {note}' if note else ''))
    raise SystemExit(0)

  compile_and_plan, as_program = plan.plan_run, cli.as_program
  plan.plan_run, cli.as_program = configured_only, lambda: None   # (as_program: errors would end this process)
  sys.argv = ['capsjax-plan', *argv]
  try:
    plan.entry_point(os.path.join(ROOT, 'experiments'))
  finally:
    plan.plan_run, cli.as_program = compile_and_plan, as_program


def _script(argv):
  parse = argparse.ArgumentParser.parse_args

  def parse_then_stop(self, args=None, namespace=None):
    parse(self, args, namespace)
    raise _Parsed()

  sys.argv = list(argv)
  argparse.ArgumentParser.parse_args = parse_then_stop
  try:
    runpy.run_path(os.path.join(ROOT, argv[0]), run_name='__main__')
  except _Parsed:
    return
  finally:
    argparse.ArgumentParser.parse_args = parse
  raise AssertionError(f'{argv[0]} ended without parsing its arguments')


def main():
  sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
  checks = json.loads(sys.stdin.read())
  results = [None] * len(checks)
  # The plans first: the first one starts JAX with the CUDA plugin for the GPU targets (as
  # capsjax-plan does), which a JAX already started by a training command's check would lack.
  for index in sorted(range(len(checks)), key=lambda index: checks[index][0] != 'plan'):
    kind, argv = checks[index]
    out, err = io.StringIO(), io.StringIO()
    status = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      try:
        {'training': _training, 'capsjax': _capsjax, 'plan': _plan, 'script': _script}[kind](argv)
      except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
      except Exception as e:  # pylint: disable=broad-except
        status, err = 1, io.StringIO(f'{type(e).__name__}: {e}')
    results[index] = {'status': status, 'stdout': out.getvalue()[-2000:], 'stderr': err.getvalue()[-2000:]}
  sys.stdout.flush()
  print(json.dumps(results))


if __name__ == '__main__':
  main()
