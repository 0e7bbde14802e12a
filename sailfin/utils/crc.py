"""CRC-32 with zlib's polynomial, at memory speed where the machine allows.

Every checkpoint file's manifest entry, every memory snapshot and every shard
member carries a CRC-32 (``zlib.crc32``'s polynomial and values). zlib's own
implementation runs at about 2 GB/s; ISA-L's (the ``isal`` package, a sailfin
dependency where it ships wheels) uses the processor's carry-less multiply and
runs at 20 GB/s or more, with the same values: files written with either are
read with either. Both release the GIL on large buffers.

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
