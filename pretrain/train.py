"""The training loop: data -> model -> AdamW, with validation, checkpoints and tracking.

One code path for every launch: a plain `python -m pretrain train` is a 1-rank world; under
torchrun or Slurm the ranks form a TP x DP grid (megatron-core order, TP fastest). Data is
read by sample (docs/data.md#sample-order-and-exact-resume), so the global batch of a step
is the same whatever the number of data-parallel ranks, and a resumed run sees exactly the
samples it would have seen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from data_pipeline import DataError
from data_pipeline.progress import progress_bar, write_line
from parallel.primitives import groups
from parallel.primitives.layout import Layout, setup_layout
from parallel.strategies.microbatch_fit import Batch, resolve_microbatches
from pretrain import checkpoint
from pretrain.analyze import write_checkpoint_heatmap
from pretrain.checkpoint import checkpoint_dir
from pretrain.config import Config, ConfigError, config_to_dict, save_config
from pretrain.cpu_memory import keep_freed_memory
from pretrain.data_checks import check_data, trained_seq_len
from pretrain.engine import build_engine
from pretrain.evaluate import autocast_for, evaluate
from pretrain.exit_codes import EXIT_NONFINITE, EXIT_PREEMPTED, EXIT_SAVE_FAILED
from pretrain.init_from import init_from
from pretrain.mfu import TrainingPeak
from pretrain.optim import lr_at
from pretrain.run_checkpoint import Checkpointer, SaveFailed, load_run
from pretrain.run_dir import agreed_on_rank0, fingerprint, fingerprint_mismatch, prepare_run_dir
from pretrain.signals import StopRequest
from pretrain.step_rows import PendingRows, ProgressClock
from pretrain.tracking import MetricsLog, Tracker, plot_loss_curve


class NonFiniteLoss(RuntimeError):
    """Training produced a NaN/inf loss or gradient norm."""


def resolve_run_dir(cfg: Config, layout: Layout) -> Path:
    """run.dir, or runs/<name>-<timestamp> chosen by rank 0 and shared with every rank."""
    if cfg.run.dir is not None:
        return Path(cfg.run.dir).absolute()
    name = [f"runs/{cfg.run.name}-{datetime.now():%Y%m%d-%H%M%S}"]
    if layout.world > 1:
        dist.broadcast_object_list(name, src=0)
    return Path(name[0]).absolute()


def compute_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    if cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def step_seed(seed: int, step: int, dp_rank: int) -> int:
    """Dropout RNG seed of one step on one data-parallel rank (TP peers share it, as their
    residual streams must match); re-derived every step, so resuming needs no RNG state."""
    digest = hashlib.sha256(f"{seed}:{step}:{dp_rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def run_device(setting: str) -> torch.device:
    """The device of `train.device` (auto, cpu or cuda); ConfigError when cuda is asked for
    and there is none."""
    device = groups.default_device()
    if setting == "cpu":
        return torch.device("cpu")
    if setting == "cuda" and device.type != "cuda":
        raise ConfigError("train.device", "cuda requested but no CUDA device is available")
    return device


class Trainer:
    """Owns the model, optimizer, data loader and run directory of one training run."""

    def __init__(self, cfg: Config):
        # deferred: pulls in sentencepiece, wids (slow to start, or optional)
        from data_pipeline.loader import TrainLoader

        self.cfg = cfg
        p = cfg.parallel
        self.layout = layout = setup_layout(p.tp, p.pp, p.timeout_s, run_device(cfg.train.device))
        self.index = check_data(cfg)
        seq_len, note = trained_seq_len(cfg, self.index)
        for line in (cfg.model.ignored_dwa_note(), note):
            if line and layout.is_main:
                write_line(line)
        # The vocabulary (and a too long seq_len) come from the data: a resolved copy of the
        # config, not a mutation.
        model = dataclasses.replace(cfg.model.with_vocab(self.index.vocab_size), seq_len=seq_len)
        cfg = dataclasses.replace(cfg, model=model)
        # parallel.microbatches: auto -> a count that fits the device
        # (parallel/strategies/microbatch_fit.py)
        batch = Batch(cfg.train.batch_size, cfg.train.dtype, cfg.optim.decay_alphas)
        parallel, microbatch_line = resolve_microbatches(cfg.parallel, model, batch, layout)
        cfg = dataclasses.replace(cfg, parallel=parallel)
        self.run_choices = [microbatch_line] if microbatch_line else []  # for the log
        if layout.device.type == "cpu":  # freed activations kept for the next step
            self.run_choices.append(keep_freed_memory())
        self.cfg = cfg
        self.model_cfg = cfg.model
        self.fingerprint = fingerprint(config_to_dict(cfg)["model"],
                                       self.index.tokenizer_sha256, cfg.train.seed)
        self.run_dir = resolve_run_dir(cfg, layout)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.lock, self.resume_from = prepare_run_dir(
            self.run_dir, self.ckpt_dir, cfg.train.resume, layout.is_main, layout.world,
            tokenizer=(self.index.tokenizer_path, self.index.tokenizer_sha256))

        self.dtype = compute_dtype(cfg, layout.device)
        self.local_batch = cfg.train.batch_size // layout.dp
        self.engine = build_engine(self.model_cfg, cfg, layout, self.dtype)
        self.model = self.engine.model  # this rank's parameters
        self.checkpointer = Checkpointer(
            self.engine, self.ckpt_dir, layout, timeout_s=cfg.parallel.timeout_s,
            asynchronous=cfg.checkpoint.async_ is True
            or (cfg.checkpoint.async_ == "auto" and layout.device.type == "cuda"))
        self.loader = TrainLoader(cfg.data.path, global_batch_size=cfg.train.batch_size,
                                  dp_rank=layout.dp_rank, dp_size=layout.dp, seed=cfg.train.seed,
                                  num_workers=cfg.data.num_workers)
        self.step = 0
        self.mlflow_run_id = None
        self.saved_step: int | None = None  # step of the newest checkpoint this run wrote
        self.skip_streak = 0  # consecutive skipped steps (train.on_nan=skip)
        self.protected_checkpoint: Path | None = None  # kept from pruning during a streak
        self.origin: dict[str, str] = {}  # MLflow tags naming train.init_from's checkpoint
        if self.resume_from is not None:
            # The ranks hashed its files between them when choosing it (pretrain/run_dir.py).
            self._load(self.resume_from)
            self.saved_step = self.step
        elif cfg.train.init_from is not None:
            self.origin = init_from(self.engine, cfg.train.init_from, self.model_cfg,
                                    self.fingerprint, layout.rank, layout.world)

    # -- checkpoints ---------------------------------------------------------------------

    def _load(self, path: Path) -> None:
        """Resume from checkpoint `path`: each rank reads its own slices (collective)."""
        def same_run(meta: dict) -> None:
            if "fingerprint" in meta:  # checkpoints from before fingerprints load unchecked
                differ = fingerprint_mismatch(meta["fingerprint"], self.fingerprint)
                if differ:
                    raise ConfigError("train.resume", f"{path} was written by a different "
                                      "run; these differ: " + "; ".join(differ))

        meta = load_run(self.engine, path, check=same_run)
        self.loader.load_state_dict(meta["loader"])
        self.step = meta["step"]
        self.mlflow_run_id = meta.get("mlflow_run_id")

    def save(self) -> Path:
        """Write a checkpoint of the current step (collective: every rank its own tensors);
        every rank gets its path, or SaveFailed with the first error, at once. With
        checkpoint.async the path it will have once committed (`checkpointer.poll`)."""
        layout = self.layout
        meta = {"step": self.step, "loader": self.loader.state_dict(),
                "mlflow_run_id": self.mlflow_run_id, "layout": layout.name,
                "parallel": dataclasses.asdict(self.cfg.parallel), "world": layout.world,
                "config": self.cfg.run.name, "fingerprint": self.fingerprint}
        path = self.checkpointer.save(self.step, meta, keep=self.cfg.checkpoint.keep,
                                      protect=self._protected)
        self.saved_step = self.step
        return path

    # -- one optimizer step --------------------------------------------------------------

    def lr(self, step: int) -> float:
        o = self.cfg.optim
        return lr_at(step, lr=o.lr, min_lr=o.min_lr, warmup=self.cfg.effective_warmup_steps(),
                     total=self.cfg.train.steps)

    def next_batch(self, data) -> torch.Tensor:
        """This data-parallel rank's batch: TP rank 0 reads it, its TP peers receive it (no
        broadcast with one TP rank). On CUDA the copy goes through pinned memory, so that
        the host does not wait for the device's queue."""
        layout = self.layout
        if layout.tp_rank == 0:
            batch = next(data)
            batch = (batch.pin_memory().to(layout.device, non_blocking=True)
                     if layout.device.type == "cuda" else batch.to(layout.device))
            if layout.tp == 1:
                return batch
        else:
            batch = torch.empty(self.local_batch, self.index.seq_len + 1, dtype=torch.long,
                                device=layout.device)
        dist.broadcast(batch, src=layout.tp_src, group=layout.tp_group)
        return batch

    def train_step(self, batch: torch.Tensor) -> dict:
        """Forward/backward over the micro-batches, reduce, clip, update (skipped on the
        device if the gradient norm is not finite); returns the step's row, its loss and
        gradient norm still on the device (`check_row` reads them once fetched)."""
        cfg, layout = self.cfg, self.layout
        step = self.step + 1
        lr = self.lr(step)
        self.engine.set_lr(lr)
        torch.manual_seed(step_seed(cfg.train.seed, step, layout.dp_rank))
        seq = self.model_cfg.seq_len
        micro = cfg.parallel.microbatches
        with autocast_for(layout.device, self.dtype):
            loss_sum = self.engine.forward_backward(batch[:, :seq], batch[:, 1: seq + 1], micro)
        grad_norm = self.engine.update()  # not finite: the update was skipped
        if layout.dp > 1:
            dist.all_reduce(loss_sum, group=layout.dp_group)
        self.step = step
        return {"step": step, "loss": loss_sum / (micro * layout.dp), "lr": lr,
                "grad_norm": grad_norm}

    def check_row(self, record: dict) -> None:
        """A fetched row, in step order: a non-finite step stops the run (NonFiniteLoss,
        train.on_nan=stop) or is marked skipped, and counts toward the skip streak."""
        cfg, step = self.cfg, record["step"]
        loss, grad_norm = record["loss"], record["grad_norm"]
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if not finite and cfg.train.on_nan == "stop":
            raise NonFiniteLoss(f"step {step}: loss {loss}, gradient norm {grad_norm}")
        self._count_skip(finite)
        if self.skip_streak > cfg.train.max_consecutive_skips:
            raise NonFiniteLoss(f"step {step}: {self.skip_streak} steps in a row skipped, more "
                                f"than train.max_consecutive_skips="
                                f"{cfg.train.max_consecutive_skips} (the run has diverged)")
        if not finite:
            record.update(loss=None, grad_norm=None, skipped=True)

    def _count_skip(self, finite: bool) -> None:
        """Track the streak of skipped steps; its first step pins the newest checkpoint taken
        before it, committed or still being written (checkpoint.async)."""
        if finite:
            self.skip_streak, self.protected_checkpoint = 0, None
            return
        self.skip_streak += 1
        if self.skip_streak == 1 and self.saved_step is not None:
            self.protected_checkpoint = checkpoint_dir(self.ckpt_dir, self.saved_step)

    def _protected(self) -> set[Path]:
        """What no commit of this run may prune, asked at each commit: the checkpoint it
        resumed from and the one pinned before a streak of skipped steps."""
        return {p for p in (self.resume_from, self.protected_checkpoint) if p is not None}


