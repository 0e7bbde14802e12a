"""The named splits ``sailfin evaluate`` and ``sailfin predict`` read: ``val`` (the recipe's
validation sets, ``get_val_dataloaders``), ``test`` (its held-out sets,
``get_test_dataloaders``, PyMarlin's name) or one set by its name. Each loader is built
with a sampler sailfin hands the recipe, so every sample is read by exactly one rank."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import torch

from ...distributed import DistEnv
from ...interfaces import ModuleInterface, RecipeError
from ...data.sampler import EvalSampler


class StridedSampler(torch.utils.data.Sampler[int]):
    """Rank ``r`` of ``W`` reads samples ``r, r + W, r + 2W, ...`` in order: the ranks'
    ``k``-th batches of size ``B`` together hold the contiguous block
    ``[k*B*W, (k+1)*B*W)``, so predictions gathered batch by batch are written in input
    order, holding one batch per rank at a time. No sample is padded or read twice."""

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1) -> None:
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.num_samples, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.num_samples, self.world_size))


def split_loaders(module: ModuleInterface, split: str, batch_size: int, dist: DistEnv,
                  strided: bool = False) -> tuple[dict[str, Any], dict[int, Any]]:
    """``split``'s loaders (dataset name -> loader) and, by ``id(loader)``, the sampler
    each was built with. ``strided``: :class:`StridedSampler` (prediction, in input
    order); otherwise validation's contiguous :class:`EvalSampler`."""
    made: list[Any] = []

    def sampler(dataset: Any) -> Any:
        cls = StridedSampler if strided else EvalSampler
        made.append(cls(len(dataset), dist.rank, dist.world_size))
        return made[-1]

    found: dict[str, dict[str, Any]] = {}
    for kind, build in (("val", module.get_val_dataloaders),
                        ("test", module.get_test_dataloaders)):
        found[kind] = _loaders(build, sampler, batch_size, kind)
    if split in found:
        loaders = found[split]
        if not loaders:
            hook = "get_val_dataloaders / get_val_datasets" if split == "val" else \
                "get_test_dataloaders / DataInterface.get_test_dataset(s)"
            raise RecipeError(f"--split {split}: {type(module).__name__} has no {split} data; "
                              f"implement {hook}{_named(found)}")
    else:
        loaders = {name: loader for sets in found.values() for name, loader in sets.items()
                   if name == split}
        if not loaders:
            raise RecipeError(f"--split {split}: no such split; use val, test{_named(found)}")
    samplers = {}
    for name, loader in loaders.items():
        used = getattr(loader, "sampler", None)
        if not any(used is s for s in made):
            raise RecipeError(
                f"the loader of split '{name}' was not built with sampler(dataset): build "
                "it as DataLoader(dataset, batch_size=batch_size, sampler=sampler(dataset)) "
                "so that each rank reads its own samples, each once")
        samplers[id(loader)] = used
    return loaders, samplers


def _loaders(build: Callable[..., Any], sampler: Callable[[Any], Any], batch_size: int,
             kind: str) -> dict[str, Any]:
    try:
        loaders = build(sampler, batch_size)
    except NotImplementedError:
        return {}  # no data attribute
    if loaders is None:
        return {}
    return dict(loaders) if isinstance(loaders, Mapping) else {kind: loaders}


def _named(found: dict[str, dict[str, Any]]) -> str:
    names = sorted({n for sets in found.values() for n in sets} - {"val", "test"})
    return f", or a set by name ({', '.join(names)})" if names else ""
