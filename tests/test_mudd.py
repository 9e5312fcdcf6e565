"""MUDD (pretrain/model/mudd.py) against a naive fp64 model written from the equations
(arXiv 2502.12170, our index conventions, docs/connections.md#mudd): after block i, per
token, Y_i^s = sum_{j <= i} A_i[s, j] X_j with A_i = a_i + W2_i GELU(W1_i RMSNorm(X_i))
(static: a_i), each stream s of block i + 1 its own input; the query, key and value
projections each from the full fused weight on their own normed input (three times the
FLOPs: a separate route from the model's sliced weights)."""

import pytest
import torch
import torch.nn.functional as F

from pretrain.model.config import DenseFormerConfig, ModelConfigError
from pretrain.model.denseformer import DenseFormer
from pretrain.model.mudd_program import MuddLayout, mudd_program

VARIANTS = [(True, "qkvr"), (False, "qkvr"), (True, "r"), (False, "r")]


def config(dynamic=True, streams="qkvr", **over):
    base = dict(n_layers=3, d_model=32, n_heads=4, vocab_size=97, seq_len=12,
                connection="mudd", mudd_dynamic=dynamic, mudd_streams=streams)
    return DenseFormerConfig(**{**base, **over})


def naive_attention(block, q_in, k_in, v_in):
    """Attn from the full QKV weight on each input, picking each input's features."""
    attn = block.attn
    outs = [F.linear(x, attn.qkv.weight) for x in (q_in, k_in, v_in)]
    g = attn.group
    kind = torch.tensor(([0] * g + [1, 2]) * attn.groups_local).repeat_interleave(attn.head_dim)
    qkv = sum(torch.where(kind == n, out, torch.zeros_like(out)) for n, out in enumerate(outs))
    q, k, v = block.rope.qkv(qkv, attn.groups_local, g)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=g > 1)
    b, s = q.shape[0], q.shape[2]
    return attn.proj(out.transpose(1, 2).reshape(b, s, -1))[0]


def naive_logits(model: DenseFormer, tokens: torch.Tensor):
    cfg, layout = model.config, model.config.mudd_layout
    xs = [model.embedding(tokens)]
    streams = [xs[0]] * 4
    for i in range(1, cfg.n_layers + 1):
        block = model.blocks[i - 1]
        q, k, v, r = streams if layout.streams == "qkvr" else [streams[-1]] * 4
        if layout.streams == "qkvr":
            h = r + naive_attention(block, block.norm_attn(q), block.norm_k(k), block.norm_v(v))
        else:
            h = r + naive_attention(block, *[block.norm_attn(r)] * 3)
        xs.append(h + block.mlp(block.norm_mlp(h)))
        key = str(i)
        a = model.mudd_static[key]
        if layout.dynamic:
            x = xs[i]
            normed = x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps)
            hidden = F.gelu(normed @ model.mudd_w1[key].T) @ model.mudd_w2[key].T
            a = a + hidden.view(*x.shape[:-1], *a.shape)  # (B, S, C, i + 1)
        else:
            a = a.expand(*xs[0].shape[:-1], *a.shape)
        streams = [sum(a[..., s, j, None] * xs[j] for j in range(i + 1))
                   for s in range(a.shape[-2])]
    y = model.final_norm(streams[-1])
    return y @ model.embedding.weight[: cfg.vocab_size].T


def randomised(model: DenseFormer, seed: int = 1) -> DenseFormer:
    """MUDD weights (and the key/value norms) away from their init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("mudd_") or "norm_k" in name or "norm_v" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


@pytest.mark.parametrize("dynamic,streams", VARIANTS)
@pytest.mark.parametrize("block", ["gpt", "llama"])
def test_forward_and_gradients_match_the_equations(dynamic, streams, block):
    torch.manual_seed(0)
    over = dict(block=block, n_kv_heads=2) if block == "llama" else {}
    model = randomised(DenseFormer(config(dynamic, streams, **over)).double())
    tokens = torch.randint(0, 97, (2, 12))
    ours = model(tokens)
    ours.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = naive_logits(model, tokens)
    ref.square().mean().backward()
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-10, msg=name)


def test_functional_mix_equals_the_buffered_one():
    torch.manual_seed(0)
    model = randomised(DenseFormer(config(block="llama")).double())
    x0 = model.embed(torch.randint(0, 97, (2, 12)))
    ys = [model.run_blocks(x0, functional=f) for f in (False, True)]
    torch.testing.assert_close(ys[0], ys[1], rtol=1e-12, atol=1e-12)
    params = [p for n, p in model.named_parameters() if n.startswith(("blocks", "mudd"))]
    ga = torch.autograd.grad(ys[0].square().sum(), params, retain_graph=True)
    gb = torch.autograd.grad(ys[1].square().sum(), params)
    for a, b in zip(ga, gb, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dynamic,streams", VARIANTS)
def test_at_init_the_model_equals_the_transformer(dynamic, streams):
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    mudd = DenseFormer(config(dynamic, streams, init_std=0.3), seed=5)
    plain = DenseFormer(config(None, None, connection="none", init_std=0.3), seed=5)
    ours, ref = mudd(tokens), plain(tokens)
    assert (ours - ref).abs().max() <= 1e-6 * ref.abs().max()


def test_program_reads_every_earlier_output():
    program = mudd_program(MuddLayout(3))
    assert [s.input.terms for s in program.steps] == [(), (0, 1), (0, 1, 2)]
    assert program.outgoing_sources[0].terms == (0, 1, 2, 3)


def test_counts_and_names():
    cfg = config()
    model = DenseFormer(cfg)
    assert model.num_params() == cfg.num_params()
    assert cfg.architecture == "MUDD"
    assert config(False, "r").architecture == "MUDD static r"
    assert config(False).architecture == "MUDD static"
    # K_i = C_i (i + 1): 8, 12 for the two inner mixes, 4 for the last (R alone)
    assert [p.shape[0] for p in model.mudd_w1.values()] == [8, 12, 4]
    base = config(None, None, connection="none")
    extra = cfg.flops_per_token() - base.flops_per_token()
    assert extra == 6 * sum(k * 32 + k * (32 + k) for k in (8, 12, 4))


def test_config_errors_name_the_key():
    with pytest.raises(ModelConfigError, match="model.mudd_streams"):
        config(streams="qk")
    with pytest.raises(ModelConfigError, match="model.mudd_dynamic"):
        DenseFormerConfig(mudd_dynamic=False)  # a DWA model


def test_a_second_backward_through_the_graph_gives_the_same_gradients():
    torch.manual_seed(0)
    model = randomised(DenseFormer(config()).double())
    loss = model(torch.randint(0, 97, (2, 12))).square().mean()
    first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    second = torch.autograd.grad(loss, list(model.parameters()))
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
