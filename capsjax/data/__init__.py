"""Datasets (host-side numpy arrays) and on-device augmentation."""
from capsjax.data.mnist import Dataset, load_dataset

__all__ = ['Dataset', 'load_dataset']
