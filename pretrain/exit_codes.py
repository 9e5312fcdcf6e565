"""Exit statuses of `python -m pretrain train` (documented in the README); no imports, so
launchers (slurm/) can use them without loading torch."""

EXIT_OK = 0
EXIT_USAGE = 2  # bad config, data or checkpoint: nothing was trained
EXIT_NONFINITE = 3  # the loss or gradient norm became NaN/inf and train.on_nan=stop
EXIT_PREEMPTED = 75  # stopped on a signal after writing a checkpoint (EX_TEMPFAIL): resume
