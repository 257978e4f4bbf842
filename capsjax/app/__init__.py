"""The application: what a user runs on top of the library (capsjax/ outside this folder).

The command lines (cli, launch, commands), the run programs beside training (programs/),
the planner (plan), trained-run loading and prediction (trained, predict), the capsule
explorer (explorer/), plots, the MultiMNIST export, and the config's validation before a
run. The library never imports this package (tests/test_design.py); this package imports
the library freely.
"""
