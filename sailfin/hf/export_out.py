"""Where ``sailfin export SOURCE OUT`` reads and writes: SOURCE's ``latest`` and ``best``
pointers followed and a run's output directory taken as its final model; OUT checked
before anything is built, so that an export never deletes what it did not write.

OUT may be absent, or an earlier export (a directory holding only what an export wrote,
listed in its :data:`MARK` file). Anything else is refused in one line: an existing
directory of other files, a file, a symbolic link (dangling or not), a FIFO or device
(never opened: nothing hangs), the working directory, and any path inside the run or
the checkpoint, or holding either.

Example::

    source = resolve_source("outputs/run/checkpoints/best")   # the checkpoint it names
    out = check_out("exported", source)                     # raises HFConfigError if not
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
from typing import Optional

from .errors import HFConfigError

MARK = ".sailfin-export.json"
"""The file in an export that lists what the export wrote (a re-export replaces only such
a directory, and only while nothing else was added to it)."""
_POINTERS = ("latest", "best")


@dataclasses.dataclass(frozen=True)
class Source:
    """What to export: ``checkpoint`` (a checkpoint, or a directory of them: its latest),
    or ``final`` (a run's ``final/hf``); ``protected``: the local directories OUT must
    stay out of (the checkpoint, its directory, the run)."""

    given: str
    checkpoint: Optional[str] = None
    final: Optional[str] = None
    protected: tuple[str, ...] = ()


def resolve_source(path: str) -> Source:
    """``checkpoints/latest`` or ``checkpoints/best``: the checkpoint it names; a run's
    output directory (it holds ``checkpoints/`` or ``final/``, no ``manifest.json``): its
    final model, ``final/hf``; anything else: ``path`` as a checkpoint."""
    if "://" in path:  # a URL: read as a checkpoint, nothing local to protect
        return Source(path, checkpoint=path)
    local = os.path.realpath(path)
    if os.path.basename(local) in _POINTERS and os.path.isfile(local):
        return Source(path, checkpoint=_pointed(path, local),
                      protected=_run_of(os.path.dirname(local)))
    if os.path.isdir(local) and not os.path.exists(os.path.join(local, "manifest.json")) \
            and any(os.path.isdir(os.path.join(local, d)) for d in ("checkpoints", "final")):
        return Source(path, final=_final_of(path, local), protected=(local,))
    if os.path.exists(os.path.join(local, "manifest.json")):  # a checkpoint, and its run
        return Source(path, checkpoint=path,
                      protected=(local, *_run_of(os.path.dirname(local))))
    if os.path.isdir(local):  # a directory of checkpoints: its latest
        return Source(path, checkpoint=path, protected=_run_of(local))
    return Source(path, checkpoint=path)


def _run_of(store: str) -> tuple[str, ...]:
    """A directory of checkpoints and, when it is a run's ``checkpoints/``, the run."""
    if os.path.basename(store) == "checkpoints":
        return (store, os.path.dirname(store))
    return (store,)


def _pointed(given: str, local: str) -> str:
    """The checkpoint a ``latest``/``best`` pointer names, read as resume reads it."""
    from ..checkpoint.checkpointer import DirectoryCheckpointer
    from ..config.checkpoint import CheckpointArguments
    from ..distributed import DistEnv

    store = os.path.dirname(local)
    layout = DirectoryCheckpointer(store, CheckpointArguments(), DistEnv())
    name = layout.pointer(os.path.basename(local))
    if name is None:
        latest = layout.latest()
        advice = (f"export the latest complete one: sailfin export "
                  f"{os.path.dirname(given) or '.'} OUT" if latest
                  else "the directory holds no complete checkpoint")
        raise HFConfigError(f"{given} names no complete checkpoint; {advice}")
    return os.path.join(os.path.dirname(given), name)


def _final_of(given: str, local: str) -> str:
    """A run's final model, ``final/hf`` (written when training ended)."""
    final = os.path.join(local, "final", "hf")
    if os.path.isdir(final) and not os.path.islink(final) and any(
            os.path.isfile(os.path.join(final, f))
            for f in ("config.json", "adapter_config.json")):
        return final
    checkpoints = os.path.join(given, "checkpoints")
    has = os.path.isdir(checkpoints) and any(
        n.startswith("step-") and os.path.exists(os.path.join(checkpoints, n, "manifest.json"))
        for n in os.listdir(checkpoints))
    advice = (f"export its latest checkpoint instead: sailfin export {checkpoints} OUT"
              if has else "and no checkpoint either")
    raise HFConfigError(f"{given} is a run's output directory without a final model "
                        f"(final/hf: the run has not finished, or its recipe is not a "
                        f"sailfin.hf module); {advice}")


def check_out(out_dir: str, source: Source) -> str:
    """``out_dir`` (normalised) if an export may write it; else :class:`HFConfigError`
    naming what is there. Nothing is opened: a FIFO or device is only looked at."""
    if not out_dir.strip():
        raise HFConfigError("OUT is empty: give the directory to write")
    out = os.path.normpath(out_dir)
    real = os.path.realpath(out)
    cwd = os.path.realpath(os.getcwd())
    if _within(cwd, real):
        raise HFConfigError(f"OUT {out_dir} is the working directory or holds it; give a "
                            "new directory's name")
    for kept in map(os.path.realpath, source.protected):
        if _within(real, kept) or _within(kept, real):
            what = "the checkpoint or the run it belongs to" if source.final is None \
                else "the run"
            raise HFConfigError(f"OUT {out_dir} is inside {what} ({kept}) or holds it; an "
                                "export replaces OUT whole: give a directory outside it")
    try:
        info = os.lstat(out)
    except FileNotFoundError:
        return out
    except OSError as exc:
        raise HFConfigError(f"OUT {out_dir} cannot be looked at: {exc}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise HFConfigError(f"OUT {out_dir} exists and is {_kind(info.st_mode)}; an export "
                            "writes a new directory (or replaces an earlier export): give "
                            "another name, or move it away")
    others = _not_written_by_an_export(out)
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3
                                          else "")
        raise HFConfigError(f"OUT {out_dir} exists and holds what no export wrote ({shown}); "
                            "an export replaces OUT whole: give a new directory's name, or "
                            "move it away")
    return out


