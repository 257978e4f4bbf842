"""TensorBoard event files in the workdir, next to metrics.jsonl: `tensorboard --logdir=W`.

Written with TensorBoard's own record writer and protos into a plain local file
(TensorBoard's EventFileWriter opens files through tf.io.gfile, which imports
TensorFlow when it is installed, as it is here for TFDS: 16 s), so a training run
imports neither TensorFlow nor PyTorch for its curves (measured against tensorboardX and
tf.summary: docs/choices.md, "Your own images: sources, tasks, predict, TensorBoard").

Every numeric field of a metrics row becomes a scalar `SPLIT/FIELD` (train/loss,
train/learning_rate, test/error, validation/error, train/images_per_s, …); images are
PNG summaries. A resumed run first writes a SessionLog START at its restored step:
TensorBoard then drops the events the interrupted invocation wrote after that step, as
metrics.jsonl drops its rows.
"""
import contextlib
import io
import math
import os
import socket
import time
from typing import Any, Dict

import numpy as np


class EventWriter:
  """Scalars and images for TensorBoard in `logdir` (opened on first use)."""

  def __init__(self, logdir: str):
    self.logdir = logdir
    self._writer = None
    self._path = None

  def _events(self):
    if self._writer is None:
      from tensorboard.compat.proto import event_pb2  # pylint: disable=g-import-not-at-top
      from tensorboard.summary.writer.record_writer import RecordWriter  # pylint: disable=g-import-not-at-top
      # EventFileWriter's file name; a plain local file (its GFile would import TensorFlow).
      name = f'events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.0'
      self._path = os.path.join(self.logdir, name)
      self._writer = RecordWriter(open(self._path, 'wb'))
      self._writer.write(event_pb2.Event(wall_time=time.time(), file_version='brain.Event:2').SerializeToString())
    return self._writer

  def _add(self, step: int, **fields) -> None:
    from tensorboard.compat.proto import event_pb2  # pylint: disable=g-import-not-at-top
    with self._naming_the_file():
      self._events().write(event_pb2.Event(wall_time=time.time(), step=int(step), **fields).SerializeToString())
      self._events().flush()   # a few small records per log step: TensorBoard sees them at once

  @contextlib.contextmanager
  def _naming_the_file(self):
    """A failed write or flush (a full disk) names the events file: a buffered file's own
    OSError names none, and the command's line would say only 'No space left on device'."""
    try:
      yield
    except OSError as e:
      if e.filename is not None or self._path is None:
        raise
      raise OSError(e.errno, e.strerror, self._path) from None

  def restart_at(self, step: int) -> None:
    """Marks a resumed run: TensorBoard discards this run's events after `step`."""
    from tensorboard.compat.proto import event_pb2  # pylint: disable=g-import-not-at-top
    self._add(step, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))

  def scalars(self, step: int, prefix: str, record: Dict[str, Any]) -> None:
    """One scalar `prefix/KEY` per finite number in `record` (lists and text skipped)."""
    from tensorboard.compat.proto import summary_pb2  # pylint: disable=g-import-not-at-top
    values = [summary_pb2.Summary.Value(tag=f'{prefix}/{key}', simple_value=float(value))
              for key, value in record.items()
              if isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
              and math.isfinite(float(value))]
    if values:
      self._add(step, summary=summary_pb2.Summary(value=values))

  def images(self, step: int, tag: str, images: np.ndarray) -> None:
    """uint8 images [n, h, w, 1|3] as `tag/0` … `tag/n-1` (PNG)."""
    from PIL import Image  # pylint: disable=g-import-not-at-top
    from tensorboard.compat.proto import summary_pb2  # pylint: disable=g-import-not-at-top
    values = []
    for i, image in enumerate(np.asarray(images, np.uint8)):
      buffer = io.BytesIO()
      Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(buffer, format='PNG')
      encoded = summary_pb2.Summary.Image(height=image.shape[0], width=image.shape[1], colorspace=image.shape[-1],
                                          encoded_image_string=buffer.getvalue())
      values.append(summary_pb2.Summary.Value(tag=f'{tag}/{i}', image=encoded))
    self._add(step, summary=summary_pb2.Summary(value=values))

  def flush(self) -> None:
    if self._writer is not None:
      with self._naming_the_file():
        self._writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      writer, self._writer = self._writer, None
      with self._naming_the_file():
        writer.close()
