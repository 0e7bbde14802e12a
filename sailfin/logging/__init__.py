"""Writers for metrics (stdout, JSONL, CSV, TensorBoard, MLflow) and the list
that forwards to them. TensorBoard and MLflow are imported only when used."""

from __future__ import annotations

from typing import Any

from .files import CsvWriter, JsonlWriter
from .stdout import StdoutWriter
from .writers import Writer, WriterError, Writers, build_writers, writer_class

__all__ = ["CsvWriter", "JsonlWriter", "MlflowWriter", "StdoutWriter", "TensorBoardWriter",
           "Writer", "WriterError", "Writers", "build_writers"]


def __getattr__(name: str) -> Any:
    if name == "TensorBoardWriter":
        return writer_class("tensorboard")
    if name == "MlflowWriter":
        return writer_class("mlflow")
    raise AttributeError(f"module 'sailfin.logging' has no attribute '{name}'")
