"""Attention Residuals (pretrain/model/attnres.py) against a naive fp64 model written from
the paper's equations (arXiv 2603.15031): every sub-layer's input is a softmax over the
embedding and earlier sub-layer outputs (block AttnRes: over block sums and the open
block's partial sum), keyed by RMSNorm with a learned weight, queried by a learned vector."""

import pytest
import torch

from pretrain.model.attnres_layout import AttnResLayout
from pretrain.model.config import DenseFormerConfig, ModelConfigError
from pretrain.model.denseformer import DenseFormer

VARIANTS = [None, 1, 2, 4, 8]  # attnres_blocks for n_layers=4 (8 sub-layers): full, block N


def config(blocks=None, **over):
    base = dict(n_layers=4, d_model=32, n_heads=4, vocab_size=97, seq_len=12,
                connection="attnres", attnres_blocks=blocks)
    return DenseFormerConfig(**{**base, **over})


def naive_logits(model: DenseFormer, tokens: torch.Tensor, n_blocks: int | None):
    """The paper's forward, in the model's dtype, from its weights: v_0 = embedding, v_l =
    f_l(h_l) the l-th sub-layer (attention, MLP alternately, each on its own pre-norm), and
    h_l = sum_i softmax_i(w_l . RMSNorm_l(k_i)) k_i over the sources k_i."""
    cfg = model.config
    n_sub = 2 * cfg.n_layers
    size = 1 if n_blocks is None else n_sub // n_blocks
    v = [model.embedding(tokens)]
    queries, gains = model.attnres_query, model.attnres_key_norm

    def sources(c):  # for the input of sub-layer c (c = n_sub + 1: the output)
        if n_blocks is None:
            return v[:c]
        done = (c - 1) // size  # completed blocks
        blocks = [v[0]] + [sum(v[1 + n * size: 1 + (n + 1) * size]) for n in range(done)]
        partial = v[1 + done * size: c]
        return blocks + ([sum(partial)] if partial else [])

    def mix(c):
        keys = sources(c)
        logits = []
        for k in keys:
            rms = torch.sqrt((k * k).mean(-1, keepdim=True) + cfg.norm_eps)
            logits.append(((k / rms) * gains[c - 1] * queries[c - 1]).sum(-1))
        weights = torch.softmax(torch.stack(logits), dim=0)
        return sum(w.unsqueeze(-1) * k for w, k in zip(weights, keys, strict=True))

    for sub in range(1, n_sub + 1):
        block = model.blocks[(sub - 1) // 2]
        h = mix(sub)
        if sub % 2:
            v.append(block.attn(block.norm_attn(h), block.rope))
        else:
            v.append(block.mlp(block.norm_mlp(h)))
    y = model.final_norm(mix(n_sub + 1))
    return y @ model.embedding.weight[: cfg.vocab_size].T


def randomised(model: DenseFormer, seed: int = 1) -> DenseFormer:
    """Queries and key norms away from their init, so that the weights are not uniform."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        q = model.attnres_query
        q.copy_(torch.randn(q.shape, generator=gen, dtype=q.dtype))
        g = model.attnres_key_norm
        g.copy_(1 + 0.3 * torch.randn(g.shape, generator=gen, dtype=g.dtype))
    return model


@pytest.mark.parametrize("blocks", VARIANTS)
@pytest.mark.parametrize("block", ["gpt", "llama"])
def test_forward_and_gradients_match_the_paper(blocks, block):
    torch.manual_seed(0)
    model = randomised(DenseFormer(config(blocks, block=block)).double())
    tokens = torch.randint(0, 97, (2, 12))
    ours = model(tokens)
    ours.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = naive_logits(model, tokens, blocks)
    ref.square().mean().backward()
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-12,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("blocks", VARIANTS)
@pytest.mark.parametrize("block", ["gpt", "llama"])
def test_equals_the_transformer_at_init(blocks, block):
    """Zero queries weigh the sources uniformly: each sub-layer's input is the Transformer's
    residual stream divided by the number of sources, which its pre-norm undoes (up to
    the norm's eps, tiny here)."""
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = DenseFormer(config(blocks, block=block, norm_eps=1e-12)).double()(tokens)
    base = DenseFormer(config(None, block=block, norm_eps=1e-12, connection="none")).double()
    ref = base(tokens)
    assert ((ours - ref).abs().max() / ref.abs().max()) < 1e-5


def softmax_mix(query, xs, eps):
    """One consumer's mix in plain autograd ops: softmax_j(q . X_j / rms(X_j)) over the
    stacked sources, in fp32 at least."""
    v = torch.stack([x.to(torch.promote_types(x.dtype, torch.float32)) for x in xs])
    keys = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + eps)
    a = torch.softmax(keys @ query.to(v.dtype), dim=0)
    return (a.unsqueeze(-1) * v).sum(0)


def test_prefix_sums_in_fp32_over_mixed_dtypes():
    from pretrain.model.attnres_mix import group_prefix

    xs = [torch.randn(4, 8).bfloat16(), torch.randn(4, 8)]
    [(o, lse)] = group_prefix(torch.zeros(1, 8), xs, 1e-5)
    assert o.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(o, (xs[0].float() + xs[1]) / 2)


def test_layout_sources():
    full = AttnResLayout(2)
    assert [full.sources(c) for c in range(1, 6)] == [(0,), (0, 1), (0, 1, 2), (0, 1, 2, 3),
                                                       (0, 1, 2, 3, 4)]
    block = AttnResLayout(3, blocks=2)  # 6 sub-layers, groups of 3: X_3 and X_6 complete
    assert [block.sources(c) for c in range(1, 8)] == [
        (0,), (0, 1), (0, 2), (0, 3), (0, 3, 4), (0, 3, 5), (0, 3, 6)]
    assert [block.accumulates(s) for s in range(1, 7)] == [False, True, True] * 2


@pytest.mark.parametrize("blocks", [None, 2])
def test_parameter_count_and_flops_include_the_connection(blocks):
    cfg = config(blocks)
    base = config(None, connection="none")
    extra = 2 * (2 * cfg.n_layers + 1) * cfg.d_model
    assert cfg.num_params() == base.num_params() + extra == DenseFormer(cfg).num_params()
    reads = sum(len(cfg.attnres_layout.sources(c)) for c in range(1, 2 * cfg.n_layers + 2))
    assert cfg.flops_per_token() == base.flops_per_token() + 6 * 2 * reads * cfg.d_model


@pytest.mark.parametrize("over, key", [
    (dict(connection="bogus"), "connection"),
    (dict(connection="dwa", attnres_blocks=2), "attnres_blocks"),
    (dict(connection=None, dwa=False, attnres_blocks=2), "attnres_blocks"),
    (dict(attnres_blocks=3), "attnres_blocks"),  # 8 sub-layers
    (dict(attnres_blocks=0), "attnres_blocks"),
    (dict(skip_gains=True), "skip_gains"),
])
def test_bad_input_names_the_key(over, key):
    with pytest.raises(ModelConfigError) as err:
        config(**{"blocks": None, **over})
    assert err.value.key == key


def test_connection_wins_over_the_dwa_shorthand():
    assert config(None, connection=None, dwa=False).depth_connection == "none"
    assert config(None, connection=None).depth_connection == "dwa"
    assert config(None, connection="none", dwa=True).depth_connection == "none"
    cfg = config(None, dwa_dilation=4, dwa_period=5)
    assert cfg.dwa_pattern.inputs == {}  # ignored
    assert cfg.ignored_dwa_keys() == ["dwa_dilation", "dwa_period"]
    assert config(None, connection="dwa").ignored_dwa_keys() == []


def test_two_phases_by_gradcheck():
    """Phase 1 (every consumer of a group over the completed sums) and phase 2 (one more
    source merged into a prefix) against finite differences, and their composition
    against the softmax over all the sources at once."""
    from pretrain.model.attnres_mix import group_prefix, merge_partial

    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, 3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
          for _ in range(3)]
    p = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    queries = torch.randn(4, 6, generator=gen, dtype=torch.float64, requires_grad=True)

    def both(queries, p, *xs):
        outs = []
        for k, (o, lse) in enumerate(group_prefix(queries, list(xs), 1e-6)):
            outs += [o, lse, merge_partial(o, lse, p, queries[k], 1e-6)]
        return tuple(outs)

    assert torch.autograd.gradcheck(both, (queries, p, *xs))
    for k, (o, lse) in enumerate(group_prefix(queries, xs, 1e-6)):
        torch.testing.assert_close(o.reshape(p.shape), softmax_mix(queries[k], xs, 1e-6))
        torch.testing.assert_close(merge_partial(o, lse, p, queries[k], 1e-6),
                                   softmax_mix(queries[k], [*xs, p], 1e-6))
