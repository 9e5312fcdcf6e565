"""The "tests" section of the GPU check: pytest -m gpu, the model's equivalences on the
device, and a real training run through the CLI (tracking off). Used by gpu_check.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# On the CPU the suite's subset is cut to three quick tests (CI runs the full files anyway),
# one of them a CLI subprocess whose PYTHONPATH is reset (tests/conftest.py cli_env): the
# kind that could not import the carried wheels on the first GPU run.
CPU_PYTEST_FILTER = "identity_init or api_shapes or (invalid_config and n_heads)"


def child_env() -> dict:
    """The environment of a child process: this one's, the repository first on the path."""
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), path) if p),
                OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"))


def run_pytest(out: Path, cpu: bool, timeout_s: float) -> dict:
    """`pytest -m gpu` on the model and trainer tests; counts and the failures' names."""
    xml = out / "pytest.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
           f"--junitxml={xml}", "tests/test_model.py", "tests/test_train.py"]
    if cpu:
        cmd += ["-k", CPU_PYTEST_FILTER]
    with open(out / "pytest.log", "w") as log:
        try:
            done = subprocess.run(cmd, cwd=ROOT, env=child_env(), stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout_s)
            returncode = done.returncode
        except subprocess.TimeoutExpired:
            returncode = None
    result = {"command": " ".join(cmd[1:]), "returncode": returncode, "log": "pytest.log",
              "timeout_s": timeout_s}
    if not xml.exists():
        return {**result, "error": "pytest wrote no junit XML (see pytest.log)"}
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed = []
    for case in suite.iter("testcase"):
        # An Element without children is falsy: compare with None, never use `or`.
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}: "
                          f"{bad.get('message', '')[:300]}")
    return {**result, **{k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors",
                                                            "skipped")},
            "seconds": float(suite.get("time", 0)), "failed": failed}


def _relative_grad_errors(model, reference: dict) -> float:
    """max over parameters of ||g - g_ref|| / ||g_ref|| (zero reference: absolute)."""
    worst = 0.0
    for name, p in model.named_parameters():
        ref = reference[name]
        diff = (p.grad - ref).norm().item()
        worst = max(worst, diff / ref.norm().item() if ref.norm().item() > 0 else diff)
    return worst