def _within(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or inside it (both real paths)."""
    try:
        return os.path.commonpath([path, folder]) == folder
    except ValueError:  # different drives
        return False


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISREG, "a file"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a directory"


def _not_written_by_an_export(out: str) -> list[str]:
    """The entries of ``out`` its :data:`MARK` does not list (every one, without a mark)."""
    names = sorted(os.listdir(out))
    try:
        with open(os.path.join(out, MARK), "rb") as fh:  # a file: checked by the listing
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return names
            written = set(json.loads(fh.read(1 << 20))["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return names
    return [n for n in names if n != MARK and n not in written]


def write_mark(directory: str, source: Source) -> None:
    """List what the export wrote in ``directory`` (before it is renamed into place)."""
    files = sorted(os.listdir(directory))
    with open(os.path.join(directory, MARK), "w") as fh:
        json.dump({"exported_from": os.path.abspath(source.given), "files": files}, fh,
                  indent=1)


def remove(path: str) -> None:
    """Remove ``path`` whatever it is, without opening it: a directory tree, or a file,
    link or FIFO (``shutil.rmtree`` opens its argument, and an open FIFO blocks)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        os.unlink(path)


def copy_final(final: str, tmp: str) -> None:
    """Copy a run's ``final/hf`` files into ``tmp`` (regular files only)."""
    os.makedirs(tmp)
    for entry in os.scandir(final):
        if not entry.is_file(follow_symlinks=False):
            raise HFConfigError(f"{entry.path} is not a file that final/hf's export wrote; "
                                "move it away and export again")
        shutil.copy2(entry.path, os.path.join(tmp, entry.name))
