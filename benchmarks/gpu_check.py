"""The GPU check: one call on a borrowed GPU measures what the CPU box cannot.

    python benchmarks/gpu_check.py --out OUT [--cpu] [--official PATH] [--budget-s S]
                                   [--only dwa,dwa_compiled,transformer,memory,tests]

(`scripts/gpu_check.sh OUT [options]` makes the carried wheels importable first and runs
this.) Five parts, each sized to run in under 4 minutes on an H200, compile included; `--only`
picks some (a comma list), in this order:

- dwa (gpu_check_dwa.py): sections dwa_steps (our DenseFormer 1x1, 4x1, 4x5 with
  `model.dwa_dtype` fp32 and bf16 against our Transformer; the official DWA, or the
  clean-room ReferenceDWA, inside the nanoGPT-style anchor) and dwa_alone (the DWAs against
  their byte floor at the measured copy bandwidth); each row records its `model.dwa_impl`,
  with the torch implementation beside the default at 1x1 and 4x5;
- dwa_compiled (gpu_check_dwa.py): the Transformer and DenseFormer 1x1 and 4x5 compiled
  (`train.compile` blocks, and model for 1x1 bf16), each against the Transformer compiled
  the same way;
- transformer (gpu_check_transformer.py, gpu_check_perf.py): sections transformer (the
  scoreboard: ours against `anchor-rope` and the learned-position anchor, eager and
  compiled, at micro-batches 32 x 256, 128 x 256 and 32 x 1024: tokens/s, MFU against the
  spec and the measured matmul peak, our memory against the estimate; 11 goals), profile
  (the top 15 kernels of one step of each) and compile (eager against every block
  compiled);
- memory: parallel.strategies.memory's activation estimate against torch.cuda.max_memory_allocated;
- tests (gpu_check_tests.py): the model's equivalences on the device, a real `python -m
  pretrain train` run with stop and resume, then `pytest -m gpu` in the time left.

All at the paper shape (48 x 768, seq 256, vocabulary 50304), micro-batch 32, bf16 autocast,
fused AdamW, synthetic tokens. Timing, intervals and goals: gpu_check_timing.py (CUDA events;
60 steps of each configuration in 12 interleaved rounds; each ratio the median of per-round
ratios with a distribution-free 95% interval; a goal met only when the interval clears it).

OUT/gpu_check.json is rewritten after every section, so a run cut off by its time limit
still returns what it measured; each section carries its part and "status" ("ok", "error"
with the traceback's tail, or "skipped" when its part's time budget ran out before it
started); "goals" gathers every goal's verdict. `--cpu` runs the same parts on the CPU at
tiny shapes (fp32, 6 rounds of one step) in a few minutes: that is what CI tests
(tests/test_gpu_check.py); its timings and goals mean nothing. Nothing here downloads, tracks
to MLflow or uses DeepSpeed; "imports" lists the third-party modules this process imported and
any that the bare GPU machine lacks, and "carried" whether a child process whose PYTHONPATH is
reset (as the test suite's CLI subprocesses do) imports every module of the carried wheels.
"""

from __future__ import annotations

import argparse
import gc
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

PARTS = {"dwa": ("dwa_steps", "dwa_alone"), "dwa_compiled": ("dwa_compiled",),
         "transformer": ("transformer", "profile", "compile"), "memory": ("memory",),
         "tests": ("tests",)}
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
               "gpu_check_tests", "gpu_check_timing", "gpu_check_dwa", "gpu_check_transformer",
               "nanogpt_anchor", "bench_model", "denseformer", "sitecustomize", "usercustomize"}
# (and Python's site hooks; `denseformer` is the official code given with --official)
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


def environment(device) -> dict:
    """Versions, device (a torch.device) and commit: what a figure needs to be quoted."""
    from importlib import metadata

    import torch

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
           # The device gets a copy of the working tree without .git (and any .git above it
           # is not ours): the caller names the commit, and that wins.
           "commit": os.environ.get("GPU_CHECK_COMMIT") or _git("rev-parse", "--short", "HEAD"),
           "commit_source": "GPU_CHECK_COMMIT" if os.environ.get("GPU_CHECK_COMMIT") else "git",
           "triton": version("triton"),
           "c_compiler": shutil.which("cc") or shutil.which("gcc"),  # Triton builds with it
           "uncommitted_files": None if status is None else len(status.splitlines())}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                   device_memory_gib=props.total_memory / 2**30,
                   cudnn=torch.backends.cudnn.version())
    return env


def carried_imports() -> dict | None:
    """Whether a child process, its PYTHONPATH reset to the repository alone (as
    tests/conftest.py's cli_env does), imports every top-level module of the wheels that
    scripts/gpu_check.sh installed into $GPU_CHECK_SITE, and from where; None without it."""
    site = os.environ.get("GPU_CHECK_SITE")
    if not site:
        return None
    # Packages (namespace ones too, like megatron) and modules; not dist-info, bin, caches.
    names = sorted(p.stem for p in Path(site).iterdir() if p.stem.isidentifier()
                   and not p.name.startswith("_") and p.name != "bin"
                   and (p.is_dir() or p.suffix == ".py"))
    probe = ("import importlib, json, sys\nfound = {}\nfor name in sys.argv[1:]:\n"
             "    try:\n        m = importlib.import_module(name)\n"
             "        found[name] = m.__file__ or list(m.__path__)[0]\n"
             "    except Exception as err:\n        found[name] = repr(err)\n"
             "print(json.dumps(found))")
    done = subprocess.run([sys.executable, "-c", probe, *names], cwd=ROOT, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True)
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        found = dict.fromkeys(names, f"probe failed: {done.stderr[-500:]}")
    site_dir = str(Path(site).resolve())
    modules = {n: {"file": f, "from_site": str(Path(f).resolve()).startswith(site_dir)
                   if f and os.path.isabs(f) else False} for n, f in found.items()}
    return {"site": site, "python": sys.executable, "via": os.environ.get("GPU_CHECK_VIA"),
            "child_env": "PYTHONPATH reset to the repository alone", "modules": modules,
            "all_from_site": all(m["from_site"] for m in modules.values())}


