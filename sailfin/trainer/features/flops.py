"""Model FLOPs of a training step, achieved TFLOP/s and model FLOPs utilisation (MFU)
(docs/validation-and-features.md): the first step's forwards and backwards are counted
once under :class:`torch.utils.flop_counter.FlopCounterMode` (which only counts), unless
the recipe gives ``flops_per_sample`` (needed under ``torch.compile``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from ...utils.voice import say
from ..core.callbacks import Callback

if TYPE_CHECKING:
    from ..core.view import RunView

# Dense peak TFLOP/s of one GPU, from the vendors' datasheets. Datasheets often
# quote tensor-core figures "with sparsity", twice these. Keys: bf16 / fp16
# (tensor cores, fp32 accumulation), tf32 (fp32 matmuls on tensor cores) and
# fp32 (no tensor cores). Matched in order against torch.cuda.get_device_name().
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    # H100 SXM5 (name "NVIDIA H100 80GB HBM3"): 989.4 bf16 dense (1979 sparse).
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    ("H100 NVL", {}),  # not in the table: set trainer.peak_tflops
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("GH200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    # A100 SXM4 and PCIe, 40 and 80 GB: 312 bf16 dense (624 sparse).
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10G", {}),  # not in the table (AWS's variant of the A10): set trainer.peak_tflops
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("RTX A6000", {"bf16": 154.8, "fp16": 154.8, "tf32": 77.4, "fp32": 38.7}),
    # GeForce RTX 4090: 165.2 with fp32 accumulation (330.3 with fp16 accumulation).
    ("RTX 4090", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    # V100 and T4 have fp16 tensor cores only (no bf16, no tf32).
    ("V100-PCIE", {"fp16": 112.0, "fp32": 14.0}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
    ("T4", {"fp16": 65.0, "fp32": 8.1}),
]


def device_peak_tflops(device: Any, precision: str) -> Optional[float]:
    """The table's dense peak for ``device`` at ``precision`` (``fp32``: TF32 if PyTorch
    lets fp32 matmuls use it); None when the device or the precision is not in it."""
    if getattr(device, "type", None) != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        precision = "tf32"
    for key, peaks in PEAK_TFLOPS:
        if key in name:
            if precision == "tf32" and "tf32" not in peaks:  # no TF32 cores (V100, T4)
                precision = "fp32"
            return peaks.get(precision)
    return None


class FlopsMeter:
    """Counts the first step's FLOPs (unless the recipe gave them) and turns the
    trainer's samples/s into ``tflops`` and ``mfu``."""

    def __init__(self, world_size: int = 1, peak_tflops: Optional[float] = None,
                 flops_per_sample: Optional[float] = None, count: bool = True) -> None:
        self.world_size = world_size
        self.peak_tflops = peak_tflops
        self.flops_per_sample = flops_per_sample
        self.pending = count and flops_per_sample is None  # count on the next step
        self._mode: Any = None

    def start(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        self._mode = FlopCounterMode(display=False)
        self._mode.__enter__()

    def stop(self, samples: int) -> None:
        """End counting; ``samples``: the samples this rank's counted step forwarded."""
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        self.pending = False
        total = mode.get_total_flops()
        if total and samples:
            self.flops_per_sample = total / samples
        else:
            say("no FLOPs counted in the first step (no matmul or convolution the "
                "counter knows): no tflops/mfu; a recipe can give flops_per_sample")

    def abort(self) -> None:
        """Leave the counting mode if an error ended the step inside it."""
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def metrics(self, samples_per_second: float) -> dict[str, float]:
        """``tflops`` per device and, with a known peak, ``mfu`` (0..1)."""
        if self.flops_per_sample is None:
            return {}
        tflops = self.flops_per_sample * samples_per_second / self.world_size / 1e12
        out = {"tflops": tflops}
        if self.peak_tflops:
            out["mfu"] = tflops / self.peak_tflops
        return out


def build_flops_meter(module: Any, args: Any, world_size: int, device: Any,
                      precision: str, compiled: bool) -> FlopsMeter:
    """The meter ``trainer.count_flops`` and ``trainer.peak_tflops`` ask for."""
    given = getattr(module, "flops_per_sample", None)  # the recipe's: a number or a method
    if callable(given):
        given = given()
    given = None if given is None else float(given)
    peak = args.peak_tflops or device_peak_tflops(device, precision)
    count = args.count_flops and given is None
    if count and compiled:
        # Compiled code runs fused kernels the counter does not see op by op.
        say("trainer.count_flops: FLOPs are not counted under torch.compile; give the "
            "recipe a flops_per_sample for tflops/mfu")
        count = False
    return FlopsMeter(world_size, peak, given, count)


class FirstStepFlops(Callback):
    """``trainer.count_flops``: counts the FLOPs of the first step's forwards and
    backwards with ``meter``. A step run again (a smaller micro-batch after running out
    of memory) is counted afresh; once a step is counted it leaves the loop."""

    def __init__(self, meter: FlopsMeter) -> None:
        self.meter = meter

    def on_step_begin(self, trainer: "RunView") -> None:
        if self.meter.pending:
            self.meter.abort()  # an attempt that did not reach on_backward_end
            self.meter.start()

    def on_backward_end(self, trainer: "RunView", samples: int) -> bool:
        if self.meter.pending:
            self.meter.stop(samples)  # before the optimizer step: forwards and backwards
        return False

    def on_step_end(self, trainer: "RunView") -> None:
        if not self.meter.pending:  # counted: no call at all from the next step on
            trainer.remove_callback(self)
