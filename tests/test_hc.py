"""Hyper-Connections (hc, static and dynamic) and mHC: the model's forward and every gradient
against a naive fp64 implementation written from the papers' equations (loops over streams,
independent of pretrain/model/hc_mix.py), the initial model against the Transformer, the
Sinkhorn projection, generation with the KV cache, and the config keys."""

import math

import pytest
import torch

from pretrain.model import DenseFormer, DenseFormerConfig
from pretrain.model.config import ModelConfigError
from pretrain.model.hc_mix import sinkhorn

TOKENS = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(0))


def hc_model(seed: int = 1, perturb: bool = True, dtype=torch.float64, **kw) -> DenseFormer:
    """A tiny hc/mhc model; `perturb`: every connection weight drawn away from its init (the
    scales large enough that the dynamic terms matter)."""
    base = dict(n_layers=3, d_model=32, n_heads=4, vocab_size=101, seq_len=16)
    model = DenseFormer(DenseFormerConfig(**{**base, **kw}), seed=seed).to(dtype)
    if perturb:
        gen = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for name, p in model.hc_parameters().items():
                scale = 0.5 if name.endswith("scale") else 0.3
                p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


# -- the naive implementation ---------------------------------------------------------------

def naive_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def naive_sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """(T, n, n): exp, then `iters` times every row then every column divided by its sum."""
    m = torch.exp(logits)
    n = m.shape[-1]
    for _ in range(iters):
        m = torch.stack([m[:, k, :] / m[:, k, :].sum(-1, keepdim=True) for k in range(n)], 1)
        m = torch.stack([m[:, :, j] / m[:, :, j].sum(-1, keepdim=True) for j in range(n)], 2)
    return m


def naive_weights(model: DenseFormer, c: int, streams: list[torch.Tensor]):
    """Sub-layer c's (pre[k], res[l][k] source-major, post[k]) per token, from the papers:
    HC (Zhu et al., eqs. for DHC) and mHC (the projections of the flattened state)."""
    cfg, p, row = model.config, model.hc_parameters(), c - 1
    layout, n, eps = cfg.hc_layout, len(streams), cfg.norm_eps
    tokens = streams[0].shape[0]
    if layout.kind == "hc":
        pre = [p["hc_pre"][row, k].expand(tokens) for k in range(n)]
        res = [[p["hc_res"][row, k, j].expand(tokens) for j in range(n)] for k in range(n)]
        post = [p["hc_post"][row, k].expand(tokens) for k in range(n)]
        if layout.dynamic:
            w, (s_a, s_b) = p["hc_proj"][row], p["hc_scale"][row]
            for k in range(n):
                z = torch.tanh(naive_rms(streams[k], eps) @ w)  # stream k's row of weights
                pre[k] = pre[k] + s_a * z[:, 0]
                res[k] = [res[k][j] + s_a * z[:, 1 + j] for j in range(n)]
                post[k] = post[k] + s_b * z[:, n + 1]
        return pre, res, post
    x = naive_rms(torch.cat(streams, dim=-1), eps)
    z = x @ p["mhc_proj"][row]
    a_pre, a_post, a_res = p["mhc_scale"][row]
    b = p["mhc_bias"][row]
    pre = [torch.sigmoid(a_pre * z[:, k] + b[k]) for k in range(n)]
    post = [2 * torch.sigmoid(a_post * z[:, n + k] + b[n + k]) for k in range(n)]
    logits = (a_res * z[:, 2 * n:] + b[2 * n:]).reshape(tokens, n, n)
    h_res = naive_sinkhorn(logits, layout.sinkhorn_iters)  # [k, l]: l into k
    res = [[h_res[:, k, j] for k in range(n)] for j in range(n)]  # source j, destination k
    return pre, res, post


