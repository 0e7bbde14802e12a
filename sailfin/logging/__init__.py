"""Writers for metrics (stdout, JSONL) and the list that forwards to them."""

from .writers import JsonlWriter, StdoutWriter, Writer, Writers, build_writers

__all__ = ["JsonlWriter", "StdoutWriter", "Writer", "Writers", "build_writers"]
