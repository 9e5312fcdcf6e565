"""The GPU check: one call on a borrowed GPU measures what the CPU box cannot.

    python benchmarks/gpu_check.py --out OUT [--cpu] [--sections speed,memory,compile,tests]

(`scripts/gpu_check.sh OUT [--cpu]` installs the wheels of `scripts/gpu_wheels.sh` first and
runs this.) Sections, in this order (the figures no CPU can give first, the tests last, cut to
the time left):

- speed: 48 x 768 paper-shape Transformer, DenseFormer 4x5 and 1x1, bf16 autocast on
  synthetic tokens, interleaved rounds: s/step, tokens/s, MFU against the device's spec peak
  (pretrain/mfu.py's datasheet table; the measured matmul peak for an unknown device), ratios to
  the Transformer.
- memory: parallel.memory's activation estimate against torch.cuda.max_memory_allocated for
  `block` and `dwa_block` activation checkpointing (bf16 and fp32).
- compile: torch.compile on every block against eager for one configuration.
- tests: the model's equivalences on the device (buffered and functional DWA, checkpointing
  modes, bf16 against fp32), a real `python -m pretrain train` run on the device with
  tracking off (loss, checkpoint, stop and resume, bitwise or not), then `pytest -m gpu` (the
  model and single-process trainer tests that need neither MLflow nor DeepSpeed nor a second
  GPU) in whatever remains of the time budget.

OUT/gpu_check.json is rewritten after every section, so a run cut off by its time limit
still returns what it measured; each section carries "status" ("ok", "error" with the
traceback's tail, or "skipped" when the time budget ran out before it started). `--cpu` runs
the same sections on the CPU at tiny shapes (fp32) in about a minute: that is what CI
tests (tests/test_gpu_check.py). Nothing here downloads, tracks to MLflow or uses DeepSpeed;
"imports" lists the third-party modules this process imported and any that the bare GPU
machine lacks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # on the GPU machine the repository is not pip-installed
    sys.path.insert(0, str(ROOT))

import gpu_check_perf as perf  # noqa: E402
import torch  # noqa: E402
from gpu_check_tests import section_tests  # noqa: E402

SECTIONS = ("speed", "memory", "compile", "tests")
# Top-level modules the bare GPU machine has (its packages and what they pull in), those
# scripts/gpu_wheels.sh brings, and those only tried behind a guard, imported where they are
# installed and skipped where not (megatron: einops; torch: dill, and colorama in inductor;
# lm-eval, the `eval` extra, installs the last two here).
DEVICE_MODULES = {
    "torch", "torchgen", "functorch", "triton", "nvidia", "numpy", "yaml", "tqdm", "safetensors",
    "sentencepiece", "scipy", "matplotlib", "mpl_toolkits", "PIL", "kiwisolver", "cycler",
    "fontTools", "pyparsing", "dateutil", "six", "contourpy", "transformers", "huggingface_hub",
    "tokenizers", "regex", "requests", "urllib3", "idna", "certifi", "charset_normalizer",
    "filelock", "fsspec", "jinja2", "markupsafe", "networkx", "sympy", "mpmath",
    "typing_extensions", "setuptools", "pkg_resources", "jaraco", "more_itertools",
    "backports", "packaging", "pytest", "py", "pluggy", "iniconfig", "pygments", "cython_runtime"}
WHEEL_MODULES = {"megatron", "wids", "webdataset", "braceexpand", "pytest_timeout"}
GUARDED_MODULES = {"einops", "dill", "colorama"}
OWN_MODULES = {"pretrain", "parallel", "data_pipeline", "slurm", "tests", "gpu_check_perf",
               "gpu_check_tests", "sitecustomize", "usercustomize"}  # and Python's site hooks
# What must never be imported on these paths: neither is on the GPU machine.
FORBIDDEN_MODULES = ("deepspeed", "mlflow")


def third_party_modules() -> list[str]:
    """Top-level names of the non-stdlib modules imported so far (private ones left out)."""
    names = {name.partition(".")[0] for name in sys.modules}
    return sorted(n for n in names - set(sys.stdlib_module_names) - OWN_MODULES
                  if not n.startswith("_") or n == "_pytest")


def imports_report() -> dict:
    """What this process imported; "outside_device": modules the GPU machine is not known to
    have (a new dependency on the check's paths shows up here, on the CPU run of CI)."""
    imported = third_party_modules()
    known = DEVICE_MODULES | WHEEL_MODULES | GUARDED_MODULES | {"_pytest"}
    return {"third_party": imported,
            "outside_device": [n for n in imported if n not in known],
            "forbidden": [n for n in FORBIDDEN_MODULES if n in imported]}


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def environment(device: torch.device) -> dict:
    """Versions, device and commit: what a figure needs to be quoted."""
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    import shutil

    status = _git("status", "--short")
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "megatron_core": version("megatron-core"),
           "wids": version("wids"), "webdataset": version("webdataset"),
           "host": platform.node(), "cpu_count": os.cpu_count(), "device": str(device),
           # The device gets a copy of the working tree without .git: the caller names it.
           "commit": _git("rev-parse", "--short", "HEAD") or os.environ.get("GPU_CHECK_COMMIT"),
           "triton": version("triton"),
           "c_compiler": shutil.which("cc") or shutil.which("gcc"),  # Triton builds with it
           "uncommitted_files": None if status is None else len(status.splitlines())}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                   device_memory_gib=props.total_memory / 2**30,
                   cudnn=torch.backends.cudnn.version())
    return env


