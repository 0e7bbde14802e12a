"""What a memory snapshot's state looks like as bytes: each tensor replaced by its slot
(which rank's ``.bin`` holds its storage, where), the rest plain values, pickled; and
reading that back with an unpickler that rebuilds no class but a few plain ones.

:class:`Planner` keeps the layout from snapshot to snapshot while the state's tensors
stay the same, so a snapshot of an unchanged model and optimizer only walks its state.
The sets' files, their checks and the copy are :mod:`.snapshot_sets`'.
"""

from __future__ import annotations

import collections
import io
import json
import pickle
from typing import Any, Callable, NamedTuple, Optional

import torch

from ..utils.crc import crc32

TENSOR = "__sailfin_tensor__"  # a tensor's place in a set's .bin, in its .pt
OTHER = "__sailfin_torch_save__"  # a sparse or quantized tensor: torch.save'd, weights_only
INLINE = "__sailfin_bytes__"  # a tensor's bytes in the .pt itself (the random streams)
MARK = "__sailfin_dtensor__"  # a DTensor's local rows and where they belong
ALIGN = 64
_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})


def map_tree(obj: Any, fn: Callable[[Any], Any], leaf: Callable[[Any], bool]) -> Any:
    """``obj`` with ``fn(x)`` for each ``x`` that is a ``leaf``, through dicts, lists and
    tuples (new containers, of the same types); other values are kept as they are. A
    sequence of scalars (Python's random state: 625 ints) is recognised in C."""
    if leaf(obj):
        return fn(obj)
    if isinstance(obj, dict):
        out = {k: v if type(v) in _SCALARS else map_tree(v, fn, leaf) for k, v in obj.items()}
        return type(obj)(out) if type(obj) is not dict else out
    if type(obj) in (list, tuple):
        if _SCALARS.issuperset(map(type, obj)):
            return obj if type(obj) is tuple else list(obj)
        return type(obj)(v if type(v) in _SCALARS else map_tree(v, fn, leaf) for v in obj)
    return obj


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)



class Layout(NamedTuple):
    """Where a snapshot's storages go: each to one part (a rank of the node, when the
    state is the same on every rank there: each copies a share), packed in that part's
    ``.bin``. ``sources`` (key, tensor): this rank's, in copy order (those copied at the
    step's end first: ``now`` of them, ``full`` bytes)."""

    keys: frozenset
    sources: list
    offsets: list
    table: list  # [[part, offset, nbytes]] per storage: what every part's .pt records
    total: int
    now: int
    full: int
    cuda: bool
    part: int  # this rank's part (of ``parts``)
    parts: int
    ident: str  # what every part of one snapshot agrees on: a CRC-32 of ``table``


class Planner:
    """A snapshot's state as a skeleton (each tensor replaced by its slot) and its layout,
    kept from snapshot to snapshot: a tensor seen in the last one (same address, dtype,
    shape, strides, device) keeps its slot, and the same storages keep their layout, so
    the snapshot of an unchanged model and optimizer only walks its state. The rank's own
    state (its random streams: small, and new tensors at every call, which would change
    the layout) is copied into the skeleton itself."""

    def __init__(self) -> None:
        self._seen: dict[tuple, tuple[tuple, list, torch.Tensor]] = {}
        self.layout: Optional[Layout] = None
        self._shape: Optional[tuple] = None  # (defer, part, parts) of the layout

    def plan(self, shared: Any, rank: Any, later: Callable[[], frozenset], defer: bool,
             part: int = 0, parts: int = 1) -> tuple[Any, Layout]:
        """The skeleton of ``{"shared": shared, "rank": rank}`` and its layout. ``later()``:
        the storage keys ``(data_ptr, device)`` that may be copied beside training (asked
        only when the layout changes; ``defer`` False: none). ``parts``: how many ranks
        share the copy of ``shared`` (the same on each of them); this rank is ``part``."""
        seen, previous = {}, self._seen

        def inline(value: torch.Tensor) -> Any:
            if value.layout is not torch.strided or value.is_quantized:
                return whole(value)
            flat = value.detach().reshape(-1).to("cpu").contiguous()
            return {INLINE: [str(value.dtype)[6:], list(value.shape),
                             flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""]}

        def slot(value: torch.Tensor) -> Any:
            if value.layout is not torch.strided or value.is_quantized:  # rare: kept whole
                return whole(value)
            fingerprint = (value.data_ptr(), value.dtype, value.shape, value.stride(),
                           value.device)
            known = previous.get(fingerprint) or seen.get(fingerprint)
            if known is None:
                value = value.detach()  # shares the version counter: a change is seen
                storage = value.untyped_storage()
                key = (storage.data_ptr(), str(value.device), storage.nbytes())
                known = (key, [key, str(value.dtype)[6:], list(value.size()),
                               list(value.stride()), value.storage_offset()], value)
            seen[fingerprint] = known
            return {TENSOR: known[1]}

        skeleton = {"shared": map_tree(shared, slot, is_tensor),
                    "rank": map_tree(rank, inline, is_tensor)}
        self._seen = seen
        keys = frozenset(key for key, _, _ in seen.values())
        shape = (defer, part, parts)
        if self.layout is None or self.layout.keys != keys or self._shape != shape:
            self.layout = _layout(seen.values(), keys, later() if defer else frozenset(),
                                  part, parts)
            self._shape = shape
        return skeleton, self.layout


