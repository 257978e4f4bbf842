"""Where a run's images come from: registered sources, each describing itself.

A source is chosen from the config's data keys (`DataSpec`: dataset, data_dir,
tfds_data_dir, image_size): the one that serves config.dataset by name (its `datasets`
capability), else the first registered kind that claims them; one module each:
- `image_folder` (config.dataset='image_folder'): config.data_dir in tfds.ImageFolder's
  layout, DIR/train/CLASS/*.png|jpg and DIR/test/CLASS/…;
- `idx_folder`: a folder of LeCun IDX files (config.data_dir) for the MNIST family;
- `tfds`: the described datasets (capsjax.data.datasets) and any other TFDS
  image-classification builder by name (`kmnist`, `emnist/digits`, …), downloaded and
  prepared on first use.
Each describes itself (`SourceInfo`: image shape, classes and their names,
preprocessing) before any image is read, and loads a split as `Dataset`: uint8 images
[n, h, w, c], either whole (numpy) or read on demand (`on_demand=True`:
capsjax.data.rows.ImageRows over TFDS's array_record files, a memory map of an
uncompressed IDX file, or the image files), so that a process of a multi-host run holds
only the rows it reads. config.image_size resizes every image to N×N (capsjax.data.images,
the same conversion `capsjax.app.predict` applies to a file).
"""

from capsjax.data.sources.core import (  # the core every kind builds on
    IMAGE_FOLDER, SOURCES, SPLITS, DataSpec, Dataset, Source, SourceInfo, describe_source, dataset_names_help,
    is_dataset_name, load_dataset, open_source, register_source, with_image_size)

# The built-in kinds, in the order they are asked (each module registers its class).
from capsjax.data.sources.image_folder import FolderScan, ImageFolderSource, scan_image_folder
from capsjax.data.sources.idx_folder import IdxFolderSource, load_idx_split
from capsjax.data.sources.tfds_builders import TfdsSource, load_tfds_split, tfds_builder

__all__ = ['Dataset', 'DataSpec', 'SourceInfo', 'Source', 'SOURCES', 'register_source', 'open_source',
           'describe_source', 'load_dataset', 'dataset_names_help', 'is_dataset_name', 'with_image_size',
           'IMAGE_FOLDER', 'SPLITS', 'FolderScan', 'ImageFolderSource', 'scan_image_folder', 'IdxFolderSource',
           'load_idx_split', 'TfdsSource', 'load_tfds_split', 'tfds_builder']
