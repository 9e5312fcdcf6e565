"""Hyper-Connections (Zhu et al., arXiv 2409.19606) and manifold-constrained Hyper-Connections
(mHC, DeepSeek-AI, arXiv 2512.24880): the residual stream widened to n streams, which each
sub-layer reads through a weighted sum and writes back through a mixing matrix plus a
weighted copy of its output (docs/connections.md#hyper-connections-hc-and-mhc has the
equations; the program and its index conventions are hc_program.py, the arithmetic
hc_mix.py).

With sub-layers c = 1..L and X_{c-1} the state (..., n, H) that sub-layer c reads:

- static HC: h_c = sum_k Am_c[k] X[k],  X'[k] = sum_l Ar_c[l, k] X[l] + B_c[k] T_c(h_c),
  with Am, Ar, B learned per sub-layer (`hc_pre` (L, n), `hc_res` (L, n, n), `hc_post`
  (L, n)), initialised to Am_c = e_{(c - 1) mod n}, Ar_c = I, B_c = 1;
- dynamic HC (the default): each adds a tanh-gated term of the RMS-normalised streams
  (hc_mix.py `hc_dynamic`; `hc_proj` (L, H, n + 2) zeros, `hc_scale` (L, 2) = 0.01), equal
  to static HC at init;
- mHC: H_pre = sigmoid(.), H_post = 2 sigmoid(.), H_res = Sinkhorn(exp(.)) of a projection of
  the RMS-normalised flattened state (hc_mix.py `mhc_weights`; `mhc_proj` (L, nH, n^2 + 2n)
  zeros, `mhc_scale` (L, 3) = 0.01, `mhc_bias` (L, n^2 + 2n): b_pre = e_{(c - 1) mod n},
  b_post = 0 so H_post = 1, b_res = I), with X'[k] = sum_l H_res[k, l] X[l] + H_post[k] T(h).

X_0 is the embedding copied into every stream and the model output the streams' sum: with
the initial weights every stream equals the Transformer's residual stream, so (the
sub-layers being pre-norm) the model equals the Transformer up to the norms' eps.
"""

from __future__ import annotations

import torch
from torch import nn

from pretrain.model.hc_mix import (
    GradSlot,
    dynamic_read,
    hc_dynamic,
    mhc_weights,
    no_autocast,
    read,
    streams,
    write,
)
from pretrain.model.hc_program import HCLayout
from pretrain.model.program import Source, Step

# Parameter names (init, optimizer), by layout kind.
HC_STATIC = ("hc_pre", "hc_res", "hc_post")
HC_DYNAMIC = ("hc_proj", "hc_scale")
MHC = ("mhc_proj", "mhc_scale", "mhc_bias")
PARAMETERS = HC_STATIC + HC_DYNAMIC + MHC
SCALE_INIT = 0.01  # s_a, s_b (HC) and a_pre, a_post, a_res (mHC) at init


def parameter_names(layout: HCLayout) -> tuple[str, ...]:
    if layout.kind == "mhc":
        return MHC
    return HC_STATIC + (HC_DYNAMIC if layout.dynamic else ())


def parameter_shapes(layout: HCLayout, d_model: int) -> dict[str, tuple[int, ...]]:
    n, subs = layout.streams, layout.n_sublayers
    shapes = {"hc_pre": (subs, n), "hc_res": (subs, n, n), "hc_post": (subs, n),
              "hc_proj": (subs, d_model, n + 2), "hc_scale": (subs, 2),
              "mhc_proj": (subs, n * d_model, layout.n_weights), "mhc_scale": (subs, 3),
              "mhc_bias": (subs, layout.n_weights)}
    return {name: shapes[name] for name in parameter_names(layout)}


def initial_value(name: str, layout: HCLayout, shape: tuple[int, ...]) -> torch.Tensor:
    """The initial value of parameter `name` (module docstring)."""
    n, subs = layout.streams, layout.n_sublayers
    one_hot = torch.zeros(subs, n)
    one_hot[torch.arange(subs), torch.arange(subs) % n] = 1.0  # sub-layer c: (c - 1) mod n
    if name == "hc_pre":
        return one_hot
    if name == "hc_res":
        return torch.eye(n).expand(subs, n, n).clone()
    if name == "hc_post":
        return torch.ones(shape)
    if name in ("hc_scale", "mhc_scale"):
        return torch.full(shape, SCALE_INIT)
    if name == "mhc_bias":
        return torch.cat([one_hot, torch.zeros(subs, n), torch.eye(n).flatten().expand(subs, -1)],
                         dim=1)
    return torch.zeros(shape)  # hc_proj, mhc_proj


