"""What a checkpoint save costs: the trainer's DCP save (pretrain/sharded_checkpoint.py),
synchronous and asynchronous, at 1, 2 and 4 ranks on this machine.

The state is `--tensors` equal fp32 matrices of `--rows` x `--cols` (256 MiB by default),
held the way a layout holds it (`--layout`):

- `zero`: each rank owns one flat range of the concatenated state, as a ZeRO-1/2/3
  partition does, handed to DCP as FlatShards (row-blocks with global offsets,
  pretrain/flat_shards.py), views of the rank's one flat buffer;
- `tp`: each tensor split by rows over the ranks as a DTensor (`Shard(0)`), as a
  tensor-parallel weight is.

Either way a rank's share is 1 / ranks of the state. Fresh gloo processes per rank count,
one torch thread each. Per rank:

- save: wall time of `sharded_checkpoint.save` (DCP plan exchange, write with fsync, sha256
  of the file written), barrier to barrier; bytes it wrote;
- load: wall time of DCP reading the same slices back (checked equal);
- peak extra host memory during the save: the RSS high-water mark (reset through
  `/proc/self/clear_refs` just before, after `malloc_trim`) minus the RSS before, against
  the rank's share;
- async, twice (a run's first save, and a later one that reuses the first's host copy as
  `Checkpointer` does): how long the training loop is blocked (`host_copy` of the share,
  then `save_async` starting DCP's thread), the time until the write ended, and the same
  peak extra memory.

    .venv/bin/python benchmarks/bench_checkpoint.py [--layout zero|tp] [--ranks 1 2 4]
        [--device cpu|cuda] [--tensors 64 --rows 1024 --cols 1024] [--dir /tmp] [--json]

With `--device cuda` the state lives on the GPUs (ranks share them round robin), so the
asynchronous save's blocked time is the device-to-host copy into pinned memory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from host_memory import reset_peak, status_kib  # noqa: E402


def state_of_rank(args: argparse.Namespace, rank: int, world: int, fill: bool = True) -> dict:
    """This rank's share of the state under `args.layout` (zeros unless `fill`)."""
    import torch

    from pretrain.flat_shards import FlatShard

    shape, numel = (args.rows, args.cols), args.rows * args.cols
    gen = torch.Generator().manual_seed(rank)
    if args.layout == "zero":
        total = args.tensors * numel
        lo, hi = rank * total // world, (rank + 1) * total // world
        flat = torch.randn(hi - lo, generator=gen) if fill else torch.zeros(hi - lo)
        flat = flat.to(_device(args, rank))
        state = {}
        for n in range(args.tensors):
            start, stop = max(lo, n * numel), min(hi, (n + 1) * numel)
            if start < stop:
                state[f"model.w{n}"] = FlatShard(flat[start - lo: stop - lo], start - n * numel,
                                                 shape, shape)
        return state
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    rows = args.rows // world
    device = _device(args, rank)
    mesh = DeviceMesh(device.type, list(range(world))) if world > 1 else None
    state = {}
    for n in range(args.tensors):
        local = (torch.randn(rows, args.cols, generator=gen) if fill else
                 torch.zeros(rows, args.cols)).to(device)
        state[f"model.w{n}"] = local if mesh is None else \
            DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return state


def _device(args: argparse.Namespace, rank: int):
    """Where this rank's state lives: the CPU, or a GPU (ranks share GPUs round robin)."""
    import torch

    if args.device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())


def _sync(args: argparse.Namespace) -> None:
    import torch

    if args.device == "cuda":
        torch.cuda.synchronize()


def _values(value):
    """The tensors a state entry holds on this rank."""
    if hasattr(value, "blocks"):
        return list(value.blocks.values())
    return [value.to_local() if hasattr(value, "to_local") else value]


