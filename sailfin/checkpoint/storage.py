"""Where checkpoint files live: a local directory (files fsynced, directories renamed into
place), or any fsspec URL (no rename: a checkpoint is complete when its manifest exists).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
from typing import BinaryIO, Iterator, Optional

from ..config.checkpoint import is_url
from ..utils.files import fsync_dir, replace_file


class Storage:
    """The few file operations checkpoints need. Paths are strings this storage made;
    ``write_bytes`` replaces a file in one step, ``listdir`` of a missing path is empty."""

    atomic_rename: bool = False

    def join(self, *parts: str) -> str: ...
    def write_bytes(self, path: str, data: bytes) -> None: ...
    def open_read(self, path: str) -> contextlib.AbstractContextManager[BinaryIO]: ...
    def exists(self, path: str) -> bool: ...
    def size(self, path: str) -> int: ...
    def listdir(self, path: str) -> list[str]: ...
    def makedirs(self, path: str) -> None: ...
    def remove(self, path: str) -> None: ...
    def remove_tree(self, path: str) -> None: ...

    def display(self, path: str) -> str:
        """The path as the user would write it (for messages)."""
        return path

    def local_path(self, path: str) -> Optional[str]:
        """The OS path of ``path`` if it is a local file, else None."""
        return None

    def mtime(self, path: str) -> Optional[float]:
        """When ``path`` was last written (seconds), or None when the storage cannot say."""
        return None

    def rename_dir(self, src: str, dst: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot rename directories")


class LocalStorage(Storage):
    """A local (or mounted shared) directory."""

    atomic_rename = True

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def write_bytes(self, path: str, data: bytes) -> None:
        replace_file(path, data)

    def open_read(self, path: str) -> contextlib.AbstractContextManager[BinaryIO]:
        return open(path, "rb")

    def local_path(self, path: str) -> Optional[str]:
        return path

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def mtime(self, path: str) -> Optional[float]:
        try:
            return os.stat(path).st_mtime_ns / 1e9
        except FileNotFoundError:
            return None

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def rename_dir(self, src: str, dst: str) -> None:
        os.rename(src, dst)
        fsync_dir(os.path.dirname(dst))  # the rename itself survives a power cut

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)


class FsspecStorage(Storage):
    """Any fsspec file system: ``s3://``, ``gs://``, ``az://``, ``memory://``..."""

    def __init__(self, url: str, storage_options: Optional[dict] = None) -> None:
        try:
            import fsspec
        except ImportError:
            raise ImportError(f"checkpoint dir {url!r} is a URL, which needs fsspec: "
                              "pip install 'sailfin[remote]'") from None
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except ImportError as exc:  # the protocol's own package (s3fs, gcsfs...) is missing
            raise ImportError(f"checkpoint dir {url!r}: {exc}. For s3:// install "
                              "'sailfin[remote]'; other stores need their fsspec package "
                              "(gcsfs, adlfs...)") from None

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    def display(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    def write_bytes(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)  # one PUT: the object is replaced whole

    def open_read(self, path: str) -> contextlib.AbstractContextManager[BinaryIO]:
        return self.fs.open(path, "rb")

    # Some file systems (s3fs) cache what they saw; another rank or process may have
    # written since, so each question goes to the store.
    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return self.fs.exists(path)

    def size(self, path: str) -> int:
        self.fs.invalidate_cache(path)
        return int(self.fs.size(path))

    def listdir(self, path: str) -> list[str]:
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def remove_tree(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)
        self.fs.invalidate_cache(path)


def open_storage(location: str, storage_options: Optional[dict] = None) -> tuple[Storage, str]:
    """The storage for a directory or URL, and the root path inside it."""
    if is_url(location):
        storage = FsspecStorage(location, storage_options)
        return storage, storage.root.rstrip("/")
    if location.startswith("file://"):
        location = location[len("file://"):]
    return LocalStorage(), os.path.abspath(location)

