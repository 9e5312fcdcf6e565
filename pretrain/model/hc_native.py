"""Hyper-Connections' fused CPU kernels (pretrain/model/hc_kernels.c): built with the C
compiler on first use, loaded through ctypes, called on contiguous fp32/fp64 CPU tensors.

The library is built once per source, compiler (its path, size and time) and flags into the
kernel cache (`$DENSEFORMER_KERNEL_CACHE`, else `$XDG_CACHE_HOME/denseformer/kernels`, else
`~/.cache/denseformer/kernels`), as DeepSpeed builds its ops: written to a temporary name,
then renamed, so ranks building at once on one node never load a half-written file. Where
there is no compiler, the build fails, or `DENSEFORMER_HC_KERNELS=0` is set, `lib()` is None
and hc_mix.py runs the same products as torch operations (logged once, naming the reason).
GPU tensors always take the torch path (under `train.compile` the compiler fuses it).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("hc_kernels.c")
FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno")
SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_I64, _INT, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
# Argument types by kernel (the dtype suffix added): sizes int64, arrays pointers.
SIGNATURES = {
    "hc_read": (_I64, _I64, _I64, _PTR, _PTR, _PTR, _INT),
    "hc_read_backward": (_I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _INT, _INT),
    "hc_write": (_I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _INT),
    "hc_write_backward": (_I64, _I64, _I64) + (_PTR,) * 9 + (_INT,),
    "hc_sumsq": (_I64, _I64, _PTR, _PTR, _INT),
    "hc_dynamic_read": (_I64, _I64, _I64) + (_PTR,) * 6 + (ctypes.c_double,) + (_PTR,) * 7
                       + (_INT,),
    "hc_dynamic_read_backward": (_I64, _I64, _I64) + (_PTR,) * 11 + (_INT,)
                                + (_PTR,) * 5 + (_INT,),
    "hc_sinkhorn": (_I64, _I64, _I64, _PTR, _PTR, _INT),
    "hc_sinkhorn_backward": (_I64, _I64, _I64, _PTR, _PTR, _PTR, _INT),
}
# Kernels that return 0, or 1 when out of memory (`call` raises MemoryError for it).
RETURNS_STATUS = ("hc_dynamic_read_backward", "hc_sinkhorn", "hc_sinkhorn_backward")


def cache_dir() -> Path:
    if os.environ.get("DENSEFORMER_KERNEL_CACHE"):
        return Path(os.environ["DENSEFORMER_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "denseformer" / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build(directory: Path | None = None) -> Path:
    """The built library's path (building it if this source, compiler and flags have none
    yet). Raises OSError or subprocess.CalledProcessError naming what failed."""
    cc = _compiler()
    if cc is None:
        raise OSError("no C compiler (gcc or cc on PATH, or $CC)")
    found = Path(shutil.which(cc) or cc).resolve()
    stat = found.stat()  # the compiler as installed: a new one gets a new build
    key = hashlib.sha256("\0".join([SOURCE.read_text(), str(found), str(stat.st_size),
                                    str(stat.st_mtime_ns), *FLAGS]).encode())
    directory = cache_dir() if directory is None else directory
    path = directory / f"hc_kernels-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        partial = Path(tmp) / path.name
        done = subprocess.run([cc, *FLAGS, "-o", str(partial), str(SOURCE), "-lm"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout,
                                                done.stderr)
        os.replace(partial, path)
    return path


@functools.cache
def lib() -> ctypes.CDLL | None:
    """The loaded kernels, or None (logged once) where they cannot be had."""
    if os.environ.get("DENSEFORMER_HC_KERNELS", "1") == "0":
        log.info("Hyper-Connections: DENSEFORMER_HC_KERNELS=0, torch operations on the CPU")
        return None
    try:
        library = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as err:  # RuntimeError: no home
        detail = getattr(err, "stderr", "") or err
        log.warning("Hyper-Connections: the fused CPU kernels (%s) could not be built, torch "
                    "operations run instead: %s", SOURCE.name, str(detail).strip()[:500])
        return None
    for name, args in SIGNATURES.items():
        for suffix in SUFFIX.values():
            fn = getattr(library, f"{name}_{suffix}")
            fn.argtypes = args
            fn.restype = ctypes.c_int if name in RETURNS_STATUS else None
    return library


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels serve these tensors: all on the CPU, of one dtype they have, and
    not under torch.compile (which traces the torch operations instead)."""
    first = tensors[0]
    return (first.device.type == "cpu" and not torch.compiler.is_compiling()
            and first.dtype in SUFFIX
            and all(t.device.type == "cpu" and t.dtype == first.dtype for t in tensors)
            and lib() is not None)


def call(name: str, *args) -> None:
    """Kernel `name` for the dtype of the first tensor among `args`: tensors pass as their
    data pointers (each must be contiguous), ints as themselves; the thread count is torch's.
    Raises MemoryError where the kernel found no memory for its work buffers."""
    dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor))
    values = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if not a.is_contiguous():
                raise ValueError(f"{name}: argument {len(values)} is not contiguous")
            values.append(a.data_ptr())
        else:
            values.append(a)
    if getattr(lib(), f"{name}_{SUFFIX[dtype]}")(*values, torch.get_num_threads()):
        raise MemoryError(f"{name}: no memory for its work buffers")
