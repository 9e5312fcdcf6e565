"""Model and AdamW tensors of a checkpoint through torch.distributed.checkpoint (DCP).

Every rank hands DCP the tensors it holds under global, layout-free keys:

    model.<parameter name>           the parameter (single-process name and shape)
    optim.<parameter name>.<key>     its AdamW state: step, exp_avg, exp_avg_sq

A tensor-parallel shard goes in as a DTensor over a device mesh built from megatron-core's TP
group (`Shard(partition_dim)`), so DCP records which slice of the global tensor it is; a
tensor held whole by several ranks (data-parallel replicas, the tied embedding on the first
and last pipeline stage, the (d, d + 1) DWA alphas on every pipeline rank, replicated norms)
has the same key and slice everywhere and DCP's planner picks one writer for it, balancing
the bytes over the ranks. So each rank writes its own file (`__<rank>_0.distcp`) holding
only what it owns, rank 0 writes DCP's index (`.metadata`), and no tensor data crosses a
collective (DCP exchanges only its plans).

Loading asks for the slices this rank holds now, at whatever layout: DCP reads the overlap
of each saved slice with each requested one, so a checkpoint written at one TP x PP x DP
layout resumes at any other. Tools (eval, export, inspect) read full tensors in one process.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from pretrain.checkpoint import (
    CheckpointError,
    Retention,
    finalize_checkpoint,
    hash_share,
    new_tmp_dir,
    read_manifest,
    read_meta,
    sha256_file,
    write_meta,
)
from pretrain.flat_shards import Blocks, FlatShard, LoadPlanner, SavePlanner
from pretrain.model.init import full_shape, local_shard
from pretrain.optim import is_fused

TENSOR_DIR = "tensors"  # the DCP directory inside a checkpoint
METADATA_FILE = ".metadata"  # DCP's index: a pickle, checked against our manifest first
MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."


def model_key(name: str) -> str:
    return MODEL_PREFIX + name


def optim_key(name: str, key: str) -> str:
    return f"{OPTIM_PREFIX}{name}.{key}"


def tp_mesh(model: nn.Module):
    """A 1-D device mesh over the model's tensor-parallel group (None without TP)."""
    group = getattr(model, "tp_group", None)
    if group is None or group.size() == 1:
        return None
    device = next(model.parameters()).device.type
    return DeviceMesh.from_group(group, device)


def _global(param: torch.Tensor, tensor: torch.Tensor, mesh):
    """`tensor` (this rank's part of `param`'s global tensor) as DCP should see it."""
    tensor = tensor.detach()
    if mesh is None or not getattr(param, "tensor_model_parallel", False):
        return tensor

    return DTensor.from_local(tensor, mesh, [Shard(param.partition_dim)], run_check=False)


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's parameters and AdamW state under global keys, TP shards as DTensors."""
    mesh = tp_mesh(model)
    state = {}
    for name, param in model.named_parameters():
        state[model_key(name)] = _global(param, param, mesh)
        for key, value in optimizer.state.get(param, {}).items():
            # 0-dim entries (AdamW's `step`) are the same on every rank holding the parameter
            state[optim_key(name, key)] = value.detach() if value.ndim == 0 else \
                _global(param, value, mesh)
    return state


def full_state(model_state: dict, optimizer_state: dict) -> dict:
    """Full tensors by name (pretrain.model.state's form) under the same global keys."""
    state = {model_key(name): tensor for name, tensor in model_state.items()}
    for name, entries in optimizer_state.items():
        state.update({optim_key(name, key): value for key, value in entries.items()})
    return state


def writer(directory: Path):
    """DCP's file writer for directory/tensors."""
    # One thread: the file this rank writes is then exactly `__<rank>_0.distcp`.
    return FileSystemWriter(Path(directory) / TENSOR_DIR, single_file_per_rank=True,
                            sync_files=True, thread_count=1, overwrite=True)


def save(directory: Path, state: dict, rank: int) -> dict[str, dict]:
    """Write `state` into directory/tensors with every rank (collective); {relative path:
    {"bytes", "sha256"}} of the files this rank wrote, for the manifest."""
    with _one_process_is_intended():
        dcp.save(state, storage_writer=writer(directory), planner=SavePlanner())
    return written_files(directory, rank)


def save_async(directory: Path, staged: dict, group):
    """Start writing `staged` (a `host_copy`) into directory/tensors in a background thread,
    DCP's collectives on `group` (collective: every rank calls it); DCP's future."""
    return dcp.async_save(staged, storage_writer=writer(directory), planner=SavePlanner(),
                          process_group=group, async_stager=_AlreadyStaged())


