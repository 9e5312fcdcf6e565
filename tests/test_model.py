"""DenseFormer model: DWA math against a naive reference, identity init, API contracts."""

import subprocess
import sys

import pytest
import torch

from pretrain.model import DenseFormer, DenseFormerConfig, ModelConfigError
from pretrain.model.dwa import depth_weighted_average
from tests.conftest import ROOT, cli_env

SHAPES = [  # (d, k, p, window)
    (4, 1, 1, None),   # 1x1: every DWA reads every earlier output
    (10, 4, 5, None),  # the paper's cheap variant
    (6, 4, 1, None),
    (3, 5, 1, None),   # k > d
    (4, 2, 7, None),   # p > d: no DWA at all
    (7, 3, 2, None),   # k and p not dividing d
    (6, 1, 1, 2),      # Last-K window
    (5, 1, 5, None),   # connect-to-last
]


def tiny(d, k=1, p=1, window=None, **kw):
    return DenseFormerConfig(n_layers=d, d_model=32, n_heads=2, vocab_size=50, seq_len=16,
                             dwa=True, dwa_dilation=k, dwa_period=p, dwa_window=window, **kw)


def random_alpha(model, gen):
    """Random alphas at exactly the connections docs/design.md#index-conventions defines."""
    cfg = model.config
    d, k, p = cfg.n_layers, cfg.dwa_dilation, cfg.dwa_period
    matrix = torch.zeros(d, d + 1)
    for i in range(1, d + 1):
        if i % p == 0:
            for j in range(i + 1):
                in_window = cfg.dwa_window is None or j > i - cfg.dwa_window
                if j % k == i % k and in_window:
                    matrix[i - 1, j] = torch.randn((), generator=gen).item()
        else:
            matrix[i - 1, i] = 1.0
    return matrix


def naive_forward(model, tokens, matrix):
    """Loop over the formula: Y_i = sum_j M[i-1, j] X_j with M the full (d, d+1) matrix."""
    xs = [model.embed(tokens)]
    y = xs[0]
    for i, block in enumerate(model.blocks, start=1):
        xs.append(block(y))
        y = sum(matrix[i - 1, j] * xs[j] for j in range(i + 1))
    return model.head(y)


@pytest.mark.gpu
@pytest.mark.parametrize("functional", [False, True], ids=["buffered", "functional"])
@pytest.mark.parametrize("d,k,p,window", SHAPES)
def test_dwa_matches_naive_formula(d, k, p, window, functional):
    torch.manual_seed(0)
    model = DenseFormer(tiny(d, k, p, window), seed=1)
    gen = torch.Generator().manual_seed(d * 100 + k * 10 + p)
    matrix = random_alpha(model, gen)
    model.load_dwa_matrix(matrix)
    assert torch.equal(model.dwa_matrix(), matrix)
    tokens = torch.randint(0, 50, (2, 16), generator=gen)

    out = model.head(model.run_blocks(model.embed(tokens), functional=functional))
    out.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    alpha = matrix.clone().requires_grad_(True)
    ref = naive_forward(model, tokens, alpha)
    ref.square().mean().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for name, param in model.named_parameters():
        if name == "dwa_alpha":
            expected = alpha.grad * model.dwa_mask
            torch.testing.assert_close(grads[name], expected, rtol=1e-4, atol=1e-6)
        else:
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("d,k,p,window", SHAPES)
def test_dwa_pattern_follows_the_definition(d, k, p, window):
    """The one DWAPattern against the set definition of docs/design.md#index-conventions,
    written out independently here."""
    pattern = tiny(d, k, p, window).dwa_pattern
    expected = {i: [j for j in range(i + 1) if j % k == i % k
                    and (window is None or j > i - window)]
                for i in range(1, d + 1) if i % p == 0}
    assert {i: list(js) for i, js in pattern.inputs.items()} == expected
    assert list(pattern.stored) == sorted({j for js in expected.values() for j in js})
    for j in pattern.stored:  # kept until the last DWA that reads it
        assert pattern.last_reader[j] == max(i for i, js in expected.items() if j in js)
    for i, js in expected.items():  # the buffered DWA reads S_i as one slice of its class
        r, start, stop = pattern.reads[i]
        assert r == i % k and [pattern.slot[j] for j in js] == [(r, n) for n in range(start,
                                                                                       stop)]
    assert sum(pattern.class_sizes.values()) == len(pattern.stored)
    mask = torch.tensor(pattern.mask())
    assert mask.shape == pattern.alpha_shape == (d, d + 1)
    assert int(mask.sum()) == pattern.n_connections == sum(map(len, expected.values()))
    init = torch.tensor(pattern.initial_alpha())
    assert torch.equal(init, torch.tensor([[float(i in expected and j == i)
                                            for j in range(d + 1)] for i in range(1, d + 1)]))


def test_dwa_pattern_is_built_once_per_shape_and_handed_to_the_model():
    cfg = tiny(7, 3, 2)
    assert cfg.dwa_pattern is tiny(7, 3, 2).dwa_pattern
    assert DenseFormer(cfg).dwa_pattern is cfg.dwa_pattern
    assert tiny(7, 3, 2, window=2).dwa_pattern is not cfg.dwa_pattern
    plain = DenseFormerConfig(**{**vars(cfg), "dwa": False})
    assert not plain.dwa_pattern.inputs and plain.dwa_pattern.n_connections == 0


