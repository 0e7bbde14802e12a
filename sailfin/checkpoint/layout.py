"""The default checkpointer's directory: names, pointers, and tidying after a kill
(writing and reading files is :mod:`.checkpointer`'s)."""

from __future__ import annotations

import contextlib
import os
import re
import stat
from typing import Any, Optional

from ..utils.voice import say
from . import manifest as manifests
from .errors import CheckpointCorrupt, CheckpointError
from .serialize import read_checked

_STEP = re.compile(r"^step-(\d+)$")
_LEFTOVER = re.compile(r"^\.(?:tmp|old)-step-(\d+)")
# A save killed between its renames can leave a complete checkpoint under either name.
_RENAMED = re.compile(r"^\.(tmp|old)-(step-\d+)$")
_POINTER_TMP = re.compile(r"^(?:latest|best)\.tmp-\d+$")
_POINTER_BYTES = 4096  # "step-00000120\n"; anything larger is not a pointer


class DirectoryLayout:
    """The names in a checkpoint directory (``storage`` at ``root``), for every rank (the
    directory side of :class:`.checkpointer.DirectoryCheckpointer`)."""

    storage: Any
    root: str
    args: Any
    dist: Any
    barrier: Any
    wait: Any  # the checkpointer's: a background save finishes

    @staticmethod
    def name_for(step: int) -> str:
        return f"step-{step:08d}"

    def path(self, *parts: str) -> str:
        return self.storage.join(self.root, *parts)

    def complete(self) -> list[tuple[int, str]]:
        """(step, name) of every checkpoint with a manifest, oldest first."""
        return [(step, name) for step, name in self._steps() if self._has_manifest(name)]

    def _steps(self) -> list[tuple[int, str]]:
        """(step, name) of every ``step-*`` directory (links left out), oldest first."""
        return sorted((int(match.group(1)), entry) for entry in self.storage.listdir(self.root)
                      if (match := _STEP.match(entry)) and not self._a_link(entry))

    def _has_manifest(self, name: str) -> bool:
        """Whether ``name`` holds a manifest in any form (a damaged one, a link loop, is
        still there: loading it says what is wrong)."""
        path = self.path(name, manifests.MANIFEST)
        local = self.storage.local_path(path)
        return os.path.lexists(local) if local is not None else self.storage.exists(path)

    def _a_link(self, entry: str) -> bool:
        """A ``step-*`` entry that is a symbolic link: sailfin never makes one, and what it
        points at (perhaps outside this directory) is not this run's checkpoint."""
        local = self.storage.local_path(self.path(entry))
        if local is None or not os.path.islink(local):
            return False
        said = self.__dict__.setdefault("_links_said", set())
        if entry not in said:
            said.add(entry)
            say(f"checkpoint {local} is a symbolic link (to {os.readlink(local)}), not a "
                "checkpoint sailfin saved here: it is not resumed; remove it", warning=True)
        return True

    def pointer(self, which: str) -> Optional[str]:
        """The checkpoint ``latest`` or ``best`` names, if it is complete."""
        path = self.path(which)
        try:
            name = read_checked(self.storage, path, self.storage.display(path),
                                what="checkpoint pointer", limit=_POINTER_BYTES,
                                within=self.root).decode("utf-8").strip()
        except (FileNotFoundError, UnicodeDecodeError, CheckpointCorrupt):
            return None  # not a pointer sailfin wrote: recover() says so and replaces it
        if _STEP.match(name) and not self._a_link(name) and self._has_manifest(name):
            return name
        return None

    def latest(self) -> Optional[str]:
        complete = self.complete()
        return self.pointer("latest") or (complete[-1][1] if complete else None)

    def candidates(self) -> list[str]:
        """Newest first; where saves are renamed into place, a ``step-*`` directory without
        a manifest too: there it is damage (a save in progress is ``.tmp-``), and
        loading it names it."""
        steps = self._steps() if self.storage.atomic_rename else self.complete()
        names = [name for _, name in reversed(steps)]
        pointed = self.pointer("latest")
        if pointed is not None:
            names.remove(pointed)
            names.insert(0, pointed)
        return names

    def recover(self) -> None:
        """Rank 0 renames complete checkpoints that a kill left under ``.tmp-``/``.old-``
        names back into place, and moves ``latest`` to a checkpoint committed after it
        was last written (a kill between the rename and the pointer). Then all ranks wait."""
        if self.dist.is_main:
            self._clear_bad_pointers()
            entries = self.storage.listdir(self.root)
            for entry in filter(_POINTER_TMP.match, entries):
                self.storage.remove(self.path(entry))
            # .tmp- holds the newer save of a step, .old- the one it was replacing: tmp first.
            renamed = sorted((m.group(1) == "old", entry, m.group(2)) for entry in entries
                             if (m := _RENAMED.match(entry)))
            for is_old, entry, name in renamed:
                if not self.storage.exists(self.path(entry, manifests.MANIFEST)):
                    continue  # unfinished: retain() removes it after the next save
                if self.storage.exists(self.path(name, manifests.MANIFEST)):
                    if not is_old:  # stopped before replacing the step: finish
                        self.move_into_place(self.path(entry), name)
                    continue
                self.storage.remove_tree(self.path(name))
                self.storage.rename_dir(self.path(entry), self.path(name))
                say(f"recovered checkpoint {self.storage.display(self.path(name))} "
                    f"from {entry} (a save was stopped between its renames)")
            self._catch_up_latest()
        self.barrier()

    def move_into_place(self, staging: str, name: str) -> None:
        """Rename ``staging`` to ``name``; an older save of that step (a run resumed before
        it) goes aside to ``.old-`` first and is removed last."""
        final = self.path(name)
        if not self.storage.exists(final):
            self.storage.rename_dir(staging, final)
            return
        old = self.path(f".old-{name}")
        self.storage.remove_tree(old)
        self.storage.rename_dir(final, old)
        self.storage.rename_dir(staging, final)
        self.storage.remove_tree(old)

    def _clear_bad_pointers(self) -> None:
        """``latest`` or ``best`` that is not a small regular file (a directory, a pipe, a
        link elsewhere) is ignored when reading; it goes before a save must replace it. A
        directory with something in it is the user's: then stop and say so."""
        local = self.storage.local_path(self.root)
        for which in ("latest", "best") if local is not None else ():
            path = os.path.join(local, which)
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(info.st_mode) and info.st_size <= _POINTER_BYTES:
                continue
            if stat.S_ISDIR(info.st_mode):
                try:
                    os.rmdir(path)
                except OSError:
                    raise CheckpointError(
                        f"{path} is a directory with files in it, where sailfin keeps the "
                        f"name of the {which} checkpoint; move it out of {local}") from None
            elif not stat.S_ISREG(info.st_mode):
                os.remove(path)  # a link or a pipe: only the name goes, not what it points to
            else:
                continue  # an oversized regular file: ignored, replaced by the next save
            say(f"removed {path}: it was not the pointer file sailfin writes; the "
                f"{which} checkpoint is found from the step-* directories", warning=True)

    def _catch_up_latest(self) -> None:
        complete = self.complete()
        if not complete:
            return
        newest = complete[-1][1]
        pointed = self.pointer("latest")
        if pointed is None or pointed == newest:
            return
        # A newer checkpoint is normal after resuming from an older one on purpose; only
        # one committed after ``latest`` was written was cut off before its pointer.
        written = self.storage.mtime(self.path("latest"))
        committed = self.storage.mtime(self.path(newest, manifests.MANIFEST))
        if written is not None and committed is not None and committed > written:
            self.storage.write_bytes(self.path("latest"), f"{newest}\n".encode())
            say(f"latest now names {newest}: its save was stopped before it moved the pointer")

    def abort(self) -> None:
        # Every rank that saw the save fail removes what it finds (its own files, where
        # each node has a directory of its own); on shared storage the removals overlap
        # harmlessly (remove_tree ignores what another rank removed first).
        with contextlib.suppress(CheckpointError):  # the failure being handled, or the same
            self.wait()  # a background save still writing would re-create what goes
        for entry in self.storage.listdir(self.root):
            if ((_LEFTOVER.match(entry) or _STEP.match(entry))
                    and not self.storage.exists(self.path(entry, manifests.MANIFEST))):
                self.storage.remove_tree(self.path(entry))  # the failed save's partial files

    def retain(self) -> None:
        """Delete all but the newest ``keep_last``, the best and what ``latest`` names, and
        what killed saves left behind once a newer save completed."""
        complete = self.complete()
        if not complete:
            return
        newest, names = complete[-1][0], [name for _, name in complete]
        keep = set(names if self.args.keep_last is None else names[-self.args.keep_last:])
        keep |= {p for p in (self.pointer("latest"), self.pointer("best")) if p}
        for name in names:
            if name not in keep:
                self.storage.remove_tree(self.path(name))
        for entry in self.storage.listdir(self.root):
            match = _LEFTOVER.match(entry) or _STEP.match(entry)
            if match and entry not in names and int(match.group(1)) < newest:
                self.storage.remove_tree(self.path(entry))  # an unfinished, superseded save