def _print_main(layout: Layout, *lines: str) -> None:
    if layout.is_main:
        for line in lines:
            write_line(line)


def run_training(cfg: Config, stop: StopRequest | None = None) -> int:
    """Train as configured; returns the process exit status (pretrain.exit_codes).

    `stop`: signal handlers the caller installed before set-up (else installed here)."""
    trainer = Trainer(cfg)
    try:
        return _train(trainer, stop)
    finally:
        trainer.checkpointer.close()  # a write in flight finishes before the lock goes
        if trainer.lock is not None:
            trainer.lock.release()


def _train(trainer: Trainer, stop: StopRequest | None) -> int:
    cfg, layout, run_dir = trainer.cfg, trainer.layout, trainer.run_dir
    main = layout.is_main
    if main:  # with the directory resolved, so `eval --run` and resume=auto can reread it
        save_config(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(run_dir))),
                    run_dir / "config.yaml")
    resumed_at = trainer.step if trainer.resume_from is not None else None
    metrics = MetricsLog(run_dir / "metrics.jsonl", resume_step=resumed_at) if main else None
    tracker = Tracker(cfg, run_dir, enabled=False)  # rank 0's replaces it below

    def open_tracker() -> None:  # an unreachable store stops every rank at once (exit 2)
        nonlocal tracker
        tracker = Tracker(cfg, run_dir, trainer.mlflow_run_id, enabled=cfg.tracking.enabled)

    agreed_on_rank0(open_tracker, main, layout.world)
    trainer.mlflow_run_id = tracker.run_id
    tracker.set_tags({"layout": trainer.layout.name, "resumed_from_step": resumed_at,
                      **trainer.origin})
    if main:
        tracker.log_artifact(run_dir / "config.yaml")

    mc = trainer.model_cfg
    peak = TrainingPeak(layout.device, trainer.dtype)
    # Params of a fresh run; a resumed run (perhaps on other hardware) tags its own peak.
    peak_info = {"mfu_peak_flops": f"{peak.flops():.4g}", "mfu_peak_source": peak.source}
    (tracker.set_tags if resumed_at is not None else tracker.log_params)(peak_info)
    tracker.log_params({"n_params": mc.num_params(),  # the same again on resume: allowed
                        "n_params_non_embedding": mc.num_params(non_embedding=True)})
    flops_per_token = mc.flops_per_token()
    tokens_per_step = cfg.train.batch_size * mc.seq_len
    stop_at = cfg.train.stop_at or cfg.train.steps
    _print_main(layout, (
        f"run dir: {run_dir}\nmodel: {mc.n_layers} blocks x {mc.d_model}, "
        f"{mc.architecture}"
        f", {trainer.model.num_params() / 1e6:.2f}M parameters; layout {layout.name}; "
        f"device {layout.device}, {trainer.dtype}; MFU peak {peak.flops() / 1e9:.1f} GFLOP/s "
        f"({peak.source})"
        + (f"\nresuming from {trainer.resume_from} (step {trainer.step})"
           if trainer.resume_from else "")
        + (f"\nweights from {trainer.origin['init_from']} (step "
           f"{trainer.origin['init_from_step']}); fresh optimizer, step 0"
           if trainer.origin else "")))
    _print_main(layout, *trainer.run_choices, *trainer.engine.describe())
    if trainer.step >= stop_at:
        _print_main(layout, (
            f"nothing to train: the run is already at step {trainer.step} of "
            f"{'train.stop_at' if cfg.train.stop_at else 'train.steps'}={stop_at}. To train "
            "further, raise train.steps (the learning-rate schedule then stretches to the new "
            "length), or start a new run.dir"))

    status, finish = 0, "FINISHED"
    # A bar only on a terminal; in a log file the "step N/M" lines below are the progress.
    progress = progress_bar(main, total=stop_at, initial=trainer.step, desc="train",
                            unit="step")
    data = iter(trainer.loader)
    trainer.checkpointer.on_commit = lambda path: _committed(trainer, path, tracker)
    pending = PendingRows()
    clock = ProgressClock(trainer.step, stop_at, layout.device)

    def log_rows() -> None:
        """Fetch the pending rows (one transfer), check them in order, write them."""
        rows, seconds = pending.fetch()
        tokens_per_s = tokens_per_step * len(rows) / max(seconds, 1e-9)
        accepted = []
        try:
            for record in rows:
                trainer.check_row(record)  # NonFiniteLoss: the rows before it are written
                record.update(tokens_per_s=tokens_per_s, mfu_peak_flops=peak.flops(),
                              step_time_s=seconds / len(rows),  # the interval's mean
                              tokens_seen=record["step"] * tokens_per_step)
                record["mfu"] = (flops_per_token * tokens_per_s
                                 / (record["mfu_peak_flops"] * layout.world))
                accepted.append(record)
                step = record["step"]
                if main:
                    metrics.log(record)
                if step % cfg.train.log_every == 0 or step == stop_at:
                    _print_main(layout, (
                        f"step {step}/{cfg.train.steps} loss {_fmt(record['loss'])} lr "
                        f"{record['lr']:.3e} grad_norm {_fmt(record['grad_norm'])} "
                        f"tokens/s {record['tokens_per_s']:.0f} MFU {record['mfu']:.1%}"
                        f"{peak.peak.versus} {clock.line(step)}"))
        finally:
            if main and accepted:
                tracker.log_rows(accepted)  # one batched MLflow write per fetch point
                last = accepted[-1]
                progress.set_postfix(loss=_fmt(last["loss"]), lr=f"{last['lr']:.2e}")

    try:
        with StopRequest() if stop is None else contextlib.nullcontext(stop) as stop:
            while trainer.step < stop_at:
                pending.start_step()
                pending.add(trainer.train_step(trainer.next_batch(data)))
                step = trainer.step
                if main:
                    progress.update(1)
                every = cfg.checkpoint.every
                save = (every and step % every == 0) or step == stop_at
                validate = cfg.data.val_batches and ((cfg.train.eval_every
                                                      and step % cfg.train.eval_every == 0)
                                                     or step == cfg.train.steps)
                if not (save or validate or step % cfg.train.log_every == 0):
                    continue  # nothing waits for the device on this step
                # A fetch point: the rows first, so that no checkpoint follows a step that
                # should have stopped the run.
                log_rows()
                trainer.checkpointer.poll()
                # The checkpoint first: nothing that validation does can lose this step.
                if save:
                    path = trainer.save()
                    if trainer.checkpointer.asynchronous:
                        _print_main(layout, f"checkpoint: {path} (writing in the background)")
                if validate:
                    _validate(trainer, metrics, tracker)
                if stop.agreed(layout.device):
                    path = _checkpoint_of_this_step(trainer)
                    trainer.checkpointer.wait()
                    _print_main(layout, f"stopped on request after step {step}; "
                                f"checkpoint {path}; exit status {EXIT_PREEMPTED}")
                    status, finish = EXIT_PREEMPTED, "KILLED"
                    break
            trainer.checkpointer.wait()  # for the last save
    except NonFiniteLoss as err:
        trainer.checkpointer.close()  # so that the last good checkpoint is complete
        _print_main(layout, f"error: non-finite training loss at {err}; nothing was saved for "
                    f"this step; last good checkpoint: {_last_good(trainer)}"
                    + ("" if cfg.train.on_nan == "skip" else
                       " (set train.on_nan=skip to skip such steps)"))
        status, finish = EXIT_NONFINITE, "FAILED"
    except SaveFailed as err:  # every rank says it: each has its own log under Slurm
        write_line(f"error (rank {layout.rank}): {err}")
        status, finish = EXIT_SAVE_FAILED, "FAILED"
    except BaseException:
        tracker.finish("FAILED")
        raise
    finally:
        progress.close()
        trainer.loader.close()
    if main:
        plot_loss_curve(run_dir / "metrics.jsonl", run_dir / "loss_curve.png")
        tracker.log_artifact(run_dir / "loss_curve.png")
    tracker.finish(finish)
    if status == 0:
        mlflow = (f"MLflow run {tracker.run_id} in {tracker.uri}" if tracker.enabled
                  else "no MLflow run (tracking.enabled=false)")
        _print_main(layout, f"done: step {trainer.step}; run dir {run_dir}; checkpoints "
                    f"{trainer.ckpt_dir}; {mlflow}")
    return status


