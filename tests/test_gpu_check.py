"""The GPU check (scripts/gpu_check.sh) on its CPU fallback, as the bare GPU machine sees it,
and the statistics it judges the goals by (benchmarks/gpu_check_timing.py).

The GPU machine has neither DeepSpeed nor MLflow: the check runs here with both made
unimportable (a sitecustomize that refuses them), so an import that would pull either in on
the check's paths fails this test instead of the one borrowed GPU run.
"""

import json
import math
import os
import random
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_check_dwa import COMPILED_ROWS, PATTERNS, STEP_GOALS, our_rows  # noqa: E402
from gpu_check_timing import interleaved, median_ci, median_interval_ranks, verdict  # noqa: E402

from pretrain.model import DenseFormerConfig  # noqa: E402
from pretrain.model.dwa_layout import buffered_traffic  # noqa: E402

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



def assert_interval(ci: dict, n: int = 6) -> None:
    """A median with its interval from n rounds, in order."""
    assert ci["n"] == n and ci["low"] <= ci["median"] <= ci["high"], ci


def assert_dwa_part(sections: dict, other: str) -> None:
    """The dwa part's rows, ratios, floors and goal verdicts, consistent with each other."""
    steps, alone = sections["dwa_steps"], sections["dwa_alone"]
    assert steps["part"] == alone["part"] == "dwa" and steps["timer"] == "perf_counter"
    assert steps["other_dwa"] == alone["other_dwa"] == other
    rows = steps["rows"]
    ran = [f"dense-{p}/{s}" for p in ("1x1", "4x1", "4x5") for s in ("fp32", "bf16")]
    ran += [f"dense-{p}/{s}/torch" for p in ("1x1", "4x5") for s in ("fp32", "bf16")]
    assert set(rows) == {"transformer", "anchor", *ran,
                         *(f"{other}-{p}" for p in ("1x1", "4x1", "4x5"))}
    tokens = steps["batch"] * 32
    for name in ran + ["transformer", "anchor"]:
        r = rows[name]
        assert r["steps"] == 6 and 0 < r["min_step_s"] <= r["median_step_s"] <= r["max_step_s"]
        assert r["tokens_per_s"] == pytest.approx(tokens / r["median_step_s"])
        assert r["mfu"] == pytest.approx(r["model_tflops"] * 1e12 / steps["peak"]["flops"])
    for name in ran:
        assert rows[name]["dwa_dtype"] == name.split("/")[1]
        assert rows[name]["dwa_impl"] == "torch"  # the CPU's, for auto too
        assert_interval(rows[name]["vs_transformer"])
        assert_interval(rows[name][f"added_time_vs_{other}"])
        assert rows[name]["last_loss"] < 7  # ln(512) = 6.24 at init: a finite, sane loss
    for p in ("1x1", "4x1", "4x5"):
        assert_interval(rows[f"{other}-{p}"]["vs_anchor"])
    goals = steps["goals"]
    assert {g["row"] for g in goals if "step" in g["measure"]} == {
        f"dense-{p}/{s}" for p, s in STEP_GOALS}
    assert len(goals) == 4 + 2 * 2  # step goals; added time at 1x1 and 4x5, both storages
    assert all(g["met"] is None and "paper shape" in g["reason"]
               for g in goals), goals  # never judged on the CPU
    bandwidth = alone["copy_bandwidth"]["best_bytes_per_s"]
    assert set(alone["rows"]) == set(ran) | {f"{other}-{p}" for p in ("1x1", "4x1", "4x5")}
    for name, r in alone["rows"].items():
        k, p = PATTERNS[name.split("-")[1].split("/")[0]]
        pattern = DenseFormerConfig(n_layers=10, dwa_dilation=k, dwa_period=p).dwa_pattern
        traffic = buffered_traffic(pattern)
        assert r["floor_tensors"] == traffic["floor_forward"] + traffic["floor_backward"], name
        assert r["floor_ms"] == pytest.approx(r["floor_tensors"] * r["tensor_bytes"] / bandwidth
                                              * 1e3)
        assert_interval(r["vs_floor"])
        assert r["vs_floor"]["median"] == pytest.approx(r["added_ms"]["median"] / r["floor_ms"])
    assert [g["row"] for g in alone["goals"]] == [n for n in ran if not n.endswith("/torch")]
    assert all(g["goal"] == "<= 1.3" and g["met"] is None for g in alone["goals"])


