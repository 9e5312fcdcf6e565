"""The Attention Residuals mix in two phases (the paper's section 4.1), for the training and
inference forward alike: what `AttnResConnections` (pretrain/model/attnres.py) runs.

Every consumer of one group reads the same completed group sums C = (X_0, X_S, ...,
X_{(g-1)S}) and, past the group's first sub-layer, its own partial sum p. So:

1. `group_prefix`: once per group, when its first consumer is mixed, all S consumers'
   softmax over C at once: for consumer k the weighted mean o_k = sum_j a_kj X_j and the
   log-sum-exp of its logits, lse_k. The sources are stacked once, token-major (T, g, H), so
   the logits are one matrix product and the S weighted means one batched product, instead
   of S passes over the stacked sources.
2. `merge_partial`: per consumer, the softmax over (o_k as a source with logit lse_k) and p,
   which is exact: h = w o_k + (1 - w) p, w = sigmoid(lse_k - s_p).

Full AttnRes is the case S = 1: phase 1 is the whole mix and phase 2 never runs.

A pipeline stage that receives consumer states (o, lse) over the sources before its
boundary (pretrain/model/attnres_program.py) folds its own completed sums in with
`merge_states`, the same merge over two prefixes.
"""

from __future__ import annotations

import functools

import torch


def _without_autocast(method):
    """An autograd Function's forward or backward with autocast off: the mix's arithmetic is
    fp32 (at least) in an autocast region too, where its matmuls would otherwise run in bf16
    and hand bf16 weighted means to the fp32 mix."""

    @functools.wraps(method)
    def run(ctx, *args):
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        with torch.autocast(device, enabled=False):
            return method(ctx, *args)

    return run


def _compute_dtype(xs) -> torch.dtype:
    """fp32 at least (bf16 branch outputs under autocast meet an fp32 embedding)."""
    return functools.reduce(torch.promote_types, (x.dtype for x in xs), torch.float32)


def token_major(xs) -> torch.Tensor:
    """The sources as one (T, g, H) tensor, T every leading dim, in the compute dtype."""
    dtype = _compute_dtype(xs)
    return torch.stack([x.to(dtype).reshape(-1, x.shape[-1]) for x in xs], dim=1)


def mix_logits(v: torch.Tensor, queries: torch.Tensor, eps: float):
    """(s, r) for sources v (T, g, H) and queries (S, H): s (T, g, S) = r (q . X), r (T, g)."""
    t, g, width = v.shape
    r = torch.rsqrt(torch.linalg.vector_norm(v, dim=-1).square() / width + eps)
    s = (v.reshape(t * g, width) @ queries.to(v.dtype).T).reshape(t, g, -1)
    return s * r.unsqueeze(-1), r


class _GroupPrefix(torch.autograd.Function):
    """o_1..o_S (each (T, H), the weighted means over the g sources) and lse_1..lse_S (each
    (T,)), as separate outputs so that each consumer's gradient arrives alone (a slice of
    one output would be padded to the whole). Saves the sources (which the program holds
    anyway) and (T, g, S) scalars, never the stack."""

    @staticmethod
    @_without_autocast
    def forward(ctx, queries: torch.Tensor, eps: float, *xs: torch.Tensor):
        v = token_major(xs)
        s, r = mix_logits(v, queries, eps)
        lse = torch.logsumexp(s, dim=1)  # (T, S)
        a = torch.exp(s - lse.unsqueeze(1))  # (T, g, S)
        o = torch.bmm(a.transpose(1, 2), v).transpose(0, 1)  # (S, T, H) view
        ctx.save_for_backward(queries, a, r, s, *xs)
        ctx.set_materialize_grads(False)
        return (*o.unbind(0), *lse.T.unbind(0))

    @staticmethod
    @_without_autocast
    def backward(ctx, *grads: torch.Tensor | None):
        queries, a, r, s, *xs = ctx.saved_tensors
        v = token_major(xs)
        t, g, width = v.shape
        n_out = a.shape[2]
        do = _stacked_grads(grads[:n_out], (t, width), v)
        dlse = _stacked_grads(grads[n_out:], (t,), v)
        dot = torch.bmm(v, do.transpose(1, 2))  # (T, g, S): X_j . do_k
        ds = a * (dot - (a * dot).sum(1, keepdim=True) + dlse.unsqueeze(1))
        dsr = ds * r.unsqueeze(-1)
        dqueries = None
        if ctx.needs_input_grad[0]:
            dqueries = (dsr.reshape(t * g, -1).T @ v.reshape(t * g, width)).to(queries.dtype)
        # dX_j = sum_k [a_jk do_k + ds_jk (r_j q_k - s_jk r_j^2 X_j / H)]
        coef = -(dsr * s).sum(-1) * r / width  # (T, g)
        dv = v.mul_(coef.unsqueeze(-1))
        dv.baddbmm_(a, do)
        dv.view(t * g, width).addmm_(dsr.reshape(t * g, -1), queries.to(v.dtype))
        return (dqueries, None, *(dv[:, n].reshape(x.shape).to(x.dtype)
                                  if ctx.needs_input_grad[2 + n] else None
                                  for n, x in enumerate(xs)))


