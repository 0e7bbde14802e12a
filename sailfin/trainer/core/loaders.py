"""The recipe's data loaders, built with the samplers sailfin hands it (which decide which
samples form each optimizer step and which share each rank sees) and checked. A loader
over in-memory tensors is rebuilt to gather each micro-batch in one call
(:mod:`sailfin.data.batched`), with bit-identical batches."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping, Optional

from ...config.trainer import TrainerArguments
from ...data.batched import gathered_loader
from ...data.plan import BatchPlan
from ...data.sampler import EvalSampler, ResumableSampler
from ...distributed import DistEnv
from ...interfaces import ModuleInterface, RecipeError


def build_train_loader(module: ModuleInterface, plan: BatchPlan, dist: DistEnv,
                       args: TrainerArguments) -> tuple[Any, ResumableSampler]:
    """The recipe's training loader and the sampler it was built with."""
    made: list[ResumableSampler] = []

    def sampler(dataset: Any) -> ResumableSampler:
        # A dataset with its own epoch order (sharded data) keeps its reads local.
        s = plan.sampler(len(dataset), dist.rank, args.seed, args.shuffle,
                         order=getattr(dataset, "epoch_order", None))
        made.append(s)
        return s

    loader = module.get_train_dataloader(sampler, plan.micro_batch)
    if not made:
        raise RecipeError(
            "get_train_dataloader did not call sampler(dataset): build the loader with "
            "DataLoader(dataset, batch_size=batch_size, sampler=sampler(dataset)) so "
            "sailfin decides which samples form each optimizer step")
    check = getattr(made[-1], "check_loader", None)  # dp: the accountant's sampling only
    if check is not None:
        check(loader)
    if getattr(loader, "batch_size", None) != plan.micro_batch or getattr(
            loader, "drop_last", False):
        raise RecipeError(
            f"get_train_dataloader must use batch_size={plan.micro_batch} (the "
            f"batch_size argument) and drop_last=False; got batch_size="
            f"{getattr(loader, 'batch_size', None)}, drop_last="
            f"{getattr(loader, 'drop_last', None)}. Use trainer.drop_last instead.")
    # A sampler with steps of varying size (dp's Poisson sampler) rebuilds the loader itself.
    rebuild = getattr(made[-1], "wrap_loader", None)
    return (rebuild(loader) if rebuild else gathered_loader(loader, made[-1])), made[-1]


def build_val_loaders(module: ModuleInterface, batch_size: int, dist: DistEnv
                      ) -> dict[str, Any]:
    """Name -> the recipe's validation loader (empty: the recipe has no validation data)."""
    made: list[EvalSampler] = []

    def sampler(dataset: Any) -> EvalSampler:
        made.append(EvalSampler(len(dataset), dist.rank, dist.world_size))
        return made[-1]

    try:
        loaders = module.get_val_dataloaders(sampler, batch_size)
    except NotImplementedError:
        if type(module).get_val_dataloaders is not ModuleInterface.get_val_dataloaders:
            raise
        return {}  # no data attribute: the recipe has no validation data
    if loaders is None:
        return {}
    if not isinstance(loaders, Mapping):
        loaders = {"val": loaders}
    # Each loader over one of sailfin's samplers gathers its batches where it can.
    return {name: next((gathered_loader(loader, s) for s in made
                        if getattr(loader, "sampler", None) is s), loader)
            for name, loader in loaders.items()}


def dataset_set_epoch(loader: Any) -> Optional[Callable[[int], Any]]:
    """The training dataset's ``set_epoch``, if it has one: called before each epoch."""
    set_epoch = getattr(getattr(loader, "dataset", None), "set_epoch", None)
    if not callable(set_epoch):
        return None
    if getattr(loader, "persistent_workers", False) and getattr(loader, "num_workers", 0):
        warnings.warn(
            "the training dataset has set_epoch, but its DataLoader keeps persistent_workers: "
            "the workers keep the dataset as it was when they started, so epoch-dependent "
            "work in them (augmentation seeded by sample_seed) sees the first epoch only. "
            "Build the loader with persistent_workers=False.", RuntimeWarning, stacklevel=3)
    return set_epoch
