"""The arithmetic of Hyper-Connections on the n-stream state, per token: what `HCConnections`
(pretrain/model/hc.py) runs. The state is one tensor (..., n, H) (token-major: (B, S, n, H),
or (S, B, n, H) under sequence parallelism); every weight below is per token (..., n) or
(..., n, n), or shared by all tokens ((n,), (n, n)), and broadcasts.

- `read`: the sub-layer's input h = sum_k pre[k] X[k], one (1, n) x (n, H) product per token.
- `write`: X'[k] = sum_l M[k, l] X[l] + post[k] out, one (n, n) x (n, H) product per token
  (M is the destination-major mixing matrix: Ar^T for HC, H_res for mHC).
- `hc_dynamic`: dynamic HC's weights from the RMS-normalised streams (tanh-gated, scaled).
- `mhc_weights`: mHC's H_pre, H_post and H_res from the RMS-normalised flattened state,
  H_res projected by `sinkhorn` (doubly stochastic after the iterations, to a tolerance).

Autocast is off here (`no_autocast`): the mixes run in the state's dtype (fp32 for an fp32
module under autocast: the embedding's), the Sinkhorn iterations in fp32 at least.

Each autograd function runs the fused C kernels of hc_native.py on CPU fp32/fp64 tensors
and the same products as torch operations elsewhere (GPUs, torch.compile, no compiler);
`dynamic_read` is `hc_dynamic` and `read` as one kernel. The three gradients of a state
(its write's, its read's, its projection's) are summed in place in one `GradSlot`.
"""

from __future__ import annotations

import contextlib

import torch

from pretrain.model import hc_native


def no_autocast(x: torch.Tensor):
    """A context with autocast off on x's device type."""
    if not torch.is_autocast_enabled(x.device.type):
        return contextlib.nullcontext()
    return torch.autocast(x.device.type, enabled=False)


def streams(x0: torch.Tensor, n: int) -> torch.Tensor:
    """X_0 (..., H) copied into n streams (..., n, H): one contiguous state like every other
    (the fused kernels read contiguous states; a view of x0 would be copied by each reader)."""
    return x0.unsqueeze(-2).expand(*x0.shape[:-1], n, x0.shape[-1]).contiguous()


def _per_token(weights: torch.Tensor, state: torch.Tensor, dims: int) -> torch.Tensor:
    """Weights of `dims` trailing dims, shared ((n,), (n, n)) or per token, as (T, ...) over
    the state's T tokens in its dtype: shared ones expanded (a view), so that every product
    is one batched matmul (bmm) over the tokens (a broadcast matmul of a shared matrix is
    several times slower on the CPU); their gradient is summed back by autograd."""
    tokens = state.shape[:-2].numel()
    shape = weights.shape[-dims:]
    weights = weights.to(state.dtype).expand(*state.shape[:-2], *shape)
    return weights.reshape(tokens, *shape).contiguous()  # bmm of strided batches is slow


