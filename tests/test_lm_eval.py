"""lm-evaluation-harness: the `denseformer` model class against the model's own loss, lm-eval's
evaluator and command line on local tasks (offline), and the scores in the run's MLflow run.

One tiny run (2 blocks, seq_len 32, 2 steps, MLflow in the run directory) serves the module.
"""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval", reason="lm-eval is the optional extra `eval`")

from pretrain.generation import generate  # noqa: E402
from tests.conftest import ROOT, cli_env  # noqa: E402
from tests.test_train import run, train_cmd

SEQ_LEN = 32
TEXTS = ["The fox jumps.", "A short one.", "x = 1\nreturn x"]


def offline_env(tmp_path) -> dict:
    """No network for lm-eval and datasets; their caches under tmp_path."""
    return dict(cli_env(), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
                HF_HOME=str(tmp_path / "hf"), HF_DATASETS_CACHE=str(tmp_path / "hf-datasets"))


@pytest.fixture(scope="module")
def trained_run(tiny_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lm-eval") / "run"
    done = run(train_cmd(tiny_data, run_dir, f"model.seq_len={SEQ_LEN}", "train.steps=2",
                         "optim.warmup_steps=1", "data.val_batches=0", "checkpoint.every=2"))
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def lm(trained_run):
    from pretrain.lm_eval_adapter import DenseFormerLM

    return DenseFormerLM(checkpoint=str(trained_run), batch_size=3, device="cpu")


def request(kind: str, *args):
    from lm_eval.api.instance import Instance

    return Instance(kind, {}, tuple(args), 0)


def summed_logprob(model, ids: list[int], count: int) -> float:
    """log p of the last `count` ids from the training forward's cross entropy."""
    tokens = torch.tensor([ids])
    with torch.no_grad():
        losses = F.cross_entropy(model(tokens[:, :-1])[0].float(), tokens[0, 1:],
                                 reduction="none")
    return -losses[-count:].sum().item()


@pytest.mark.timeout(240)
def test_rolling_loglikelihood_is_the_models_summed_loss(lm):
    results = lm.loglikelihood_rolling([request("loglikelihood_rolling", t) for t in TEXTS])
    for text, result in zip(TEXTS, results, strict=True):
        ids = lm.tokenizer.encode(text)
        assert 2 < len(ids) <= SEQ_LEN  # one window: the model's own loss applies
        tokens = torch.tensor([[lm.tokenizer.eos_id] + ids])
        with torch.no_grad():
            loss = lm.model.loss(tokens[:, :-1], tokens[:, 1:]).item()
        assert result == pytest.approx(-loss * len(ids), rel=1e-5)


@pytest.mark.timeout(240)
def test_loglikelihood_batched_and_left_truncated(lm):
    long_context = " ".join(["words that run past the context"] * 12)
    pairs = [("The quick brown", " fox"), ("", "Hello world"), (long_context, " again"),
             ("A short one", ".")]
    batched = lm.loglikelihood([request("loglikelihood", *p) for p in pairs])
    alone = [lm.loglikelihood([request("loglikelihood", *p)])[0] for p in pairs]
    for (logprob, greedy), (alone_logprob, alone_greedy) in zip(batched, alone, strict=True):
        assert logprob == pytest.approx(alone_logprob, rel=1e-5, abs=1e-5)
        assert greedy == alone_greedy
    context_ids, continuation_ids = lm.encode_pair(long_context, " again")
    whole = context_ids + continuation_ids
    assert len(whole) > SEQ_LEN + 1  # the case under test: cut from the left
    expected = summed_logprob(lm.model, whole[-(SEQ_LEN + 1):], len(continuation_ids))
    assert batched[2][0] == pytest.approx(expected, rel=1e-5)
    empty = summed_logprob(lm.model, [lm.tokenizer.eos_id] + lm.tokenizer.encode("Hello world"),
                           len(lm.tokenizer.encode("Hello world")))
    assert batched[1][0] == pytest.approx(empty, rel=1e-5)


@pytest.mark.timeout(240)
def test_generate_until_stops_and_batches(lm):
    options = {"until": ["e"], "max_gen_toks": 6}
    contexts = ["The quick brown", "Once upon a time there", "x"]
    batched = lm.generate_until([request("generate_until", c, options) for c in contexts])
    alone = [lm.generate_until([request("generate_until", c, options)])[0] for c in contexts]
    assert batched == alone
    assert all("e" not in text for text in batched)
    # Without a stop string: exactly the model's greedy continuation.
    prompt = lm.context_ids(contexts[0])
    greedy = generate(lm.model, [prompt], 6, greedy=True, eos_id=lm.tokenizer.eos_id)[0]
    text = lm.generate_until([request("generate_until", contexts[0], {"max_gen_toks": 6})])[0]
    assert text == lm.new_text(prompt, greedy.tokens)


QUESTIONS = [("The capital of France is", [" Paris", " a fish", " green"], 0),
             ("Two plus two is", [" blue", " four", " the"], 1),
             ("The sky is", [" under", " of", " blue"], 2),
             ("Water is", [" wet", " and", " if"], 0)]


def mc_by_hand(lm) -> dict:
    """tiny_mc scored from the model's own cross entropy: each choice's summed log
    probability after its question (the task has no delimiter: the choice as written), the
    highest one (acc) and the highest per character of the choice (acc_norm)."""
    logprobs, acc, acc_norm = [], [], []
    for question, choices, answer in QUESTIONS:
        scores = []
        for choice in choices:
            context_ids, choice_ids = lm.encode_pair(question, choice)
            scores.append(summed_logprob(lm.model, context_ids + choice_ids, len(choice_ids)))
        logprobs.append(scores)
        acc.append(float(max(range(len(choices)), key=scores.__getitem__) == answer))
        per_char = [s / len(c) for s, c in zip(scores, choices, strict=True)]
        acc_norm.append(float(max(range(len(choices)), key=per_char.__getitem__) == answer))
    return {"logprobs": logprobs, "acc": sum(acc) / len(acc),
            "acc_norm": sum(acc_norm) / len(acc_norm)}


def word_perplexity_by_hand(lm) -> float:
    """tiny_ppl's word perplexity: exp of minus the summed log probability of the texts (the
    model's own loss after EOS, times the tokens) over their whitespace-separated words."""
    import math
    import re

    logprob = 0.0
    for text in TEXTS:
        ids = lm.tokenizer.encode(text)
        tokens = torch.tensor([[lm.tokenizer.eos_id] + ids])
        with torch.no_grad():
            logprob -= lm.model.loss(tokens[:, :-1], tokens[:, 1:]).item() * len(ids)
    return math.exp(-logprob / sum(len(re.split(r"\s+", text)) for text in TEXTS))


def write_tasks(directory, data_dir) -> None:
    """A multiple-choice task and a rolling-loglikelihood task over local JSONL files."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "mc.jsonl", "w") as f:
        for question, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": question, "choices": choices,
                                "answer": answer}) + "\n")
    with open(data_dir / "docs.jsonl", "w") as f:
        for text in TEXTS:
            f.write(json.dumps({"text": text}) + "\n")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tiny_mc.yaml").write_text(textwrap.dedent(f"""\
        task: tiny_mc
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data_dir / 'mc.jsonl'}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{question}}}}"
        doc_to_choice: choices
        doc_to_target: answer
        target_delimiter: ""
        metric_list:
          - metric: acc
          - metric: acc_norm
        metadata:
          version: 1.0
        """))
    (directory / "tiny_ppl.yaml").write_text(textwrap.dedent(f"""\
        task: tiny_ppl
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data_dir / 'docs.jsonl'}
        test_split: test
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{{{text}}}}"
        metric_list:
          - metric: word_perplexity
          - metric: byte_perplexity
          - metric: bits_per_byte
        metadata:
          version: 1.0
        """))


@pytest.mark.timeout(300)
def test_cli_runs_lm_eval_and_logs_scores_to_mlflow(trained_run, lm, tmp_path):
    from pretrain.checkpoint import latest_checkpoint, read_meta
    from pretrain.tracking import default_tracking_uri, mlflow_client

    write_tasks(tmp_path / "tasks", tmp_path / "data")
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "pretrain", "lm-eval", "--model_args",
           f"checkpoint={trained_run}", "--tasks", "tiny_mc,tiny_ppl", "--include_path",
           str(tmp_path / "tasks"), "--batch_size", "4", "--device", "cpu",
           "--output_path", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280,
                          env=offline_env(tmp_path), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    written = list(out.rglob("results_*.json"))
    assert len(written) == 1, done.stderr[-2000:]
    results = json.loads(written[0].read_text())["results"]
    by_hand = mc_by_hand(lm)
    assert results["tiny_mc"]["acc,none"] == pytest.approx(by_hand["acc"])
    assert results["tiny_mc"]["acc_norm,none"] == pytest.approx(by_hand["acc_norm"])
    assert results["tiny_ppl"]["word_perplexity,none"] == pytest.approx(
        word_perplexity_by_hand(lm), rel=1e-5)

    meta = read_meta(latest_checkpoint(trained_run / "checkpoints"))
    client = mlflow_client(default_tracking_uri(trained_run))
    logged = client.get_run(meta["mlflow_run_id"]).data.metrics
    assert logged["lm_eval/tiny_mc/acc"] == pytest.approx(results["tiny_mc"]["acc,none"])
    assert logged["lm_eval/tiny_ppl/bits_per_byte"] == pytest.approx(
        results["tiny_ppl"]["bits_per_byte,none"])
    history = client.get_metric_history(meta["mlflow_run_id"], "lm_eval/tiny_mc/acc_norm")
    assert [m.step for m in history] == [meta["step"]]


@pytest.mark.timeout(240)
def test_simple_evaluate_scores_the_rolling_task_with_our_loglikelihoods(lm, tmp_path,
                                                                         monkeypatch):
    """lm-eval's evaluator in this process: its bits per byte are our summed losses, its
    multiple-choice log probabilities and accuracies those computed by hand."""
    import math

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    for name, value in offline_env(tmp_path).items():
        if name.startswith("HF_"):
            monkeypatch.setenv(name, value)
    write_tasks(tmp_path / "tasks", tmp_path / "data")
    manager = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    results = simple_evaluate(model=lm, tasks=["tiny_ppl", "tiny_mc"], task_manager=manager,
                              log_samples=True)
    rolling = lm.loglikelihood_rolling([request("loglikelihood_rolling", t) for t in TEXTS])
    expected = -sum(rolling) / sum(len(t.encode("utf-8")) for t in TEXTS) / math.log(2)
    assert results["results"]["tiny_ppl"]["bits_per_byte,none"] == pytest.approx(expected,
                                                                                 rel=1e-6)
    assert results["results"]["tiny_ppl"]["word_perplexity,none"] == pytest.approx(
        word_perplexity_by_hand(lm), rel=1e-5)
    by_hand = mc_by_hand(lm)
    samples = sorted(results["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
    for sample, expected_logprobs in zip(samples, by_hand["logprobs"], strict=True):
        assert [r[0] for r in sample["filtered_resps"]] == pytest.approx(expected_logprobs,
                                                                         rel=1e-5)
    assert results["results"]["tiny_mc"]["acc,none"] == pytest.approx(by_hand["acc"])
    assert results["results"]["tiny_mc"]["acc_norm,none"] == pytest.approx(by_hand["acc_norm"])


def test_lm_eval_argv_names_our_model():
    from pretrain.lm_eval_cli import lm_eval_argv, numeric_scores

    assert lm_eval_argv(["--tasks", "x"]) == ["run", "--model", "denseformer", "--tasks", "x"]
    assert lm_eval_argv(["--model", "hf"]) == ["run", "--model", "hf"]
    assert lm_eval_argv(["ls", "tasks"]) == ["ls", "tasks"]
    scores = dict(((t, m), v) for t, m, v in numeric_scores({"results": {"gsm8k": {
        "alias": "gsm8k", "exact_match,strict-match": 0.25, "exact_match_stderr,none": "N/A",
        "acc,none": 0.5}}}))
    assert scores == {("gsm8k", "exact_match.strict-match"): 0.25, ("gsm8k", "acc"): 0.5}


def test_entry_point_names_the_model_class():
    """pyproject.toml's `lm_eval.models` entry point, for lm-eval versions that read it."""
    from importlib.metadata import entry_points

    from pretrain.lm_eval_adapter import DenseFormerLM

    (found,) = [e for e in entry_points(group="lm_eval.models") if e.name == "denseformer"]
    assert found.load() is DenseFormerLM