def naive_loss(model: DenseFormer, tokens: torch.Tensor) -> torch.Tensor:
    """The loss with the connections written out stream by stream."""
    cfg = model.config
    n = cfg.hc_layout.streams
    x0 = model.embed(tokens)
    shape = x0.shape
    streams = [x0.reshape(-1, shape[-1])] * n
    for c in range(1, 2 * cfg.n_layers + 1):
        block = model.block((c + 1) // 2)
        pre, res, post = naive_weights(model, c, streams)
        h = sum(pre[k].unsqueeze(-1) * streams[k] for k in range(n))
        branch = block.attention_branch if c % 2 else block.mlp_branch
        out = branch(h.reshape(shape)).reshape(-1, shape[-1])
        streams = [sum(res[j][k].unsqueeze(-1) * streams[j] for j in range(n))
                   + post[k].unsqueeze(-1) * out for k in range(n)]
    y = sum(streams).reshape(shape)
    return model.head_loss(model.final_norm(y), model.head_weight, tokens)


CASES = {"hc-n2-gpt": dict(connection="hc", hc_streams=2),
         "hc-n4-llama": dict(connection="hc", block="llama"),
         "hc-static-n2-llama": dict(connection="hc", hc_streams=2, hc_dynamic=False,
                                    block="llama"),
         "hc-static-n4-gpt": dict(connection="hc", hc_dynamic=False),
         "mhc-n4-gpt": dict(connection="mhc"),
         "mhc-n2-llama": dict(connection="mhc", hc_streams=2, block="llama",
                              mhc_sinkhorn_iters=7)}


def grads(model: DenseFormer, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    names = [n for n, p in model.named_parameters()]
    values = torch.autograd.grad(loss, list(model.parameters()))
    return dict(zip(names, values, strict=True))


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_every_gradient_equal_the_naive_papers_equations(case):
    model = hc_model(**CASES[case])
    ours = model.loss(TOKENS, TOKENS)
    naive = naive_loss(model, TOKENS)
    torch.testing.assert_close(ours, naive, rtol=1e-10, atol=1e-10)
    g_ours, g_naive = grads(model, ours), grads(model, naive)
    for name in g_ours:
        torch.testing.assert_close(g_ours[name], g_naive[name], rtol=1e-9, atol=1e-9,
                                   msg=lambda m, name=name: f"{name}: {m}")
    # The connections' gradients are not all zero (the check can fail).
    assert all(g_ours[name].abs().sum() > 0 for name in model.hc_names
               if not name.endswith("scale") or CASES[case]["connection"] == "hc")


@pytest.mark.parametrize("case", ["hc-n4-llama", "hc-static-n4-gpt", "mhc-n4-gpt"])
def test_the_initial_model_equals_the_transformer(case):
    """Every stream starts as X_0 and stays the Transformer's residual stream: equal logits
    up to the norms' eps (the branches are pre-norm, the output sums n equal streams): with
    norm_eps 1e-5 and embeddings of std 0.02 that is about 1%, so eps is 1e-10 here."""
    kw = {**CASES[case], "norm_eps": 1e-10}
    model = hc_model(perturb=False, dtype=torch.float32, **kw).eval()
    shape = {k: v for k, v in kw.items() if not k.startswith(("connection", "hc_", "mhc_"))}
    transformer = hc_model(perturb=False, dtype=torch.float32, connection="none",
                           **shape).eval()
    ours, reference = model(TOKENS), transformer(TOKENS)
    assert (ours - reference).abs().max() <= 1e-4 * reference.abs().max()


def test_sinkhorn_is_doubly_stochastic_and_its_backward_is_the_gradient():
    """Measured (seed 0, 4096 matrices 4 x 4): the worst row sum is off by 9.8e-4 after 20
    iterations for logits of std 1, 9e-11 for std 0.5, 0.03 for std 2 (docs/connections.md)."""
    logits = torch.randn(4096, 4, 4, generator=torch.Generator().manual_seed(0),
                         dtype=torch.float64)
    m = sinkhorn(logits, 20)
    # Columns are normalised last (exact); rows to within 1e-3 after 20 iterations.
    assert (m.sum(-2) - 1).abs().max() < 1e-12
    assert (m.sum(-1) - 1).abs().max() < 1e-3
    assert (m >= 0).all()
    torch.testing.assert_close(m, naive_sinkhorn(logits, 20), rtol=1e-12, atol=1e-12)
    x = logits[:3].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: sinkhorn(t, 5), (x,))


def test_config_keys_architecture_and_counts():
    base = dict(n_layers=3, d_model=32, n_heads=4, vocab_size=101)
    names = {(): "HC n=4", (("hc_dynamic", False),): "HC static n=4"}
    for extra, name in names.items():
        assert DenseFormerConfig(connection="hc", **base, **dict(extra)).architecture == name
    assert DenseFormerConfig(connection="mhc", **base).architecture == "mHC n=4"
    assert DenseFormerConfig(connection="mhc", hc_streams=2, **base).architecture == "mHC n=2"
    for kw in CASES.values():
        cfg = DenseFormerConfig(**base, **kw)
        assert cfg.num_params() == DenseFormer(cfg).num_params()
    # flops: the Transformer's plus 6 x the connections' multiply-adds (HCLayout.n_macs).
    n, h, subs = 4, 32, 6
    plain = DenseFormerConfig(connection="none", **base).flops_per_token()
    static = DenseFormerConfig(connection="hc", hc_dynamic=False, **base).flops_per_token()
    assert static - plain == 6 * (subs * (n * n + 2 * n) * h + n * h)
    mhc = DenseFormerConfig(connection="mhc", **base).flops_per_token()
    assert mhc - plain == 6 * (subs * (n + 1) * (n * n + 2 * n) * h + n * h)


@pytest.mark.parametrize("kw,key,words", [
    (dict(connection="hc", hc_streams=0), "hc_streams", ">= 1"),
    (dict(connection="mhc", mhc_sinkhorn_iters=0), "mhc_sinkhorn_iters", ">= 1"),
    (dict(connection="mhc", hc_dynamic=True), "hc_dynamic", "mHC is dynamic by definition"),
    (dict(connection="hc", mhc_sinkhorn_iters=5), "mhc_sinkhorn_iters",
     "belongs to model.connection=mhc"),
    (dict(connection="dwa", hc_streams=2), "hc_streams", "belongs to model.connection=hc or mhc"),
    (dict(connection="attnres", hc_dynamic=False), "hc_dynamic", "belongs to model.connection=hc"),
])
def test_config_errors_name_the_key(kw, key, words):
    with pytest.raises(ModelConfigError, match=words) as err:
        DenseFormerConfig(n_layers=2, d_model=32, n_heads=4, **kw)
    assert err.value.key == key


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", [pytest.param("hc-n2-gpt", marks=pytest.mark.slow),
                                  pytest.param("hc-static-n4-gpt", marks=pytest.mark.slow),
                                  "mhc-n4-gpt"])
