"""`import-hf`: a Hugging Face Llama directory becomes one of our runs that computes the same
logits (as a Transformer and as DenseFormers with identity DWAs, in one process and at
TP = 2 and PP = 2), exports back to transformers, and continues training through the CLI.

The Llama is a tiny random `LlamaForCausalLM` built from a config (GQA: 4 heads over 2 KV
heads, an untied head, a vocabulary of 320 rows over a 300-id BPE trained here), saved with
`save_pretrained`; weights are drawn larger than Llama's init so every path matters.
Tolerance: logits to 1e-4 relative (fp32; attention and norms sum in another order).
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from tests.distributed import run_distributed_test
from tests.test_hf_tokenizer import train_bpe

pytest.importorskip("transformers")  # the hf extra; .ci/run installs it
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, TOKENIZER_VOCAB = 320, 300
TOKENS = torch.randint(0, TOKENIZER_VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.data_fixtures import make_documents

    directory = tmp_path_factory.mktemp("llama") / "tiny-llama"
    config = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         rms_norm_eps=1e-6, rope_theta=5000.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    model.save_pretrained(directory)
    train_bpe(make_documents(), directory / "tokenizer.json", TOKENIZER_VOCAB)
    return directory


def hf_logits(directory, tokens=TOKENS) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def our_logits(run_dir, tokens=TOKENS) -> torch.Tensor:
    from parallel.primitives import groups
    from pretrain import load_model

    try:
        model, _ = load_model(run_dir, device="cpu")
        with torch.no_grad():
            return model(tokens)
    finally:
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            groups.destroy()


def imported(llama_dir, tmp_path, dwa: str | None):
    from pretrain.cli import main

    out = tmp_path / f"run-{dwa or 'transformer'}"
    assert main(["import-hf", str(llama_dir), "--out", str(out),
                 *(["--dwa", dwa] if dwa else [])]) == 0
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dwa", [None, "1x1", "4x5"])
def test_imported_model_computes_the_llama_logits(llama_dir, tmp_path, dwa):
    out = imported(llama_dir, tmp_path, dwa)
    torch.testing.assert_close(our_logits(out), hf_logits(llama_dir), rtol=1e-4, atol=1e-5)


def tp2_logits(run_dir) -> torch.Tensor:
    return our_logits(run_dir)


def pp2_loss(run_dir) -> float:
    """The imported model's loss on TOKENS through two pipeline stages (untied head on the
    last)."""
    from parallel.strategies.pipeline import PipelineRunner
    from pretrain.load import read_trained

    cfg, state, _, _ = read_trained(run_dir)
    shape = dataclasses.replace(cfg.model, seq_len=TOKENS.shape[1] - 1)  # the stages' shapes
    runner = PipelineRunner(shape, microbatches=1, micro_batch=2)
    runner.load_model_state(state)
    return runner.loss(TOKENS[:, :-1], TOKENS[:, 1:]).item()


# Slow: llama blocks with grouped-query attention and an untied head are checked at TP = 2
# and PP = 2 against the single-process model by default (tests/test_tensor_parallel.py,
# tests/test_pipeline.py), and the single-process model against transformers above.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_imported_model_at_tp2_and_pp2(llama_dir, tmp_path):
    import torch.nn.functional as F

    out = imported(llama_dir, tmp_path, "4x5")
    reference = hf_logits(llama_dir)
    for logits in run_distributed_test(tp2_logits, world_size=2, timeout_s=200, tp=2,
                                       run_dir=out):
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-5)
    expected = F.cross_entropy(reference[:, :-1].flatten(0, 1), TOKENS[:, 1:].flatten()).item()
    for loss in run_distributed_test(pp2_loss, world_size=2, timeout_s=200, pp=2, run_dir=out):
        assert loss == pytest.approx(expected, rel=1e-5)


@pytest.mark.timeout(300)
def test_export_back_to_transformers(llama_dir, tmp_path):
    from transformers import LlamaForCausalLM

    from pretrain.cli import main

    # A llama-block Transformer leaves as a standard LlamaForCausalLM directory.
    transformer = imported(llama_dir, tmp_path, None)
    assert main(["export-hf", "--run", str(transformer), "--out", str(tmp_path / "llama")]) == 0
    assert json.loads((tmp_path / "llama" / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"]
    back = LlamaForCausalLM.from_pretrained(tmp_path / "llama").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, hf_logits(llama_dir), rtol=1e-4,
                                   atol=1e-5)
    # A DenseFormer with llama blocks and moved alphas leaves with its modeling code.
    from pretrain import load_model
    from tests.test_hf_export import write_export

    model, tokenizer = load_model(imported(llama_dir, tmp_path, "1x1"), device="cpu")
    with torch.no_grad():
        model.dwa_alpha.add_(torch.randn(model.dwa_alpha.shape) * 0.3).mul_(model.dwa_mask)
    native = write_export(model, tokenizer.path, tmp_path / "native")
    assert main(["export-hf", "--checkpoint", str(native), "--out", str(tmp_path / "dense")]) == 0
    with torch.no_grad():
        ours = model(TOKENS)
    torch.testing.assert_close(hf_logits(tmp_path / "dense"), ours, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(300)
def test_continued_pretraining_of_an_imported_llama(llama_dir, tmp_path):
    """The imported 1x1 DenseFormer trains on demo text tokenised with the Llama's own
    tokenizer (`prepare --tokenizer HF_DIR`), starting from its weights (`train.init_from`),
    as docs/huggingface.md writes it: the model's context (64) is longer than the data's
    (32), so the run trains at 32 and says so once; the imported config warms up. Its first
    loss is the imported model's own on the first batch, and it learns."""
    import sys

    import yaml

    from data_pipeline.loader import TrainLoader
    from parallel.primitives import groups
    from pretrain import load_model
    from pretrain.config import load_config
    from tests.data_fixtures import make_documents, prepare_tiny, write_jsonl
    from tests.test_train import losses, run

    out = imported(llama_dir, tmp_path, "1x1")
    assert yaml.safe_load((out / "config.yaml").read_text())["optim"]["warmup_steps"] > 0
    data = tmp_path / "data"
    prepare_tiny([write_jsonl(tmp_path / "corpus.jsonl", make_documents(400))], data,
                 tokenizer=llama_dir, vocab_size=None, seq_len=32)
    continued = tmp_path / "continued"
    recipe = [f"train.init_from={out}", f"data.path={data}", f"run.dir={continued}"]
    quick = ["train.steps=16", "train.batch_size=4", "optim.lr=3e-3", "data.val_batches=0",
             "tracking.enabled=false", "train.log_every=1"]
    done = run([sys.executable, "-m", "pretrain", "train", "--config", str(out / "config.yaml"),
                *[a for s in recipe + quick for a in ("--set", s)]])
    assert done.returncode == 0, done.stderr[-3000:]
    notes = [line for line in (done.stdout + done.stderr).splitlines() if "model.seq_len" in line]
    assert len(notes) == 1 and "training at 32" in notes[0], notes
    assert yaml.safe_load((continued / "config.yaml").read_text())["model"]["seq_len"] == 32
    curve = losses(tmp_path / "continued")
    assert sorted(curve) == list(range(1, 17))
    loader = TrainLoader(data, global_batch_size=4,
                         seed=load_config(out / "config.yaml").train.seed)
    try:
        batch = next(loader)
        model, _ = load_model(out, device="cpu")
        with torch.no_grad():
            start = model.loss(batch[:, :-1], batch[:, 1:]).item()
    finally:
        loader.close()
        groups.destroy()
    assert curve[1] == pytest.approx(start, rel=1e-5)  # the imported weights, not a new init
    # It learns: 5.80 at step 1, 5.56 on average over steps 14-16 when written, after the
    # imported config's 10-step warm-up (deterministic on CPU).
    assert sum(curve[s] for s in (14, 15, 16)) / 3 < curve[1] - 0.15, curve


