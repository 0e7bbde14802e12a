"""Writers: where logged metrics go. A base that does nothing, a list that forwards to
each, and :func:`build_writers`, which makes the ones a config names (rank 0 only). Each
checks its destination when built, so a bad path or a full disk fails before training;
heavy back ends (TensorBoard, MLflow) are imported only when chosen.
"""

from __future__ import annotations

import importlib
import numbers
import os
from typing import IO, Any, Callable, Iterable, Iterator, Mapping, Optional


class WriterError(OSError):
    """A writer cannot write where it was told to; the message names the writer,
    the destination and the config key to change."""


class Writer:
    """Receives logged events. Subclass and override what you need.

    Example::

        class PrintLoss(Writer):
            def log_metrics(self, metrics, step, epoch, split):
                if "loss" in metrics:
                    print(step, metrics["loss"])

        Trainer(module, args, writers=[PrintLoss()]).train()
    """

    def log_metrics(self, metrics: Mapping[str, Any], step: int, epoch: int,
                    split: str) -> None:
        """``metrics``: name -> value; a validation event with several validation
        sets also carries ``"dataset": name``. ``epoch`` is counted from 1, as the
        console shows it (the epoch the step belongs to)."""

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        """Called once before training with the run's flattened settings."""

    def log_run_totals(self, totals: Mapping[str, float], step: int, epoch: int) -> None:
        """Called once at the end with figures of the whole run across its restarts
        (goodput, the time account's seconds). They are no event of the training, so the
        event logs (metrics.jsonl, metrics.csv, which a resumed run must repeat exactly)
        leave them to summary.json; dashboards (TensorBoard, MLflow) show them."""

    def flush(self) -> None: ...

    def close(self) -> None:
        self.flush()


class Writers(Writer):
    """Forwards every call to each writer in order."""

    def __init__(self, writers: Iterable[Writer] = ()) -> None:
        self.writers = list(writers)

    def log_metrics(self, metrics, step, epoch, split):
        for w in self.writers:
            w.log_metrics(metrics, step, epoch, split)

    def log_hparams(self, hparams):
        for w in self.writers:
            w.log_hparams(hparams)

    def log_run_totals(self, totals, step, epoch):
        for w in self.writers:
            w.log_run_totals(totals, step, epoch)

    def flush(self):
        for w in self.writers:
            w.flush()

    def close(self):
        # Close every writer even if one fails, then report the first failure.
        error: Optional[BaseException] = None
        for w in self.writers:
            try:
                w.close()
            except Exception as exc:  # noqa: BLE001 - re-raised below
                error = error or exc
        if error is not None:
            raise error


def scalars(metrics: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """The real numbers (not bools) of an event, as floats, each named ``prefix``, then
    ``<dataset>/`` when the event names its validation set, then its key."""
    dataset = metrics.get("dataset")
    prefix += f"{dataset}/" if isinstance(dataset, str) else ""
    return ((prefix + key, float(value)) for key, value in metrics.items()
            if isinstance(value, numbers.Real) and not isinstance(value, bool))


# name -> (module, factory name, pip extra or None, where in output_dir). Modules are
# imported when chosen.
WRITER_MODULES: dict[str, tuple[str, str, Optional[str], str]] = {
    "stdout": ("sailfin.logging.stdout", "StdoutWriter", None, ""),
    "jsonl": ("sailfin.logging.files", "JsonlWriter", None, "metrics.jsonl"),
    "csv": ("sailfin.logging.files", "CsvWriter", None, "metrics.csv"),
    "tensorboard": ("sailfin.logging.tensorboard_writer", "TensorBoardWriter", "tensorboard",
                    "tensorboard"),
    "mlflow": ("sailfin.logging.mlflow_writer", "MlflowWriter", "mlflow", ""),
}


def build_writers(names: Iterable[str], output_dir: str, *,
                  stdout: Optional[Callable[[], IO[str]]] = None,
                  run_name: Optional[str] = None,
                  mlflow_tracking_uri: Optional[str] = None,
                  mlflow_experiment: str = "sailfin") -> Writers:
    """The writers named in ``trainer.writers``. ``stdout`` returns the stream the stdout
    writer prints to (a progress bar passes one that prints above the bar). Writers
    already built are closed if a later one fails.

    Example::

        writers = build_writers(["stdout", "jsonl", "csv"], "outputs/run1")
    """
    built: list[Writer] = []
    try:
        for name in names:
            if name not in WRITER_MODULES:  # the config rejects these first
                raise ValueError(f"unknown writer {name!r}; available: "
                                 f"{', '.join(WRITER_MODULES)}")
            cls = writer_class(name)
            if name == "stdout":
                built.append(cls(stream=stdout))
            elif name == "mlflow":
                built.append(cls(output_dir, tracking_uri=mlflow_tracking_uri,
                                 experiment=mlflow_experiment, run_name=run_name))
            else:
                built.append(cls(os.path.join(output_dir, WRITER_MODULES[name][3])))
    except BaseException:
        Writers(built).close()
        raise
    return Writers(built)


def writer_class(name: str) -> type:
    """Import the module of writer ``name``; a missing extra names what to install."""
    module_name, attr, extra, _ = WRITER_MODULES[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if extra is None or exc.name == module_name:
            raise
        raise ModuleNotFoundError(
            f"the {name} writer needs the '{(exc.name or '?').split('.')[0]}' package: "
            f"pip install "
            f"'sailfin[{extra}]' (or remove {name} from trainer.writers)") from None
    return getattr(module, attr)
