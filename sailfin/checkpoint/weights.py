"""Named weights read one tensor at a time, whole or only the rows a rank owns.

``trainer.init_from`` loads a ``.safetensors`` file or an sp/ddp checkpoint's
``model.pt`` through a :class:`TensorSource` into a module whose parameters may be
sharded (DTensors under fsdp): each tensor is read and copied on its own, and of a
sharded parameter only this rank's block is read (safetensors reads exactly those
bytes; a memory-mapped ``model.pt`` touches only those pages).

Example::

    with SafetensorsSource("final/model.safetensors") as source:
        load_into(model, source)
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from .errors import CheckpointError


class TensorSource:
    """Tensors by name; :meth:`read` returns one whole, or the block ``index`` of it."""

    location = "?"

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, name: str, index: Optional[tuple[slice, ...]] = None) -> torch.Tensor:
        raise NotImplementedError

    def __enter__(self) -> "TensorSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class StateDictSource(TensorSource):
    """A state dict in memory (or memory-mapped: ``torch.load(mmap=True)``)."""

    def __init__(self, state: Mapping[str, torch.Tensor], location: str) -> None:
        self.state, self.location = state, location

    def names(self) -> list[str]:
        return [k for k, v in self.state.items() if isinstance(v, torch.Tensor)]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def read(self, name: str, index: Optional[tuple[slice, ...]] = None) -> torch.Tensor:
        tensor = self.state[name]
        return tensor if index is None else tensor[index]


class SafetensorsSource(TensorSource):
    """A ``.safetensors`` file, opened with ``safe_open``: nothing is read until asked."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        self.location = path
        try:
            self._file = safe_open(path, framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"trainer.init_from: {path} is not a readable .safetensors "
                                  f"file: {exc}") from None

    def names(self) -> list[str]:
        return list(self._file.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file.get_slice(name).get_shape())

    def read(self, name: str, index: Optional[tuple[slice, ...]] = None) -> torch.Tensor:
        if index is None:
            return self._file.get_tensor(name)
        return self._file.get_slice(name)[index]

    def __exit__(self, *exc: Any) -> None:
        self._file = None


def local_index(tensor: Any) -> Optional[tuple[slice, ...]]:
    """The block of the full tensor a DTensor holds on this rank; None for a plain tensor."""
    if not (hasattr(tensor, "device_mesh") and hasattr(tensor, "to_local")):
        return None
    from ..compat.torch import local_shape_and_offset

    shape, offset = local_shape_and_offset(tensor)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


@torch.no_grad()
def load_into(module: torch.nn.Module, source: TensorSource) -> None:
    """Copy ``source``'s tensors into ``module``'s parameters and persistent buffers, in
    place, one at a time; a sharded parameter reads only its own block. Raises
    :class:`CheckpointError` naming the file and the first key that does not fit."""
    own = module.state_dict(keep_vars=True)
    names = set(source.names())
    # safetensors stores one tensor for tied weights: the twin of a loaded one is loaded.
    loaded = {id(own[n]) for n in own if n in names}
    missing = [n for n in own if n not in names and id(own[n]) not in loaded]
    unexpected = sorted(names - set(own))
    if missing or unexpected:
        raise CheckpointError(
            f"trainer.init_from: the weights in {source.location} do not fit this model: "
            f"missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected keys "
            f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}. Point it at weights "
            "of the same architecture")
    for name, tensor in own.items():
        if name not in names:
            continue
        if source.shape(name) != tuple(tensor.shape):
            raise CheckpointError(
                f"trainer.init_from: tensor '{name}' in {source.location} has shape "
                f"{list(source.shape(name))}, this model's has {list(tensor.shape)}. Point it "
                "at weights of the same architecture")
        index = local_index(tensor)
        target = tensor.to_local() if index is not None else tensor
        target.copy_(source.read(name, index))
