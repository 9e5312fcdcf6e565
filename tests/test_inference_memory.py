"""The inference memory estimate (parallel/strategies/inference_memory.py) against measured bytes.

A tiny model runs a prefill and a decoding step through `DenseFormer.forward_cached` with a
`KVCache`, as pretrain/generation.py drives it; measured are the parameters' bytes,
`KVCache.nbytes`, `DecodeDWAState.nbytes`, the bytes of the X_j a `PrefillDWAState` holds at
its fullest (a recording subclass put in the model module's place for the call) and the
logits' storage. fp32 on CPU must match exactly; CPU bf16 autocast checks the dtype of every
term but autocast's weight copies, which are not observable there.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from parallel.strategies.inference_memory import estimate_inference, prefill_peak_tensors
from tests.conftest import ROOT, cli_env

SHAPES = {
    "transformer": dict(n_layers=3, dwa=False),
    "1x1": dict(n_layers=4),
    "4x5": dict(n_layers=10, dwa_dilation=4, dwa_period=5),
    "last-2": dict(n_layers=5, dwa_window=2),
}


def model_config(shape: str, **overrides):
    from pretrain.model.config import DenseFormerConfig

    return DenseFormerConfig(**{**dict(d_model=32, n_heads=4, vocab_size=101, seq_len=24),
                                **SHAPES[shape], **overrides})


def estimated(config, tp: int, batch: int, context: int, prompt: int, dtype: str) -> dict:
    from parallel.strategies.memory import local_parameters

    parameters = local_parameters(config, tp, range(1, config.n_layers + 1), True, True,
                                  decay_alphas=False)
    ranks = estimate_inference(config, parameters, tp, batch, context, prompt, dtype)
    assert all(r.as_json() | {"rank": 0} == ranks[0].as_json() for r in ranks)
    return ranks[0].as_json()


def _nbytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def measure(shape: str, batch: int, context: int, prompt: int, autocast: bool = False) -> dict:
    """Bytes a prefill of `prompt` tokens and one decoding step really hold, keyed as the
    estimate's JSON (without the autocast weight copies and the totals)."""
    from pretrain.generation import KVCache
    from pretrain.model import denseformer
    from pretrain.model.dwa_inference import PrefillDWAState

    states = []

    class RecordingPrefill(PrefillDWAState):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.peak_bytes = 0
            states.append(self)

        def keep(self, j: int, x: torch.Tensor) -> None:
            super().keep(j, x)
            self.peak_bytes = max(self.peak_bytes, _nbytes(self.kept.values()))

    model = denseformer.DenseFormer(model_config(shape), seed=1).eval()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 101, (batch, prompt + 1), generator=generator)
    cache = KVCache(len(model.blocks), context)
    original = denseformer.PrefillDWAState
    denseformer.PrefillDWAState = RecordingPrefill
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            cache.positions = torch.arange(prompt).expand(batch, prompt)
            cache.mask, cache.is_causal = None, True
            prefill_logits = model.forward_cached(tokens[:, :prompt], cache)
            cache.length = prompt
            cache.positions = torch.full((batch, 1), prompt)
            cache.mask, cache.is_causal = None, False
            decode_logits = model.forward_cached(tokens[:, prompt:], cache)
    finally:
        denseformer.PrefillDWAState = original
    assert states[0].peak == prefill_peak_tensors(model.dwa_pattern)
    logits = _nbytes([prefill_logits])
    assert _nbytes([decode_logits]) == logits
    return {"weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "kv_cache_bytes": cache.nbytes,
            "dwa_decode_bytes": 0 if cache.dwa_decode is None else cache.dwa_decode.nbytes,
            "dwa_prefill_peak_bytes": states[0].peak_bytes, "logits_bytes": logits}


def without_copies_and_totals(terms: dict) -> dict:
    return {k: v for k, v in terms.items()
            if k not in ("rank", "weight_copies_bytes", "prefill_total_bytes",
                         "decode_total_bytes")}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape,batch,context,prompt", [
    ("1x1", 2, 9, 6), ("4x5", 3, 12, 5), ("transformer", 2, 8, 7), ("last-2", 1, 10, 4)])
