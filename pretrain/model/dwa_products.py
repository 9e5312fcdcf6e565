"""The buffered DWA's matrix-vector products, with the choice of path made in one place.

A buffered DWA (pretrain/model/dwa.py) is three products over rows of one buffer:

    forward   y = V^T w                 V (m, n): the stored X_j a DWA reads, w: its alphas
    backward  g = grad + R^T w          R (m, n): the output gradients of the DWAs that read
              a = R x                             X_j, w: their alphas on X_j, x: X_j

V, R and x are in the storage dtype (`model.dwa_dtype`: fp32 or bf16); the results and every
sum are in the residual stream's dtype (fp32 on every path: accumulation never happens in
bf16). Two paths compute the same values:

- `chunked` (the CPU's): the backward reads R in column chunks of at most 4 MiB, so a chunk
  is still in cache (a quarter of a 32 MiB L3) when the second product reads it again, and a
  bf16 chunk is widened to fp32 there, in cache.
- `one_pass` (every other device): one kernel per product. A GPU keeps nothing in cache
  between two kernels, and each chunk costs two kernel launches: at the paper's 48 x 768
  shape the chunks were some 15,000 launches a step. bf16 products use the `out_dtype`
  overload of `torch.mm` (bf16 inputs, fp32 accumulation and result) where this torch has it
  for the device, and widen to fp32 otherwise.

`contraction_path` picks the path from the device; `forced_contraction` overrides it (tests
pin how many ops each path issues per stored X_j on the CPU).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

CHUNKED, ONE_PASS = "chunked", "one_pass"
PATHS = (CHUNKED, ONE_PASS)
_CHUNK_BYTES = 4 << 20
_forced: str | None = None


def contraction_path(device: torch.device) -> str:
    """`chunked` on a CPU, `one_pass` elsewhere (or what `forced_contraction` set)."""
    if _forced is not None:
        return _forced
    return CHUNKED if device.type == "cpu" else ONE_PASS


@contextmanager
def forced_contraction(path: str) -> Iterator[None]:
    """Use `path` on every device inside the block."""
    global _forced
    if path not in PATHS:
        raise ValueError(f"contraction path must be one of {PATHS}, got {path!r}")
    before, _forced = _forced, path
    try:
        yield
    finally:
        _forced = before


def _has_out_dtype_mm(device: torch.device) -> bool:
    """Whether `torch.mm(..., out_dtype=torch.float32)` runs on bf16 inputs here (CUDA)."""
    return device.type == "cuda" and hasattr(torch.ops.aten.mm, "dtype")


def _matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b (2-D) with `out_dtype` result and accumulation, from inputs in a's dtype."""
    if a.dtype == out_dtype:
        return a @ b.to(out_dtype)
    if _has_out_dtype_mm(a.device):
        return torch.mm(a, b.to(a.dtype), out_dtype=out_dtype)
    return a.to(out_dtype) @ b.to(out_dtype)


def weighted_rows(values: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype
                  ) -> torch.Tensor:
    """values^T weights (n,) for values (m, n) in storage dtype and weights (m,) in
    `out_dtype`, the result's."""
    if values.dtype == out_dtype:  # one gemv on the transposed rows (a quarter faster)
        return torch.mv(values.t(), weights)
    if contraction_path(values.device) == CHUNKED:
        m, n = values.shape
        out = values.new_empty(n, dtype=out_dtype)
        step = _chunk_columns(m, out_dtype)
        for start in range(0, n, step):
            torch.mv(values[:, start:start + step].t().to(out_dtype), weights,
                     out=out[start:start + step])
        return out
    return _matmul(values.t(), weights[:, None], out_dtype)[:, 0]


def _chunk_columns(m: int, dtype: torch.dtype) -> int:
    return max(1024, _CHUNK_BYTES // (m * dtype.itemsize))


def stored_output_grads(rows: torch.Tensor, weights: torch.Tensor, x: torch.Tensor,
                        grad: torch.Tensor | None, chunk: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad + rows^T weights, rows x) for rows (m, n) and x (n,) in storage dtype, weights
    (m,) and grad (n,) in the stream's: X_j's gradient and the gradients of its m alphas,
    both in weights' dtype. `chunk`: columns per chunk on the chunked path, for tests."""
    dtype = weights.dtype
    if contraction_path(rows.device) == ONE_PASS and rows.dtype == dtype:
        grad_x = (torch.mv(rows.t(), weights) if grad is None
                  else torch.addmv(grad, rows.t(), weights))
        return grad_x, torch.mv(rows, x)
    if contraction_path(rows.device) == ONE_PASS:
        grad_x = _matmul(rows.t(), weights[:, None], dtype)[:, 0]
        if grad is not None:
            grad_x.add_(grad)
        return grad_x, _matmul(rows, x[:, None], dtype)[:, 0]
    m, n = rows.shape
    out = torch.empty(n, dtype=dtype, device=rows.device)
    grad_weights = torch.zeros(m, dtype=dtype, device=rows.device)
    step = chunk or _chunk_columns(m, rows.dtype)
    for start in range(0, n, step):
        cols = slice(start, start + step)
        part, x_part = rows[:, cols], x[cols]
        if rows.dtype != dtype:  # widened in cache
            part, x_part = part.to(dtype), x_part.to(dtype)
        if grad is None:
            torch.mv(part.t(), weights, out=out[cols])
        else:
            torch.addmv(grad[cols], part.t(), weights, out=out[cols])
        grad_weights.addmv_(part, x_part)
    return out, grad_weights
