"""An earlier sailfin in the same rounds (overhead.py ``--against REV``).

The rev is checked out into a temporary git worktree (removed at the end); each of its
runs is a child process that imports sailfin from there (``PYTHONPATH``, with
:data:`FROM_PYTHONPATH` set so the benchmark does not put this tree first) and prints
one :data:`RESULT` line of JSON. This tree's sailfin runs the same way beside it, so the
two differ in the library only, never in process age or warm caches.

    with checkout("8132136") as tree:
        earlier = run_child([sys.executable, "overhead.py", "--child-time", "sailfin", "3000"],
                            tree)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from typing import Any, Iterator, Sequence

FROM_PYTHONPATH = "SAILFIN_BENCH_FROM_PYTHONPATH"  # set: import sailfin as PYTHONPATH says
RESULT = "OVERHEAD_CHILD_RESULT "
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def checkout(rev: str, repo: str = REPO) -> Iterator[str]:
    """A detached worktree of ``rev`` (any git rev: a commit, a tag, ``HEAD~3``)."""
    tmp = tempfile.mkdtemp(prefix="sailfin-against-")
    tree = os.path.join(tmp, "tree")
    done = subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", tree, rev],
                          capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"--against {rev}: git could not check it out: "
                         f"{done.stderr.strip()}")
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", tree],
                       capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def run_child(command: Sequence[str], tree: str) -> dict[str, Any]:
    """Run ``command`` importing sailfin from ``tree``; its RESULT line, read as JSON
    (it must name a sailfin from ``tree``)."""
    env = {**os.environ, "PYTHONPATH": tree, FROM_PYTHONPATH: "1"}
    # (run in the tree: a script given with -c finds the current directory's modules first)
    done = subprocess.run(list(command), env=env, capture_output=True, text=True, cwd=tree)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"a child run with sailfin from {tree} failed (exit "
                         f"{done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1][len(RESULT):])
    if not os.path.realpath(result["sailfin"]).startswith(os.path.realpath(tree) + os.sep):
        raise SystemExit(f"the child imported sailfin from {result['sailfin']}, not {tree}")
    return result


def say_result(result: dict[str, Any]) -> None:
    """What a child prints last: ``RESULT {json}`` (see :func:`run_child`)."""
    import sailfin

    print(RESULT + json.dumps({**result, "sailfin": sailfin.__file__}), flush=True)
