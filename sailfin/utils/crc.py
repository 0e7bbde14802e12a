"""CRC-32 with zlib's polynomial, at memory speed where the machine allows.

Checkpoint manifests, memory snapshots and shard members carry ``zlib.crc32``'s
values. zlib computes them at about 2 GB/s; ISA-L (the ``isal`` package, a dependency
where it ships wheels) at 20 GB/s or more, with the same values. Both release the GIL.

Example::

    from sailfin.utils.crc import crc32
    value = crc32(b"abc")              # == zlib.crc32(b"abc")
    value = crc32(b"def", value)       # chained, as zlib.crc32(data, value)
"""

from __future__ import annotations

#: ``crc32(data, value=0)``: ``zlib.crc32``'s value, from the fastest implementation
#: installed (:data:`IMPLEMENTATION` names it). A plain alias: no call of ours in between.
try:
    from isal.isal_zlib import crc32  # ISA-L: the same CRC-32, vectorised
    IMPLEMENTATION = "isal"
except ImportError:  # a platform without its wheels: zlib's own
    from zlib import crc32
    IMPLEMENTATION = "zlib"


__all__ = ["IMPLEMENTATION", "crc32"]
