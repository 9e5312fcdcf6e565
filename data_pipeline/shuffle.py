"""Seeded permutations that stay the same across numpy versions.

numpy promises stable bit streams from its BitGenerators but not from Generator methods
such as permutation(), and a resumed run must reproduce the order of the original run.
So: draw n raw 64-bit words from PCG64 seeded by SeedSequence(words), and argsort them
with a stable sort (a tie, rare at 2**-64 per pair, is broken by position).
"""

from __future__ import annotations

import numpy as np

# Separate streams for separate uses of the same user seed.
PURPOSE_VAL_SPLIT = 1
PURPOSE_EPOCH_ORDER = 2


def seeded_permutation(n: int, *words: int) -> np.ndarray:
    """A permutation of range(n) determined by the non-negative integers `words`."""
    if n < 0 or any(word < 0 for word in words):
        raise ValueError(f"need n >= 0 and non-negative seed words, got n={n} words={words}")
    raw = np.random.PCG64(np.random.SeedSequence(list(words))).random_raw(n)
    return np.argsort(raw, kind="stable")
