"""`python -m parallel.plan` (parallel/cli/plan.py)."""