def assert_dwa_compiled(section: dict) -> None:
    """The compiled rows, each against the Transformer compiled the same way."""
    assert section["part"] == "dwa_compiled" and section["backend"] == "aot_eager"
    rows = section["rows"]
    assert set(rows) == {"transformer/blocks", "transformer/model",
                         *(f"{r}/{m}" for r, m in COMPILED_ROWS)}
    for name, r in rows.items():
        assert r["steps"] == 6 and r["first_step_s_with_compile"] > 0, name
        if not name.startswith("transformer"):
            assert r["dwa_impl"] == "torch" and r["compile"] == name.split("/")[-1]
            assert_interval(r["vs_transformer"])
    assert [g["row"] for g in section["goals"]] == [f"{r}/{m}" for r, m in COMPILED_ROWS
                                                    if not r.endswith("/torch")]
    assert all(g["met"] is None for g in section["goals"])


@pytest.fixture
def fake_official(tmp_path) -> Path:
    """A stand-in checkout of the official code: a `denseformer` package whose DWAModules is
    the clean-room ReferenceDWA (same interface), so the --official path runs here."""
    package = tmp_path / "official" / "denseformer"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from nanogpt_anchor import ReferenceDWA as DWAModules\n")
    return package.parent


@pytest.mark.timeout(300)
def test_cpu_dwa_part_with_an_official_checkout(tmp_path, bare_env, fake_official):
    out = tmp_path / "out"
    done = check(out, bare_env, "--cpu", "--only", "dwa,dwa_compiled", "--official",
                 str(fake_official))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["parts"] == ["dwa", "dwa_compiled"]
    assert set(doc["sections"]) == {"dwa_steps", "dwa_alone", "dwa_compiled"}
    assert doc["environment"]["official"] == str(fake_official)
    assert_dwa_part(doc["sections"], "official")
    assert_dwa_compiled(doc["sections"]["dwa_compiled"])
    assert doc["goals"] == [{"section": name, **g}
                            for name in ("dwa_steps", "dwa_alone", "dwa_compiled")
                            for g in doc["sections"][name]["goals"]]


