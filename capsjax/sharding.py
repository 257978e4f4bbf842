"""Data parallelism over every device of every process: a 1-D mesh with a `data` axis.

Parameters and optimizer state are replicated; batches are split along the batch axis
(the axis after any leading ensemble-member axis). One device is the same program with a
mesh of size 1. With several processes (hosts), each process holds only its slice of
every global batch and `jax.make_array_from_process_local_data` assembles the global
array; only process 0 writes logs, metrics, results and figures.
"""
import functools
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from capsjax.errors import ConfigError

DATA_AXIS = 'data'


def is_main_process() -> bool:
  return jax.process_index() == 0


def data_mesh(devices: Optional[Sequence[Any]] = None) -> jax.sharding.Mesh:
  """A mesh over all (or the given) devices with the single axis `data`."""
  devices = list(devices) if devices is not None else jax.devices()
  # Auto axes: XLA propagates the batch split through the step (and inserts the gradient
  # all-reduce) without sharding annotations inside the model code.
  return jax.make_mesh((len(devices),), (DATA_AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=devices)


@functools.lru_cache(maxsize=16)   # asked at every global batch: once per mesh
def is_compile_only(mesh) -> bool:
  """Whether `mesh` holds devices this process cannot run on: the compile-only devices of a
  TPU topology or GPU target that capsjax.app.plan compiles for. Nothing can be placed on them:
  `replicate` and `global_batch` then describe the arrays (jax.ShapeDtypeStruct with their
  sharding) instead of making them, so the run's own program lowers for the target."""
  return mesh.devices.flat[0] not in jax.devices()


def _described(value, sharding) -> jax.ShapeDtypeStruct:
  dtype = value.dtype if hasattr(value, 'dtype') else np.asarray(value).dtype
  return jax.ShapeDtypeStruct(np.shape(value), dtype, sharding=sharding)


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh, leading_axes: int = 0) -> NamedSharding:
  """Split the batch axis, which comes after `leading_axes` unsplit axes (ensemble members)."""
  return NamedSharding(mesh, PartitionSpec(*([None] * leading_axes), DATA_AXIS))


def check_batch_size(batch_size: int, mesh, what: str = 'batch_size') -> None:
  devices = mesh.devices.size
  if batch_size % devices:
    raise ConfigError(f'global {what} {batch_size} does not divide by the {devices} devices '
                      f'of the data mesh; use a multiple of {devices}')
  if devices % jax.process_count():
    raise ConfigError(f'{devices} devices do not split evenly over {jax.process_count()} processes')


def padded_batch_size(batch_size: int, mesh) -> int:
  """`batch_size` rounded up to a multiple of the mesh's devices (an evaluation batch:
  its padding rows weigh 0)."""
  return -(-batch_size // mesh.devices.size) * mesh.devices.size


def process_rows(batch_size: int) -> slice:
  """This process's rows of a global batch: an equal, contiguous share per process."""
  per_process = batch_size // jax.process_count()
  start = jax.process_index() * per_process
  return slice(start, start + per_process)


def global_batch(mesh, arrays, global_size: int, leading_axes: int = 0):
  """This process's rows (`process_rows`) of a global batch of `global_size` examples →
  global jax.Arrays split over `data` along the batch axis (after `leading_axes`)."""
  sharding = batch_sharding(mesh, leading_axes)
  compile_only = is_compile_only(mesh)

  def one(array):
    array = np.asarray(array)
    shape = array.shape[:leading_axes] + (global_size,) + array.shape[leading_axes + 1:]
    if compile_only:
      return jax.ShapeDtypeStruct(shape, array.dtype, sharding=sharding)
    return jax.make_array_from_process_local_data(sharding, array, shape)

  return jax.tree.map(one, arrays)


def replicate(tree, mesh):
  """Host values identical on every process → replicated global arrays."""
  sharding = replicated(mesh)
  if is_compile_only(mesh):
    return jax.tree.map(lambda value: _described(value, sharding), tree)

  def one(value):
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

  return jax.tree.map(one, tree)


def to_host(tree):
  """Replicated global arrays → numpy on every process (each reads its local copy)."""
  def one(array):
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
      return np.asarray(array.addressable_shards[0].data)
    return np.asarray(array)
  return jax.tree.map(one, tree)
