"""What the model may use: process groups and devices (groups.py), the rank grid and its
gradient reductions (layout.py), tensor-parallel helpers (tensor.py), and the workarounds
and internals of megatron-core and DeepSpeed (megatron_compat.py, deepspeed_compat.py).
Below the model: nothing here imports `pretrain`."""