@pytest.mark.slow  # ~2 min: every part; the quick tests above and below cover the rest
@pytest.mark.timeout(600)
def test_cpu_check_writes_every_section_with_plausible_figures(tmp_path, bare_env):
    out = tmp_path / "out"
    done = check(out, bare_env, "--cpu", timeout=560)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((out / "gpu_check.json").read_text())
    assert (out / "gpu_check.log").read_text().count("[gpu_check]") >= 14
    assert doc["mode"] == "cpu" and doc["finished"]
    assert doc["environment"]["torch"] and doc["environment"]["megatron_core"] == "0.16.1"
    sections = doc["sections"]
    assert {k: (s["part"], s["status"]) for k, s in sections.items()} == {
        "dwa_steps": ("dwa", "ok"), "dwa_alone": ("dwa", "ok"),
        "dwa_compiled": ("dwa_compiled", "ok"),
        "transformer": ("transformer", "ok"), "profile": ("transformer", "ok"),
        "compile": ("transformer", "ok"), "memory": ("memory", "ok"),
        "tests": ("tests", "ok")}, json.dumps(sections)[:3000]
    assert_dwa_part(sections, "reference")

    transformer = sections["transformer"]
    assert len(transformer["goals"]) == 11
    assert all(g["met"] is None for g in transformer["goals"])  # a CPU judges no goal
    assert "measured" in transformer["peak"]["source"]  # no spec peak for a CPU
    for shape in transformer["shapes"].values():
        for mode in ("eager", "compiled"):
            assert set(shape[mode]) == {"transformer", "anchor-rope", "anchor"}
            for anchor in ("anchor-rope", "anchor"):
                assert_interval(shape[mode]["transformer"][f"tokens_per_s_vs_{anchor}"])
    for name, profile in sections["profile"]["models"].items():
        times = [k["self_ms"] for k in profile["top"]]
        assert len(times) == 15 and times == sorted(times, reverse=True), name
        assert profile["ranked"] == "ops" and (out / profile["table"]).exists()
    for name, compiled in sections["compile"]["models"].items():
        assert compiled["first_loss_abs_diff"] < 1e-5, name
        assert_interval(compiled["speedup"])

    rows = sections["memory"]["rows"]
    assert {(r["model"], r["mode"]) for r in rows} == {
        (m, c) for m in ("dense-1x1", "dense-4x5") for c in ("block", "dwa_block")}
    for r in rows:  # the CPU probe counts exactly what the estimator models
        assert 0.95 < r["measured_over_estimated"] < 1.05, r

    tests = sections["tests"]
    assert tests["problems"] == [], json.dumps(tests)[:3000]
    assert tests["pytest"]["tests"] >= 3 and tests["pytest"]["failures"] == 0
    # ...a CLI subprocess among them, whose PYTHONPATH is reset (tests/conftest.py cli_env)
    assert "test_invalid_config_exits_2_naming_the_key" in (out / "pytest.xml").read_text()
    for name, v in tests["equivalence"]["variants"].items():
        assert v["loss_abs_diff"] < (0.05 if name == "bf16_autocast" else 1e-5), name
        assert v.get("max_rel_grad_diff", 0) < 1e-5, name
    trainer = tests["trainer"]
    assert trainer["returncodes"] == {"straight": 0, "stopped": 0, "resumed": 0}
    assert trainer["steps"] == list(range(1, 13)) and trainer["resume_bitwise"] is True
    assert trainer["last_loss"] < trainer["first_loss"]
    assert "cpu" in trainer["device_line"]  # the trainer's log names the device it used

    imports = doc["imports"]
    assert imports["forbidden"] == [] and imports["outside_device"] == [], imports
    assert {"torch", "megatron", "numpy"} <= set(imports["third_party"])


