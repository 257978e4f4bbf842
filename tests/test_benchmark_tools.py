"""The benchmark scripts' own plumbing, where it can fail without a long run."""
import os
import subprocess
import sys

import pytest

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


def test_the_profile_counts_each_instruction_s_flops_from_its_shapes():
  """benchmarks/profile_step.py's FLOPs per instruction of a compiled module, against the
  counts by hand: a batched matmul, a convolution, a loop's matmul × its trip count, an FFT
  by 5/2 N log2 N per real transform (the parts' share of the peak rests on these)."""
  import math  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
  import profile_step  # pylint: disable=g-import-not-at-top

  def program(a, b, x, k):
    products = jnp.einsum('bij,bjk->bik', a, b)                        # [4, 8, 5]: 2·4·8·5·16
    maps = jax.lax.conv_general_dilated(x, k, (1, 1), 'VALID',         # [2, 10, 10, 6]: 2·600·(3·3·3)
                                        dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
    spectrum = jnp.fft.rfft2(x, axes=(1, 2))                           # 2·3 transforms of 12×12 points
    looped = jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ a[0, :8, :8]), a[0, :, :8])   # 3 × 2·8·8·8
    return products.sum() + maps.sum() + jnp.abs(spectrum).sum() + looped.sum()

  shapes = ((4, 8, 16), (4, 16, 5), (2, 12, 12, 3), (3, 3, 3, 6))
  compiled = jax.jit(program).lower(*(jnp.ones(shape) for shape in shapes)).compile().as_text()
  counted = profile_step.instruction_flops(compiled)
  expected = [2 * 4 * 8 * 5 * 16, 2 * 2 * 10 * 10 * 6 * 27, 3 * 2 * 8 * 8 * 8, 2.5 * 144 * math.log2(144) * 6]
  assert sorted(counted.values()) == pytest.approx(sorted(expected), rel=1e-12), counted