class Report:
    """The JSON document, rewritten atomically after every section."""

    def __init__(self, out: Path, mode: str):
        self.path = out / "gpu_check.json"
        self.doc = {"schema": 1, "mode": mode, "started": _now(), "finished": None,
                    "sections": {}}

    def write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=2, default=str) + "\n")
        os.replace(tmp, self.path)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run_section(report: Report, name: str, fn, deadline: float) -> None:
    """Run one section into report.doc["sections"][name], then write the document."""
    start = time.monotonic()
    if start > deadline:
        result = {"status": "skipped", "reason": "the time budget (--budget-s) ran out"}
    else:
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            result = {"status": "ok", **fn()}
        except Exception as err:  # one broken section must not lose the others' figures
            result = {"status": "error", "error": f"{type(err).__name__}: {err}",
                      "traceback": traceback.format_exc()[-4000:]}
            traceback.print_exc()
    result["seconds"] = time.monotonic() - start
    report.doc["sections"][name] = result
    report.write()
    print(f"[gpu_check] {name}: {result['status']} in {result['seconds']:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no section after this many seconds (default 270 on a "
                             "GPU, 150 with --cpu)")
    args = parser.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {SECTIONS}")
    if not args.cpu and not torch.cuda.is_available():
        print("error: no CUDA device visible to torch (pass --cpu to run the CPU fallback)",
              file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if args.cpu:  # on a shared CPU box a descheduled OpenMP thread stalls a step for seconds
        torch.set_num_threads(1)
    shapes = perf.CPU_SHAPES if args.cpu else perf.GPU_SHAPES
    budget = args.budget_s if args.budget_s is not None else (150.0 if args.cpu else 270.0)
    deadline = time.monotonic() + budget
    args.out.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    report = Report(args.out, device.type)
    report.doc["environment"] = environment(device)
    report.write()

    models: dict = {}  # shared by speed and memory: building a 378M model takes seconds
    work = {"speed": lambda: perf.section_speed(device, shapes, models),
            "memory": lambda: perf.section_memory(device, shapes, models),
            "tests": lambda: section_tests(device, args.out, deadline),
            "compile": lambda: perf.section_compile(device, shapes)}
    for name in SECTIONS:
        if name in sections:
            run_section(report, name, work[name], deadline)
            if name == "memory":
                models.clear()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    report.doc["imports"] = imports_report()
    report.doc["finished"] = _now()
    report.write()
    failed = [n for n, s in report.doc["sections"].items() if s["status"] == "error"]
    print(f"[gpu_check] wrote {report.path}; sections with errors: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