@pytest.mark.parametrize("case, key", [
    ("not-hf", "config.json"), ("architecture", "architectures"),
    ("rope", "rope_parameters.rope_type"), ("tokenizer", "vocab_size"),
    ("wrong-shape", "model.layers.1.mlp.up_proj.weight"), ("truncated", "model.safetensors")])
def test_bad_input_exits_2_naming_the_file_and_key(llama_dir, tmp_path, capsys, case, key):
    import shutil

    from safetensors.torch import load_file, save_file

    from pretrain.cli import main

    source = tmp_path / "hf"
    weights = source / "model.safetensors"
    if case == "not-hf":
        source.mkdir()
    elif case == "wrong-shape":
        shutil.copytree(llama_dir, source)
        state = load_file(weights)
        state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(175, 64)  # 176 rows
        save_file(state, weights)
    elif case == "truncated":
        shutil.copytree(llama_dir, source)
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    else:
        shutil.copytree(llama_dir, source)
        config = json.loads((source / "config.json").read_text())
        if case == "architecture":
            config["architectures"] = ["MistralForCausalLM"]
        elif case == "rope":
            config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5000.0}
        else:
            config["vocab_size"] = 256  # the tokenizer has 300 ids
        (source / "config.json").write_text(json.dumps(config))
    assert main(["import-hf", str(source), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{source}" in err and key in err, err
    assert not (tmp_path / "out").exists()
