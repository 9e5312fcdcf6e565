"""benchmarks/bench_model.py: its reference DWA computes our DWA's function, and it runs."""

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from tests.conftest import ROOT, cli_env

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_model import (  # noqa: E402
    Scale,
    config,
    interleaved,
    median_ratio,
    parse_args,
    train_steps,
)
from nanogpt_anchor import AnchorGPT, ReferenceDWA  # noqa: E402

from pretrain.model import DenseFormer  # noqa: E402


@pytest.mark.parametrize("pattern", ["1x1", "4x5"])
def test_reference_dwa_equals_ours(pattern):
    args = parse_args(["--layers", "10", "--width", "8", "--heads", "1", "--seq", "4",
                       "--vocab", "16"])
    ours = DenseFormer(config(args, pattern))
    reference = ReferenceDWA(10, *map(int, pattern.split("x")))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for i, js in ours.dwa_pattern.inputs.items():
            values = torch.randn(len(js), generator=gen)
            ours.dwa_alpha[i - 1, list(js)] = values
            reference.alphas[reference.index[i]].copy_(values)
    anchor = AnchorGPT(1, 8, 1, 1, 8, reference)
    ours.blocks = anchor.blocks = nn.ModuleList(Scale() for _ in range(10))
    x0 = torch.randn(2, 4, 8, generator=gen)
    y_ours, y_ref = ours.run_blocks(x0), anchor.run_blocks(x0)
    torch.testing.assert_close(y_ref, y_ours)
    g_ours = torch.autograd.grad(y_ours.square().sum(), ours.dwa_alpha)[0]
    g_ref = torch.autograd.grad(y_ref.square().sum(), list(reference.alphas))
    for i, js in ours.dwa_pattern.inputs.items():
        torch.testing.assert_close(g_ref[reference.index[i]], g_ours[i - 1, list(js)])


def test_anchor_with_rope_is_our_transformer():
    """`anchor-rope` is our architecture: given our Transformer's weights it gives its loss
    and gradients (our QKV rows are (head, q|k|v, head_dim), nanoGPT's (q|k|v, head,
    head_dim))."""
    args = parse_args(["--layers", "3", "--width", "16", "--heads", "2", "--seq", "8",
                       "--vocab", "40"])
    ours = DenseFormer(config(args, None))
    anchor = AnchorGPT(3, 16, 2, 8, 40, rope=True)
    names = {"wte.weight": "embedding.weight", "ln_f.weight": "final_norm.weight"}
    for i in range(3):
        for theirs, mine in (("ln_1", "norm_attn"), ("attn.qkv", "attn.qkv"),
                             ("attn.proj", "attn.proj"), ("ln_2", "norm_mlp"),
                             ("mlp.fc", "mlp.fc_in"), ("mlp.proj", "mlp.fc_out")):
            names[f"blocks.{i}.{theirs}.weight"] = f"blocks.{i}.{mine}.weight"
    params = dict(ours.named_parameters())

    def mapped(theirs: str, grad: bool = False) -> torch.Tensor:
        value = params[names[theirs]]
        value = value.grad if grad else value
        if theirs == "wte.weight":
            return value[:40]  # our vocabulary is padded
        if theirs.endswith("attn.qkv.weight"):  # (head, q|k|v, d) -> (q|k|v, head, d)
            return value.view(2, 3, 8, 16).transpose(0, 1).reshape(48, 16)
        return value

    with torch.no_grad():
        for name, p in anchor.named_parameters():
            p.copy_(mapped(name))
    tokens = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    loss_ours = ours.loss(tokens[:, :-1], tokens[:, 1:])
    loss_anchor = anchor(tokens[:, :-1], tokens[:, 1:])
    torch.testing.assert_close(loss_anchor, loss_ours, rtol=1e-6, atol=1e-6)
    loss_ours.backward()
    loss_anchor.backward()
    for name, p in anchor.named_parameters():
        torch.testing.assert_close(p.grad, mapped(name, grad=True), rtol=1e-5, atol=1e-6)


def test_ratio_to_a_known_slowed_variant_survives_drift_and_a_disturbed_round():
    """Interleaved rounds on a clock the runs advance: the variant costs 1.5x the baseline,
    the machine slows down round by round, and one round of the baseline is disturbed
    tenfold. The benchmark's ratio is 1.5 exactly; the ratio of the medians is not."""
    clock = [0.0]
    drift = [1.0, 1.0, 1.3, 1.7, 2.2, 2.8]  # per call: a warm-up, then rounds 0-4
    disturbed = {3: 10.0}  # the baseline's round 2 (its call 3)
    calls = {"transformer": 0, "slowed": 0}

    def run(name: str, cost: float):
        def step():
            n = calls[name]
            calls[name] += 1
            clock[0] += cost * drift[n] * (disturbed.get(n, 1.0) if name == "transformer"
                                           else 1.0)
        return step

    times = interleaved({"transformer": run("transformer", 0.2), "slowed": run("slowed", 0.3)},
                        rounds=5, clock=lambda: clock[0])
    assert calls == {"transformer": 6, "slowed": 6}  # one warm-up each, left out of times
    assert times["slowed"] == pytest.approx([0.3 * d for d in drift[1:]])
    assert median_ratio(times["slowed"], times["transformer"]) == pytest.approx(1.5)
    assert median_ratio(times["transformer"], times["slowed"]) == pytest.approx(1 / 1.5)
    medians = sorted(times["slowed"])[2] / sorted(times["transformer"])[2]
    assert medians != pytest.approx(1.5, rel=0.05)  # what the per-round ratio protects from


@pytest.mark.slow  # ~20 s of a benchmark run; its reference DWA is checked above
def test_benchmark_runs_every_configuration():
    cmd = [sys.executable, str(ROOT / "benchmarks/bench_model.py"), "--layers", "5",
           "--width", "16", "--heads", "2", "--seq", "8", "--batch", "1", "--vocab", "32",
           "--rounds", "1", "--llama"]
    done = subprocess.run([*cmd, "--json"], capture_output=True, text=True, env=cli_env(),
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert {"anchor", "anchor-rope", "dense-4x1", "reference-4x5",
            "llama-4x5", "mudd", "mudd-static"} <= results["variants"].keys()
    for name, row in results["variants"].items():  # every variant measured, ratios positive
        assert row["median_step_s"] > 0 and row["ratio_vs_transformer"] > 0, name
        assert row.get("ratio_vs_llama_transformer", 1) > 0, name
    assert results["dwa_alone"]["ours-1x1"]["floor_mib"] > 0


def test_only_restricts_the_variants_to_those_named_and_the_transformer():
    args = parse_args(["--layers", "2", "--width", "16", "--heads", "2", "--seq",
                                   "8", "--batch", "1", "--vocab", "32", "--only", "mudd"])
    assert set(train_steps(args)) == {"transformer", "mudd"}


def test_a_bad_official_checkout_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--official", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--official" in err and "DWAModules" in err
