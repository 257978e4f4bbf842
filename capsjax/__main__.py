"""`python -m capsjax`: the `capsjax` command (train and evaluate an experiment)."""
from capsjax import commands

if __name__ == '__main__':
  commands.train()
