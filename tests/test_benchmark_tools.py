"""The benchmark scripts' own plumbing, where it can fail without a long run."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worktrees():
  return subprocess.run(['git', '-C', ROOT, 'worktree', 'list'], capture_output=True, text=True).stdout


def test_revisions_refuses_an_unknown_revision_in_one_line_and_leaves_no_worktree():
  before = _worktrees()
  result = subprocess.run([sys.executable, os.path.join(ROOT, 'benchmarks', 'revisions.py'), '--base',
                           'no-such-revision'], capture_output=True, text=True, timeout=120)
  assert result.returncode != 0
  assert result.stderr.strip().splitlines() == [
      "error: --base='no-such-revision': fatal: invalid reference: no-such-revision"], result.stderr
  assert _worktrees() == before
  for args, message in ((['--base', 'HEAD', '--rounds', '0'], 'error: --rounds=0: allowed an integer >= 1'),
                        ([], 'error: --base=REV is required: the git revision to compare this checkout with')):
    result = subprocess.run([sys.executable, os.path.join(ROOT, 'benchmarks', 'revisions.py'), *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.strip() == message, result.stderr
  assert _worktrees() == before
