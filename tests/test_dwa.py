"""The buffered DWA's own backward against plain autograd, in fp64, and its layout tables."""

import pytest
import torch

from pretrain.model.dwa import BufferedDWA
from pretrain.model.dwa_layout import buffer_layout
from pretrain.model.dwa_pattern import pattern_for_shape

PATTERNS = [  # (d, k, p, window)
    (6, 1, 1, None), (12, 4, 1, None), (15, 4, 5, None), (7, 3, 2, None), (6, 1, 1, 2),
    (5, 1, 5, None),
]


def run_chain(pattern, alpha, x0, gains, buffered: bool, ignores_input=()):
    """Y_d of blocks X_i = tanh(Y_{i-1}) * gains[i - 1] (a block in `ignores_input` reads X_0
    instead, so the DWA before it gets no gradient), DWAs buffered or as a plain sum."""
    dwa = BufferedDWA(pattern.layout, alpha, x0) if buffered else None
    xs = {0: dwa.store(0, x0) if dwa else x0}
    y = xs[0]
    for i in range(1, pattern.n_layers + 1):
        x = torch.tanh(x0 if i in ignores_input else y) * gains[i - 1]
        xs[i] = dwa.store(i, x) if dwa else x
        js = pattern.inputs.get(i)
        if js is None:
            y = xs[i]
        elif dwa:
            y = dwa.combine(i, [xs[j] for j in js])
        else:
            y = sum(alpha[i - 1, j] * xs[j] for j in js)
    return y


@pytest.mark.parametrize("d,k,p,window", PATTERNS)
def test_buffered_backward_equals_autograd_in_fp64(d, k, p, window):
    pattern = pattern_for_shape(d, k, p, window)
    gen = torch.Generator().manual_seed(d * 100 + k * 10 + p)
    mask = torch.tensor(pattern.mask(), dtype=torch.float64)
    alpha = (torch.randn(d, d + 1, generator=gen, dtype=torch.float64) * mask).requires_grad_()
    x0 = torch.randn(2, 5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    gains = torch.randn(d, generator=gen, dtype=torch.float64, requires_grad=True)
    target = torch.randn(2, 5, 3, generator=gen, dtype=torch.float64)
    ignores = {3} if pattern.has_dwa(2) else ()  # a DWA output that never reaches the loss
    results = []
    for buffered in (True, False):
        y = run_chain(pattern, alpha, x0, gains, buffered, ignores)
        grads = torch.autograd.grad((y * target).sum(), [alpha, x0, gains])
        results.append((y, *grads))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)


def test_layout_reads_and_readers_are_runs_and_strided_views():
    layout = pattern_for_shape(15, 4, 5).layout
    # DWAs after blocks 5, 10, 15 (classes 1, 2, 3): S_10 = {2, 6, 10}, every 4th column of
    # row 9; X_2 is read by the DWA after block 10 alone (row 0 of class 2).
    assert layout.reads[10] == (2, 0, 3) and layout.weights_index[10] == (9, slice(2, 11, 4))
    assert layout.readers[2] == (2, 0, 1) and layout.column_index[2] == (slice(9, 10, 1), 2)
    full = pattern_for_shape(6, 1, 1).layout  # X_0 is read by every DWA, rows 0..5
    assert full.readers[0] == (0, 0, 6) and full.column_index[0] == (slice(0, 6, 1), 0)
    with pytest.raises(AssertionError, match=r"S_3 = \[0, 1, 3\] is not equally spaced"):
        buffer_layout({3: (0, 1, 3)}, 1)
