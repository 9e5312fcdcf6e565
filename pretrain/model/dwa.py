"""Depth weighted averages (DWA): the contraction Y_i = sum_{j in S_i} alpha[i, j] X_j.

Which blocks have a DWA, the S_i they read and the buffer layout below come from the model's
`DWAPattern` (pretrain/model/dwa_pattern.py, index conventions there) and its `BufferLayout`
(pretrain/model/dwa_layout.py); this file only computes. Two implementations of the same
contraction, tested against each other and a naive loop:

- buffered (`BufferedDWA`, over `StoreOutput` and `Combine`): each X_j that a later DWA reads
  is copied once into a contiguous buffer of its residue class, so S_i is a slice and a DWA
  is one matrix-vector product. In backward a DWA only files its output gradient dY_i in a
  per-class gradient buffer; when autograd reaches X_j, its whole DWA gradient
  sum_i alpha[i, j] dY_i and the alpha gradients <dY_i, X_j> on column j come from one pass
  over the rows of the DWAs that read it (`stored_output_grads`). So backward reads each
  (i, j) pair once, as forward does (docs/design.md#bytes-moved-by-the-dwas); the products
  themselves are those of `model.dwa_impl` (dwa_impl.py: Triton kernels or torch, chosen once
  per pass and kept in the buffers, so that every path runs the same ones). Autograd never
  saves (or version-checks) the buffers, so writing later slots is safe; the buffers belong
  to one forward pass, so micro-batches and activation recomputation (which rewrites
  identical values) do not interfere.
- functional (`depth_weighted_average`): one sum per DWA over separate tensors (dwa_op.py:
  a custom op for the Triton kernels), used under torch.compile, which keeps it in its
  graph.

`BufferedDWA` and `FunctionalDWA` are the connection states that the block program's
interpreter (program.py) runs in training (`training_connections` picks one per forward
pass); the states of a cached forward are in dwa_inference.py.

Storage dtype (`model.dwa_dtype`): the stored X_j, and in backward the DWAs' output-gradient
rows, may be kept in bf16 while the residual stream is fp32. Sums are always fp32, and the
diagonal term alpha[i, i] X_i of the DWA after block i uses the live X_i wherever the
forward pass has it (`live`), so that a model at initialisation (alpha = identity) still
equals the Transformer exactly and X_i's gradient through that term is exact; the alpha
gradients read the stored X_j. Where a checkpointed unit recomputes its leading DWA from
the buffers (`dwa_block`), that DWA's diagonal is read from storage too.
"""

from __future__ import annotations

import weakref

import torch

from pretrain.model.dwa_impl import dwa_ops
from pretrain.model.dwa_layout import BufferLayout
from pretrain.model.dwa_op import functional_dwa


def storage_dtype(dwa_dtype: str) -> torch.dtype | None:
    """The buffers' dtype for `model.dwa_dtype`: None (the stream's own) for fp32."""
    return {"fp32": None, "bf16": torch.bfloat16}[dwa_dtype]


def stream_precision(x: torch.Tensor):
    """No autocast inside a DWA: it mixes residual-stream tensors, kept in their own dtype
    (autocast would round the fp32 stream to bf16 in the matrix-vector product)."""
    return torch.autocast(x.device.type, enabled=False)


