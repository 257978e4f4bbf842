"""Train and evaluate an experiment: `python run.py --experiment=NAME --workdir=DIR`
(`python run.py --help` lists the experiments; see capsjax/app/launch.py)."""
import os

from capsjax.app import launch

if __name__ == '__main__':
  launch.entry_point(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'experiments'))