def measure(args: argparse.Namespace, directory: str) -> dict:
    """(in each rank) sync save, load, async save of this rank's share; its figures."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from pretrain import sharded_checkpoint
    from pretrain.flat_shards import LoadPlanner

    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(_device(args, rank))
    state = state_of_rank(args, rank, world)
    share = sum(t.numel() * 4 for v in state.values() for t in _values(v))
    group = dist.new_group(backend="gloo")
    sync_dir, async_dir = Path(directory) / "sync", Path(directory) / "async"
    out = {"rank": rank, "share_mib": share / 2**20}

    dist.barrier()
    before = reset_peak()
    start = time.perf_counter()
    written = sharded_checkpoint.save(sync_dir, state, rank)
    dist.barrier()
    out["save_s"] = time.perf_counter() - start
    out["save_peak_extra_mib"] = (status_kib("VmHWM") - before) / 1024
    out["bytes"] = sum(entry["bytes"] for entry in written.values())

    target = state_of_rank(args, rank, world, fill=False)
    dist.barrier()
    start = time.perf_counter()
    dcp.load(target, storage_reader=FileSystemReader(sync_dir / sharded_checkpoint.TENSOR_DIR),
             planner=LoadPlanner())
    _sync(args)
    dist.barrier()
    out["load_s"] = time.perf_counter() - start
    out["load_equal"] = all(torch.equal(a, b) for key in state for a, b in
                            zip(_values(state[key]), _values(target[key]), strict=True))
    del target

    staged = None
    for run in ("first", "next"):  # a run's later saves reuse the first one's host copy
        dist.barrier()
        before = reset_peak()
        start = time.perf_counter()
        staged = sharded_checkpoint.host_copy(state, dp_rank=0, dp_size=1, reuse=staged)
        future = sharded_checkpoint.save_async(async_dir / run, staged, group)
        out[f"async_{run}_blocked_s"] = time.perf_counter() - start
        future.result()
        dist.barrier()
        out[f"async_{run}_total_s"] = time.perf_counter() - start
        out[f"async_{run}_peak_extra_mib"] = (status_kib("VmHWM") - before) / 1024
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=("zero", "tp"), default="zero")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the state lives (cuda: the save copies it to host memory)")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device")
    if args.layout == "tp" and any(args.rows % world for world in args.ranks):
        parser.error("--layout tp: --rows must divide by every --ranks count")

    from tests.distributed import run_distributed_test

    total_mib = args.tensors * args.rows * args.cols * 4 / 2**20
    results = {}
    for world in args.ranks:
        directory = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)
        try:
            results[world] = run_distributed_test(measure, world_size=world, timeout_s=1800,
                                                  args=args, directory=directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    if not all(r["load_equal"] for per_rank in results.values() for r in per_rank):
        print("error: a rank loaded other values than it saved", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"layout": args.layout, "state_mib": total_mib, "ranks": results},
                         indent=1))
        return 0
    print(f"state: {args.tensors} fp32 tensors of {args.rows} x {args.cols}, {total_mib:.0f} "
          f"MiB, layout {args.layout}; times of the slowest rank, memory of the largest")
    print("ranks | share MiB | save s | load s | MiB written/rank | save peak extra MiB "
          "(x share) | async blocked s, first save / next (/ save) | async total s | async "
          "peak extra MiB, first / next (x share)")
    for world, per_rank in results.items():
        def worst(key, per_rank=per_rank):
            return max(r[key] for r in per_rank)
        share, save = worst("share_mib"), worst("save_s")
        first, later = worst("async_first_blocked_s"), worst("async_next_blocked_s")
        peak_first, peak_later = (worst(f"async_{run}_peak_extra_mib") for run in ("first",
                                                                                   "next"))
        print(f"{world} | {share:.0f} | {save:.2f} | {worst('load_s'):.2f} | "
              f"{worst('bytes') / 2**20:.0f} | {worst('save_peak_extra_mib'):.0f} "
              f"({worst('save_peak_extra_mib') / share:.2f}) | {first:.3f} / {later:.3f} "
              f"({first / save:.3f} / {later / save:.3f}) | {worst('async_next_total_s'):.2f} | "
              f"{peak_first:.0f} / {peak_later:.0f} ({peak_first / share:.2f} / "
              f"{peak_later / share:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
