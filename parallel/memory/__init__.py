"""`python -m parallel.memory` (parallel/cli/memory.py)."""