class _AlreadyStaged:
    """DCP's AsyncStager protocol for a state dict `host_copy` made: nothing left to copy
    (DCP's default stager would copy again, and does not know Blocks)."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: dict) -> dict:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def host_copy(state: dict, dp_rank: int, dp_size: int, reuse: dict | None = None) -> dict:
    """What this rank writes of `state` (a `local_state` or a ZeRO one), copied to host
    memory (pinned when on CUDA) so that training can go on changing the originals; into
    the tensors of `reuse` (an earlier host_copy whose write has ended) where they fit.

    ZeRO ranges are this rank's alone. A tensor every data-parallel replica holds is copied
    by one of them only: the replicas split such tensors by bytes, greedily and identically
    on every rank, so each copies about 1/DP of them (DCP would pick one writer for each
    anyway, but only after planning in the background)."""
    boxes = {}
    for key, value in state.items():
        if isinstance(value, Blocks):
            boxes[key] = value
        elif isinstance(value, DTensor):
            _, offsets = compute_local_shape_and_global_offset(
                value.shape, value.device_mesh, value.placements)
            boxes[key] = Blocks({tuple(offsets): value.to_local()}, value.shape)
        else:
            boxes[key] = Blocks({(0,) * value.dim(): value}, value.shape)
    replicated = {key: {"bytes": value.nbytes()} for key, value in boxes.items()
                  if not isinstance(value, FlatShard)}
    mine = set(hash_share(replicated, dp_rank, dp_size))
    cuda = any(v.is_cuda for b in boxes.values() for v in b.blocks.values())
    reuse = reuse or {}
    staged = {key: value.copy_to("cpu", pin_memory=cuda, into=reuse.get(key))
              for key, value in boxes.items() if key not in replicated or key in mine}
    if cuda:
        torch.cuda.synchronize()  # the pinned copies were issued non-blocking
    return staged


def written_files(directory: Path, rank: int) -> dict[str, dict]:
    """{relative path: {"bytes", "sha256"}} of the tensor files rank `rank` wrote."""
    target = Path(directory) / TENSOR_DIR
    written = {}
    for path in sorted(target.glob(f"__{rank}_*.distcp")):
        rel = path.relative_to(directory).as_posix()
        written[rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    return written


@contextlib.contextmanager
def _one_process_is_intended():
    """Silence DCP's warning that it runs without a process group (tools, one process)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


def read_metadata(checkpoint: Path, manifest: dict) -> Metadata:
    """DCP's index of `checkpoint`, after its sha256 matched the manifest's (it is a pickle:
    never unpickle bytes the manifest does not vouch for)."""

    rel = f"{TENSOR_DIR}/{METADATA_FILE}"
    path = Path(checkpoint) / rel
    entry = manifest["files"].get(rel)
    if entry is None:
        raise CheckpointError(f"{Path(checkpoint) / 'manifest.json'}: does not list {rel}")
    if not path.is_file() or sha256_file(path) != entry["sha256"]:
        raise CheckpointError(f"{path}: missing, or its sha256 differs from the manifest "
                              "(corrupt); not unpickling it")
    return FileSystemReader(path.parent).read_metadata()


