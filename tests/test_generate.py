"""Generation: the KV cache against the full forward, batching, TP, the DWA state, the CLI.

Models are tiny, with random weights drawn larger than training's init (init_std 0.3) and
off-diagonal alphas (0.3), so that tokens depend on the whole context and every DWA input.
"""

import json
import subprocess
import sys

import pytest
import torch

from pretrain.generation import FINISH_EOS, FINISH_LENGTH, KVCache, context_budgets, generate
from tests.conftest import ROOT, cli_env
from tests.distributed import run_distributed_test
from tests.test_train import run, train_cmd

SHAPES = {
    "transformer": dict(n_layers=3, dwa=False),
    "1x1": dict(n_layers=4),
    "4x5": dict(n_layers=10, dwa_dilation=4, dwa_period=5),
    "last-2": dict(n_layers=5, dwa_window=2),
}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [9, 1, 2, 3], [60]]


def tiny_model(shape: str, seq_len: int = 40, dwa_dtype: str = "fp32"):
    from pretrain.model import DenseFormer, DenseFormerConfig

    config = DenseFormerConfig(d_model=32, n_heads=4, vocab_size=101, seq_len=seq_len,
                               init_std=0.3, dwa_init_offdiag=0.0 if shape == "transformer"
                               else 0.3, dwa_dtype=dwa_dtype, **SHAPES[shape])
    return DenseFormer(config, seed=1).eval()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cached_greedy_equals_full_forward_greedy(shape):
    model = tiny_model(shape)
    cached = generate(model, PROMPTS, 12, greedy=True)
    reference = generate(model, PROMPTS, 12, greedy=True, use_cache=False)
    assert [c.tokens for c in cached] == [r.tokens for r in reference]
    assert all(len(c.tokens) == 12 and c.finish_reason == FINISH_LENGTH for c in cached)
    # Not a degenerate model that repeats one token.
    assert len({t for c in cached for t in c.tokens}) > 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape,dwa_dtype", [("1x1", "fp32"), ("4x5", "fp32"), ("1x1", "bf16")])
def test_cached_logits_match_the_training_forward(shape, dwa_dtype):
    """A padded prefill then single-token steps give the training forward's logits (with
    bf16 DWA storage too: the cached DWA state rounds the X_j as training stores them)."""
    _check_cached_logits(tiny_model(shape, dwa_dtype=dwa_dtype))


def _check_cached_logits(model) -> KVCache:
    """A padded prefill, then single-token steps, against the training forward of each row
    (row 1 is the last 9 tokens of its sequence, left-padded by 3); returns the cache."""
    from pretrain.generation import _Batch

    tokens = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(0))
    full = [model(tokens[:1]), model(tokens[1:, 3:])]
    batch = _Batch([tokens[0, :6].tolist(), tokens[1, 3:6].tolist()], 12, 40,
                   torch.device("cpu"))
    cache = KVCache(len(model.blocks), 12)
    cache.positions, cache.mask, cache.is_causal = batch.positions(0, 6), \
        batch.prefill_mask(), False
    logits = [model.forward_cached(batch.tokens, cache, last_only=False)]
    cache.length = 6
    for slot in range(6, 12):
        cache.positions, cache.mask = batch.positions(slot, slot + 1), batch.decode_mask(slot + 1)
        logits.append(model.forward_cached(tokens[:, slot:slot + 1], cache))
        cache.length = slot + 1
    logits = torch.cat(logits, dim=1)
    torch.testing.assert_close(logits[0], full[0][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1, 3:], full[1][0], rtol=1e-4, atol=1e-4)
    return cache


ATTNRES = {"full-gpt": dict(block="gpt"), "full-llama": dict(block="llama"),
           "block3-gpt": dict(block="gpt", attnres_blocks=3),
           "block3-llama": dict(block="llama", attnres_blocks=3)}


