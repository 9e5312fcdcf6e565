"""`export-hf`: a model directory that transformers loads with trust_remote_code computes the
trainer's logits, generates, and carries a tokenizer AutoTokenizer reads.

The exported models are tiny with random weights drawn larger than training's init and
random in-pattern alphas, so every DWA input matters; the tokenizer is a BPE trained here.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.test_hf_tokenizer import train_bpe

pytest.importorskip("transformers")  # the hf extra; .ci/run installs it
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 300
SHAPES = {
    "transformer": dict(n_layers=3, dwa=False),
    "1x1": dict(n_layers=4),
    "4x5": dict(n_layers=10, dwa_dilation=4, dwa_period=5),
    "skip-gains": dict(n_layers=3, dwa=False, skip_gains=True),
    "1x1-bf16-storage": dict(n_layers=4, dwa_dtype="bf16"),  # the export rounds as trained
    "attnres-full": dict(n_layers=3, connection="attnres"),
    "attnres-block3-llama": dict(n_layers=3, connection="attnres", attnres_blocks=3,
                                 block="llama", n_kv_heads=2),
}


def trained_like(shape: str, seq_len: int = 24):
    """A DenseFormer whose alphas, AttnRes weights and skip gains are far from their
    initial values."""
    from pretrain.model import DenseFormer, DenseFormerConfig

    config = DenseFormerConfig(d_model=32, n_heads=4, vocab_size=VOCAB, seq_len=seq_len,
                               init_std=0.3, **SHAPES[shape])
    model = DenseFormer(config, seed=1).eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in ("dwa_alpha", "attnres_query", "attnres_key_norm") or "skip_gain" in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.3)
        if model.dwa_alpha is not None:
            model.dwa_alpha.mul_(model.dwa_mask)  # entries outside the pattern stay zero
    return model


def write_export(model, tokenizer_file, directory):
    """What `checkpoint export` writes: config.yaml, model.safetensors, the tokenizer."""
    from safetensors.torch import save_file

    from data_pipeline.tokenizer import copy_tokenizer
    from pretrain.config import load_config, save_config
    from tests.conftest import ROOT

    directory.mkdir()
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    save_config(dataclasses.replace(cfg, model=model.config), directory / "config.yaml")
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()},
              directory / "model.safetensors")
    copy_tokenizer(tokenizer_file, directory)
    return directory


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    from tests.data_fixtures import make_documents

    return train_bpe(make_documents(), tmp_path_factory.mktemp("bpe") / "tokenizer.json", VOCAB)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_exported_model_computes_the_trainers_logits(shape, bpe, tmp_path):
    from transformers import AutoModelForCausalLM

    from pretrain.cli import main

    model = trained_like(shape)
    source = write_export(model, bpe, tmp_path / "native")
    assert main(["export-hf", "--checkpoint", str(source), "--out", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()

    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    # bf16 storage: 1e-7 differences upstream flip the odd bf16 rounding (2e-4 at most
    # here; ignoring the storage dtype would be 2e-3 off).
    tol = dict(rtol=1e-4, atol=5e-4 if "bf16" in shape else 1e-5)
    torch.testing.assert_close(theirs, ours, **tol)
    # Left padding with an attention mask: the real tokens' logits are the unpadded ones.
    mask = torch.ones_like(tokens)
    mask[1, :5] = 0
    with torch.no_grad():
        padded = hf(tokens, attention_mask=mask).logits[1, 5:]
        torch.testing.assert_close(padded, model(tokens[1:, 5:])[0], **tol)


@pytest.mark.timeout(180)
def test_generate_and_tokenizer_of_the_export(bpe, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data_pipeline.tokenizer import load_tokenizer
    from pretrain.hf.export import export_hf

    model = trained_like("4x5", seq_len=64)
    export_hf(write_export(model, bpe, tmp_path / "native"), tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    ours = load_tokenizer(bpe)
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf", trust_remote_code=True)
    text = "def main():\n    return 1"
    assert theirs(text)["input_ids"] == ours.encode(text)  # no BOS added, as in training
    assert theirs.eos_token_id == ours.eos_id

    prompt = torch.tensor([ours.encode(text)])
    out = hf.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None)
    expected = prompt
    with torch.no_grad():  # greedy decoding with the trainer's own full forward
        for _ in range(8):
            nxt = model(expected)[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, nxt], dim=1)
    assert out.tolist() == expected.tolist()


@pytest.mark.timeout(180)
def test_autotokenizer_reads_a_sentencepiece_export(tmp_path):
    """transformers 5 converts a tokenizer.model on loading; with the export's
    tokenizer_config.json it gives training's ids (no BOS), EOS, and EOS as padding."""
    from transformers import AutoTokenizer

    from data_pipeline.tokenizer import load_tokenizer, train_tokenizer
    from pretrain.hf.export import export_hf
    from tests.data_fixtures import make_documents

    documents = make_documents()
    ours = load_tokenizer(train_tokenizer(documents, tmp_path / "tokenizer.model", VOCAB, 0))
    export_hf(write_export(trained_like("1x1"), ours.path, tmp_path / "native"), tmp_path / "hf")
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    texts = [*documents, "def main():\n    return 1", " leading space", "ünïcode ✓ 漢字"]
    assert [theirs(t)["input_ids"] for t in texts] == [ours.encode(t) for t in texts]
    assert theirs.eos_token_id == theirs.pad_token_id == ours.eos_id is not None


@pytest.mark.timeout(180)
def test_lm_eval_hf_model_reads_the_export(bpe, tmp_path):
    """lm-eval's own `hf` model on the export scores a continuation as our model does."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from data_pipeline.tokenizer import load_tokenizer
    from pretrain.hf.export import export_hf

    model = trained_like("1x1", seq_len=64)
    export_hf(write_export(model, bpe, tmp_path / "native"), tmp_path / "hf")
    lm = HFLM(pretrained=str(tmp_path / "hf"), trust_remote_code=True, batch_size=1,
              device="cpu", max_length=64)
    (score, _), = lm.loglikelihood([Instance("loglikelihood", {}, ("def main():", " return 1"),
                                             0)])
    tok = load_tokenizer(bpe)
    context, continuation = tok.encode("def main():"), tok.encode(" return 1")
    with torch.no_grad():
        logprobs = model(torch.tensor([context + continuation])).log_softmax(-1)[0]
    ours = sum(logprobs[len(context) - 1 + k, t].item() for k, t in enumerate(continuation))
    assert score == pytest.approx(ours, rel=1e-5)


@pytest.mark.parametrize("connection", ["hc", "mhc"])
def test_hyper_connections_are_refused_by_name(connection, bpe, tmp_path, capsys):
    from pretrain.cli import main
    from pretrain.model import DenseFormer, DenseFormerConfig

    model = DenseFormer(DenseFormerConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=VOCAB,
                                          seq_len=24, connection=connection))
    source = write_export(model, bpe, tmp_path / "native")
    out = tmp_path / "hf"
    assert main(["export-hf", "--checkpoint", str(source), "--out", str(out)]) == 2
    assert f"model.connection: {connection}: export-hf does not support it" \
        in capsys.readouterr().err
    assert not out.exists()


def test_a_non_empty_out_is_refused(bpe, tmp_path, capsys):
    from pretrain.cli import main

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("x")
    assert main(["export-hf", "--run", str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    assert f"--out: {tmp_path / 'hf'} exists and is not an empty directory" in \
        capsys.readouterr().err
