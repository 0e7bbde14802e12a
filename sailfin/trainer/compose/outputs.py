"""Files a finished run leaves behind: summary.json and final/model.safetensors."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..features.loop_features import finish_summary
from ...utils.memory import peak_rss_bytes

if TYPE_CHECKING:
    from .trainer import Trainer


def finish_run(trainer: "Trainer", write: bool = True) -> dict[str, Any]:
    """The run's summary; the final weights (and EMA weights) and summary.json written
    (unless not ``write``: a run that trained nothing leaves the finished one's files).
    Every rank calls it: under fsdp, gathering each full tensor is a collective."""
    summary = {
        "global_step": trainer.global_step,
        "epoch": trainer.epoch,
        "samples_seen": trainer.samples_seen,
        "train_seconds": round(trainer.train_seconds, 4),
        "samples_per_second": (trainer.samples_seen / trainer.train_seconds
                               if trainer.train_seconds > 0 else None),
        "world_size": trainer.dist.world_size,
        "nonfinite_steps": trainer.nonfinite.count,
        "val": _flat_val(trainer.last_val_metrics),
        "best": trainer.run_stats.best,
        "peak_memory": peak_memory(trainer.device),
        "micro_batch_size": trainer.plan.micro_batch,
    }
    summary.update(finish_summary(trainer))  # stopped_early, tflops, mfu, ema
    for callback in trainer.callbacks:  # e.g. privacy (dp)
        fields = getattr(callback, "summary_fields", None)
        if callable(fields):
            summary.update(fields())
    if trainer.autobatch is not None:
        summary["auto_micro_batch"] = trainer.autobatch.summary()
    if not write:
        return summary
    backend, output_dir, is_main = trainer.backend, trainer.args.output_dir, trainer.dist.is_main
    # Every rank takes part (fsdp gathers one tensor at a time); rank 0 writes.
    backend.save_final_weights(trainer.module,
                               os.path.join(output_dir, "final", "model.safetensors"), is_main)
    if trainer.ema is not None:  # final/ema.safetensors, the same names
        trainer.ema.save_final(trainer.module, output_dir, backend.save_final_weights, is_main)
    if is_main:
        write_json_atomic(os.path.join(output_dir, "summary.json"), summary)
    return summary


def _flat_val(results: dict[str, dict[str, float]]) -> dict[str, Any]:
    if len(results) == 1:
        return next(iter(results.values()))
    return results


def write_json_atomic(path: str, data: Any) -> None:
    """Write JSON to a temporary file and rename it: a reader never sees half a file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, default=_jsonable)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return str(value)


def peak_memory(device: Any = None) -> dict[str, Optional[int]]:
    """Peak resident memory of this process and, on CUDA, peak allocated tensor memory.

    Both in bytes; ``None`` where the platform cannot tell (Windows; no CUDA device).
    """
    rss = peak_rss_bytes()
    cuda: Optional[int] = None
    if device is not None and getattr(device, "type", None) == "cuda":
        cuda = int(torch.cuda.max_memory_allocated(device))
    return {"cpu_rss_bytes": rss, "cuda_max_allocated_bytes": cuda}