def _fmt(value: float | None) -> str:
    return "nan (step skipped)" if value is None else f"{value:.4f}"


def _last_good(trainer: Trainer) -> Path | None:
    """The checkpoint a diverged run falls back to: the one pinned before the skip streak."""
    return trainer.protected_checkpoint or checkpoint.latest_checkpoint(trainer.ckpt_dir)


def _committed(trainer: Trainer, path: Path, tracker) -> None:
    """A checkpoint is complete on disk: say so, and draw its DWA heatmap (rank 0)."""
    _print_main(trainer.layout, f"checkpoint: {path}" + (
        " (committed)" if trainer.checkpointer.asynchronous else ""))
    if trainer.layout.is_main:
        _plot_dwa(trainer, path, tracker)


def _plot_dwa(trainer: Trainer, path: Path, tracker) -> None:
    """Rank 0: the DWA heatmap of checkpoint `path` into run_dir/dwa/ and MLflow's dwa/
    (pretrain/analyze.py). A failure to draw is a warning: the checkpoint is what matters."""
    try:
        png = write_checkpoint_heatmap(path, trainer.model_cfg.dwa_pattern,
                                       trainer.run_dir / "dwa")
    except Exception as err:  # noqa: BLE001 (matplotlib, a full disk: training goes on)
        write_line(f"warning: no DWA heatmap for {path}: {type(err).__name__}: {err}")
        return
    if png is not None:
        tracker.log_artifact(png, "dwa")


