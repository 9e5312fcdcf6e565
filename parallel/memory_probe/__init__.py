"""`python -m parallel.memory_probe` (parallel/cli/memory_probe.py)."""