class Report:
    """The JSON document, rewritten atomically after every section."""

    def __init__(self, out: Path, mode: str):
        self.path = out / "gpu_check.json"
        self.doc = {"schema": 2, "mode": mode, "started": _now(), "finished": None,
                    "sections": {}, "goals": []}

    def write(self) -> None:
        self.doc["goals"] = [{"section": name, **goal}
                             for name, section in self.doc["sections"].items()
                             for goal in section.get("goals", [])]
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=2, default=str) + "\n")
        os.replace(tmp, self.path)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run_section(report: Report, part: str, name: str, fn, deadline: float) -> None:
    """Run one section into report.doc["sections"][name], then write the document."""
    start = time.monotonic()
    if start > deadline:
        result = {"status": "skipped", "reason": "the part's time budget (--budget-s) ran out"}
    else:
        print(f"[gpu_check] {part}/{name} ...", flush=True)
        try:
            result = {"status": "ok", **fn()}
        except Exception as err:  # one broken section must not lose the others' figures
            result = {"status": "error", "error": f"{type(err).__name__}: {err}",
                      "traceback": traceback.format_exc()[-4000:]}
            traceback.print_exc()
    import torch

    gc.collect()  # the section's models: a 378M model with AdamW state is 6 GB
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    result = {"part": part, **result, "seconds": time.monotonic() - start}
    report.doc["sections"][name] = result
    report.write()
    print(f"[gpu_check] {part}/{name}: {result['status']} in {result['seconds']:.1f} s",
          flush=True)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--only", default=",".join(PARTS),
                        help=f"comma-separated subset of {','.join(PARTS)} (default: all)")
    parser.add_argument("--official", metavar="PATH",
                        help="a checkout of epfml/DenseFormer (the directory holding "
                             "denseformer/): its DWAModules in the anchor instead of the "
                             "clean-room ReferenceDWA")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no section of a part after this many seconds into the "
                             "part (default 220 on a GPU, 120 with --cpu)")
    args = parser.parse_args(argv)
    args.parts = [p for p in args.only.split(",") if p]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown or not args.parts:
        parser.error(f"--only: unknown part(s) {unknown or args.only!r}; choose from "
                     f"{','.join(PARTS)}")
    args.official_cls = None
    if args.official:
        from nanogpt_anchor import official_dwa_class

        try:
            args.official_cls = official_dwa_class(str(Path(args.official).resolve()))
        except ValueError as err:
            parser.error(f"--official: {err}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # before torch is imported: a usage error answers at once
    import gpu_check_perf as perf
    import torch
    from gpu_check_dwa import section_dwa_alone, section_dwa_compiled, section_dwa_steps
    from gpu_check_tests import section_tests
    from gpu_check_transformer import section_profile, section_transformer

    if not args.cpu and not torch.cuda.is_available():
        print("error: no CUDA device visible to torch (pass --cpu to run the CPU fallback)",
              file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if args.cpu:  # on a shared CPU box a descheduled OpenMP thread stalls a step for seconds
        torch.set_num_threads(1)
    shapes = perf.CPU_SHAPES if args.cpu else perf.GPU_SHAPES
    budget = args.budget_s if args.budget_s is not None else (120.0 if args.cpu else 220.0)
    args.out.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    report = Report(args.out, device.type)
    fused = perf.fused_adamw_supported(device)
    report.doc["environment"] = {**environment(device), "fused_adamw": fused,
                                 "official": args.official}
    report.doc["carried"] = carried = carried_imports()
    if carried is not None and not carried["all_from_site"]:
        print(f"[gpu_check] warning: a child process with PYTHONPATH reset does not import "
              f"every carried module from {carried['site']}: {carried['modules']}", flush=True)
    report.doc["parts"] = [p for p in PARTS if p in args.parts]
    report.write()

    keep: dict = {}  # the dwa part's models, from dwa_steps to dwa_alone
    work = {"dwa_steps": lambda: section_dwa_steps(device, shapes, fused, args.official_cls,
                                                   keep),
            "dwa_alone": lambda: section_dwa_alone(device, shapes, args.official_cls, keep),
            "dwa_compiled": lambda: section_dwa_compiled(device, shapes, fused),
            "transformer": lambda: section_transformer(device, shapes, fused),
            "profile": lambda: section_profile(device, shapes, fused, args.out),
            "compile": lambda: perf.section_compile(device, shapes, fused),
            "memory": lambda: perf.section_memory(device, shapes),
            "tests": lambda: section_tests(device, args.out, deadline)}
    for part in report.doc["parts"]:
        deadline = time.monotonic() + budget
        for name in PARTS[part]:
            run_section(report, part, name, work[name], deadline)
        keep.clear()
    report.doc["imports"] = imports_report()
    report.doc["finished"] = _now()
    report.write()
    failed = [n for n, s in report.doc["sections"].items() if s["status"] == "error"]
    print(f"[gpu_check] wrote {report.path}; sections with errors: {failed or 'none'}")
    for goal in report.doc["goals"]:
        print(f"[gpu_check] goal {goal['measure']} {goal['goal']}: median "
              f"{goal.get('median')} [{goal.get('low')}, {goal.get('high')}] met "
              f"{goal['met']}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