def test_model_config_arithmetic_does_not_import_torch():
    """Parameter counts and FLOPs (config validation, the sweep expander) stay torch-free."""
    code = ("import sys; from pretrain.model.config import DenseFormerConfig as C; "
            "c = C(n_layers=48, d_model=768, n_heads=12, vocab_size=50304, dwa_dilation=4, "
            "dwa_period=5); c.num_params(); c.flops_per_token(); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=cli_env(), cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.gpu
def test_identity_init_equals_transformer():
    tokens = torch.randint(0, 50, (2, 16))
    dense = DenseFormer(tiny(5, 1, 1), seed=3)
    plain = DenseFormer(DenseFormerConfig(**{**vars(tiny(5)), "dwa": False}), seed=3)
    gains = DenseFormer(DenseFormerConfig(**{**vars(tiny(5)), "dwa": False, "skip_gains": True}),
                        seed=3)
    assert torch.equal(dense(tokens), plain(tokens))
    assert torch.equal(gains(tokens), plain(tokens))


def test_connect_to_last_init():
    model = DenseFormer(tiny(4, 1, 4, dwa_init_offdiag=1e-4))
    row = model.dwa_matrix()[3]
    assert torch.allclose(row, torch.tensor([1e-4, 1e-4, 1e-4, 1e-4, 1.0]))


def test_efficient_dwa_equals_naive_sum():
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 3, 4, generator=gen, requires_grad=True) for _ in range(5)]
    w = torch.randn(5, generator=gen, requires_grad=True)
    out = depth_weighted_average(w, xs)
    g = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, [w, *xs], g)
    ref = sum(w[n] * xs[n] for n in range(5))
    want = torch.autograd.grad(ref, [w, *xs], g)
    torch.testing.assert_close(out, ref)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_activation_checkpointing_gives_same_gradients():
    from torch.utils.checkpoint import checkpoint

    model = DenseFormer(tiny(4, 2, 1), seed=0)
    model.load_dwa_matrix(random_alpha(model, torch.Generator().manual_seed(5)))
    tokens = torch.randint(0, 50, (2, 16))
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    def checkpointed(forward):
        return lambda y: checkpoint(forward, y, use_reentrant=False)

    for block in model.blocks:  # recompute every block's internals in backward
        block.forward = checkpointed(block.forward)
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_compiles_without_graph_breaks():
    model = DenseFormer(tiny(3, 1, 1), seed=0)
    tokens = torch.randint(0, 50, (2, 16))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(tokens), model(tokens))


@pytest.mark.gpu
def test_api_shapes_and_padding():
    cfg = tiny(2)
    model = DenseFormer(cfg)
    tokens = torch.randint(0, 50, (3, 16))
    x0 = model.embed(tokens)
    assert x0.shape == (3, 16, 32)
    assert model.blocks[0](x0).shape == (3, 16, 32)
    assert model(tokens).shape == (3, 16, 50)  # padded vocab (128) removed
    assert model.local_logits(x0)[..., 50:].max() < -1e30  # padding is never predicted


def test_load_dwa_matrix_rejects_weight_outside_pattern():
    model = DenseFormer(tiny(4, 2, 2))
    matrix = model.dwa_matrix()
    matrix[1, 1] = 0.5  # X_1 is in class 1, the DWA after block 2 reads class 0
    with pytest.raises(ValueError, match="outside the 2x2 pattern"):
        model.load_dwa_matrix(matrix)
    matrix = model.dwa_matrix()
    matrix[0, 0] = 0.5  # block 1 has no DWA (p=2)
    with pytest.raises(ValueError, match="row 0"):
        model.load_dwa_matrix(matrix)


@pytest.mark.parametrize("d,expected", [(48, 378.45e6), (72, 548.35e6), (90, 675.78e6)])
def test_paper_parameter_counts(d, expected):
    cfg = DenseFormerConfig(n_layers=d, d_model=768, n_heads=12, vocab_size=50304, seq_len=256,
                            dwa=False)
    assert abs(cfg.num_params() - expected) / expected < 1e-3
    dense = DenseFormerConfig(**{**vars(cfg), "dwa": True})
    assert dense.num_params() - cfg.num_params() == d * (d + 3) // 2


@pytest.mark.gpu
def test_param_count_matches_built_model_and_meta_build():
    cfg = tiny(6, 4, 5)
    assert DenseFormer(cfg).num_params() == cfg.num_params()
    with torch.device("meta"):
        meta = DenseFormer(DenseFormerConfig(n_layers=48, d_model=768, n_heads=12,
                                             vocab_size=50304, seq_len=256, dwa_dilation=4,
                                             dwa_period=5))
    assert meta.num_params() - meta.num_params(non_embedding=True) == 50304 * 768
    assert meta.config.num_params() - DenseFormerConfig(
        **{**vars(meta.config), "dwa": False}).num_params() == 62


@pytest.mark.parametrize("field,value", [("dwa_dilation", 0), ("dwa_period", -1),
                                         ("n_heads", 5), ("dwa_window", 0)])
def test_invalid_model_config_names_the_field(field, value):
    with pytest.raises(ModelConfigError, match=field if field != "n_heads" else "heads"):
        DenseFormerConfig(**{**vars(tiny(4)), field: value})


@pytest.mark.parametrize("functional", [False, True], ids=["buffered", "functional"])
def test_bf16_autocast_runs_and_stays_close_to_fp32(functional):
    """bf16 is for GPUs (CPU bf16 matmul is ~100x slower): check correctness on a tiny shape."""
    model = DenseFormer(tiny(4, 2, 1), seed=0)
    model.load_dwa_matrix(random_alpha(model, torch.Generator().manual_seed(3)))
    tokens = torch.randint(0, 50, (2, 17), generator=torch.Generator().manual_seed(4))

    def loss():
        logits = model.local_logits(model.run_blocks(model.embed(tokens[:, :-1]), functional))
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 tokens[:, 1:].flatten())

    reference = loss()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = loss()
    low.backward()
    assert abs(low.item() - reference.item()) < 0.05
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
