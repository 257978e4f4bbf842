"""`python -m capsjax`: the `capsjax` command (train and evaluate an experiment)."""
from capsjax.app import commands

if __name__ == '__main__':
  commands.train()