def tiny_attnres_model(shape: str):
    """3 blocks with Attention Residuals; queries drawn away from their zero init so that
    every consumer's weights differ from uniform and between tokens."""
    from pretrain.model import DenseFormer, DenseFormerConfig

    config = DenseFormerConfig(d_model=32, n_heads=4, vocab_size=101, seq_len=40, n_layers=3,
                               init_std=0.3, connection="attnres", **ATTNRES[shape])
    model = DenseFormer(config, seed=1).eval()
    with torch.no_grad():
        model.attnres_query.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    return model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", list(ATTNRES))
def test_attnres_cached_greedy_equals_full_forward_greedy(shape):
    model = tiny_attnres_model(shape)
    cached = generate(model, PROMPTS, 12, greedy=True)
    reference = generate(model, PROMPTS, 12, greedy=True, use_cache=False)
    assert [c.tokens for c in cached] == [r.tokens for r in reference]
    assert len({t for c in cached for t in c.tokens}) > 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", ["full-llama", "block3-gpt"])
def test_attnres_cached_logits_match_the_training_forward(shape):
    """A padded prefill then single-token steps: the depth mix of each new token reads that
    token's sub-layer outputs alone, so the KV cache is all that carries over."""
    cache = _check_cached_logits(tiny_attnres_model(shape))
    assert cache.dwa_decode is None  # no state of the connection between steps


@pytest.mark.timeout(60)
def test_batched_equals_one_prompt_at_a_time():
    model = tiny_model("4x5")
    batched = generate(model, PROMPTS, 10, greedy=True)
    alone = [generate(model, [prompt], 10, greedy=True)[0] for prompt in PROMPTS]
    assert batched == alone


def pattern_tables(d: int, k: int, p: int | None, window: int | None):
    """Straight from the formula: {j: last i whose DWA reads X_j} (docs/design.md)."""
    last = {}
    for i in range(1, d + 1):
        if p is None or i % p:
            continue
        for j in range(0, i + 1):
            if j % k == i % k and (window is None or j > i - window):
                last[j] = i
    return last


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_dwa_state_holds_exactly_what_the_pattern_implies(shape):
    from pretrain.model import dwa_inference as dwa

    model = tiny_model(shape)
    cfg = model.config
    last = pattern_tables(cfg.n_layers, cfg.dwa_dilation, cfg.dwa_period if cfg.dwa else None,
                          cfg.dwa_window)
    peaks = []
    original = dwa.PrefillDWAState.combine

    def spy(self, i, live):
        peaks.append(len(self.kept))
        return original(self, i, live)

    dwa.PrefillDWAState.combine = spy
    try:
        generate(model, PROMPTS[:3], 4, greedy=True)
    finally:
        dwa.PrefillDWAState.combine = original
    # Prefill: before DWA i, exactly the X_j (j <= i) some DWA at or after i still reads.
    dwa_blocks = [i for i in range(1, cfg.n_layers + 1) if cfg.dwa and i % cfg.dwa_period == 0]
    assert peaks == [sum(1 for j, reader in last.items() if j <= i <= reader)
                     for i in dwa_blocks]
    # Decoding: one tensor of the current token per X_j that some DWA reads, no more.
    cache = KVCache(len(model.blocks), 8)
    from pretrain.generation import _Batch

    batch = _Batch([[1, 2, 3], [4, 5]], 8, cfg.seq_len, torch.device("cpu"))
    cache.positions, cache.mask = batch.positions(0, 3), batch.prefill_mask()
    model.forward_cached(batch.tokens, cache)
    cache.length = 3
    cache.positions, cache.mask = batch.positions(3, 4), batch.decode_mask(4)
    model.forward_cached(torch.tensor([[7], [8]]), cache)
    if not last:
        assert cache.dwa_decode is None or cache.dwa_decode.num_tensors == 0
        return
    state = cache.dwa_decode
    assert state.num_tensors == len(last)
    assert all(v.shape[1:] == (2, 1, cfg.d_model) for v in state.values.values())
    assert state.nbytes == len(last) * 2 * cfg.d_model * 4