def test_cached_greedy_equals_full_forward_greedy(case):
    """The connections are per token: the KV cache is all the state a decoding step needs."""
    from pretrain.generation import generate
    from tests.test_generate import PROMPTS

    model = hc_model(dtype=torch.float32, init_std=0.3, **{**CASES[case], "seq_len": 40}).eval()
    cached = generate(model, PROMPTS, 12, greedy=True)
    reference = generate(model, PROMPTS, 12, greedy=True, use_cache=False)
    assert [c.tokens for c in cached] == [r.tokens for r in reference]
    assert len({t for c in cached for t in c.tokens}) > 4


def test_record_gives_every_sublayers_mhc_weights():
    """The weights as the model forms them (`record`, for analysis): H_res's columns sum to
    1, H_post lies in (0, 2) (the rows of these far-from-init H_res converge slower)."""
    model = hc_model(connection="mhc")
    record = {}
    from pretrain.model.program import run_program
    with torch.no_grad():
        x0 = model.embed(TOKENS)
        run_program(model.program, model.block, model.training_connections(x0, False, record),
                    {0: x0})
    assert sorted(record) == list(range(1, 7))
    for _, mix, post in record.values():
        assert (mix.sum(-2) - 1).abs().max() < 1e-12
        assert ((post > 0) & (post < 2)).all()
    assert math.isfinite(model.loss(TOKENS, TOKENS).item())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["hc-n4-llama",
                                  pytest.param("mhc-n2-llama", marks=pytest.mark.slow)])
def test_every_checkpointing_mode_gives_the_loss_and_gradients_of_none(case):
    """fp64, dropout on: a unit's input and output are the n-stream state, and it
    recomputes the mix into its first sub-layer (tests/test_checkpointing_attnres.py)."""
    from parallel.strategies.checkpointing import ActivationCheckpointing

    model = hc_model(**{**CASES[case], "dropout": 0.1})
    tokens = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(2))

    def run(mode: str, every: int):
        model.activation_checkpointing = None if mode == "none" else \
            ActivationCheckpointing(mode, every, recorder=units)
        torch.manual_seed(11)  # dropout
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        return loss.item(), grads(model, loss)

    units = []
    ref_loss, ref_grads = run("none", 1)
    for mode, every in [("block", 1), ("block", 2), ("dwa_block", 1), ("dwa_block", 3)]:
        units.clear()
        loss, got = run(mode, every)
        assert abs(loss - ref_loss) <= 1e-12, (mode, every)
        for name, ref in ref_grads.items():
            rel = ((got[name] - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            assert rel <= 1e-10, (mode, every, name, rel)
        n = model.config.hc_layout.streams
        assert len(units) == -(-3 // every)
        assert all(entry is None and [tuple(x.shape[-2:]) for x in held] == [(n, 32)]
                   for _, (entry, *held) in units)


def test_sweep_shorthands():
    from slurm.sweep_axes import parse_architecture

    assert parse_architecture("hc").overrides == {"model.connection": "hc",
                                                  "model.hc_dynamic": True}
    assert parse_architecture("hc-static").overrides == {"model.connection": "hc",
                                                         "model.hc_dynamic": False}
    assert parse_architecture("mhc").overrides == {"model.connection": "mhc"}
