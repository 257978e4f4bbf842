"""Train and evaluate an experiment: `python run.py --experiment=NAME --workdir=DIR`
(`python run.py --help` lists the experiments; see capsjax/launch.py)."""
from capsjax import launch

if __name__ == '__main__':
  launch.entry_point()