def generate_on_ranks(shape: str) -> dict:
    model = tiny_model(shape)
    greedy = generate(model, PROMPTS, 8, greedy=True)
    sampled = generate(model, PROMPTS, 8, seed=5, top_k=30, top_p=0.95)
    return {"greedy": [c.tokens for c in greedy], "sampled": [c.tokens for c in sampled]}


@pytest.mark.timeout(180)
def test_tp2_equals_tp1():
    one = generate_on_ranks("1x1")
    two = run_distributed_test(generate_on_ranks, world_size=2, timeout_s=150, tp=2,
                               shape="1x1")
    assert two[0] == two[1] == one


@pytest.mark.timeout(60)
def test_sampling_is_reproducible_and_options_filter():
    model = tiny_model("1x1")
    first = generate(model, PROMPTS, 10, seed=3, temperature=1.5)
    assert first == generate(model, PROMPTS, 10, seed=3, temperature=1.5)
    assert first == generate(model, PROMPTS, 10, seed=3, temperature=1.5, use_cache=False)
    assert first != generate(model, PROMPTS, 10, seed=4, temperature=1.5)
    greedy = generate(model, PROMPTS, 10, greedy=True)
    assert generate(model, PROMPTS, 10, seed=3, top_k=1) == greedy
    assert generate(model, PROMPTS, 10, seed=3, top_p=1e-6) == greedy


@pytest.mark.timeout(60)
def test_stops_at_eos_or_the_context():
    model = tiny_model("1x1", seq_len=16)
    greedy = generate(model, PROMPTS, 8, greedy=True)
    eos = greedy[0].tokens[3]
    stopped = generate(model, PROMPTS, 8, greedy=True, eos_id=eos)
    assert stopped[0].finish_reason == FINISH_EOS
    assert stopped[0].tokens == greedy[0].tokens[:greedy[0].tokens.index(eos)]
    filled = generate(model, PROMPTS, greedy=True)  # no max_new_tokens: up to the context
    assert [len(p) + len(c.tokens) for p, c in zip(PROMPTS, filled, strict=True)] == [16] * 4
    assert all(c.finish_reason == FINISH_LENGTH for c in filled)
    with pytest.raises(ValueError, match="past the model's context"):
        generate(model, PROMPTS, 10, greedy=True)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        context_budgets([3, 0], 16, None)


# -- load_model and the command line on a 2-step trained run --------------------------------


@pytest.fixture(scope="module")
def trained_run(tiny_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gen") / "run"
    done = run(train_cmd(tiny_data, run_dir, "train.steps=2", "optim.warmup_steps=1",
                         "data.val_batches=0", "checkpoint.every=2", "tracking.enabled=false"))
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.mark.timeout(240)
def test_load_model_from_run_checkpoint_and_export(trained_run, tmp_path):
    from data_pipeline.tokenizer import find_tokenizer_file
    from pretrain import load_model
    from pretrain.checkpoint import latest_checkpoint
    from pretrain.checkpoint_cli import run_tool

    step = latest_checkpoint(trained_run / "checkpoints")
    exported = tmp_path / "exported"
    run_tool("export", step, False, exported)
    tokens = torch.tensor([[2, 40, 41, 42, 43]])
    logits = []
    for path in (trained_run, step, exported):
        model, tokenizer = load_model(path)
        assert not model.training and tokenizer.vocab_size == model.config.vocab_size
        logits.append(model(tokens))
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    # The run directory carries the tokenizer it trained with; without it, the data index
    # names it.
    copy = find_tokenizer_file(trained_run)
    assert copy is not None and load_model(trained_run)[1].path == copy
    moved = copy.rename(tmp_path / copy.name)
    try:
        fallback = load_model(trained_run)[1]
        assert fallback.path != copy and fallback.sha256 == tokenizer.sha256
    finally:
        moved.rename(copy)


def generate_cli(capsys, *args: str) -> tuple[int, str, str]:
    from pretrain.cli import main

    status = main(["generate", *args])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.timeout(240)
def test_cli_json_output_and_no_cache(trained_run, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "The"}) + "\n" +
                       json.dumps({"prompt": "def main():\n    return"}) + "\n")
    runs = []
    for extra in ([], ["--no-cache"]):
        status, out, _ = generate_cli(capsys, "--run", str(trained_run), "--prompts",
                                      str(prompts), "--max-new-tokens", "6", "--greedy",
                                      "--json", *extra)
        assert status == 0
        runs.append([json.loads(line) for line in out.splitlines()])
    assert runs[0] == runs[1]
    assert [r["prompt"] for r in runs[0]] == ["The", "def main():\n    return"]
    for record in runs[0]:
        assert record["finish_reason"] in (FINISH_EOS, FINISH_LENGTH)
        assert len(record["tokens"]) == 6 or record["finish_reason"] == FINISH_EOS
        assert isinstance(record["completion"], str)
    status, out, err = generate_cli(capsys, "--run", str(trained_run), "--prompts",
                                    str(prompts), "--max-new-tokens", "4", "--seed", "1")
    assert status == 0 and out.startswith("=== prompt 1 (") and "tokens/s" in err


