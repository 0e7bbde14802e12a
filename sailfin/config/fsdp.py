"""The ``trainer.fsdp:`` section: how the ``fsdp`` backends shard the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import ConfigError, short_repr


@dataclass
class FSDPArguments:
    """Which submodules become FSDP units, and how they hold their parameters: a unit's
    parameters are gathered just before its forward (and backward) and freed after, so
    fewer parameters per unit lower the peak memory and more units mean more, smaller
    collectives.

    Example::

        trainer:
          backend: fsdp
          fsdp: {units: [TransformerBlock], reshard_after_forward: true}
    """

    units: Optional[list[str]] = None
    """Submodules sharded as units of their own: class names (``TransformerBlock``) or
    dotted module paths (``encoder.layers.0``). Null: the model's repeated blocks (a
    Hugging Face model's ``_no_split_modules``, otherwise the class of the children of
    its largest ``ModuleList`` or ``Sequential``). The whole model is always sharded
    last, as the root unit, which also keeps every parameter no unit took."""
    reshard_after_forward: bool = True
    """Free each unit's gathered parameters after its forward and gather them again in
    backward (less memory, one more all-gather per unit). False keeps them until backward."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (CUDA only):
    the device holds a unit's gathered parameters only while it runs."""

    accumulate: str = "full"
    """Gradient accumulation over a step's micro-batches. ``full``: each rank keeps the
    unsharded gradients until the step's last micro-batch, then reduce-scatters once
    (fewest collectives). ``sharded``: reduce-scatter after every micro-batch, so only
    gradient shards are held (least memory; one collective per unit and micro-batch)."""
    build: str = "rank0"
    """How the model reaches each rank's shards. ``rank0``: rank 0 builds the recipe as
    ``sp`` does (its own init, ties, buffers) in host memory, the other ranks on the meta
    device; after sharding, each rank receives its rows from rank 0, one tensor at a
    time. ``meta``: for a model larger than one host: every rank builds on the meta
    device, and after sharding the recipe's ``init_weights()`` fills the sharded
    parameters (deterministic for a seed and world size; not sp's initial weights)."""

    def __post_init__(self) -> None:
        if self.accumulate not in ("full", "sharded"):
            raise ConfigError(f"trainer.fsdp.accumulate must be full or sharded, got "
                              f"{short_repr(self.accumulate)}")
        if self.build not in ("rank0", "meta"):
            raise ConfigError("trainer.fsdp.build must be rank0 or meta, got "
                              f"{short_repr(self.build)}")
        if self.units is None:
            return
        if isinstance(self.units, str):
            raise ConfigError(f"trainer.fsdp.units must be a list of class names or module "
                              f"paths, got the string {short_repr(self.units)}; "
                              f"write [{self.units}]")
        for i, name in enumerate(self.units):
            if not isinstance(name, str) or not name or name != name.strip():
                raise ConfigError(f"trainer.fsdp.units[{i}] must be a class name or a dotted "
                                  f"module path, got {short_repr(name)}")
        if len(set(self.units)) != len(self.units):
            raise ConfigError(f"trainer.fsdp.units lists a name twice: {self.units}")
