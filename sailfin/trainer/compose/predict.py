"""``Trainer.predict`` / ``sailfin predict``: the recipe's ``predict_step`` over a split,
one row per sample with its ``id`` (its position in the split), written in input order
by rank 0 as the batches come (JSON lines, or parquet for a ``.parquet`` name): each
rank reads every W-th sample (:class:`~.splits.StridedSampler`), so the ranks' k-th
batches together are the next block of the split, and only that block is ever held.
The file is written under a temporary name and renamed when complete: a kill leaves
no file under the output's name.

Example::

    with Trainer(module, args) as trainer:
        trainer.predict(checkpoint="outputs/run/final", split="test", out="preds.jsonl")
"""

from __future__ import annotations

import itertools
import json
import os
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

import torch

from ...checkpoint.rng import seed_loader
from ...interfaces import ModuleInterface, RecipeError
from ...utils.voice import say
from ..core.pymarlin_forms import batch_size
from .evaluate import _micro_batch, prepare
from .splits import split_loaders

if TYPE_CHECKING:
    from .trainer import Trainer

PARQUET_ROWS = 4096  # rows per parquet row group


def predict(trainer: "Trainer", checkpoint: Optional[str], split: str, out: str
            ) -> dict[str, Any]:
    """Write ``split``'s predictions to ``out``; returns ``{"split", "checkpoint", "rows",
    "file"}`` (``file`` on rank 0)."""
    source = prepare(trainer, checkpoint)
    args, dist, module, backend = trainer.args, trainer.dist, trainer.module, trainer.backend
    size = args.val_batch_size or _micro_batch(args, dist.world_size)
    loaders, samplers = split_loaders(module, split, size, dist, strided=True)
    if len(loaders) != 1:
        raise RecipeError(f"--split {split} holds {len(loaders)} datasets "
                          f"({', '.join(loaders)}); predict one of them by its name")
    name, loader = next(iter(loaders.items()))
    positions = iter(samplers[id(loader)])
    if len(samplers[id(loader)]) == 0 and dist.world_size > 1:
        raise RecipeError(f"split '{name}' has fewer samples than the {dist.world_size} "
                          "ranks; predict it with fewer processes")
    forward = backend.predict_step
    if type(module).predict_step is ModuleInterface.predict_step:
        forward = _from_val_step(backend)  # no predict_step: val_step's per-sample values
        if dist.is_main:
            say(f"predict: {type(module).__name__} has no predict_step; each row holds "
                "val_step's per-sample outputs (define predict_step to choose them)")
    writer = RowWriter(out) if dist.is_main else None
    error: Optional[BaseException] = None
    rows_written = 0
    step = trainer.global_step
    was_training = module.training
    module.eval()
    seed_loader(loader, args.seed, step, dist.rank)
    try:
        with torch.no_grad():
            batches, last = iter(loader), None
            while True:
                batch = next(batches, None)
                # Every rank takes part in each round while any rank has a batch left.
                if backend.agree_min(0 if batch is not None else 1) == 1:
                    break
                rows: list[Any] = []
                if batch is None:
                    # Out of batches before a partner: under fsdp every forward is a
                    # collective, so this rank repeats its last one and drops it.
                    forward(module, step, last)
                else:
                    out_rows = forward(module, step, batch)
                    ids = list(itertools.islice(positions, batch_size(batch, out_rows)))
                    rows = [[i, r] for i, r in zip(ids, per_sample(out_rows, len(ids)))]
                    last = batch
                block = backend.gather_outputs({"rows": rows}).get("rows", rows)
                if writer is not None and error is None:
                    try:
                        writer.write(row for _, row in sorted(block, key=lambda p: p[0]))
                        rows_written += len(block)
                    except Exception as exc:  # noqa: BLE001 - raised once the rounds end
                        error = exc
        if writer is not None:
            if error is not None:
                raise error
            writer.commit()
    finally:
        module.train(was_training)
        if writer is not None:
            writer.abort()  # a no-op once committed
    result: dict[str, Any] = {"split": name, "checkpoint": source[1] if source else None,
                              "rows": rows_written if dist.is_main else None}
    if writer is not None:
        result["file"] = out
    return result


