"""Data pipeline: demo corpus, tokenizer, packing into webdataset shards, and the loader.

See docs/data.md for the commands and the on-disk format.
"""


class DataError(Exception):
    """Bad or inconsistent data; the message names the offending file, shard or key.

    The command line maps it to exit status 2.
    """


__all__ = ["DataError"]
