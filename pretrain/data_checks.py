"""The start-up checks of a run's data against its config: what the trainer refuses before it
builds a model, and what `python -m slurm sweep --submit` runs for every task before
queueing (slurm/preflight.py). Torch-free."""

from __future__ import annotations

from data_pipeline.index import read_index
from data_pipeline.tokenizer import check_index_vocabulary
from pretrain.config import Config, ConfigError


def check_data(cfg: Config, index=None):
    """The DatasetIndex of cfg.data.path, checked: index, tokenizer hash and shard sizes
    (`read_index`), the index's vocabulary against its tokenizer's, then the vocabulary,
    sequence length and validation split against the config. `index`: one already read
    (and checked) for this path. Raises ConfigError naming the key, or DataError naming the
    file. A model.seq_len longer than the data's is no error: the run trains at the data's
    length (`trained_seq_len`)."""
    if cfg.data.path is None:
        raise ConfigError("data.path", "is required: a directory written by "
                          "`python -m data_pipeline prepare`")
    index = index if index is not None else read_index(cfg.data.path)
    check_index_vocabulary(index)
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < index.vocab_size:
        raise ConfigError("model.vocab_size",  # a larger one is fine (reserved rows)
                          f"{cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"vocabulary of {index.vocab_size} in {cfg.data.path}/index.json")
    val_samples = sum(s.num_samples for s in index.split_shards.get("val", []))
    if cfg.data.val_batches and val_samples < cfg.train.batch_size:
        raise ConfigError("data.path", f"{cfg.data.path} has {val_samples} validation "
                          f"samples, fewer than one batch of train.batch_size="
                          f"{cfg.train.batch_size}: prepare it with --val-fraction > 0, "
                          "or set data.val_batches=0 to train without validation")
    return index


def trained_seq_len(cfg: Config, index) -> tuple[int, str | None]:
    """The sequence length a run trains at: model.seq_len, or the data's when that is
    shorter (an imported model's context is often longer than the data prepared for it);
    with the note that says so, else None."""
    if index.seq_len >= cfg.model.seq_len:
        return cfg.model.seq_len, None
    return index.seq_len, (f"note: model.seq_len {cfg.model.seq_len} is longer than the "
                           f"data's sequence length {index.seq_len} ({cfg.data.path}): "
                           f"training at {index.seq_len}, and the run's model.seq_len is "
                           f"{index.seq_len}")
