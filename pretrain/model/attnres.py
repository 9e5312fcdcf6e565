"""Attention Residuals (Kimi Team, arXiv 2603.15031): each sub-layer's input is a softmax
over earlier sub-layer outputs, weighted per token by a learned query against the outputs
normalised by RMSNorm (docs/connections.md#attention-residuals has the equations).

With the conventions of attnres_layout.py (sub-layers 1..L, consumers 1..L + 1, X_j the
held running sums), consumer c forms

    h_c = sum_{j in sources(c)} a_{c,j} X_j,   a_{c,.} = softmax_j(w_c . (g_c * X_j / rms(X_j)))

with w_c its query (zeros at init, so every a_{c,.} is uniform and, the sub-layers being
pre-norm, the model equals the Transformer up to the norms' eps) and g_c its key norm's
weight (ones at init). `w_c * g_c` is one effective query, so each source's key costs one
dot product and its RMS.

Here: the model's parameters (`AttnResWeights`), the mix as one autograd function over the
stacked sources (`depth_softmax`: stacks them for the forward and again for the backward,
and saves only the sources themselves, which the program holds anyway, plus per-token
scalars), the connection state that the block program's interpreter runs
(`AttnResConnections`, pretrain/model/program.py), and the program of blocks first..last.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from pretrain.model.attnres_layout import AttnResLayout
from pretrain.model.attnres_mix import group_prefix, merge_partial
from pretrain.model.program import Item, Source, StageProgram, Step

QUERY, KEY_NORM = "attnres_query", "attnres_key_norm"  # parameter names (init, optimizer)


class AttnResWeights:
    """The queries and key-norm weights of every consumer, one (L + 1, H) matrix each,
    replicated on every rank (a pipeline stage uses its consumers' rows)."""

    def __init__(self, layout: AttnResLayout, d_model: int):
        self.layout, self.d_model = layout, d_model

    def new_parameters(self) -> tuple[nn.Parameter, nn.Parameter]:
        shape = (self.layout.n_sublayers + 1, self.d_model)
        return nn.Parameter(torch.zeros(shape)), nn.Parameter(torch.ones(shape))


def _stacked(xs) -> torch.Tensor:
    """The sources as one (n, T, H) tensor (T: every leading dim), in fp32 at least (bf16
    branch outputs under autocast meet an fp32 embedding)."""
    dtype = functools.reduce(torch.promote_types, (x.dtype for x in xs), torch.float32)
    return torch.stack([x.to(dtype).reshape(-1, x.shape[-1]) for x in xs])


def _logits(v: torch.Tensor, q: torch.Tensor, eps: float):
    """(s, r): the logits r_j (q . X_j) and r_j = rsqrt(mean(X_j^2) + eps), each (n, T)."""
    width = v.shape[-1]
    r = torch.rsqrt(torch.linalg.vector_norm(v, dim=-1).square() / width + eps)
    return (v @ q.to(v.dtype)) * r, r


class _DepthSoftmax(torch.autograd.Function):
    """h = sum_j a_j X_j, a = softmax_j(r_j (q . X_j)), r_j = rsqrt(mean(X_j^2) + eps); the
    arithmetic in fp32 (fp64 for fp64 sources), the result in the sources' dtype. Every
    op reads the stacked sources whole (a matrix-vector product, a norm, one weighted sum),
    and the backward writes the sources' gradients with in-place updates, no further
    hidden-size temporaries."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, eps: float, *xs: torch.Tensor) -> torch.Tensor:
        v = _stacked(xs)  # freed on return
        s, r = _logits(v, q, eps)
        a = torch.softmax(s, dim=0)
        h = (a.unsqueeze(-1) * v).sum(0)
        ctx.save_for_backward(q, a, r, s, *xs)
        dtype = functools.reduce(torch.promote_types, (x.dtype for x in xs))
        return h.to(dtype).reshape(xs[0].shape)

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        q, a, r, s, *xs = ctx.saved_tensors
        v = _stacked(xs)
        dh = dh.to(v.dtype).reshape(v.shape[1:])
        da = torch.linalg.vecdot(v, dh)
        ds = a * (da - (a * da).sum(0, keepdim=True))
        dsr = ds * r
        dq = None
        if ctx.needs_input_grad[0]:
            dq = (dsr.reshape(1, -1) @ v.reshape(-1, v.shape[-1])).reshape(q.shape).to(q.dtype)
        # dX_j = a_j dh + ds_j (r_j q - s_j r_j^2 X_j / H), built in v's storage.
        dv = v.mul_((dsr * s * r / -v.shape[-1]).unsqueeze(-1))
        dv.addcmul_(a.unsqueeze(-1), dh).addcmul_(dsr.unsqueeze(-1), q.to(v.dtype))
        return (dq, None, *(dv[n].reshape(x.shape).to(x.dtype) if ctx.needs_input_grad[2 + n]
                            else None for n, x in enumerate(xs)))


def depth_softmax(query: torch.Tensor, xs: list[torch.Tensor], eps: float) -> torch.Tensor:
    """The AttnRes mix of the sources `xs` (each (..., H)) for the effective query (H,)."""
    return _DepthSoftmax.apply(query, eps, *xs)


def depth_weights(query: torch.Tensor, xs: list[torch.Tensor], eps: float) -> torch.Tensor:
    """The softmax weights a_j of `depth_softmax` (n, ...), for analysis (no gradient)."""
    with torch.no_grad():
        s, _ = _logits(_stacked(xs), query, eps)
        return torch.softmax(s, dim=0).reshape(len(xs), *xs[0].shape[:-1])


class AttnResConnections:
    """The connection state of a forward pass (training or cached inference alike: the mix
    is per token, so a decoding step needs nothing from earlier tokens but the KV cache).

    The mix runs in two phases (pretrain/model/attnres_mix.py): the softmax over a group's
    completed sums for a span of its consumers at once (`prefix`, made when the span's
    first consumer is mixed, from that consumer's handles), then each consumer merges its
    own partial sum. A span ends at the group's last consumer or at `last`, whichever comes
    first (never before the consumer itself): a checkpoint unit runs on a state `within`
    its own consumers, so no prefix made inside a unit is read outside it, and a recomputed
    unit makes the same prefixes again (parallel/strategies/checkpointing.py).
    `record`: a dict that gets each consumer's weights over its sources (analysis)."""

    def __init__(self, query: torch.Tensor, key_norm: torch.Tensor, eps: float,
                 layout: AttnResLayout, record: dict | None = None, last: int | None = None):
        self.queries = query * key_norm  # (L + 1, H): w_c * g_c
        self.eps, self.layout, self.record = eps, layout, record
        self.last = layout.n_sublayers + 1 if last is None else last
        self.prefix: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # c -> (o_c, lse_c)

    def within(self, last: int) -> AttnResConnections:
        """A state of the same pass (the same queries) whose prefix spans end by consumer
        `last` (0: one consumer each)."""
        state = copy.copy(self)
        state.last, state.prefix = last, {}
        return state

    def hold(self, j: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x

    def mix(self, source: Source, handles: list, live: torch.Tensor | None) -> torch.Tensor:
        c, size = source.index, self.layout.group
        if self.record is not None:
            self.record[c] = depth_weights(self.queries[c - 1], handles, self.eps)
        first = (c - 1) // size * size  # the group's X_j: its consumers are first + 1..
        partial = c - 1 != first  # the sources end with the partial sum X_{c-1}
        if c not in self.prefix:
            end = max(c, min(first + size, self.last, self.layout.n_sublayers + 1))
            completed = handles[:-1] if partial else handles
            spans = group_prefix(self.queries[c - 1:end], completed, self.eps)
            self.prefix.update(zip(range(c, end + 1), spans, strict=True))
        o, lse = self.prefix.pop(c)
        # In the sources' dtype (bf16 for a bf16 module; fp32 under autocast, X_0 being fp32).
        dtype = functools.reduce(torch.promote_types, (h.dtype for h in handles))
        if not partial:  # the prefix is the mix
            return o.reshape(handles[0].shape).to(dtype)
        return merge_partial(o, lse, handles[-1], self.queries[c - 1], self.eps).to(dtype)


def boundary_items(layout: AttnResLayout, b: int) -> tuple[Item, ...]:
    """What crosses the stage boundary after block b: the X_j (j <= 2b) that a consumer
    past it reads (block AttnRes: the completed groups' sums and the open group's partial
    sum, at most N + 1)."""
    last_sub = 2 * b
    reads = {j for c in range(last_sub + 1, layout.n_sublayers + 2)
             for j in layout.sources(c) if j <= last_sub}
    return tuple(Item("x", j) for j in sorted(reads))


def attnres_program(layout: AttnResLayout, first: int = 1, last: int | None = None,
                    incoming: tuple[Item, ...] = ()) -> StageProgram:
    """The program of blocks first..last (default: the whole model), each block run as its
    two branches; a stage after the first starts from `incoming` (its `boundary_items`)
    and one before the last sends its own."""
    d = layout.n_layers
    last = d if last is None else last
    lo, hi = 2 * first - 1, 2 * last
    available = {0} if first == 1 else {item.index for item in incoming}

    def source(c: int) -> Source:
        terms = layout.sources(c)
        missing = [j for j in terms if j not in available and not lo <= j < c]
        if missing:
            raise ValueError(f"stage {first}..{last} needs X_{missing[0]}, which does not "
                             "reach it")
        return Source("attnres", c, terms=terms)

    steps = []
    for i in range(first, last + 1):
        for sub, layer in ((2 * i - 1, "attention_branch"), (2 * i, "mlp_branch")):
            steps.append(Step(i, layer, source(sub), out=sub,
                              residual=sub - 1 if layout.accumulates(sub) else None))
    if last == d:
        outgoing, sources = (), (source(hi + 1),)
    else:
        outgoing = boundary_items(layout, last)
        sources = tuple(Source("x", item.index) for item in outgoing)
    return StageProgram(first, last, d, tuple(incoming), tuple(steps), outgoing, sources)


def stage_programs(layout: AttnResLayout, stages: list[tuple[int, int]]) -> list[StageProgram]:
    """One program per stage (inclusive block ranges covering 1..d, in order)."""
    programs, incoming = [], ()
    for first, last in stages:
        program = attnres_program(layout, first, last, incoming)
        programs.append(program)
        incoming = program.outgoing
    return programs
