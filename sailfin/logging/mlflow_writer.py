"""The MLflow writer: params and metrics to an MLflow tracking store.

Imported only when ``mlflow`` is in ``trainer.writers`` (extra:
``pip install 'sailfin[mlflow]'``). Azure ML reads MLflow: inside an Azure ML
job ``MLFLOW_TRACKING_URI`` is already set and the run appears there.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Mapping, Optional

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from ..utils.voice import say
from .destination import check_directory
from .writers import Writer, WriterError, scalars

KEY = "trainer.mlflow_tracking_uri"
_MAX_METRICS_PER_BATCH = 1000  # MLflow's limits for one log_batch call
_MAX_PARAMS_PER_BATCH = 100
_MAX_PARAM_CHARS = 6000
CLOSE_TIMEOUT_SECONDS = 300.0


class MlflowWriter(Writer):
    """One MLflow run per training run: trainer settings as params, metrics by step.

    The store is ``tracking_uri``, else ``MLFLOW_TRACKING_URI``, else
    ``sqlite:///<output_dir>/mlflow.db`` (SQLite: MLflow's supported local store).
    Metrics are named ``<split>/<name>`` like TensorBoard's tags, buffered, and handed
    every ``flush_seconds`` to a background thread that sends them: a store write takes
    about a third of a millisecond per value, which a step must not wait for. ``close``
    waits until everything is sent; a failed send is raised by the next call.

    Example::

        w = MlflowWriter("outputs/run1")            # -> outputs/run1/mlflow.db
        w.log_metrics({"loss": 0.5}, step=10, epoch=0, split="train")
        w.close()   # then: mlflow ui --backend-store-uri sqlite:///outputs/run1/mlflow.db
    """

    name = "mlflow"

    def __init__(self, output_dir: str, tracking_uri: Optional[str] = None,
                 experiment: str = "sailfin", run_name: Optional[str] = None,
                 flush_seconds: float = 10.0) -> None:
        self.tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (
            "sqlite:///" + os.path.abspath(os.path.join(output_dir, "mlflow.db")))
        self.flush_seconds = flush_seconds
        self._pending: list[Metric] = []
        self._last_flush = time.monotonic()
        self.run_id: Optional[str] = None
        self._queue: "queue.Queue[Optional[list]]" = queue.Queue()
        self._error: Optional[WriterError] = None  # set by the sender thread
        self._reported = False
        local = self.tracking_uri.startswith("sqlite:///")
        if local:
            check_directory(os.path.dirname(self.tracking_uri[len("sqlite:///"):]) or ".",
                            self.name, KEY)
        try:
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
            found = self._client.get_experiment_by_name(experiment)
            if found is not None:
                experiment_id = found.experiment_id
            else:
                # Artifacts next to the database, not in the working directory.
                artifacts = (os.path.join(os.path.abspath(output_dir), "mlartifacts")
                             if local else None)
                experiment_id = self._client.create_experiment(
                    experiment, artifact_location=artifacts)
            run = self._client.create_run(
                experiment_id, run_name=run_name or os.path.basename(
                    os.path.abspath(output_dir)))
            self.run_id = run.info.run_id
        except Exception as exc:  # noqa: BLE001 - any store failure: say which and where
            raise WriterError(
                f"the mlflow writer cannot start a run at {self.tracking_uri}: "
                f"{type(exc).__name__}: {exc}; check {KEY} (null: "
                "MLFLOW_TRACKING_URI or a SQLite file in trainer.output_dir)") from None
        self._sender = threading.Thread(target=self._send_loop, name="sailfin-mlflow",
                                        daemon=True)
        self._sender.start()

    def log_metrics(self, metrics, step, epoch, split):
        now_ms = int(time.time() * 1000)
        self._pending.extend(Metric(name, value, now_ms, step)
                             for name, value in scalars(metrics, f"{split}/"))
        now = time.monotonic()
        if (len(self._pending) >= _MAX_METRICS_PER_BATCH
                or now - self._last_flush >= self.flush_seconds):
            self.flush()

    def log_run_totals(self, totals, step, epoch):
        self.log_metrics(totals, step, epoch, "time")  # time/goodput, time/replayed_seconds...

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        # Sent now, in this thread: a store that refuses them fails before training.
        params = [Param(str(k)[:250], str(v)[:_MAX_PARAM_CHARS]) for k, v in hparams.items()]
        for i in range(0, len(params), _MAX_PARAMS_PER_BATCH):
            self._send([], params[i:i + _MAX_PARAMS_PER_BATCH])

    def flush(self):
        """Hand the buffered values to the sender thread (does not wait for the store)."""
        self._raise_send_error()
        self._last_flush = time.monotonic()
        if self._pending:
            self._queue.put(self._pending)
            self._pending = []

    def close(self):
        if self.run_id is None:
            return
        try:
            self.flush()
        finally:
            self._queue.put(None)  # the sender stops after what is queued
            self._sender.join(CLOSE_TIMEOUT_SECONDS)
            if self._sender.is_alive():
                say(f"the mlflow writer is still sending to {self.tracking_uri} after "
                    f"{CLOSE_TIMEOUT_SECONDS:.0f} s; the run may miss its last metrics",
                    warning=True)
            status = "FINISHED" if self._error is None else "FAILED"
            try:
                self._client.set_terminated(self.run_id, status)
            except Exception as exc:  # noqa: BLE001
                self._error = self._error or WriterError(
                    f"the mlflow writer could not end run {self.run_id} at "
                    f"{self.tracking_uri}: {type(exc).__name__}: {exc}")
            self.run_id = None
        self._raise_send_error()

    # -- the sender thread ----------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            metrics = self._queue.get()
            if metrics is None:
                return
            if self._error is not None:
                continue  # already failed: drain, the main thread reports it
            try:
                for i in range(0, len(metrics), _MAX_METRICS_PER_BATCH):
                    self._send(metrics[i:i + _MAX_METRICS_PER_BATCH], [])
            except WriterError as exc:
                self._error = exc

    def _send(self, metrics: list, params: list) -> None:
        try:
            self._client.log_batch(self.run_id, metrics=metrics, params=params)
        except Exception as exc:  # noqa: BLE001
            raise WriterError(f"the mlflow writer could not log to {self.tracking_uri} "
                              f"(run {self.run_id}): {type(exc).__name__}: {exc}") from None

    def _raise_send_error(self) -> None:
        if self._error is not None and not self._reported:
            self._reported = True  # once: the run goes on without MLflow after that
            raise self._error
