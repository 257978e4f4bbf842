"""Datasets (host-side numpy arrays) and on-device augmentation."""
from capsjax.data.sources import Dataset, load_dataset

__all__ = ['Dataset', 'load_dataset']
