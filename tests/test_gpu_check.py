"""The GPU check (scripts/gpu_check.sh) on its CPU fallback, as the bare GPU machine sees it.

The GPU machine has neither DeepSpeed nor MLflow: the check runs here with both made
unimportable (a sitecustomize that refuses them), so an import that would pull either in on
the check's paths fails this test instead of the one borrowed GPU run.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT

BLOCKER = textwrap.dedent("""\
    # Make the GPU machine's missing packages unimportable in every process of the check.
    import importlib.abc
    import sys

    class _Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in ("deepspeed", "mlflow"):
                raise ModuleNotFoundError(f"{name} is not on the GPU machine", name=name)
            return None

    sys.meta_path.insert(0, _Refuse())
""")


@pytest.fixture(scope="module")
def bare_env(tmp_path_factory) -> dict:
    """The environment of a process that cannot import deepspeed or mlflow."""
    site = tmp_path_factory.mktemp("bare-site")
    (site / "sitecustomize.py").write_text(BLOCKER)
    return dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(site), OMP_NUM_THREADS="2")


def check(out: Path, env: dict, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), str(out), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_blocker_refuses_deepspeed_and_mlflow(bare_env):
    for module in ("deepspeed", "mlflow.tracking"):
        done = subprocess.run([sys.executable, "-c", f"import {module}"], env=bare_env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and "not on the GPU machine" in done.stderr, module


@pytest.mark.slow  # ~50 s; the script's start-up and document: the budget-0 test below
@pytest.mark.timeout(400)
def test_cpu_check_writes_every_section_with_plausible_figures(tmp_path, bare_env):
    out = tmp_path / "out"
    done = check(out, bare_env, "--cpu")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((out / "gpu_check.json").read_text())
    assert (out / "gpu_check.log").read_text().count("[gpu_check]") >= 8
    assert doc["mode"] == "cpu" and doc["finished"]
    assert doc["environment"]["torch"] and doc["environment"]["megatron_core"] == "0.16.1"
    sections = doc["sections"]
    assert {k: s["status"] for k, s in sections.items()} == dict.fromkeys(
        ("speed", "memory", "tests", "compile"), "ok"), json.dumps(sections)[:3000]

    speed = sections["speed"]
    assert set(speed["variants"]) == {"transformer", "dense-4x5", "dense-1x1"}
    shape, peak = speed["shape"], speed["peak"]["flops"]
    for name, v in speed["variants"].items():  # consistent figures; speed is never asserted
        assert v["steps"] == 6 and 0 < v["min_step_s"] <= v["median_step_s"], name
        tokens = shape["batch"] * shape["seq_len"]
        assert v["tokens_per_s"] == pytest.approx(tokens / v["median_step_s"])
        assert v["mfu"] == pytest.approx(v["model_tflops"] * 1e12 / peak) and v["mfu"] > 0
        assert v["vs_transformer"] == pytest.approx(
            v["median_step_s"] / speed["variants"]["transformer"]["median_step_s"])
        assert v["last_loss"] < 7  # ln(512) = 6.24 at init: a finite, sane loss
    assert speed["variants"]["transformer"]["vs_transformer"] == 1.0
    assert speed["variants"]["dense-1x1"]["params"] > speed["variants"]["transformer"]["params"]
    assert "measured" in speed["peak"]["source"]  # no spec peak for a CPU

    rows = sections["memory"]["rows"]
    assert {(r["model"], r["mode"]) for r in rows} == {
        (m, c) for m in ("dense-1x1", "dense-4x5") for c in ("block", "dwa_block")}
    for r in rows:  # the CPU probe counts exactly what the estimator models
        assert 0.95 < r["measured_over_estimated"] < 1.05, r

    tests = sections["tests"]
    assert tests["problems"] == [], json.dumps(tests)[:3000]
    assert tests["pytest"]["tests"] >= 2 and tests["pytest"]["failures"] == 0
    for name, v in tests["equivalence"]["variants"].items():
        assert v["loss_abs_diff"] < (0.05 if name == "bf16_autocast" else 1e-5), name
        assert v.get("max_rel_grad_diff", 0) < 1e-5, name
    trainer = tests["trainer"]
    assert trainer["returncodes"] == {"straight": 0, "stopped": 0, "resumed": 0}
    assert trainer["steps"] == list(range(1, 13)) and trainer["resume_bitwise"] is True
    assert trainer["last_loss"] < trainer["first_loss"]
    assert "cpu" in trainer["device_line"]  # the trainer's log names the device it used

    compiled = sections["compile"]
    assert compiled["first_loss_abs_diff"] < 1e-5
    assert compiled["eager_median_step_s"] > 0 and compiled["compiled_median_step_s"] > 0

    imports = doc["imports"]
    assert imports["forbidden"] == [] and imports["outside_device"] == [], imports
    assert {"torch", "megatron", "numpy"} <= set(imports["third_party"])


def test_spent_budget_skips_sections_but_still_writes_the_document(tmp_path, bare_env):
    out = tmp_path / "out"
    done = check(out, bare_env, "--cpu", "--budget-s", "0", timeout=120)
    assert done.returncode == 0, done.stderr
    doc = json.loads((out / "gpu_check.json").read_text())
    assert {s["status"] for s in doc["sections"].values()} == {"skipped"}
    assert len(doc["sections"]) == 4


def test_usage_errors_exit_2(tmp_path, bare_env):
    assert check(tmp_path, bare_env, "--cpu", "--sections", "speed,nonsense",
                 timeout=120).returncode == 2
    no_out = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh")], cwd=ROOT,
                            env=bare_env, capture_output=True, text=True, timeout=60)
    assert no_out.returncode == 2 and "usage" in no_out.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible")
def test_without_cuda_the_gpu_mode_refuses_naming_the_cpu_flag(tmp_path, bare_env):
    done = check(tmp_path / "out", bare_env, timeout=120)
    assert done.returncode == 2
    assert "no CUDA device" in done.stdout + done.stderr and "--cpu" in done.stdout + done.stderr