def tensor_entries(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    """{key: DCP's tensor metadata (global size, dtype, saved chunks)}."""
    return {key: md for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


def load_tensors(checkpoint: Path, target: dict, no_dist: bool) -> None:
    """Read `target`'s tensors (plain, DTensor or FlatShard: the slices they stand for)."""
    reader = FileSystemReader(Path(checkpoint) / TENSOR_DIR)
    try:
        with _one_process_is_intended():
            dcp.load(target, storage_reader=reader, planner=LoadPlanner(), no_dist=no_dist)
    except dcp.api.CheckpointException as err:  # a BaseException: make it ours
        raise CheckpointError(f"{Path(checkpoint) / TENSOR_DIR}: cannot be read ({err})") \
            from None


def empty_like_global(param: torch.Tensor, md: TensorStorageMetadata, mesh, key: str,
                       checkpoint: Path):
    """A tensor to read this rank's part of `key` into, its global shape checked."""
    expected = torch.Size(full_shape(param, mesh.size() if mesh is not None else 1))
    if md.size != expected:
        raise CheckpointError(f"{checkpoint}: {key} has shape {tuple(md.size)}, this model "
                              f"needs {tuple(expected)}")
    local = torch.empty(param.shape, dtype=md.properties.dtype, device=param.device)
    return _global(param, local, mesh)


def optim_entries(entries: dict[str, TensorStorageMetadata], name: str
                  ) -> dict[str, TensorStorageMetadata]:
    """{AdamW key: metadata} the checkpoint holds for parameter `name`."""
    prefix = optim_key(name, "")
    return {key[len(prefix):]: md for key, md in entries.items()
            if key.startswith(prefix) and "." not in key[len(prefix):]}


def missing_fill(fill: Mapping[str, torch.Tensor] | None, params: Mapping,
                 entries: Mapping) -> dict[str, torch.Tensor]:
    """The `fill` values of this rank's parameters that the checkpoint lacks."""
    return {name: value for name, value in (fill or {}).items()
            if name in params and model_key(name) not in entries}


def load_local(checkpoint: Path, manifest: dict, model: nn.Module,
               optimizer: torch.optim.Optimizer | None,
               fill: Mapping[str, torch.Tensor] | None = None) -> None:
    """Read this rank's slices of its parameters and AdamW state (collective over all ranks:
    every rank calls it); CheckpointError naming a missing or misshapen tensor. Without an
    `optimizer`, the weights alone; `fill`: full values of parameters the checkpoint may
    lack (a Transformer's checkpoint has no `dwa_alpha`)."""
    entries = tensor_entries(read_metadata(checkpoint, manifest))
    mesh = tp_mesh(model)
    params = dict(model.named_parameters())
    fill = missing_fill(fill, params, entries)
    target, optim_keys, problem = {}, {}, None
    try:
        for name, param in params.items():
            key = model_key(name)
            if name in fill:
                continue
            if key not in entries:
                raise CheckpointError(f"{checkpoint}: holds no parameter {name!r}")
            target[key] = empty_like_global(param, entries[key], mesh, key, checkpoint)
            if optimizer is None:
                continue
            for entry, md in optim_entries(entries, name).items():
                saved = optim_key(name, entry)
                if len(md.size) == 0:  # AdamW's step: 0-dim, kept on the CPU as torch does
                    target[saved] = torch.empty((), dtype=md.properties.dtype)
                else:
                    target[saved] = empty_like_global(param, md, mesh, saved, checkpoint)
                optim_keys.setdefault(name, []).append(entry)
    except CheckpointError as err:
        problem = str(err)
    raise_agreed(problem)
    load_tensors(checkpoint, target, no_dist=not dist.is_initialized())
    tp_rank = mesh.get_local_rank() if mesh is not None else 0
    with torch.no_grad():
        for name, param in params.items():
            if name in fill:
                param.copy_(local_shard(fill[name], param, tp_rank, mesh.size() if mesh
                                        is not None else 1))
                continue
            param.copy_(local_part(target[model_key(name)]))
            if name in optim_keys:
                state = {key: local_part(target[optim_key(name, key)])
                         for key in optim_keys[name]}
                if is_fused(optimizer) and "step" in state:  # its kernels read it there
                    state["step"] = state["step"].to(param.device, torch.float32)
                optimizer.state[param] = state


def raise_agreed(problem: str | None) -> None:
    """CheckpointError on every rank if any rank has a `problem` (collective): a pipeline
    rank may miss what the others have, so all stop, or none."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise CheckpointError(problem)


def local_part(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def read_full(checkpoint: Path, manifest: dict, names: list[str] | None = None,
              optimizer: bool = True, no_dist: bool = True) -> tuple[dict, dict]:
    """(model state, optimizer state) as full tensors by parameter name (`names`, or all),
    read by this process alone unless `no_dist` is False (then every rank calls it)."""

    entries = tensor_entries(read_metadata(checkpoint, manifest))
    model_names = [k[len(MODEL_PREFIX):] for k in entries if k.startswith(MODEL_PREFIX)]
    wanted = model_names if names is None else names
    target = {}
    for name in wanted:
        if model_key(name) not in entries:
            raise CheckpointError(f"{checkpoint}: holds no parameter {name!r}")
        target[model_key(name)] = torch.empty(entries[model_key(name)].size,
                                              dtype=entries[model_key(name)].properties.dtype)
        for entry, md in (optim_entries(entries, name) if optimizer else {}).items():
            target[optim_key(name, entry)] = torch.empty(md.size, dtype=md.properties.dtype)
    load_tensors(checkpoint, target, no_dist=no_dist)
    model_state, optimizer_state = {}, {}
    for key, tensor in target.items():
        if key.startswith(MODEL_PREFIX):
            model_state[key[len(MODEL_PREFIX):]] = tensor
        else:
            name, entry = key[len(OPTIM_PREFIX):].rsplit(".", 1)
            optimizer_state.setdefault(name, {})[entry] = tensor
    return model_state, optimizer_state


def read_checkpoint(path: Path, optimizer: bool = True, verify_hashes: bool = True) -> dict:
    """{"meta", "model", "optimizer"} of checkpoint `path`, full tensors by parameter name,
    read by this process alone (tools and tests; the trainer reads its own slices with
    `load_local`)."""
    manifest = read_manifest(path, verify_hashes)
    state = {"meta": read_meta(path, manifest=manifest)}
    state["model"], optimizer_state = read_full(path, manifest, optimizer=optimizer)
    if optimizer:
        state["optimizer"] = optimizer_state
    return state


def write_checkpoint(ckpt_root: Path, step: int, state: dict, keep: int = 0) -> Path:
    """Write `state` ({"meta", "model", "optimizer"}: `read_checkpoint`'s form, full tensors)
    as checkpoint ckpt_root/step-XXXXXXXX from this process alone, atomically, then prune
    to the newest `keep` intact checkpoints (0: keep all); its path. The same format as the
    trainer's at any layout, so the trainer resumes from it."""
    tmp_dir = new_tmp_dir(ckpt_root, step)
    try:
        save(tmp_dir, full_state(state["model"], state.get("optimizer", {})), rank=0)
        write_meta(tmp_dir, state["meta"])
        return finalize_checkpoint(tmp_dir, ckpt_root, step, Retention(keep))
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
