"""Experiment configs: `experiments/NAME.py` defines `get_config()` → ConfigDict."""