class _BufferPool:
    """Buffers of finished forward passes, handed to the next one. On a CPU a fresh buffer
    of many MiB comes from the OS page by page (a page fault per 4 KiB on first write: the
    copies into a new buffer ran at a quarter of memory bandwidth); CUDA's caching
    allocator reuses memory already, so only CPU buffers are pooled."""

    def __init__(self, per_shape: int = 8):
        self.free: dict[tuple, list[torch.Tensor]] = {}
        self.per_shape = per_shape

    def take(self, shape: tuple[int, ...], like: torch.Tensor,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """An uninitialised tensor on `like`'s device, in `dtype` (None: `like`'s)."""
        dtype = dtype or like.dtype
        free = self.free.get((shape, dtype, like.device))
        return free.pop() if free else like.new_empty(shape, dtype=dtype)

    def give_back(self, *groups: dict[int, torch.Tensor]) -> None:
        for tensor in (t for group in groups for t in group.values()):
            if tensor.device.type == "cpu":
                free = self.free.setdefault((tuple(tensor.shape), tensor.dtype, tensor.device),
                                            [])
                if len(free) < self.per_shape:
                    free.append(tensor)


_POOL = _BufferPool()


class DWABuffers:
    """One forward pass's stored X_j (per class, contiguous) and, in backward, the DWAs'
    output gradients (per class, one row per DWA); `ops` compute on them (dwa_impl.py)."""

    def __init__(self, layout: BufferLayout, alpha: torch.Tensor, like: torch.Tensor,
                 storage_dtype: torch.dtype | None = None, impl: str = "auto"):
        self.layout = layout
        self.ops = dwa_ops(impl, like.device)
        # alpha as this forward pass applies it (one small copy, in the stream's dtype).
        self.alpha = alpha.detach().to(like.dtype, copy=True)
        self.values = {r: _POOL.take((n, *like.shape), like, storage_dtype)
                       for r, n in layout.class_sizes.items()}
        self.output_grads: dict[int, torch.Tensor] = {}
        # Consumers whose diagonal term took the live X_c (its gradient went there).
        self.live_diagonal: set[int] = set()
        # Back to the pool once autograd has freed the graph that holds this object.
        weakref.finalize(self, _POOL.give_back, self.values, self.output_grads)
        self.unfilled: dict[int, set[int]] = {}  # rows whose DWA has had no gradient (yet)
        self.copy_grads: dict[int, torch.Tensor] = {}  # j -> gradient of ReadStored copies

    def file_output_grad(self, c: int, grad: torch.Tensor) -> None:
        """Keep consumer c's output gradient for the X_j it read."""
        r, row = self.layout.row[c]
        if r not in self.output_grads:
            rows = self.layout.class_rows[r]
            self.output_grads[r] = _POOL.take((rows, self.values[r][0].numel()), self.values[r])
            self.unfilled[r] = set(range(rows))
        self.output_grads[r][row].copy_(grad.reshape(-1))  # rounded to the storage dtype
        self.unfilled[r].discard(row)

    def reader_grads(self, j: int) -> torch.Tensor | None:
        """(readers of X_j, numel): their output gradients, zero for a reader that got none;
        None when no DWA of the class got one."""
        r, start, stop = self.layout.readers[j]
        grads = self.output_grads.get(r)
        if grads is None:
            return None
        for row in sorted(self.unfilled[r] & set(range(start, stop))):
            grads[row].zero_()  # its output did not reach the loss
            self.unfilled[r].discard(row)
        return grads[start:stop]


    def reads_own_output(self, c: int) -> bool:
        """Whether consumer c's last input is X_c (the diagonal term of the DWA after c)."""
        r, _, stop = self.layout.reads[c]
        return self.layout.slot.get(c) == (r, stop - 1)

    def column_weights(self, j: int) -> torch.Tensor:
        """The alphas on X_j of its readers (contiguous), zero for a reader whose diagonal
        term took the live X_j (Combine gave X_j that gradient already)."""
        weights = self.alpha[self.layout.column_index[j]].contiguous()
        if j in self.live_diagonal:
            r, start, _ = self.layout.readers[j]
            weights[self.layout.row[j][1] - start] = 0
        return weights


class StoreOutput(torch.autograd.Function):
    """Identity on X_j that also copies it into its buffer slot. In backward (after every DWA
    that reads X_j: they consume this output) it adds sum_i alpha[i, j] dY_i to X_j's
    gradient and returns the gradients of those alphas."""

    @staticmethod
    def forward(ctx, x, alpha, buffers: DWABuffers, j: int):
        r, position = buffers.layout.slot[j]
        buffers.values[r][position].copy_(x)
        ctx.set_materialize_grads(False)
        ctx.buffers, ctx.j, ctx.alpha_meta = buffers, j, (alpha.shape, alpha.dtype)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        buffers, j = ctx.buffers, ctx.j
        copies = buffers.copy_grads.pop(j, None)
        if copies is not None:
            grad = copies if grad is None else grad + copies
        rows = buffers.reader_grads(j)
        if rows is None:
            return grad, None, None, None
        r, position = buffers.layout.slot[j]
        x = buffers.values[r][position]
        weights = buffers.column_weights(j)
        flat = None if grad is None else grad.reshape(-1).to(weights.dtype)
        grad_x, grad_weights = buffers.ops.stored_output_grads(rows, weights, x.reshape(-1),
                                                               flat)
        shape, dtype = ctx.alpha_meta
        grad_alpha = grad_weights.new_zeros(shape, dtype=dtype)
        grad_alpha[buffers.layout.column_index[j]] = grad_weights
        return grad_x.view(x.shape), grad_alpha, None, None


class Combine(torch.autograd.Function):
    """Y_c = sum_n alpha[c, j_n] values[r][start + n]: one matrix-vector product over the
    slice of the buffer consumer c reads; in backward it only files dY_c (StoreOutput turns
    it into the gradients of the X_j and of the alphas).

    `live`: X_c itself (or None) when c reads X_c from a buffer of another dtype; its term is
    then alpha[c, c] live, and its gradient alpha[c, c] dY_c goes straight to `live`.
    `stored` are the StoreOutput results for S_c: passed only so that autograd runs this
    backward before theirs; their gradient goes through the gradient buffer instead."""

    @staticmethod
    def forward(ctx, alpha, buffers: DWABuffers, c: int, live, *stored):
        r, start, stop = buffers.layout.reads[c]
        ctx.buffers, ctx.c, ctx.n_stored = buffers, c, len(stored)
        ctx.set_materialize_grads(False)
        # A contiguous copy of the strided view (|S_c| floats): gemv is a quarter faster.
        weights = buffers.alpha[buffers.layout.weights_index[c]].contiguous()
        ctx.diagonal = None
        if live is not None:  # the last weight goes to `live` instead of the stored X_c
            ctx.diagonal = weights[-1]
            buffers.live_diagonal.add(c)
            stop -= 1
        values = buffers.values[r]
        with stream_precision(values):
            y = buffers.ops.weighted_rows(values[start:stop].flatten(1), weights, live)
            return y.view(values.shape[1:])

    @staticmethod
    def backward(ctx, grad_y):
        grad_live = None
        if grad_y is not None:
            ctx.buffers.file_output_grad(ctx.c, grad_y)
            if ctx.diagonal is not None:
                grad_live = grad_y * ctx.diagonal
        return (None, None, None, grad_live) + (None,) * ctx.n_stored


class ReadStored(torch.autograd.Function):
    """A fresh copy of the buffered X_j, in the stream's dtype (activation checkpointing
    reads a unit's input back); its gradient joins X_j's in StoreOutput. `handle` orders
    autograd as in Combine."""

    @staticmethod
    def forward(ctx, buffers: DWABuffers, j: int, handle):
        r, position = buffers.layout.slot[j]
        ctx.buffers, ctx.j = buffers, j
        ctx.set_materialize_grads(False)
        return buffers.values[r][position].to(buffers.alpha.dtype, copy=True)  # stream dtype

    @staticmethod
    def backward(ctx, grad):
        if grad is not None:
            copies = ctx.buffers.copy_grads
            copies[ctx.j] = grad if ctx.j not in copies else copies[ctx.j] + grad
        return None, None, None


class BufferedDWA:
    """The buffered DWAs of one forward pass: `store` each X_j as it is made (a consumer
    reads it from the buffer), `combine` each consumer when its inputs are all stored.
    `storage_dtype`: the buffers' dtype (None: the stream's, `like`'s); `impl`: whose
    products (`model.dwa_impl`, resolved for `like`'s device)."""

    def __init__(self, layout: BufferLayout, alpha: torch.Tensor, like: torch.Tensor,
                 storage_dtype: torch.dtype | None = None, impl: str = "auto"):
        self.layout, self.alpha = layout, alpha
        self.buffers = DWABuffers(layout, alpha, like, storage_dtype, impl)

    def store(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """X_j, through StoreOutput if some consumer reads it."""
        if j not in self.layout.slot:
            return x
        return StoreOutput.apply(x, self.alpha, self.buffers, j)

    def combine(self, c: int, stored: list[torch.Tensor], live: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Consumer c's sum over its X_j (`stored`: their `store` results, or handles).
        `live`: X_c as the forward pass holds it, when it does; with a storage dtype other
        than the stream's, the diagonal term takes it (see the module docstring)."""
        buffers = self.buffers
        if live is not None and (live.dtype == buffers.values[buffers.layout.reads[c][0]].dtype
                                 or not buffers.reads_own_output(c)):
            live = None
        return Combine.apply(self.alpha, buffers, c, live, *stored)

    def read_stored(self, j: int, handle: torch.Tensor) -> torch.Tensor:
        """A copy of the stored X_j (`handle`: its `store` result, or a stand-in)."""
        return ReadStored.apply(self.buffers, j, handle)

    # The connection state of a block program (pretrain/model/program.py `Connections`).

    def hold(self, j: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """X_j through `store`: the stream and the DWAs that read it take the result."""
        x = self.store(j, x)
        return x, x

    def mix(self, source, handles: list[torch.Tensor], live: torch.Tensor | None
            ) -> torch.Tensor:
        """The terms of a `dwa` source (consumer `source.index` of the layout)."""
        return self.combine(source.index, handles, live)


def depth_weighted_average(weights: torch.Tensor, xs: list[torch.Tensor],
                           storage_dtype: torch.dtype | None = None, diagonal: bool = False,
                           impl: str = "auto") -> torch.Tensor:
    """sum_n weights[n] * xs[n] (weights: 1-D, one per input; inputs of equal shape), in the
    dtype of the last input, running `impl`'s products (dwa_op.py: the custom op
    `denseformer::dwa_sum` for the Triton kernels). With a `storage_dtype`, each input is
    first rounded to it, as the buffered DWA stores it, except the last when it is the
    `diagonal` term X_i."""
    dtype = xs[-1].dtype
    if storage_dtype is not None and storage_dtype != dtype:
        live = xs[-1:] if diagonal else []
        xs = [x.to(storage_dtype) for x in xs[:len(xs) - len(live)]] + live
    with stream_precision(xs[-1]):
        return functional_dwa(xs, weights.to(dtype), impl)


class FunctionalDWA:
    """The DWAs of one forward pass as `depth_weighted_average` over the X_j themselves (the
    connection state a block program runs under torch.compile, which keeps each DWA in its
    graph); the same function as `BufferedDWA`."""

    def __init__(self, alpha: torch.Tensor | None, storage_dtype: torch.dtype | None = None,
                 impl: str = "auto"):
        self.alpha, self.storage_dtype, self.impl = alpha, storage_dtype, impl

    def hold(self, j: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x

    def mix(self, source, handles: list[torch.Tensor], live: torch.Tensor | None
            ) -> torch.Tensor:
        """alpha[c, j] X_j summed over the terms j of a `dwa` source of consumer c."""
        return depth_weighted_average(self.alpha[source.alpha_index], handles,
                                      self.storage_dtype, diagonal=source.terms[-1] == source.index,
                                      impl=self.impl)


def training_connections(layout: BufferLayout, alpha: torch.Tensor | None, like: torch.Tensor,
                         functional: bool, storage_dtype: torch.dtype | None = None,
                         impl: str = "auto") -> BufferedDWA | FunctionalDWA:
    """The connection state of one training forward pass: buffered (eager) unless
    `functional` (under torch.compile) or no DWA reads a stored X_j."""
    if functional or not layout.slot:
        return FunctionalDWA(alpha, storage_dtype, impl)
    return BufferedDWA(layout, alpha, like, storage_dtype, impl)
