"""Experiment programs outside the training loop: tables, figures, sweeps and robustness
studies that call `capsjax.train.train_and_evaluate` and read its workdirs."""
