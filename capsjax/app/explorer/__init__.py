"""The capsule explorer: a local web page to tweak a trained CapsNet's capsules and watch
the reconstruction change (figure 4 of the paper, live). `python -m capsjax.app.explorer`."""