def new_parameters(layout: HCLayout, d_model: int) -> dict[str, nn.Parameter]:
    """The connection's parameters (filled by pretrain/model/init.py), replicated on every
    TP rank (under sequence parallelism their gradients are summed over TP)."""
    return {name: nn.Parameter(torch.empty(shape))
            for name, shape in parameter_shapes(layout, d_model).items()}


class HCConnections:
    """The connection state of a forward pass (training or cached inference alike: the
    connections are per token, so a decoding step needs nothing from earlier tokens but the
    KV cache). `params`: {name: parameter}; `record`: a dict that gets each sub-layer's
    weights (pre (..., n), mix (..., n, n) destination-major, post (..., n)), for analysis.

    `mix` of sub-layer c's source computes all three of its weights from X_{c-1}, returns
    h_c and keeps (mix, post) until the step's `write` (the same step, so in the same run:
    a checkpoint unit recomputes both, parallel/strategies/checkpointing.py)."""

    def __init__(self, layout: HCLayout, params: dict[str, torch.Tensor], eps: float,
                 record: dict | None = None):
        self.layout, self.params, self.eps, self.record = layout, params, eps, record
        self.pending: dict[int, tuple] = {}
        self._rows: dict[str, tuple[torch.Tensor, ...]] = {}

    def row(self, name: str, c: int) -> torch.Tensor:
        """Sub-layer c's row of parameter `name`. The parameter is unbound once per forward:
        its gradient is then one stack of the rows', where indexing each row would add a
        parameter-sized zero-filled gradient per sub-layer (O(L^2) bytes: 0.9 GB a step for
        mHC's projections at 48 x 256)."""
        if name not in self._rows:
            self._rows[name] = self.params[name].unbind(0)
        return self._rows[name][c - 1]

    def hold(self, j: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if j == 0:  # the embedding: copied into the n streams
            x = streams(x, self.layout.streams)
        return x, x

    def slot(self) -> GradSlot | None:
        """A sub-layer's `GradSlot` (None under torch.compile): the projection returns the
        summed gradient of X where there is one (dynamic HC, mHC), else the read."""
        if torch.compiler.is_compiling():
            return None
        projected = self.layout.kind == "mhc" or self.layout.dynamic
        return GradSlot("project" if projected else "read")

    def weights(self, c: int, state: torch.Tensor, slot: GradSlot | None = None):
        """Sub-layer c's (pre, mix, post) for the state X_{c-1}."""
        row = self.row
        if self.layout.kind == "mhc":
            return mhc_weights(state, row("mhc_proj", c), row("mhc_scale", c),
                               row("mhc_bias", c), self.eps, self.layout.sinkhorn_iters, slot)
        pre, res, post = row("hc_pre", c), row("hc_res", c), row("hc_post", c)
        if self.layout.dynamic:
            pre, res, post = hc_dynamic(state, row("hc_proj", c), row("hc_scale", c), pre,
                                        res, post, self.eps, slot)
        return pre, res.mT, post  # X'[k] = sum_l Ar[l, k] X[l]

    def fused_read(self, c: int, state: torch.Tensor, slot: GradSlot | None):
        """Dynamic HC's (h, pre, mix, post) of sub-layer c from one fused CPU kernel, or None
        (static HC, mHC, or a state the kernels do not serve)."""
        if self.layout.kind != "hc" or not self.layout.dynamic:
            return None
        row = self.row
        return dynamic_read(state, row("hc_proj", c), row("hc_scale", c), row("hc_pre", c),
                            row("hc_res", c), row("hc_post", c), self.eps, slot)

    def mix(self, source: Source, handles: list, live: torch.Tensor | None) -> torch.Tensor:
        c, (state,) = source.index, handles
        with no_autocast(state):
            if c == self.layout.n_sublayers + 1:  # the model output
                return state.sum(-2)
            slot = self.slot()
            fused = self.fused_read(c, state, slot)
            if fused is None:
                pre, mix, post = self.weights(c, state, slot)
                h = read(pre, state, slot)
            else:
                h, pre, mix, post = fused
            if self.record is not None:
                self.record[c] = tuple(w.detach() for w in (pre, mix, post))
            self.pending[c] = (mix, post, slot)
            return h

    def write(self, step: Step, state: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        mix, post, slot = self.pending.pop(step.out)
        with no_autocast(state):
            return write(mix, post, state, out, slot)
