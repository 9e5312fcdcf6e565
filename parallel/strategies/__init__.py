"""The strategies applied to the model from outside: the pipeline (schedule, plan, stage
state, stage modules, runner), DDP, ZeRO, activation checkpointing, compilation, and the
memory estimates that choose among them. They take their own section (config.py:
`ParallelSection`) or plain values, and import from `pretrain` only the model."""