def _stacked_grads(grads, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """The outputs' gradients as one (T, S, ...) tensor, zeros for those that got none."""
    return torch.stack([like.new_zeros(shape) if g is None else g.to(like.dtype).reshape(shape)
                        for g in grads], dim=1)


def group_prefix(queries: torch.Tensor, xs: list[torch.Tensor], eps: float):
    """Phase 1 for the S consumers with effective queries `queries` (S, H) over the sources
    `xs` (each (..., H)): a list of (o_k (T, H), lse_k (T,)), T the tokens."""
    outputs = _GroupPrefix.apply(queries, eps, *xs)
    n = queries.shape[0]
    return list(zip(outputs[:n], outputs[n:], strict=True))


class _MergePartial(torch.autograd.Function):
    """h = p + w (o - p), w = sigmoid(lse - s_p), s_p = r_p (q . p): the softmax over the
    prefix (o, lse) and p. Saves p and h (alive anyway: the program holds p, and h is the
    branch's input, which its norm saves) and per-token scalars; never o, so a group's
    prefix outputs are freed once its consumers have merged."""

    @staticmethod
    @_without_autocast
    def forward(ctx, o, lse, p, query, eps):
        flat = p.to(_compute_dtype((p, o))).reshape(-1, p.shape[-1])
        width = flat.shape[-1]
        r = torch.rsqrt(torch.linalg.vector_norm(flat, dim=-1).square() / width + eps)
        sp = (flat @ query.to(flat.dtype)) * r
        w = torch.sigmoid(lse.to(flat.dtype) - sp)
        h = torch.lerp(flat, o.to(flat.dtype), w.unsqueeze(-1))
        ctx.save_for_backward(h, p, query, w, r, sp)
        ctx.o_dtype = o.dtype
        return h.reshape(p.shape)

    @staticmethod
    @_without_autocast
    def backward(ctx, dh):
        h, p, query, w, r, sp = ctx.saved_tensors
        flat = p.to(w.dtype).reshape(-1, p.shape[-1])
        dh = dh.to(w.dtype).reshape(flat.shape)
        width = flat.shape[-1]
        # dz = w (1 - w) dh . (o - p) = (1 - w) dh . (h - p): no need to keep o.
        dz = (torch.linalg.vecdot(dh, h) - torch.linalg.vecdot(dh, flat)) * (1 - w)
        dsr = -dz * r  # d s_p, times r
        do = (dh * w.unsqueeze(-1)).to(ctx.o_dtype)
        # dp = (1 - w) dh + ds_p (r q - s_p r^2 p / H)
        dp = flat * (-dsr * sp * r / width).unsqueeze(-1)
        dp.addcmul_((1 - w).unsqueeze(-1), dh).addcmul_(dsr.unsqueeze(-1), query.to(w.dtype))
        dq = (dsr @ flat).to(query.dtype) if ctx.needs_input_grad[3] else None
        return do, dz, dp.reshape(p.shape).to(p.dtype), dq, None


def merge_partial(o: torch.Tensor, lse: torch.Tensor, p: torch.Tensor, query: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """Phase 2: the softmax over a prefix (weighted mean `o` (T, H) with log-sum-exp `lse`
    (T,)) and one more source `p` (..., H) for `query` (H,): h in p's shape, in the dtype
    of p and o promoted."""
    h = _MergePartial.apply(o, lse, p, query, eps)
    return h.to(torch.promote_types(p.dtype, o.dtype))


def merge_states(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax state over two disjoint sets of sources from each one's (weighted mean
    (T, H), log-sum-exp (T,)): the online-softmax merge, o = o2 + w (o1 - o2) with
    w = sigmoid(lse1 - lse2) (merge_partial's form, with a whole state in place of one
    source), lse = logaddexp(lse1, lse2). Plain autograd ops: a pipeline stage merges each
    received consumer state once, and the gradients flow back through both states."""
    dtype = _compute_dtype((o1, o2))
    lse1, lse2 = lse1.to(dtype), lse2.to(dtype)
    w = torch.sigmoid(lse1 - lse2).unsqueeze(-1)
    return torch.lerp(o2.to(dtype), o1.to(dtype), w), torch.logaddexp(lse1, lse2)
