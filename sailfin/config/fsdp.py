"""The ``trainer.fsdp:`` section: how the ``fsdp`` backends shard the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import ConfigError


@dataclass
class FSDPArguments:
    """Which submodules become FSDP units, and how they hold their parameters.

    A unit's parameters are gathered just before its forward (and backward)
    and freed again after: the fewer parameters per unit, the lower the peak
    memory; the more units, the more (smaller) collectives.

    Example::

        trainer:
          backend: fsdp
          fsdp: {units: [TransformerBlock], reshard_after_forward: true}
    """

    units: Optional[list[str]] = None
    """Submodules sharded as units of their own: class names (``TransformerBlock``) or
    dotted module paths (``encoder.layers.0``). Null: every direct child of the recipe
    that holds parameters. The whole model is always sharded last, as the root unit."""
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
    meta_build: bool = True
    """``sailfin train`` builds the recipe on the meta device and initialises each rank's
    rows after sharding (no rank ever holds the whole model). False: every rank builds
    the whole model first (for a recipe whose initialisation cannot be deferred)."""

    def __post_init__(self) -> None:
        if self.accumulate not in ("full", "sharded"):
            raise ConfigError(f"trainer.fsdp.accumulate must be full or sharded, got "
                              f"{self.accumulate!r}")
        if self.units is None:
            return
        if isinstance(self.units, str):
            raise ConfigError(f"trainer.fsdp.units must be a list of class names or module "
                              f"paths, got the string {self.units!r}; write [{self.units}]")
        for i, name in enumerate(self.units):
            if not isinstance(name, str) or not name or name != name.strip():
                raise ConfigError(f"trainer.fsdp.units[{i}] must be a class name or a dotted "
                                  f"module path, got {name!r}")
        if len(set(self.units)) != len(self.units):
            raise ConfigError(f"trainer.fsdp.units lists a name twice: {self.units}")