class _Writes:
    """A stdout that keeps each write, to see text arrive in pieces."""

    def __init__(self):
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.timeout(240)
def test_cli_one_prompt_streams_and_reports_speed(trained_run, capsys, monkeypatch):
    from pretrain.cli import main

    args = ["generate", "--run", str(trained_run), "--prompt", "The", "--max-new-tokens", "6",
            "--greedy"]
    stdout = _Writes()
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(args) == 0
    monkeypatch.undo()
    err = capsys.readouterr().err
    text = "".join(stdout.writes)
    _, json_out, _ = generate_cli(capsys, *args[1:], "--json")
    record = json.loads(json_out)
    # The prompt, then the continuation token by token (each piece flushed), then a newline.
    assert text == "The" + record["completion"] + "\n"
    pieces = [w for w in stdout.writes[1:-1] if w and w != "\n"]
    assert len(pieces) > 1 and "".join(pieces) == record["completion"]
    assert "time to first token" in err and "tokens/s" in err
    _, out, err = generate_cli(capsys, *args[1:], "--quiet")
    assert out == text and err == ""


def test_on_step_sees_every_token_as_it_is_made():
    model = tiny_model("1x1")
    seen: list[list[int]] = []
    timings: dict = {}
    out = generate(model, PROMPTS[:1], 5, greedy=True, timings=timings,
                         on_step=lambda completions: seen.append(list(completions[0].tokens)))
    assert seen == [out[0].tokens[:n] for n in range(1, 6)]
    assert 0 < timings["first_token_s"] <= timings["prefill_s"] + timings["decode_s"]