def _checkpoint_of_this_step(trainer: Trainer) -> Path:
    """The checkpoint of the current step, written now unless it already was."""
    if trainer.saved_step == trainer.step:
        return checkpoint_dir(trainer.ckpt_dir, trainer.step)
    return trainer.save()


def _validate(trainer: Trainer, metrics, tracker) -> None:
    """Validation loss of the current step; a failure exits 2 naming the data, after this
    step's checkpoint is written (DataError)."""
    cfg, layout = trainer.cfg, trainer.layout
    try:
        result = evaluate(trainer.engine.eval_model, cfg.data.path, trainer.local_batch,
                          dp_rank=layout.dp_rank, dp_size=layout.dp, dp_group=layout.dp_group,
                          max_batches=cfg.data.val_batches, device=layout.device,
                          dtype=trainer.dtype, seq_len=trainer.model_cfg.seq_len)
    except DataError as err:
        path = _checkpoint_of_this_step(trainer)
        raise DataError(f"validation at step {trainer.step} failed: {err}; checkpoint {path} "
                        "is saved: fix the data, then evaluate it with `python -m pretrain "
                        "eval` or resume with train.resume=auto") from err
    if layout.is_main:
        metrics.log({"step": trainer.step, **result})
        tracker.log_metrics(result, trainer.step)
        write_line(f"step {trainer.step} validation: loss {result['val_loss']:.4f} "
                   f"ppl {result['val_ppl']:.2f}")


@contextlib.contextmanager
def distributed_session():
    """Tear the process groups down however training ends."""
    try:
        yield
    finally:
        groups.destroy()
