"""Exit statuses of `python -m pretrain train` (docs/failure-modes.md); no imports, so
launchers (slurm/) can use them without loading torch."""

EXIT_OK = 0
EXIT_USAGE = 2  # bad config, data, checkpoint or run directory: fix the input, then rerun
EXIT_NONFINITE = 3  # NaN/inf loss or gradient norm (on_nan=stop, or too many skips in a row)
EXIT_SAVE_FAILED = 74  # a checkpoint or run file write failed (EX_IOERR: disk full,
# permissions); the previous checkpoints are intact. Not requeued by the Slurm launcher:
# the disk needs a person.
EXIT_PREEMPTED = 75  # stopped on a signal after writing a checkpoint (EX_TEMPFAIL): resume
