"""Every dataset the experiments can name (`config.dataset`), described in one place."""
import dataclasses
from typing import Dict, Tuple

from capsjax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  tfds_name: str                      # the TFDS builder (the default source)
  image_shape: Tuple[int, int, int]   # [height, width, channels] of one image
  num_classes: int
  idx_folder: bool                    # also readable from a folder of LeCun IDX files


DATASETS: Dict[str, DatasetInfo] = {
    'mnist': DatasetInfo('mnist', (28, 28, 1), 10, idx_folder=True),
    # Same format; Debian's dataset-fashion-mnist installs the IDX files.
    'fashion_mnist': DatasetInfo('fashion_mnist', (28, 28, 1), 10, idx_folder=True),
}


def dataset_info(name: str) -> DatasetInfo:
  if name not in DATASETS:
    raise ConfigError(f'config.dataset={name!r}: allowed one of {", ".join(DATASETS)}')
  return DATASETS[name]