class GradSlot:
    """The gradient of one state X_{c-1}, summed in place by sub-layer c's functions: its
    write's backward runs first (the branch output's gradient comes from it) and starts the
    sum, its read's and its projection's add to it, and the last of them in backward order
    (`last`: "read" for static HC, else "project") returns it; the others return None for X.
    One buffer instead of autograd's sum of three (two more passes over the state); None as
    a slot (under torch.compile, which should see no Python state) gives the plain sum."""

    def __init__(self, last: str):
        self.last, self.grad = last, None

    def add(self, who: str, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Keep `grad` (the sum so far, updated in place) and return what `who` returns for X."""
        self.grad = grad
        if who != self.last:
            return None
        self.grad = None
        return grad


def _sum_so_far(slot: GradSlot | None, like: torch.Tensor) -> torch.Tensor | None:
    """The slot's gradient so far, viewed as `like` (None if there is none yet)."""
    if slot is None or slot.grad is None:
        return None
    return slot.grad.view(like.shape)


def _returned(slot: GradSlot | None, who: str, grad: torch.Tensor | None):
    return grad if slot is None else slot.add(who, grad)


class _Read(torch.autograd.Function):
    """h = pre X per token: pre (T, n), X (T, n, H) -> (T, H). Backward: dX = pre^T dh (an
    outer product per token, added to the slot's sum), dpre = X dh; saves pre and X (which
    the program holds). On the CPU the fused kernels (hc_native.py) do each direction in
    one pass over X."""

    @staticmethod
    def forward(ctx, pre: torch.Tensor, flat: torch.Tensor, slot: GradSlot | None):
        ctx.slot = slot
        ctx.save_for_backward(pre, flat)
        if hc_native.usable(pre, flat):
            h = flat.new_empty(flat.shape[0], flat.shape[2])
            hc_native.call("hc_read", *flat.shape, pre, flat, h)
            return h
        return torch.bmm(pre.unsqueeze(1), flat).squeeze(1)

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        pre, flat = ctx.saved_tensors
        dh = dh.contiguous()
        dflat = _sum_so_far(ctx.slot, flat)
        if hc_native.usable(pre, flat, dh):
            dpre = torch.empty_like(pre)
            add = dflat is not None
            dflat = dflat if add else torch.empty_like(flat)
            hc_native.call("hc_read_backward", *flat.shape, pre, flat, dh, dflat, dpre, int(add))
        else:
            dpre = torch.bmm(flat, dh.unsqueeze(2)).squeeze(2)
            outer = (pre.unsqueeze(2), dh.unsqueeze(1))
            dflat = torch.bmm(*outer) if dflat is None else dflat.baddbmm_(*outer)
        return dpre, _returned(ctx.slot, "read", dflat), None


class _Write(torch.autograd.Function):
    """Y = M X + post out^T per token: M (T, n, n), X (T, n, H), post (T, n), out (T, H) ->
    (T, n, H). Backward: dX = M^T dY (which starts the slot's sum), dM = dY X^T,
    dpost = dY out, dout = post^T dY (four batched products, or on the CPU one pass of the
    fused kernel); saves the inputs (X held by the program, out by the branch)."""

    @staticmethod
    def forward(ctx, mix, flat, post, out, slot: GradSlot | None):
        ctx.slot = slot
        ctx.save_for_backward(mix, flat, post, out)
        if hc_native.usable(mix, flat, post, out):
            y = torch.empty_like(flat)
            hc_native.call("hc_write", *flat.shape, mix, flat, post, out, y)
            return y
        y = torch.bmm(mix, flat)
        return y.addcmul_(post.unsqueeze(2), out.unsqueeze(1))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        mix, flat, post, out = ctx.saved_tensors
        dy = dy.contiguous()
        if hc_native.usable(mix, flat, post, out, dy):
            dmix, dflat, dpost, dout = (torch.empty_like(t) for t in (mix, flat, post, out))
            hc_native.call("hc_write_backward", *flat.shape, mix, flat, post, out, dy,
                           dflat, dmix, dpost, dout)
        else:
            dmix = torch.bmm(dy, flat.transpose(1, 2))
            dflat = torch.bmm(mix.transpose(1, 2), dy)
            dpost = torch.bmm(dy, out.unsqueeze(2)).squeeze(2)
            dout = torch.bmm(post.unsqueeze(1), dy).squeeze(1)
        return dmix, _returned(ctx.slot, "write", dflat), dpost, dout, None


def read(pre: torch.Tensor, state: torch.Tensor, slot: GradSlot | None = None) -> torch.Tensor:
    """h = sum_k pre[k] X[k]: pre (n,) or (..., n), state (..., n, H) -> (..., H)."""
    flat = state.reshape(-1, *state.shape[-2:]).contiguous()
    h = _Read.apply(_per_token(pre, state, 1), flat, slot)
    return h.view(*state.shape[:-2], state.shape[-1])


def write(mix: torch.Tensor, post: torch.Tensor, state: torch.Tensor, out: torch.Tensor,
          slot: GradSlot | None = None) -> torch.Tensor:
    """X'[k] = sum_l mix[k, l] X[l] + post[k] out: mix (n, n) or (..., n, n), post (n,) or
    (..., n), state (..., n, H), out (..., H) -> (..., n, H) in the state's dtype."""
    flat = state.reshape(-1, *state.shape[-2:]).contiguous()
    out = out.to(state.dtype).reshape(-1, state.shape[-1]).contiguous()
    y = _Write.apply(_per_token(mix, state, 2), flat, _per_token(post, state, 1), out, slot)
    return y.view(state.shape)


def hc_dynamic(state: torch.Tensor, proj: torch.Tensor, scale: torch.Tensor, pre: torch.Tensor,
               res: torch.Tensor, post: torch.Tensor, eps: float, slot: GradSlot | None = None):
    """Dynamic HC's (pre (..., n), Ar (..., n, n), B (..., n)) for the state (..., n, H):
    with Xn[l] = X[l] / rms(X[l]) and z = tanh(Xn proj) (..., n, n + 2),

        pre[l] = Am[l] + s_a z[l, 0],  Ar[l, k] = Ar_static[l, k] + s_a z[l, 1 + k],
        B[l] = B_static[l] + s_b z[l, n + 1]      (scale = (s_a, s_b))."""
    n = state.shape[-2]
    dtype = state.dtype
    z = torch.tanh(_RMSProjection.apply(state, proj.to(dtype), eps, slot))  # (..., n, n + 2)
    s = scale.to(dtype)
    gains = torch.cat([s[:1].expand(n + 1), s[1:]])
    z = z * gains
    return (pre.to(dtype) + z[..., 0], res.to(dtype) + z[..., 1:n + 1],
            post.to(dtype) + z[..., n + 1])


class _RMSProjection(torch.autograd.Function):
    """z = (x proj) r, r = 1 / sqrt(mean(x^2) + eps) over x's last dim: RMSNorm(x) proj
    without a norm weight, the normalised x (as large as the state) never made. Backward:
    with gy = dz r, dproj = x^T gy and dx = gy proj^T - (sum(dz (x proj)) r^3 / H) x (added
    in place to the slot's sum). Saves x (held by the program) and (T, m) tensors. The
    products are BLAS's (mHC's n^2 + 2n outputs from n H inputs); on the CPU the sum of
    squares is a fused kernel (one pass, where torch's vecdot takes two)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, proj: torch.Tensor, eps: float, slot: GradSlot | None):
        ctx.slot = slot
        flat = x.reshape(-1, x.shape[-1])
        y = flat @ proj
        if hc_native.usable(flat) and flat.is_contiguous():
            sumsq = flat.new_empty(len(flat))
            hc_native.call("hc_sumsq", *flat.shape, flat, sumsq)
        else:
            sumsq = torch.linalg.vecdot(flat, flat)
        r = torch.rsqrt(sumsq / flat.shape[-1] + eps).unsqueeze(1)
        ctx.save_for_backward(x, proj, y, r)
        return (y * r).view(*x.shape[:-1], proj.shape[-1])

    @staticmethod
    def backward(ctx, dz: torch.Tensor):
        x, proj, y, r = ctx.saved_tensors
        flat = x.reshape(-1, x.shape[-1])
        dz = dz.reshape(y.shape)
        gy = dz * r
        dproj = torch.mm(gy.T, flat).T
        coef = -(dz * y).sum(1, keepdim=True) * (r * r * r) / flat.shape[-1]
        dx = _sum_so_far(ctx.slot, flat)
        dx = torch.addmm(flat * coef, gy, proj.T) if dx is None else \
            dx.addmm_(gy, proj.T).addcmul_(flat, coef)
        dx = _returned(ctx.slot, "project", dx)
        return (None if dx is None else dx.view(x.shape)), dproj, None, None


class _DynamicRead(torch.autograd.Function):
    """Dynamic HC's weights (`hc_dynamic`) and read (`read`) of one sub-layer as one fused
    CPU kernel each way (hc_native.py): the state is read once forward (its projection, RMS
    factors, the weights and h from each token's block in cache) and once backward (h's and
    the projection's gradients summed in place into the slot), where the separate functions
    read it twice each and run a dozen small operations on the weights between. Inputs:
    flat (T, n, H), proj (H, n + 2), scale (2,), Am (n,), Ar (n, n), B (n,), all in the
    state's dtype; outputs h (T, H), pre (T, n) (for the record, not differentiable),
    mix (T, n, n) destination-major and post (T, n), as the write takes them."""

    @staticmethod
    def forward(ctx, flat, proj, scale, am, ar, b, eps: float, slot: GradSlot | None):
        tokens, n, hidden = flat.shape
        w = n + 2
        h = flat.new_empty(tokens, hidden)
        pre, post, r = (flat.new_empty(tokens, n) for _ in range(3))
        mix = flat.new_empty(tokens, n, n)
        y, z = flat.new_empty(tokens, n, w), flat.new_empty(tokens, n, w)
        proj_t = proj.T.contiguous()
        hc_native.call("hc_dynamic_read", tokens, n, hidden, flat, proj_t, am, ar, b, scale,
                       eps, h, pre, mix, post, y, z, r)
        ctx.slot = slot
        ctx.save_for_backward(flat, proj, scale, pre, y, z, r)  # proj, not its transposed copy
        ctx.mark_non_differentiable(pre)
        return h, pre, mix, post

    @staticmethod
    def backward(ctx, dh, _dpre, dmix, dpost):
        flat, proj, scale, pre, y, z, r = ctx.saved_tensors
        proj_t = proj.T.contiguous()
        tokens, n, hidden = flat.shape
        dh, dmix, dpost = (torch.zeros(shape, dtype=flat.dtype) if g is None else g.contiguous()
                           for g, shape in ((dh, (tokens, hidden)), (dmix, (tokens, n, n)),
                                            (dpost, (tokens, n))))
        dflat = _sum_so_far(ctx.slot, flat)
        add = dflat is not None
        dflat = dflat if add else torch.empty_like(flat)
        dproj_t = torch.empty_like(proj_t)
        dam, db, dscale = flat.new_empty(n), flat.new_empty(n), flat.new_empty(2)
        dar = flat.new_empty(n, n)
        hc_native.call("hc_dynamic_read_backward", tokens, n, hidden, flat, proj_t, scale, pre,
                       y, z, r, dh, dmix, dpost, dflat, int(add), dproj_t, dam, dar, db,
                       dscale)
        return (_returned(ctx.slot, "project", dflat), dproj_t.T, dscale, dam, dar, db, None,
                None)


def dynamic_read(state: torch.Tensor, proj: torch.Tensor, scale: torch.Tensor,
                 pre: torch.Tensor, res: torch.Tensor, post: torch.Tensor, eps: float,
                 slot: GradSlot | None = None):
    """`hc_dynamic` then `read` as one fused function (`_DynamicRead`): (h (..., H),
    pre (..., n), mix (..., n, n) destination-major, post (..., n)); None where the fused
    kernels cannot serve the state (then the separate functions run)."""
    if not hc_native.usable(state):
        return None
    dtype, n = state.dtype, state.shape[-2]
    flat = state.reshape(-1, *state.shape[-2:]).contiguous()
    params = (w.to(dtype).contiguous() for w in (proj, scale, pre, res, post))
    h, pre, mix, post = _DynamicRead.apply(flat, *params, eps, slot)
    lead = state.shape[:-2]
    return (h.view(*lead, state.shape[-1]), pre.view(*lead, n), mix.view(*lead, n, n),
            post.view(*lead, n))


def mhc_weights(state: torch.Tensor, proj: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor, eps: float, iters: int, slot: GradSlot | None = None):
    """mHC's (H_pre (..., n), H_res (..., n, n), H_post (..., n)) for the state (..., n, H):
    x = RMSNorm(flatten(X)) (..., n H), z = x proj (..., n^2 + 2n) laid out [pre | post |
    res (row-major, [k, l])], scale = (a_pre, a_post, a_res):

        H_pre = sigmoid(a_pre z_pre + b_pre),  H_post = 2 sigmoid(a_post z_post + b_post),
        H_res = Sinkhorn(a_res z_res + b_res)."""
    n = state.shape[-2]
    dtype = state.dtype
    z = _RMSProjection.apply(state.flatten(-2), proj.to(dtype), eps, slot)
    s = scale.to(dtype)
    gains = torch.cat([s[0:1].expand(n), s[1:2].expand(n), s[2:3].expand(n * n)])
    logits = torch.addcmul(bias.to(dtype), z, gains)
    pre = torch.sigmoid(logits[..., :n])
    post = 2 * torch.sigmoid(logits[..., n:2 * n])
    res = sinkhorn(logits[..., 2 * n:].unflatten(-1, (n, n)), iters)
    return pre, res.to(dtype), post


def _iterates(logits: torch.Tensor, iters: int) -> list[torch.Tensor]:
    """M_0 = exp(logits - max) (the shift cancels in the normalisations), then `iters`
    rounds of (rows to sum 1, columns to sum 1): the 2 iters + 1 matrices, each laid out
    (n, n, T) (row index, column index, token): the sums then run over leading dims, about
    5 x faster on the CPU than over the 4 contiguous entries of a (T, n, n) row."""
    flat = logits.reshape(-1, *logits.shape[-2:])
    m = torch.exp(flat - flat.amax((-2, -1), keepdim=True)).permute(1, 2, 0).contiguous()
    ms = [m]
    for _ in range(iters):
        for dim in (1, 0):  # rows (sum over the column index), then columns
            m = m / m.sum(dim, keepdim=True)
            ms.append(m)
    return ms


def _token_major(m: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """An (n, n, T) matrix back in `like`'s (..., n, n) shape."""
    return m.permute(2, 0, 1).reshape(like.shape)


class _Sinkhorn(torch.autograd.Function):
    """Saves the logits only; the backward recomputes the iterates and runs their chain
    rule in reverse (y = x / sum x: dx = (dy - sum(dy y)) / sum x), in fp32 at least. On
    the CPU the fused kernels (hc_native.py) run each token's iterations in registers."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int) -> torch.Tensor:
        ctx.iters = iters
        ctx.save_for_backward(logits)
        if hc_native.usable(logits):
            return _native_sinkhorn("hc_sinkhorn", iters, logits.contiguous())
        with no_autocast(logits):
            return _token_major(_iterates(logits, iters)[-1], logits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (logits,) = ctx.saved_tensors
        grad = grad.to(logits.dtype)
        if hc_native.usable(logits):
            return _native_sinkhorn("hc_sinkhorn_backward", ctx.iters, logits.contiguous(),
                                    grad.contiguous()), None
        with no_autocast(logits):
            ms = _iterates(logits, ctx.iters)
            g = grad.reshape(-1, *logits.shape[-2:]).permute(1, 2, 0)
            for t in range(len(ms) - 2, -1, -1):
                dim = 1 if t % 2 == 0 else 0
                g = (g - (g * ms[t + 1]).sum(dim, keepdim=True)) / ms[t].sum(dim, keepdim=True)
            return _token_major(g * ms[0], logits), None


def _native_sinkhorn(kernel: str, iters: int, *inputs: torch.Tensor) -> torch.Tensor:
    """The fused kernel's iterates (`hc_sinkhorn`) or their backward of a gradient
    (`hc_sinkhorn_backward`): one result the logits' shape."""
    logits = inputs[0]
    result = torch.empty_like(logits)
    n = logits.shape[-1]
    hc_native.call(kernel, logits.numel() // (n * n), n, iters, *inputs, result)
    return result


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """The Sinkhorn-Knopp projection of exp(logits) (..., n, n): `iters` alternating row
    and column normalisations (columns sum to 1 exactly, rows to a tolerance that falls
    with iters), in fp32 at least."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return _Sinkhorn.apply(logits.to(dtype), iters)