def fake_wheel(folder: Path, module: str) -> Path:
    """A minimal pure-Python wheel that holds one package, `module`."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{module}-0.1.dist-info"
    files = {f"{module}/__init__.py": "CARRIED = True\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    wheel = folder / f"{module}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return wheel


@pytest.mark.timeout(200)
def test_spent_budget_skips_sections_and_carried_wheels_reach_reset_subprocesses(tmp_path,
                                                                                 bare_env):
    """The two harness faults of the first GPU run: a CLI subprocess whose PYTHONPATH is reset
    (as tests/conftest.py cli_env does) could not import the carried wheels on a venv Python,
    and the commit named by GPU_CHECK_COMMIT was ignored."""
    assert sys.prefix != sys.base_prefix  # this Python is a venv, as the GPU machine's is
    fake_wheel(tmp_path / "wheels", "gpu_check_carried_probe")
    env = dict(bare_env, GPU_CHECK_WHEELS=str(tmp_path / "wheels"), GPU_CHECK_COMMIT="c0ffee1")
    out = tmp_path / "out"
    done = check(out, env, "--cpu", "--budget-s", "0", timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((out / "gpu_check.json").read_text())
    assert {s["status"] for s in doc["sections"].values()} == {"skipped"}
    assert len(doc["sections"]) == 8 and doc["goals"] == []
    assert doc["environment"]["commit"] == "c0ffee1"
    assert doc["environment"]["commit_source"] == "GPU_CHECK_COMMIT"
    carried = doc["carried"]
    assert carried["via"] == "venv", carried
    assert carried["modules"]["gpu_check_carried_probe"]["from_site"] is True, carried
    assert carried["all_from_site"] is True
    # ...and the check's own process still has the Python's packages (torch, megatron).
    assert doc["environment"]["megatron_core"] == "0.16.1"


def test_usage_errors_exit_2(tmp_path, bare_env):
    for args in (["--only", "dwa,nonsense"], ["--only", ","], ["--official", str(tmp_path)]):
        done = check(tmp_path / "out", bare_env, "--cpu", *args, timeout=120)
        assert done.returncode == 2, (args, done.stdout[-2000:])
    assert "DWAModules" in done.stdout  # the bad --official names what it looked for
    no_out = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh")], cwd=ROOT,
                            env=bare_env, capture_output=True, text=True, timeout=60)
    assert no_out.returncode == 2 and "usage" in no_out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_without_cuda_the_gpu_mode_refuses_naming_the_cpu_flag(tmp_path, bare_env):
    done = check(tmp_path / "out", bare_env, timeout=120)
    assert done.returncode == 2
    assert "no CUDA device" in done.stdout + done.stderr and "--cpu" in done.stdout + done.stderr


# -- the statistics (benchmarks/gpu_check_timing.py) --------------------------------------


def test_median_interval_ranks_are_the_binomial_ones():
    # n = 6: [x_1, x_6] covers with 1 - 2/64; n = 12: [x_3, x_10], 1 - 2 * 79/4096.
    assert [median_interval_ranks(n) for n in (5, 6, 8, 12, 60)] == [None, 1, 1, 3, 22]
    for n in (6, 12, 60):
        rank = median_interval_ranks(n)
        miss = 2 * sum(math.comb(n, i) for i in range(rank)) / 2**n
        wider_miss = 2 * sum(math.comb(n, i) for i in range(rank + 1)) / 2**n
        assert miss <= 0.05 < wider_miss, n


def test_the_interval_covers_the_median_at_least_95_percent_of_the_time():
    rng = random.Random(0)
    for n in (6, 12):  # a skewed distribution: exponential, median ln 2
        trials = 4000
        hits = sum(ci["low"] <= math.log(2) <= ci["high"] for ci in (
            median_ci([rng.expovariate(1.0) for _ in range(n)]) for _ in range(trials)))
        exact = 1 - 2 * sum(math.comb(n, i) for i in range(median_interval_ranks(n))) / 2**n
        assert abs(hits / trials - exact) < 0.015 and exact >= 0.95, (n, hits / trials)


def test_a_goal_is_met_only_when_the_whole_interval_clears_it():
    ci = {"median": 1.0, "low": 0.9, "high": 1.1, "n": 12}
    assert verdict(ci, 1.2, "<=")["met"] is True
    assert verdict(ci, 1.05, "<=")["met"] is False  # the median is below, the interval not
    assert verdict(ci, 0.8, ">=")["met"] is True
    assert verdict(ci, 0.95, ">=")["met"] is False
    assert verdict(median_ci([1.0] * 5), 2.0, "<=")["met"] is None  # too few rounds
    assert verdict(ci, 1.2, "<=", reason="on a CPU")["met"] is None
    with pytest.raises(ValueError, match="'<'"):
        verdict(ci, 1.2, "<")


def test_rounds_interleave_every_configuration_in_a_rotated_order():
    calls = []
    runs = {name: (lambda n=name: calls.append(n)) for name in "abc"}
    times = interleaved(runs, torch.device("cpu"), rounds=3, steps=2, warmup=1)
    assert calls[:3] == ["a", "b", "c"]  # the warm-up
    assert calls[3:] == ["a", "a", "b", "b", "c", "c", "b", "b", "c", "c", "a", "a",
                         "c", "c", "a", "a", "b", "b"]
    assert all(len(rounds) == 3 and all(len(r) == 2 and min(r) >= 0 for r in rounds)
               for rounds in times.values())


def test_dwa_rows_cover_every_pattern_at_both_storage_dtypes():
    rows = our_rows()
    assert rows["dense-4x5/bf16"] == ("dense-4x5", "4x5", "bf16", "auto") and len(rows) == 6
    with_torch = our_rows(with_torch=True)
    assert with_torch["dense-1x1/fp32/torch"] == ("dense-1x1", "1x1", "fp32", "torch")
    assert len(with_torch) == 10



# The transformer part's scoreboard (gpu_check_transformer.py), in this process at a tiny shape.
TINY_SHAPES = dict(overrides=("model.n_layers=2", "model.d_model=32", "model.n_heads=2",
                              "model.vocab_size=128"), rounds=6, steps_per_round=1)


@pytest.mark.timeout(300)
def test_cpu_scoreboard_runs_a_shape_eager_and_compiled_and_skips_what_the_budget_cannot(
        monkeypatch):
    import dataclasses

    import gpu_check_perf as perf
    import gpu_check_transformer as scoreboard

    # No time left after the first shape: the other two are skipped, and said so.
    monkeypatch.setattr(scoreboard, "CPU_SCOREBOARD", ((2, 16), (2, 32), (4, 16)))
    monkeypatch.setitem(scoreboard.SCOREBOARD_BUDGET_S, "cpu", 0.0)
    shapes = dataclasses.replace(perf.CPU_SHAPES, **TINY_SHAPES)
    torch.set_num_threads(1)
    result = scoreboard.section_transformer(torch.device("cpu"), shapes, fused=True)
    assert list(result["shapes"]) == ["2x16"] and result["skipped_shapes"] == ["2x32", "4x16"]
    shape = result["shapes"]["2x16"]
    for mode in ("eager", "compiled"):
        rows = shape[mode]
        assert set(rows) == {"transformer", "anchor-rope", "anchor"}
        for anchor in ("anchor-rope", "anchor"):
            assert_interval(rows["transformer"][f"tokens_per_s_vs_{anchor}"])
        for row in rows.values():
            assert_interval(row["mfu_per_round"])
            assert row["mfu"] > 0 and row["mfu_vs_measured_matmul"] > 0
            assert ("first_step_s_with_compile" in row) == (mode == "compiled")
    # compiled as train.compile=auto picks on a GPU: the same model, the same loss
    assert abs(shape["compiled"]["transformer"]["last_loss"]
               - shape["eager"]["transformer"]["last_loss"]) < 0.5
    memory = shape["memory"]  # the CPU probe against the activation term
    assert 0.85 < memory["measured_over_estimated"] < 1.15, memory
    goals = result["goals"]
    assert len(goals) == 11 and all(g["met"] is None for g in goals)  # a CPU judges none


def test_scoreboard_goals_judge_each_shape_and_leave_missing_ones_open():
    import gpu_check_transformer as scoreboard

    def rows(ratio_low: float, mfu_low: float) -> dict:
        ci = lambda low: {"median": low + 0.01, "low": low, "high": low + 0.02, "n": 8}  # noqa: E731
        return {"transformer": {"tokens_per_s_vs_anchor-rope": ci(ratio_low),
                                "mfu_per_round": ci(mfu_low)}}

    results = {
        "32x256": {"seq": 256, "eager": rows(1.02, 0.30), "compiled": rows(0.97, 0.36),
                   "memory": {"measured_over_estimated": 1.08}},
        "128x256": {"seq": 256, "eager": rows(1.05, 0.40), "compiled": rows(1.01, 0.46),
                    "memory": {"measured_over_estimated": 1.2}},
    }  # 32x1024 skipped
    goals = scoreboard.scoreboard_goals(results, scoreboard.GPU_SCOREBOARD, None)
    assert [g["met"] for g in goals] == [
        True, False, True, True, None, None,  # ours / anchor-rope by shape and mode
        True,  # best MFU at sequence 256 (128 x 256), compiled, clears 45%
        True,  # 32 x 256 compiled clears 35%
        True, False, None]  # memory within 10%
    assert goals[4]["reason"] and goals[10]["reason"] == "the shape did not run"