def whole(value: torch.Tensor) -> dict[str, bytes]:
    blob = io.BytesIO()
    torch.save(value.to("cpu", copy=True), blob)
    return {OTHER: blob.getvalue()}


def _layout(found: Any, keys: frozenset, later: frozenset, part: int, parts: int) -> Layout:
    sources: dict[tuple, torch.Tensor] = {}
    for key, _, tensor in found:
        sources.setdefault(key, tensor)
    # The order and the shares depend only on the state's structure and sizes, the same
    # on every rank of the node: each rank computes every part's places.
    order = sorted(sources, key=lambda k: k[:2] in later)  # now first, then later
    load = [0] * parts
    owner = []
    for key in order:  # each storage to the part with the fewest bytes so far
        owner.append(min(range(parts), key=lambda p: (load[p], p)))
        load[owner[-1]] += -(-key[2] // ALIGN) * ALIGN
    fill, table = [0] * parts, []
    for key, p in zip(order, owner):
        table.append([p, fill[p], key[2]])
        fill[p] += -(-key[2] // ALIGN) * ALIGN
    index = {key: i for i, key in enumerate(order)}
    for key, entry, _ in found:
        entry[0] = index[key]  # the slot names its storage's row of the table
    mine = [i for i, p in enumerate(owner) if p == part]
    now = sum(order[i][:2] not in later for i in mine)
    offsets = [table[i][1] for i in mine]
    full = offsets[now] if now < len(mine) else fill[part]  # checked whole: copied now
    return Layout(keys, [(order[i], sources[order[i]]) for i in mine], offsets, table,
                  fill[part], now, full, any(t.device.type == "cuda" for t in sources.values()),
                  part, parts, f"{crc32(json.dumps(table).encode()):08x}")


def dump_state(obj: Any) -> bytes:
    """``obj`` (plain values: :class:`Planner` took its tensors out) as a pickle."""
    return pickle.dumps(obj, protocol=5)


class _PlainUnpickler(pickle.Unpickler):
    """Rebuilds no class but these: no code runs from a snapshot's state."""

    def find_class(self, module: str, name: str) -> Any:
        found = {("collections", "OrderedDict"): collections.OrderedDict,
                 ("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
                 ("builtins", "complex"): complex, ("torch", "Size"): torch.Size
                 }.get((module, name), getattr(torch, name, None) if module == "torch" else None)
        if found is None or (module == "torch" and name != "Size"
                             and not isinstance(found, torch.dtype)):
            raise pickle.UnpicklingError(f"a snapshot's state names {module}.{name}, which "
                                         "only arbitrary unpickling could rebuild")
        return found


def load_state(blob: bytes, part_bytes: Callable[[int], torch.Tensor]) -> Any:
    """The state :func:`dump_state` wrote as ``blob``; ``part_bytes(p)``: the bytes of
    part ``p``'s ``.bin`` (checked), where its storages are."""
    saved = _PlainUnpickler(io.BytesIO(blob)).load()
    storages = [part_bytes(part)[offset:offset + nbytes].clone().untyped_storage()
                for part, offset, nbytes in saved["layout"]]

    def tensor(slot: dict) -> torch.Tensor:
        if OTHER in slot:
            return torch.load(io.BytesIO(slot[OTHER]), weights_only=True)
        if INLINE in slot:
            dtype, shape, data = slot[INLINE]
            flat = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
                    else torch.empty(0, dtype=torch.uint8))
            return flat.view(getattr(torch, dtype)).reshape(shape)
        index, dtype, size, stride, offset = slot[TENSOR]
        return torch.empty(0, dtype=getattr(torch, dtype)).set_(
            storages[index], offset, size, stride)

    return map_tree(saved["state"], tensor, lambda v: isinstance(v, dict) and (
        TENSOR in v or OTHER in v or INLINE in v))


def local_shards(state: Any) -> Any:
    """``state`` with every DTensor replaced by a plain dict of its local rows and its
    global shape, stride and placements (a snapshot is resumed on the ranks that took it)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def local(value: Any) -> Any:
        placements = []
        for p in value.placements:
            if not isinstance(p, (Shard, Replicate)):
                raise ValueError(f"memory snapshots cannot keep a DTensor placed as {p}")
            placements.append(["shard", p.dim] if isinstance(p, Shard) else ["replicate"])
        return {MARK: value.to_local(), "shape": list(value.shape),
                "stride": list(value.stride()), "placements": placements}

    found: list = []
    out = map_tree(state, lambda v: found.append(v) or local(v),
                   lambda v: isinstance(v, DTensor))
    return out if found else state


def global_shards(state: Any, mesh: Optional[Any]) -> Any:
    """Undo :func:`local_shards` on ``mesh`` (the model's device mesh)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def rebuilt(value: dict) -> Any:
        if mesh is None:
            raise CheckpointCorrupt("the memory snapshot holds fsdp shards but this run's "
                                    "model is not sharded", "")
        placements = [Shard(int(p[1])) if p[0] == "shard" else Replicate()
                      for p in value["placements"]]
        return DTensor.from_local(value[MARK].to(mesh.device_type), mesh, placements,
                                  run_check=False, shape=torch.Size(value["shape"]),
                                  stride=tuple(value["stride"]))

    return map_tree(state, rebuilt, lambda v: isinstance(v, dict) and MARK in v)
