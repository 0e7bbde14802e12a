"""``.safetensors`` files: written whole (:func:`save_weights`) or one tensor at a time
(:class:`SafetensorsWriter`), and read one tensor at a time (:func:`load_into`).

The header (an 8-byte length, then JSON: each tensor's dtype, shape and byte range)
needs only names, dtypes and shapes: it is written first and each tensor appended as
it arrives, in ``save_file``'s order (:func:`file_order`), so both write the same bytes.

Example::

    specs = file_order([TensorSpec.of(name, t) for name, t in state.items()])
    with SafetensorsWriter("final/model.safetensors", specs) as out:
        for spec in specs:
            out.write(spec.name, state[spec.name])
    with SafetensorsSource("final/model.safetensors") as source:
        load_into(model, source)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from ..compat.torch import local_shape_and_offset
from ..checkpoint.errors import CheckpointError

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
    torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
# save_file sorts tensors by dtype (largest alignment first, this order), then by name.
_LAYOUT = ["U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
           "F8_E5M2FNUZ", "F8_E4M3FNUZ", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL"]


@dataclass(frozen=True)
class TensorSpec:
    """What the header says of one tensor: its name, dtype and (global) shape
    (``TensorSpec.of("layer.weight", param)``: a DTensor gives the full shape)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorSpec":
        return cls(name, tensor.dtype, tuple(tensor.shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def file_order(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """``specs`` in the order ``safetensors.torch.save_file`` lays tensors out."""
    return sorted(specs, key=lambda s: (_LAYOUT.index(_dtype_name(s)), s.name))


def header_bytes(specs: Sequence[TensorSpec]) -> bytes:
    """The length prefix and JSON header of a file holding ``specs`` in this order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # as save_file writes it
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": _dtype_name(spec), "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


class SafetensorsWriter:
    """A ``.safetensors`` file at ``path`` written one tensor at a time, in ``specs``' order,
    under a temporary name renamed to ``path`` when the context closes with every tensor
    written (an error or a missing tensor removes it).

    Example::

        with SafetensorsWriter(path, [TensorSpec("w", torch.float32, (2, 3))]) as out:
            out.write("w", torch.zeros(2, 3))
    """

    def __init__(self, path: str, specs: Sequence[TensorSpec]) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"{path}: a tensor name appears twice in {names}")
        self.path, self.specs = path, list(specs)
        self._next = 0
        self._tmp = f"{path}.tmp-{os.getpid()}"
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._fh = open(self._tmp, "wb")
        try:
            self._fh.write(header_bytes(self.specs))
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor``, the next one the header lists (a CPU or device tensor)."""
        if self._next >= len(self.specs):
            raise CheckpointError(f"{self.path}: '{name}' is one tensor more than the "
                                  f"{len(self.specs)} its header lists")
        spec = self.specs[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != (spec.name, spec.dtype, spec.shape):
            raise CheckpointError(
                f"{self.path}: tensor {self._next} is '{spec.name}' {spec.dtype} "
                f"{list(spec.shape)} in the header, but '{name}' {tensor.dtype} "
                f"{list(tensor.shape)} was given; write the tensors in the header's order")
        if tensor.numel():
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            if sys.byteorder == "big" and tensor.element_size() > 1:
                data = data.view(-1, tensor.element_size()).flip(1).reshape(-1)
            self._fh.write(memoryview(data.numpy()))
        self._next += 1

    def commit(self) -> str:
        """Close the file and rename it to ``path``; every tensor must have been written."""
        if self._next != len(self.specs):
            missing = [s.name for s in self.specs[self._next:]]
            self.abort()
            raise CheckpointError(f"{self.path}: {len(missing)} tensor(s) never written "
                                  f"({', '.join(missing[:3])}); the file was not saved")
        try:
            self._fh.flush()
            os.fsync(self._fh.fileno())  # on disk before the rename that publishes it
            self._fh.close()
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        return self.path

    def abort(self) -> None:
        """Close and remove the temporary file; ``path`` is left as it was."""
        self._fh.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._tmp)

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def save_weights(state: Mapping[str, torch.Tensor], path: str) -> str:
    """A full state dict as safetensors at ``path`` (the bytes ``save_file`` writes)."""
    tensors = untied(state)
    specs = file_order([TensorSpec.of(name, t) for name, t in tensors.items()])
    with SafetensorsWriter(path, specs) as out:
        for spec in specs:
            out.write(spec.name, tensors[spec.name])
    return path


def untied(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor once (safetensors refuses tensors that share memory), contiguous: tied
    weights stay under their first name."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = tensor.contiguous()
    return out


def _dtype_name(spec: TensorSpec) -> str:
    try:
        return _DTYPES[spec.dtype]
    except KeyError:
        raise CheckpointError(f"tensor '{spec.name}' has dtype {spec.dtype}, which "
                              "safetensors cannot store; cast it (e.g. to float32) "
                              "before saving") from None


class StateDictSource:
    """Tensors by name for :func:`load_into`: a state dict in memory (or memory-mapped:
    ``torch.load(mmap=True)``). :meth:`read` returns one whole, or its block ``index``."""

    def __init__(self, state: Mapping[str, torch.Tensor], location: str) -> None:
        self.state, self.location = state, location

    def names(self) -> list[str]:
        return [k for k, v in self.state.items() if isinstance(v, torch.Tensor)]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def read(self, name: str, index: Optional[tuple[slice, ...]] = None) -> torch.Tensor:
        tensor = self.state[name]
        return tensor if index is None else tensor[index]


class SafetensorsSource(StateDictSource):
    """A ``.safetensors`` file, opened with ``safe_open``: nothing is read until asked
    (a block reads exactly its bytes)."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        try:
            self._file = safe_open(path, framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"trainer.init_from: {path} is not a readable .safetensors "
                                  f"file: {exc}") from None
        self.location = path

    def names(self) -> list[str]:
        return list(self._file.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file.get_slice(name).get_shape())

    def read(self, name: str, index: Optional[tuple[slice, ...]] = None) -> torch.Tensor:
        if index is None:
            return self._file.get_tensor(name)
        return self._file.get_slice(name)[index]

    def __enter__(self) -> "SafetensorsSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._file = None


@torch.no_grad()
def load_into(module: torch.nn.Module, source: StateDictSource) -> None:
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
        index = None
        if hasattr(tensor, "device_mesh") and hasattr(tensor, "to_local"):  # a DTensor
            shape, offset = local_shape_and_offset(tensor)  # the block this rank holds
            index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
            tensor = tensor.to_local()
        tensor.copy_(source.read(name, index))