@pytest.mark.timeout(240)
def test_cli_bad_input_exits_2_naming_it(trained_run, tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file, save_file

    not_jsonl = tmp_path / "prompts.txt"
    not_jsonl.write_text("just some text\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"prompt": ""}\n')
    exported = tmp_path / "exported"
    from pretrain.checkpoint import latest_checkpoint
    from pretrain.checkpoint_cli import run_tool

    run_tool("export", latest_checkpoint(trained_run / "checkpoints"), False, exported)
    misshapen = tmp_path / "misshapen"
    shutil.copytree(exported, misshapen)
    weights = load_file(misshapen / "model.safetensors")
    weights["final_norm.weight"] = torch.ones(33)  # d_model is 32
    save_file(weights, misshapen / "model.safetensors")
    (exported / "tokenizer.model").unlink()
    run = ["--run", str(trained_run)]
    cases = [
        ([*run, "--prompts", str(not_jsonl)], f"{not_jsonl}:1: not JSONL"),
        ([*run, "--prompts", str(empty)], f"{empty}:1: the prompt is empty"),
        ([*run, "--prompt", ""], "--prompt: is empty"),
        (["--checkpoint", str(exported), "--prompt", "x"], "without a tokenizer file"),
        ([*run, "--prompt", "The", "--max-new-tokens", "40"],
         "--max-new-tokens: --max-new-tokens 40 runs past the model's context"),
        ([*run, "--prompt", "The", "--temperature", "0"], "--temperature: must be > 0"),
        (["--checkpoint", str(misshapen), "--prompt", "x"],
         "final_norm.weight: checkpoint shape (33,) does not fit this model's (32,)"),
        # What Python makes of the argument bytes 61 ff (`--prompt "$(printf 'a\xff')"`).
        ([*run, "--prompt", b"a\xff".decode("utf-8", "surrogateescape")],
         "--prompt: is not UTF-8 text: byte 0xff at offset 1"),
    ]
    for args, message in cases:
        status, _, err = generate_cli(capsys, *args)
        assert status == 2 and message in err, (args, err)


@pytest.mark.timeout(120)
def test_import_pretrain_stays_cheap():
    code = "import sys, pretrain; print('torch' in sys.modules, callable(pretrain.load_model))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=cli_env(), cwd=ROOT, timeout=100)
    assert done.stdout.split() == ["False", "True"], done.stderr


def test_tokenizer_interface(tiny_data, tmp_path):
    from data_pipeline import DataError
    from data_pipeline.index import read_index
    from data_pipeline.tokenizer import copy_tokenizer, load_tokenizer

    index = read_index(tiny_data, check_files=False)
    tokenizer = load_tokenizer(tiny_data)
    assert tokenizer.sha256 == index.tokenizer_sha256
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (index.vocab_size, index.eos_id)
    text = "def f(x):\n    return x + 12"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode_batch([text, "a"]) == [tokenizer.encode(text), tokenizer.encode("a")]
    copied = copy_tokenizer(tiny_data, tmp_path)
    assert load_tokenizer(copied).sha256 == tokenizer.sha256
    assert copy_tokenizer(tokenizer.path, tmp_path) == copied  # identical: kept
    copied.write_bytes(copied.read_bytes() + b"\0")
    with pytest.raises(DataError, match="different tokenizer"):
        copy_tokenizer(tiny_data, tmp_path)
    assert load_tokenizer(copy_tokenizer(tiny_data, tmp_path, replace=True)).sha256 == \
        tokenizer.sha256


MUDD = {"dynamic-qkvr-llama": dict(block="llama", n_kv_heads=2),
        "static-r-gpt": dict(mudd_dynamic=False, mudd_streams="r")}


def tiny_mudd_model(shape: str):
    """3 MUDD blocks, the mix weights drawn away from their init (every stream X_i)."""
    from pretrain.model import DenseFormer, DenseFormerConfig

    config = DenseFormerConfig(d_model=32, n_heads=4, vocab_size=101, seq_len=40, n_layers=3,
                               init_std=0.3, connection="mudd", **MUDD[shape])
    model = DenseFormer(config, seed=1).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("mudd_static", "mudd_w2")):
                p.add_(0.5 * torch.randn(p.shape, generator=gen))
    return model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", list(MUDD))
def test_mudd_cached_greedy_equals_full_forward_greedy(shape):
    """The mix is per token: the KV cache is all the state between steps; the three
    query/key/value inputs go through the cached attention too."""
    model = tiny_mudd_model(shape)
    cached = generate(model, PROMPTS, 12, greedy=True)
    reference = generate(model, PROMPTS, 12, greedy=True, use_cache=False)
    assert [c.tokens for c in cached] == [r.tokens for r in reference]
    assert len({t for c in cached for t in c.tokens}) > 4
    cache = _check_cached_logits(model)
    assert cache.dwa_decode is None
