"""Memory of every routing on shared-transform votes: without û (its registered `shared`
form) against û materialised (`routing.shared_votes`), one routing step with gradients.

  python benchmarks/factored_routing.py                 # the 64 px grid: 24×24 positions × 32 types
  python benchmarks/factored_routing.py --grid 52       # 128 px

Peak bytes come from the traced program (`capsjax.memory.traced_peak_bytes`: nothing is
allocated or compiled), so the table takes seconds on any machine. A routing without a
shared form (EM) has its materialised row only.
"""
import argparse

import jax
import jax.numpy as jnp

from capsjax import memory, routing


def peaks(name: str, grid: int, types: int, batch: int, classes: int, dim: int, in_dim: int):
  """(factored bytes or None, materialised bytes) of routing `name`, 3 iterations."""
  positions = grid * grid
  offsets = routing.coordinate_offsets(grid, grid, dim)
  options = {option: jnp.full(shape(positions * types, classes, dim), initial)
             for option, (shape, initial) in routing.ROUTINGS[name].learned.items()}
  args = (jax.ShapeDtypeStruct((batch, positions, types, in_dim), jnp.float32),
          jax.ShapeDtypeStruct((types, classes, dim, in_dim), jnp.float32))
  with_votes = jax.jit(jax.grad(lambda u, w: jnp.sum(routing.route(
      name, routing.shared_votes(u, w, offsets), None, 3, **options).parents), (0, 1)))
  materialised = memory.traced_peak_bytes(with_votes, *args)
  if routing.shared_form(name, options) is None:
    return None, materialised
  factored = jax.jit(jax.grad(lambda u, w: jnp.sum(
      routing.call(name, (u, w, offsets), 3, shared=True, **options).parents), (0, 1)))
  return memory.traced_peak_bytes(factored, *args), materialised


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--grid', type=int, default=24, help='primary capsule rows = columns')
  parser.add_argument('--types', type=int, default=32)
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--classes', type=int, default=10)
  args = parser.parse_args()
  print(f'{args.grid}×{args.grid} positions × {args.types} types, batch {args.batch}, {args.classes} classes × 16')
  print('| routing | without û (MB) | û materialised (MB) | ratio |')
  print('|---|---|---|---|')
  for name in routing.ROUTINGS.names():
    factored, materialised = peaks(name, args.grid, args.types, args.batch, args.classes, 16, 8)
    if factored is None:
      print(f'| {name} | — (no shared form) | {materialised / 1e6:,.0f} | — |')
    else:
      print(f'| {name} | {factored / 1e6:,.0f} | {materialised / 1e6:,.0f} | {materialised / factored:.1f}× |')


if __name__ == '__main__':
  main()
