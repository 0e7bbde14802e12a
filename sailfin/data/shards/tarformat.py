"""Just enough of the POSIX tar format: write member headers, scan headers back.

Reading a sample never parses tar (the index gives byte offsets): this is used to
index a tar that came without an index and to write headers. Not ``tarfile``:
indexing needs only (name, data offset, size), and must name the byte offset of a
damaged header (``tarfile`` takes one after the first for the end of the archive).
"""

from __future__ import annotations

import os
import tarfile
from dataclasses import dataclass
from typing import Iterator, Optional

BLOCK = 512
_REGULAR = (b"0", b"\0", b"7")  # regular file, old regular file, contiguous file


class TarFormatError(ValueError):
    """A header that is not tar; ``offset`` is the header's byte offset."""

    def __init__(self, message: str, offset: int = -1) -> None:
        super().__init__(message)
        self.offset = offset


@dataclass(frozen=True)
class Member:
    name: str
    offset: int  # byte offset of the member's data (past its header)
    size: int
    crc32: Optional[int] = None  # zlib.crc32 of the data, when the writer computed it


def header(name: str, size: int) -> bytes:
    """The header block(s) of a regular file member (PAX records for long names)."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o444
    info.mtime = 0  # a fixed time: the same samples give byte-identical shards
    return info.tobuf(tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape")


def padding(size: int) -> bytes:
    """Zero bytes that fill a member's data out to a whole block."""
    return b"\0" * (-size % BLOCK)


END_OF_ARCHIVE = b"\0" * (2 * BLOCK)


def scan(fd: int, file_size: int) -> Iterator[Member]:
    """Regular-file members of the tar open at ``fd``, in file order.

    Raises :class:`TarFormatError` naming the offset of a damaged header or of
    data that runs past the end of the file (a truncated shard).
    """
    offset = 0
    long_name: Optional[str] = None
    pax: dict[str, str] = {}
    while offset + BLOCK <= file_size:
        block = os.pread(fd, BLOCK, offset)
        if len(block) < BLOCK:
            raise TarFormatError(f"file ends inside the header at byte {offset}", offset)
        if block == b"\0" * BLOCK:
            return  # end-of-archive marker
        _check_checksum(block, offset)
        size = _number(block[124:136], offset)
        kind = block[156:157]
        data = offset + BLOCK
        if data + size > file_size:
            raise TarFormatError(
                f"member at byte {offset} claims {size} bytes but the file ends at byte "
                f"{file_size} (truncated shard)", offset)
        if kind == b"x":  # PAX extended header: applies to the next member
            pax = _pax_records(os.pread(fd, size, data), offset)
        elif kind == b"L":  # GNU long name: applies to the next member
            long_name = os.pread(fd, size, data).rstrip(b"\0").decode("utf-8", "surrogateescape")
        elif kind in _REGULAR:
            name = pax.get("path") or long_name or _name(block)
            size = int(pax.get("size", size))
            yield Member(name, data, size)
            long_name, pax = None, {}
        else:  # directories, links, global PAX headers: no sample data
            long_name, pax = None, {}
        offset = data + size + (-size % BLOCK)
    if offset < file_size:
        raise TarFormatError(f"file ends inside the header at byte {offset} (truncated shard)",
                             offset)


def _name(block: bytes) -> str:
    name = block[0:100].split(b"\0", 1)[0]
    if block[257:262] == b"ustar":
        prefix = block[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")


def _number(field: bytes, offset: int) -> int:
    if field[0] & 0x80:  # GNU base-256 for sizes of 8 GiB and more
        value = int.from_bytes(field[1:], "big")
        return value - (1 << (8 * len(field) - 1)) if field[0] & 0x40 else value
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise TarFormatError(f"header at byte {offset} has a bad size field {field!r}",
                             offset) from None


def _check_checksum(block: bytes, offset: int) -> None:
    stored = _number(block[148:156], offset)
    unsigned = sum(block[:148]) + 8 * 32 + sum(block[156:])
    if stored != unsigned:
        signed = sum(b - 256 if b > 127 else b for b in block[:148] + block[156:]) + 8 * 32
        if stored != signed:
            raise TarFormatError(
                f"header at byte {offset} has a bad checksum (not a tar file, or damaged)",
                offset)


def _pax_records(data: bytes, offset: int) -> dict[str, str]:
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos:pos + 1] != b"\0":
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError:
            raise TarFormatError(f"PAX header at byte {offset} is malformed", offset) from None
        key, _, value = data[space + 1:pos + length - 1].partition(b"=")
        records[key.decode("utf-8")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records
