"""`python -m parallel.zero --build-ops` (parallel/cli/zero.py)."""
