"""The DWA's products as Triton kernels, each reading its inputs once (`model.dwa_impl`).

Two kernels and a reduction serve every DWA path (pretrain/model/dwa_impl.py chooses them):

- `weighted_sum`: out = base + sum_i w_i t_i (+ w_live live), and with `dot_with` also
  a_i = <t_i, dot_with>. Reads each t_i, live, base and dot_with once and writes out once:
  m + 1 tensors for a DWA over m stored X_j (the pairwise floor's count), m + 3 for the
  buffered backward of X_j (its m readers' output gradients, X_j, the upstream gradient;
  writes dX_j). The buffered forward, the buffered backward and decoding use it.
- `scaled_copies`: o_i = w_i g and a_i = <x_i, g>, the backward of a DWA over separate
  tensors (the custom op of pretrain/model/dwa_op.py): reads g and each x_i once, writes
  each o_i once.

Inputs may be fp32 or bf16 (`model.dwa_dtype`); every product and sum is in fp32 registers,
results are in the weights' dtype (the residual stream's). One program handles BLOCK
elements of every input, so the m terms are a tuple of pointers (up to GROUP per launch;
longer sums chain launches through `base`). The dot products are first summed per program
into a (m, programs) table, then each row in program order by `_sum_rows`: the same
inputs give the same bits on every run (no atomics).

On a machine without a GPU, Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported) runs these kernels on CPU tensors; the tests do that.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements of each input per program
GROUP = 16  # terms per launch: one compiled kernel serves every sum up to it
ROW_BLOCK = 512  # partial dot products summed per step of `_sum_rows`


@triton.jit
def _weighted_sum(terms, m, w_ptr, live_ptr, live_w_ptr, base_ptr, dot_ptr, out_ptr,
                  partial_ptr, n, n_programs, HAS_LIVE: tl.constexpr, HAS_BASE: tl.constexpr,
                  HAS_DOT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_BASE:
        acc += tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_LIVE:
        acc += tl.load(live_w_ptr).to(tl.float32) * \
            tl.load(live_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DOT:
        other = tl.load(dot_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for i in tl.static_range(len(terms)):
        if i < m:  # the tuple is padded to GROUP so that one compiled kernel serves all m
            t = tl.load(terms[i] + offs, mask=mask, other=0.0).to(tl.float32)
            acc += tl.load(w_ptr + i).to(tl.float32) * t
            if HAS_DOT:
                tl.store(partial_ptr + i * n_programs + pid, tl.sum(t * other, axis=0))
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scaled_copies(xs, outs, m, w_ptr, g_ptr, partial_ptr, n, n_programs,
                   BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for i in tl.static_range(len(xs)):
        if i < m:
            w = tl.load(w_ptr + i).to(tl.float32)
            tl.store(outs[i] + offs, (w * g).to(outs[i].dtype.element_ty), mask=mask)
            x = tl.load(xs[i] + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(partial_ptr + i * n_programs + pid, tl.sum(x * g, axis=0))


@triton.jit
def _sum_rows(partial_ptr, out_ptr, n_programs, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_programs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + row * n_programs + offs, mask=offs < n_programs,
                       other=0.0)
    tl.store(out_ptr + row, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty))


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)  # a view of the contiguous tensors the DWAs hold


def _padded(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """`tensors` padded to GROUP with its first (the kernels never touch the padding)."""
    return tuple(tensors) + (tensors[0],) * (GROUP - len(tensors))


def _row_sums(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """partial (m, programs) summed along each row, in program order, in `dtype`."""
    out = torch.empty(partial.shape[0], dtype=dtype, device=partial.device)
    _sum_rows[(partial.shape[0],)](partial, out, partial.shape[1], BLOCK=ROW_BLOCK)
    return out


def weighted_sum(terms: Sequence[torch.Tensor], weights: torch.Tensor,
                 live: torch.Tensor | None = None, base: torch.Tensor | None = None,
                 dot_with: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(base + sum_i weights[i] terms[i] + weights[m] live, <terms[i], dot_with> for each i or
    None) for m = len(terms) tensors of n elements: flat, in `weights`' dtype. `weights`
    holds m (+ 1 with `live`) entries; the inputs may be of any float dtype."""
    terms = [_flat(t) for t in terms]
    m, n = len(terms), (terms[0] if terms else live).numel()
    weights = weights.contiguous()
    if weights.numel() != m + (live is not None):
        raise ValueError(f"{m} terms{' and live' if live is not None else ''} need "
                         f"{m + (live is not None)} weights, got {weights.numel()}")
    out = torch.empty(n, dtype=weights.dtype, device=weights.device)
    n_programs = triton.cdiv(n, BLOCK)
    partial = None if dot_with is None else torch.empty(
        (max(m, 1), n_programs), dtype=torch.float32, device=out.device)
    live, base, other = (None if t is None else _flat(t) for t in (live, base, dot_with))
    for start in range(0, max(m, 1), GROUP):
        chunk = terms[start:start + GROUP]
        with_live = start == 0 and live is not None
        chunk_base = base if start == 0 else out  # later launches add to the sum so far
        # (a pointer the kernel does not read is passed as `out`)
        _weighted_sum[(n_programs,)](
            _padded(chunk or [live]), len(chunk), weights[start:],
            live if with_live else out, weights[m:] if with_live else weights,
            out if chunk_base is None else chunk_base, out if other is None else other,
            out, out if partial is None else partial[start:], n, n_programs,
            HAS_LIVE=with_live, HAS_BASE=chunk_base is not None, HAS_DOT=other is not None,
            BLOCK=BLOCK)
    dots = None if partial is None else _row_sums(partial[:m], weights.dtype)
    return out, dots


def scaled_copies(xs: Sequence[torch.Tensor], weights: torch.Tensor, grad: torch.Tensor
                  ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """([weights[i] grad, each in xs[i]'s dtype and shape], <xs[i], grad> for each i in
    `weights`' dtype): the gradients of sum_i weights[i] xs[i] given its gradient `grad`."""
    flat = [_flat(x) for x in xs]
    g, weights = _flat(grad), weights.contiguous()
    n, m = g.numel(), len(flat)
    n_programs = triton.cdiv(n, BLOCK)
    outs = [torch.empty_like(x) for x in flat]
    partial = torch.empty((m, n_programs), dtype=torch.float32, device=g.device)
    for start in range(0, m, GROUP):
        stop = min(start + GROUP, m)
        _scaled_copies[(n_programs,)](
            _padded(flat[start:stop]), _padded(outs[start:stop]), stop - start,
            weights[start:], g, partial[start:], n, n_programs, BLOCK=BLOCK)
    return ([o.view(x.shape) for o, x in zip(outs, xs, strict=True)],
            _row_sums(partial, weights.dtype))