def _from_val_step(backend: Any) -> Any:
    """A forward through ``val_step`` whose per-sample values are the row: a tuple's
    columns are "0", "1", ... (PyMarlin's form), a 0-d value (a batch mean) is left out."""
    def forward(module: Any, step: int, batch: Any) -> Any:
        out = backend.val_step(module, step, batch)
        if isinstance(out, (tuple, list)):
            out = {str(i): v for i, v in enumerate(out)}
        if isinstance(out, Mapping):
            out = {k: v for k, v in out.items()
                   if not (isinstance(v, torch.Tensor) and v.dim() == 0)}
        return out
    return forward


def per_sample(out: Any, count: int) -> Iterator[dict[str, Any]]:
    """``predict_step``'s dict as one plain dict per sample (tensors as lists/numbers)."""
    if not isinstance(out, Mapping):
        raise RecipeError(f"predict_step must return a dict of per-sample values "
                          f"(tensors with the batch first, or lists); got {type(out).__name__}")
    columns = {}
    for key, value in out.items():
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != count:
                raise RecipeError(
                    f"predict_step's '{key}' has shape {list(value.shape)}, but the batch "
                    f"holds {count} samples: return one value per sample (batch first)")
            value = value.detach().cpu().tolist()
        elif isinstance(value, (list, tuple)):
            if len(value) != count:
                raise RecipeError(f"predict_step's '{key}' holds {len(value)} values for a "
                                  f"batch of {count} samples: return one per sample")
        else:
            raise RecipeError(f"predict_step's '{key}' is a {type(value).__name__}; return "
                              "a tensor (batch first) or a list, one value per sample")
        columns[str(key)] = value
    for i in range(count):
        yield {key: column[i] for key, column in columns.items()}


class RowWriter:
    """Rows appended to ``path`` under a temporary name (``path.tmp-<pid>``), renamed to
    ``path`` by :meth:`commit`: JSON lines, or parquet when ``path`` ends ``.parquet``
    (needs pyarrow). Each row gets ``id`` first (the recipe's own ``id``, if it returns
    one, wins)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.parquet = path.endswith(".parquet")
        if self.parquet:
            try:
                import pyarrow  # noqa: F401
            except ImportError:
                raise RecipeError(f"--out {path}: writing parquet needs pyarrow: pip install "
                                  "'sailfin[parquet]', or name the file .jsonl") from None
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self.tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
        self._fh: Any = None if self.parquet else open(self.tmp, "w", encoding="utf-8")
        self._parquet: Any = None
        self._pending: list[dict[str, Any]] = []
        self._position = 0
        self.done = False

    def write(self, rows: Iterator[dict[str, Any]]) -> None:
        for row in rows:
            row = {"id": self._position, **row}
            self._position += 1
            if self.parquet:
                self._pending.append(row)
            else:
                self._fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        if not self.parquet:
            self._fh.flush()  # the block is on its way to disk, not held here
        elif len(self._pending) >= PARQUET_ROWS:
            self._flush_parquet()

    def _flush_parquet(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self._pending:
            return
        table = pa.Table.from_pylist(self._pending)
        if self._parquet is None:
            self._parquet = pq.ParquetWriter(self.tmp, table.schema)
        self._parquet.write_table(table.cast(self._parquet.schema))
        self._pending = []

    def commit(self) -> None:
        """Finish the file and give it its name (the rows so far are the whole split)."""
        if self.parquet:
            self._flush_parquet()
            if self._parquet is None:  # an empty split: an empty table
                import pyarrow as pa
                import pyarrow.parquet as pq
                pq.write_table(pa.table({"id": pa.array([], pa.int64())}), self.tmp)
            else:
                self._parquet.close()
        else:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
        os.replace(self.tmp, self.path)
        self.done = True

    def abort(self) -> None:
        """Remove the partial file (nothing is named as the output)."""
        if self.done:
            return
        for handle in (self._fh, self._parquet):
            try:
                if handle is not None:
                    handle.close()
            except Exception:  # noqa: BLE001 - closing a half-written file on the way out
                pass
        if os.path.exists(self.tmp):
            os.remove(self.tmp)