def device_equivalence(device: torch.device) -> dict:
    """DenseFormer 1x1 (10 x 128) on the device, fp32, TF32 off: the functional DWA and the
    `block` / `dwa_block` checkpointing against the buffered DWA without checkpointing (loss
    and every gradient), and the bf16-autocast loss against fp32."""
    from gpu_check_perf import CPU_SHAPES, build, load, synthetic_batch

    from parallel.strategies.checkpointing import apply_activation_checkpointing
    from pretrain.evaluate import autocast_for

    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        cfg = load("dense-1x1", CPU_SHAPES, "model.d_model=128", "model.seq_len=64")
        model = build(cfg, device)
        # Two Adam steps move the alphas off their identity init (inside the DWA pattern:
        # the other entries get no gradient), so that every DWA really mixes.
        adam = torch.optim.Adam(model.parameters(), lr=1e-2)
        batch = synthetic_batch(cfg, 4, device, seed=3)
        x, y = batch[:, :-1], batch[:, 1:]
        for _ in range(2):
            model.loss(x, y).backward()
            adam.step()
            adam.zero_grad(set_to_none=True)

        def loss_of(functional: bool | None = None) -> torch.Tensor:
            if functional is None:
                return model.loss(x, y)
            logits = model.local_logits(model.run_blocks(model.embed(x), functional))
            return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())

        def grads_of(functional: bool | None = None) -> tuple[float, dict]:
            model.zero_grad(set_to_none=True)
            loss = loss_of(functional)
            loss.backward()
            return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

        ref_loss, ref = grads_of(functional=False)
        _, ref_full = grads_of()
        results = {}
        for name, mode, functional in (("functional_dwa", "none", True),
                                       ("block", "block", None),
                                       ("dwa_block", "dwa_block", None)):
            apply_activation_checkpointing(model, mode, 1)
            loss, _ = grads_of(functional)
            target = ref if functional is not None else ref_full
            results[name] = {"loss_abs_diff": abs(loss - ref_loss),
                             "max_rel_grad_diff": _relative_grad_errors(model, target)}
        apply_activation_checkpointing(model, "none")
        with torch.no_grad(), autocast_for(device, torch.bfloat16):
            low = model.loss(x, y).item()
        results["bf16_autocast"] = {"loss_abs_diff": abs(low - ref_loss)}
        return {"model": "dense-1x1, 10 x 128, seq 64, batch 4, fp32", "reference_loss":
                ref_loss, "variants": results}
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def trainer_run(device: torch.device) -> dict:
    """`python -m pretrain train` on the demo data: 12 steps straight, then 6 + resume to 12;
    the device line of its log, exit codes, the loss curve and whether resume is bitwise."""
    from data_pipeline.demo_corpus import build_demo_corpus
    from data_pipeline.prepare import prepare_dataset

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        tmp = Path(tmp)
        start = time.monotonic()
        build_demo_corpus(tmp / "corpus.jsonl", max_mb=0.3, workers=1, progress=False)
        prepare_dataset([str(tmp / "corpus.jsonl")], tmp / "data", vocab_size=512, seq_len=32,
                        val_fraction=0.05, workers=1, progress=False)
        data_s = time.monotonic() - start
        sets = ["model.seq_len=32", "train.batch_size=16", "train.steps=12",
                "train.eval_every=6", "train.log_every=1", "optim.warmup_steps=2",
                "data.val_batches=2", "checkpoint.every=6", "tracking.enabled=false",
                f"data.path={tmp / 'data'}"]

        def train(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
            args = [a for s in [*sets, f"run.dir={run_dir}", *extra] for a in ("--set", s)]
            return subprocess.run([sys.executable, "-m", "pretrain", "train", "--config",
                                   str(ROOT / "configs/tiny.yaml"), *args], cwd=ROOT,
                                  env=child_env(), capture_output=True, text=True, timeout=120)

        runs = {"straight": train(tmp / "straight"),
                "stopped": train(tmp / "sliced", "train.stop_at=6"),
                "resumed": train(tmp / "sliced", "train.resume=auto")}
        result = {"data_prep_s": data_s, "seconds": time.monotonic() - start,
                  "returncodes": {k: r.returncode for k, r in runs.items()}}
        failed = {k: r.stderr[-2000:] for k, r in runs.items() if r.returncode != 0}
        if failed:
            return {**result, "stderr_tail": failed}
        log = runs["straight"].stdout + runs["straight"].stderr
        straight, sliced = _losses(tmp / "straight"), _losses(tmp / "sliced")
        same = [s for s in straight if sliced.get(s) == straight[s]]
        return {**result, "device_line": next((line.strip() for line in log.splitlines()
                                               if "device " in line), None),
                "first_loss": straight.get(1), "last_loss": straight.get(12),
                "steps": sorted(straight), "resume_bitwise": sliced == straight,
                "bitwise_equal_steps": len(same),
                "max_loss_abs_diff": max((abs(straight[s] - sliced[s]) for s in straight
                                          if s in sliced), default=None)}


def section_tests(device: torch.device, out: Path, deadline: float) -> dict:
    """The three parts, each caught on its own so that one failure keeps the others; pytest
    last, given what is left of the budget (at least 30 s, at most 150 s)."""
    parts = {"equivalence": lambda: device_equivalence(device),
             "trainer": lambda: trainer_run(device),
             "pytest": lambda: run_pytest(out, device.type == "cpu", min(
                 150.0, max(30.0, deadline - time.monotonic())))}
    result = {}
    for name, fn in parts.items():
        start = time.monotonic()
        try:
            result[name] = fn()
        except Exception as err:
            result[name] = {"error": f"{type(err).__name__}: {err}"}
        result[name]["part_seconds"] = time.monotonic() - start
    result["problems"] = [name for name in parts if "error" in result[name]
                          or result[name].get("failures") or result[name].get("errors")
                          or result[name].get("returncode", 0) != 0
                          or any(result[name].get("returncodes", {}).values())]
    return result