def test_estimate_equals_measured_bytes_fp32(shape, batch, context, prompt):
    measured = measure(shape, batch, context, prompt)
    estimate = estimated(model_config(shape), 1, batch, context, prompt, "fp32")
    assert without_copies_and_totals(estimate) == measured
    assert estimate["weight_copies_bytes"] == 0
    assert estimate["prefill_total_bytes"] == sum(measured.values()) - \
        measured["dwa_decode_bytes"]
    assert estimate["decode_total_bytes"] == sum(measured.values()) - \
        measured["dwa_prefill_peak_bytes"]
    if shape != "transformer":  # not an empty check
        assert measured["dwa_decode_bytes"] > 0 and measured["dwa_prefill_peak_bytes"] > 0


@pytest.mark.timeout(60)
def test_bf16_autocast_dtypes_of_each_term():
    """KV cache and logits in bf16, the DWA states in the fp32 residual stream, weights fp32."""
    measured = measure("4x5", 2, 10, 6, autocast=True)
    estimate = estimated(model_config("4x5"), 1, 2, 10, 6, "bf16")
    assert without_copies_and_totals(estimate) == measured
    fp32 = estimated(model_config("4x5"), 1, 2, 10, 6, "fp32")
    assert 2 * estimate["kv_cache_bytes"] == fp32["kv_cache_bytes"]
    assert estimate["dwa_decode_bytes"] == fp32["dwa_decode_bytes"]
    # bf16 copies of the matmul weights: every parameter but the LayerNorm gains and alphas.
    config = model_config("4x5")
    small = config.n_layers * 2 * config.d_model + config.d_model + \
        config.n_layers * (config.n_layers + 1)
    assert estimate["weight_copies_bytes"] == 2 * (estimate["weights_bytes"] // 4 - small)


def last_readers(d: int, k: int, p: int | None, window: int | None) -> dict[int, int]:
    """Straight from the formula S_i = {j <= i: j = i (mod k), j > i - window}: {j: last i}."""
    last = {}
    for i in range(p or d + 1, d + 1, p or 1):
        for j in range(i + 1):
            if j % k == i % k and (window is None or j > i - window):
                last[j] = i
    return last


@pytest.mark.parametrize("d,k,p,window", [(4, 1, 1, None), (10, 4, 5, None), (48, 4, 5, None),
                                          (48, 1, 1, None), (12, 2, 3, 4), (6, 1, 6, None),
                                          (5, 1, 1, 2), (3, 1, None, None)])
def test_prefill_peak_is_the_most_outputs_live_at_once(d, k, p, window):
    from pretrain.model.dwa_pattern import DWAPattern

    last = last_readers(d, k, p, window)
    live = [sum(1 for j, reader in last.items() if j <= i <= reader) for i in range(d + 1)]
    assert prefill_peak_tensors(DWAPattern(d, k, p, window)) == max(live, default=0)


def test_tp2_splits_heads_and_matmul_weights_only():
    config = model_config("1x1", d_model=64, n_heads=8, vocab_size=300)
    one, two = (estimated(config, tp, 3, 20, 11, "bf16") for tp in (1, 2))
    d, h, heads, v = config.n_layers, config.d_model, config.n_heads, config.padded_vocab_size
    assert two["kv_cache_bytes"] == 2 * d * 3 * (heads // 2) * 20 * (h // heads) * 2
    assert 2 * two["kv_cache_bytes"] == one["kv_cache_bytes"]
    matmul = v * h + d * (4 + 2 * config.mlp_ratio) * h * h  # embedding, qkv, proj, MLP
    small = d * 2 * h + h + d * (d + 1)  # LayerNorm gains, final norm, alpha matrix
    assert two["weights_bytes"] == 4 * (matmul // 2 + small)
    assert one["weights_bytes"] == 4 * (matmul + small)
    assert two["weight_copies_bytes"] == 2 * matmul // 2
    for key in ("dwa_decode_bytes", "dwa_prefill_peak_bytes", "logits_bytes"):
        assert two[key] == one[key]  # the residual stream and the gathered logits are whole
    assert two["logits_bytes"] == 3 * v * 2


def test_out_of_range_requests_name_the_option():
    config = model_config("1x1")
    for args, option in [((3, 1, 9, 9), "--world-size"), ((1, 0, 9, 9), "--batch"),
                         ((1, 1, 25, 9), "--context"), ((1, 1, 9, 10), "--prompt")]:
        with pytest.raises(ValueError, match=option):
            estimated(config, *args, "fp32")


# -- the command line ------------------------------------------------------------------------


def memory_cli(capsys, *args: str) -> tuple[int, str, str]:
    from parallel.cli.memory import main

    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


PAPER_4X5 = ["--config", "configs/paper/dense-48-4x5.yaml", "--inference", "--batch", "2",
             "--context", "256", "--prompt", "200"]


def test_cli_json_per_rank_equals_the_estimate(capsys):
    from pretrain.config import load_config

    status, out, _ = memory_cli(capsys, *PAPER_4X5, "--world-size", "2", "--json")
    assert status == 0
    document = json.loads(out)
    assert document["inference"] == {"batch": 2, "context": 256, "prompt": 200,
                                     "dtype": "bf16", "tp": 2}
    model = load_config(ROOT / "configs/paper/dense-48-4x5.yaml").model
    expected = estimated(model, 2, 2, 256, 200, "bf16")
    assert [r["rank"] for r in document["ranks"]] == [0, 1]
    assert all(r | {"rank": 0} == expected for r in document["ranks"])


def test_cli_text_per_dtype(capsys):
    status, out, _ = memory_cli(capsys, *PAPER_4X5, "--device", "cpu")
    assert status == 0
    assert "48 blocks x 768 DenseFormer 4x5" in out and "fp32, tp 1" in out
    for row in ("weights", "KV cache", "DWA state, prefill", "DWA state, decode", "logits",
                "total at prefill", "total at decode"):
        assert f"  {row} " in out, row
    assert "autocast weight copies" not in out
    status, out, _ = memory_cli(capsys, *PAPER_4X5)
    assert status == 0 and "autocast weight copies" in out and "bf16" in out


def test_cli_bad_requests_exit_2_naming_them(capsys):
    cases = [(["--context", "257"], "--context"), (["--world-size", "5"], "--world-size"),
             (["--world-size", "0"], "--world-size"), (["--batch", "0"], "--batch"),
             (["--set", "model.n_layers=0"], "model.n_layers")]
    for extra, name in cases:
        status, out, err = memory_cli(capsys, *PAPER_4X5, *extra)
        assert status == 2 and name in err and out == "", (extra, err)
    for args, message in [(["--inference"], "one of the arguments --config --run is required"),
                          (PAPER_4X5[:2] + ["--batch", "2"], "need --inference")]:
        with pytest.raises(SystemExit) as exited:
            memory_cli(capsys, *args)
        assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_cli_run_dir_reads_its_config_and_tokenizer(tiny_data, tmp_path):
    """--run DIR: the run's config.yaml; a null vocabulary from the run's tokenizer copy."""
    from data_pipeline.tokenizer import copy_tokenizer
    from pretrain.config import load_config, save_config

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_config(load_config(ROOT / "configs/tiny.yaml", ["data.path=null"]),
                run_dir / "config.yaml")
    args = ["-m", "parallel.memory", "--run", str(run_dir), "--inference",
            "--context", "64", "--device", "cpu", "--json"]
    missing = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                             timeout=60, env=cli_env(), cwd=ROOT)
    assert missing.returncode == 2 and "tokenizer" in missing.stderr and missing.stdout == ""
    copy_tokenizer(tiny_data, run_dir)
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60,
                          env=cli_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    model = load_config(ROOT / "configs/tiny.yaml", ["model.vocab_size=512"]).model
    assert json.loads(done.stdout)["ranks"] == [estimated(model, 1, 1, 64, 64, "fp32")]


# -- Attention Residuals: no decoding state, the program's held X_j per forward ---------------

ATTNRES = {"attnres-full": dict(n_layers=3, connection="attnres"),
           "attnres-3": dict(n_layers=3, connection="attnres", attnres_blocks=3,
                             block="llama")}


def measure_attnres(shape: str, batch: int, context: int, prompt: int) -> dict:
    """As `measure`, the X_j that `ProgramRun` holds at its fullest in the prefill and in a
    decoding step standing for the DWA states (a recording `keep` in the class's place)."""
    from pretrain.generation import KVCache
    from pretrain.model import DenseFormer, DenseFormerConfig
    from pretrain.model.program import ProgramRun

    peaks = []
    original = ProgramRun.keep

    def keep(self, output, value):
        original(self, output, value)
        peaks[-1] = max(peaks[-1], _nbytes(self.held.values()))

    model = DenseFormer(DenseFormerConfig(d_model=32, n_heads=4, vocab_size=101, seq_len=24,
                                          **ATTNRES[shape]), seed=1).eval()
    tokens = torch.randint(0, 101, (batch, prompt + 1),
                           generator=torch.Generator().manual_seed(0))
    cache = KVCache(len(model.blocks), context)
    ProgramRun.keep = keep
    try:
        peaks.append(0)
        cache.positions = torch.arange(prompt).expand(batch, prompt)
        cache.mask, cache.is_causal = None, True
        logits = model.forward_cached(tokens[:, :prompt], cache)
        cache.length = prompt
        cache.positions = torch.full((batch, 1), prompt)
        cache.mask, cache.is_causal = None, False
        peaks.append(0)
        model.forward_cached(tokens[:, prompt:], cache)
    finally:
        ProgramRun.keep = original
    return {"weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "kv_cache_bytes": cache.nbytes, "dwa_decode_bytes": peaks[1],
            "dwa_prefill_peak_bytes": peaks[0], "logits_bytes": _nbytes([logits])}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", list(ATTNRES))
def test_attnres_estimate_equals_measured_bytes_fp32(shape):
    from pretrain.model.config import DenseFormerConfig

    config = DenseFormerConfig(d_model=32, n_heads=4, vocab_size=101, seq_len=24,
                               **ATTNRES[shape])
    measured = measure_attnres(shape, 2, 9, 6)
    estimate = estimated(config, 1, 2, 9, 6, "fp32")
    assert without_copies_and_totals(estimate) == measured
    # Full AttnRes holds every X_j to the output's mix; 3 groups of 2 sub-layers the
    # embedding and the 3 group sums (X_0, X_2, X_4, X_6) that the output's mix reads.
    held = 2 * 3 + 1 if shape == "attnres-full" else 4
    assert measured["dwa_decode_bytes"] == held * 2 * 32 * 4
    assert measured["dwa_prefill_peak_bytes"] == 6 * measured["dwa_decode_bytes"]


@pytest.mark.parametrize("d", [1, 2, 3, 6])
def test_attnres_peak_held_is_the_programs(d):
    from pretrain.model.attnres_layout import AttnResLayout
    from pretrain.model.attnres_program import attnres_program

    for blocks in [None, *(n for n in range(1, 2 * d + 1) if 2 * d % n == 0)]:
        layout = AttnResLayout(d, blocks)
        assert layout.peak_held() == attnres_program(layout).peak_held(), (d, blocks)
    assert AttnResLayout(d).peak_held() == 2 * d + 1
    assert AttnResLayout(d, 1).peak_held() == 2  # X_0 and the one running sum


def test_cli_text_of_an_attnres_config(capsys):
    status, out, _ = memory_cli(capsys, "--config", "configs/tiny.yaml", "--inference",
                                "--set", "model.vocab_size=300",
                                "--set", "model.connection=attnres",
                                "--set", "model.attnres_blocks=2")
    assert status == 0 and "AttnRes block 2" in out
    assert "  AttnRes X_j, prefill " in out and "  AttnRes X_j, decode " in out
