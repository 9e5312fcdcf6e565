"""`python -m pretrain {train,config,eval,checkpoint,generate,lm-eval,analyze,export-hf,
import-hf}`:
command-line entry points."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from data_pipeline import DataError
from data_pipeline.index import read_index
from pretrain import analyze, generate_cli, lm_eval_cli
from pretrain.checkpoint import CheckpointError
from pretrain.config import ConfigError, config_to_dict, load_config, override_argument
from pretrain.exit_codes import EXIT_NONFINITE, EXIT_PREEMPTED, EXIT_SAVE_FAILED, EXIT_USAGE
from pretrain.hf import export as hf_export
from pretrain.hf import import_llama as hf_import
from pretrain.model.config import ModelConfigError
from pretrain.run_files import RunFileError


def _config_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("--config", required=required, help="YAML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", type=override_argument,
                        help="override a config key, e.g. train.steps=50")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pretrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _config_args(sub.add_parser("train", help="train a model (torchrun-compatible)"))
    _config_args(sub.add_parser("config", help="print the resolved config and parameter count"))
    ev = sub.add_parser("eval", help="evaluate a checkpoint on the validation split")
    where = ev.add_mutually_exclusive_group(required=True)
    where.add_argument("--run", help="run directory (its latest checkpoint is evaluated)")
    where.add_argument("--checkpoint", help="a checkpoint directory")
    ev.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    type=override_argument)
    ck = sub.add_parser("checkpoint", help="inspect or export a checkpoint")
    tools = ck.add_subparsers(dest="tool", required=True)
    inspect = tools.add_parser("inspect", help="step, layout, tensors, sizes, intactness")
    inspect.add_argument("path", help="a checkpoint directory (step-XXXXXXXX)")
    inspect.add_argument("--verify", action="store_true", help="also check every sha256")
    export = tools.add_parser("export", help="model.safetensors (full tensors, weights "
                              "only), config.yaml and the tokenizer, for sharing and eval")
    export.add_argument("path", help="a checkpoint directory (step-XXXXXXXX)")
    export.add_argument("--out", required=True, help="directory to write (created)")
    generate_cli.add_parser(sub)
    lm_eval_cli.add_parser(sub)
    analyze.add_parser(sub)
    hf_export.add_parser(sub)
    hf_import.add_parser(sub)
    return parser


def cmd_train(args) -> int:
    # deferred: pulls in torch (slow to start, or optional)
    from pretrain.signals import StopRequest
    from pretrain.train import distributed_session, run_training

    cfg = load_config(args.config, args.overrides,
                      world_size=int(os.environ.get("WORLD_SIZE", 1)))
    # Handlers first: a signal during set-up stops the run after its first step, cleanly.
    try:
        with StopRequest() as stop, distributed_session():
            return run_training(cfg, stop)
    except RuntimeError as err:  # a peer that is gone: one line instead of gloo's traceback
        # deferred: pulls in torch (slow to start, or optional)
        from parallel.primitives.groups import peer_lost

        line = peer_lost(err, cfg.parallel.timeout_s)
        if line is None:
            raise
        print(f"error (rank {os.environ.get('RANK', '0')}): {line}; checkpoints already "
              "written are intact", file=sys.stderr, flush=True)
        return 1


def cmd_config(args) -> int:
    cfg = load_config(args.config, args.overrides)
    print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
    vocab = cfg.model.vocab_size
    if vocab is None and cfg.data.path and (Path(cfg.data.path) / "index.json").exists():
        vocab = read_index(cfg.data.path, check_files=False).vocab_size
    if vocab is None:
        print("# parameters: unknown until model.vocab_size is set or data.path is prepared")
        return 0
    model = cfg.model.with_vocab(vocab)
    print(f"# parameters: {model.num_params():,} ({model.num_params(non_embedding=True):,} "
          f"non-embedding); training FLOPs per token: {model.flops_per_token():.4g}")
    return 0


def cmd_eval(args) -> int:
    # deferred: pulls in megatron-core, torch (slow to start, or optional)
    from parallel.primitives import groups
    from pretrain import checkpoint, sharded_checkpoint
    from pretrain.evaluate import evaluate
    from pretrain.model import DenseFormer
    from pretrain.model.state import load_full_model_state
    from pretrain.train import compute_dtype, distributed_session

    if args.run:
        path = checkpoint.newest_intact(Path(args.run) / "checkpoints")
        if path is None:
            raise ConfigError("--run", f"no complete checkpoint under {args.run}/checkpoints")
    else:
        path = Path(args.checkpoint)
        if not path.is_dir():
            raise ConfigError("--checkpoint", f"{path} is not a checkpoint directory")
    run_dir = path.parent.parent
    # run.dir: configs saved before it was recorded may say null with resume=auto
    cfg = load_config(run_dir / "config.yaml", [f"run.dir={run_dir}", *args.overrides])
    state = sharded_checkpoint.read_checkpoint(path, optimizer=False,
                                               verify_hashes=not args.run)  # --run: checked
    with distributed_session():
        groups.ensure_initialized()
        model = DenseFormer(cfg.model)
        load_full_model_state(model, state["model"])
        device = groups.default_device()
        model.to(device)
        result = evaluate(model, cfg.data.path, cfg.train.batch_size, dp_rank=0, dp_size=1,
                          dp_group=None, max_batches=max(1, cfg.data.val_batches),
                          device=device, dtype=compute_dtype(cfg, device),
                          seq_len=cfg.model.seq_len)
    print(f"checkpoint {path} (step {state['meta']['step']}): val_loss "
          f"{result['val_loss']:.4f} val_ppl {result['val_ppl']:.2f}")
    return 0


def cmd_checkpoint(args) -> int:
    # deferred: pulls in torch (slow to start, or optional)
    from pretrain.checkpoint_cli import run_tool

    return run_tool(args.tool, Path(args.path), getattr(args, "verify", False),
                    Path(args.out) if getattr(args, "out", None) else None)


# Said on the last line of a failed run: torchrun reports every non-zero status as 1, so
# its log is where the reason survives.
_STATUS_MEANING = {
    EXIT_USAGE: "bad config, data, checkpoint or run directory; nothing more was trained",
    EXIT_NONFINITE: "the loss diverged (NaN/inf); resume from the last good checkpoint",
    EXIT_SAVE_FAILED: "a checkpoint or run file could not be written (disk full, I/O "
                      "error); the checkpoints written before are intact",
    EXIT_PREEMPTED: "stopped on a signal after a checkpoint; resume with train.resume=auto",
}
# The other commands train nothing: what their bad input (exit 2) leaves undone.
_USAGE_MEANING = {
    "config": "bad config",
    "eval": "bad run, checkpoint, config or data; nothing was evaluated",
    "checkpoint": "bad checkpoint or --out; nothing was written",
    "generate": "bad prompt, option, model or tokenizer; nothing was generated",
    "lm-eval": "bad task, option, model or tokenizer; nothing was evaluated",
    "analyze": "bad run or checkpoint; nothing was drawn",
    "export-hf": "bad run, checkpoint or --out; nothing was written",
    "import-hf": "the Hugging Face directory cannot be imported as it is; nothing was written",
}


def status_meaning(command: str, status: int) -> str | None:
    """The last line's reason for exit `status` of `command`, None for a status that
    needs none."""
    if command == "train":
        return _STATUS_MEANING.get(status)
    if status == EXIT_USAGE:
        return _USAGE_MEANING.get(command, "bad input")
    if status == EXIT_SAVE_FAILED:
        return "a file could not be written (disk full, I/O error)"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = {"train": cmd_train, "config": cmd_config, "eval": cmd_eval,
               "checkpoint": cmd_checkpoint, "generate": generate_cli.cmd_generate,
               "lm-eval": lm_eval_cli.cmd_lm_eval, "analyze": analyze.cmd_analyze,
               "export-hf": hf_export.cmd_export_hf,
               "import-hf": hf_import.cmd_import_hf}[args.command]
    try:
        status = command(args)
    except (ConfigError, ModelConfigError, DataError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        status = EXIT_USAGE
    except RunFileError as err:  # config.yaml, metrics.jsonl: a full disk, an I/O error
        print(f"error (rank {os.environ.get('RANK', '0')}): {err}", file=sys.stderr)
        status = EXIT_SAVE_FAILED
    meaning = status_meaning(args.command, status)
    if meaning is not None and os.environ.get("RANK", "0") == "0":
        print(f"exit status {status}: {meaning}", file=sys.stderr, flush=True)
    return status
