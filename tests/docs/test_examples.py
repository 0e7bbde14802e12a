"""Every ```python, ```yaml and ```bash block of README.md and docs/ runs, so the docs
cannot drift from the code.

- The blocks of one page share a temporary directory holding a copy of ``examples/``.
  A block whose first line is a file-name comment (``# my_recipe.py``, ``# wine.yaml``)
  is written there under that name before any block of the page runs.
- python: run with this interpreter in that directory, the repository importable.
- yaml: a full config (``module:``, ``data:`` or ``extends:``) is loaded and validated by
  ``sailfin.load_config``; a fragment is parsed, and its ``trainer:`` keys validated.
- bash: run by ``bash -e`` in that directory, the environment's ``sailfin`` first on PATH
  (and as ``.venv/bin/``, where ``make demo`` puts it).
- The blocks of a page run in the page's order, as a reader runs them: a block that trains
  nothing because an earlier one's finished run is in its output directory fails (give
  it its own ``--trainer.output_dir``).
- ``<!-- no-test: why -->`` on the line right before a fence skips the block (a marker
  without a reason fails); ``<!-- slow-test -->`` runs it only under ``-m slow``.
A new page under docs/ is picked up by itself.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RUN = {"python": "python", "py": "python", "yaml": "yaml", "yml": "yaml",
       "bash": "bash", "sh": "bash", "shell": "bash"}
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*(no-test|slow-test)\s*(?::(.*?))?\s*-->\s*$")
FILE_NAME = re.compile(r"^#\s*([\w.-]+(?:/[\w.-]+)*\.(?:py|ya?ml))\s*$")
NOTHING_TRAINED = "sailfin: nothing trained: "  # startup_checks.nothing_to_train
TIMEOUT_S = 180  # a default block: seconds on a quiet machine; this is the hang guard
SLOW_TIMEOUT_S = 900


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str  # "python", "yaml", "bash", or another language (not run)
    code: str
    marker: Optional[str]  # "no-test", "slow-test" or None
    reason: str
    file_name: Optional[str]  # the block's "# NAME.py" first line, if any

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def parse(page: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of a page, and the problems found with its markers."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, problems, i = [], [], 0
    rel = page.relative_to(ROOT)
    while i < len(lines):
        marker = MARKER.match(lines[i])
        if marker and not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
            problems.append(f"{rel}:{i + 1}: a {marker.group(1)} marker must sit on the "
                            "line right before a code fence")
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            line = lines[j]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            j += 1
        prev = MARKER.match(lines[i - 1]) if i > 0 else None
        kind, reason = (prev.group(1), (prev.group(2) or "").strip()) if prev else (None, "")
        if kind == "no-test" and not reason:
            problems.append(f"{rel}:{i}: <!-- no-test --> needs a reason: "
                            "<!-- no-test: why it cannot run here -->")
        code = "\n".join(body) + "\n"
        name = FILE_NAME.match(body[0].strip()) if body and RUN.get(lang) in (
            "python", "yaml") else None
        blocks.append(Block(page, i + 1, RUN.get(lang, lang), code, kind, reason,
                            name.group(1) if name else None))
        i = j + 1
    return blocks, problems


def runnable() -> list:
    params = []
    for page in pages():
        for block in parse(page)[0]:
            if block.lang not in ("python", "yaml", "bash"):
                continue
            marks = []
            if block.marker == "no-test":
                marks.append(pytest.mark.skip(reason=f"no-test: {block.reason}"))
            elif block.marker == "slow-test":
                marks.append(pytest.mark.slow)
            params.append(pytest.param(block, id=f"{block.where}:{block.lang}", marks=marks))
    return params


def test_every_marker_has_a_reason_and_a_fence():
    problems = [p for page in pages() for p in parse(page)[1]]
    assert not problems, "\n".join(problems)


FIXED_TMP = re.compile(r"""["'\s=]/tmp/""")


def test_runnable_blocks_write_only_under_their_page_directory():
    """A block that writes to a fixed /tmp path finds the last run's files there (a
    second run on the same machine then fails on them): write relative paths, which
    land in the page's fresh directory."""
    found = [f"{b.where}: names a fixed /tmp path; use a relative one (e.g. runs/NAME)"
             for page in pages() for b in parse(page)[0]
             if b.lang in ("python", "bash") and b.marker != "no-test"
             and FIXED_TMP.search(b.code)]
    assert not found, "\n".join(found)


def test_the_extractor_finds_the_front_page_examples():
    """The README's recipe (a file-named python block), its config and commands are
    collected to run: a parser that found nothing would pass every page silently."""
    blocks = [b for b in parse(ROOT / "README.md")[0] if b.marker is None]
    assert {"python", "yaml", "bash"} <= {b.lang for b in blocks}
    assert "my_recipe.py" in {b.file_name for b in blocks}


# ---------------------------------------------------------------- one directory per page

_WORKDIRS: dict[Path, Path] = {}


@pytest.fixture(scope="session")
def _docs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("docs-examples")


def workdir(page: Path, root: Path) -> Path:
    """The page's directory: a copy of examples/ and the page's file-named blocks."""
    if page not in _WORKDIRS:
        rel = page.relative_to(ROOT)
        here = root / str(rel).replace("/", "_").replace(".md", "")
        here.mkdir()
        shutil.copytree(ROOT / "examples", here / "examples",
                        ignore=shutil.ignore_patterns("__pycache__", "outputs"))
        # The pages' `.venv/bin/sailfin` (what `make demo` installs) is this environment's.
        (here / ".venv").symlink_to(Path(sys.executable).parent.parent)
        for block in parse(page)[0]:
            if block.file_name and block.marker != "no-test":
                target = here / block.file_name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(block.code, encoding="utf-8")
        _WORKDIRS[page] = here
    return _WORKDIRS[page]


def environment(here: Path) -> dict:
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(here)])
    env["OMP_NUM_THREADS"] = "1"
    env["HOME"] = str(here)  # caches (shards, MLflow) stay in the temporary directory
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def run(cmd: list[str], here: Path, block: Block) -> None:
    limit = SLOW_TIMEOUT_S if block.marker == "slow-test" else TIMEOUT_S
    try:
        done = subprocess.run(cmd, cwd=here, env=environment(here), capture_output=True,
                              text=True, timeout=limit, start_new_session=True)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where}: the {block.lang} block ran past {limit} s; shorten "
                    "it (e.g. --trainer.max_steps 2) or mark it <!-- slow-test -->")
    assert done.returncode == 0, (
        f"{block.where}: the {block.lang} block exited {done.returncode}\n--- block\n"
        f"{block.code}--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}")
    assert NOTHING_TRAINED not in done.stderr, (
        f"{block.where}: the {block.lang} block trained nothing: an earlier block's finished "
        f"run is in its output directory; give it its own --trainer.output_dir\n"
        f"{done.stderr[-2000:]}")


def check_yaml(block: Block, here: Path) -> None:
    import sailfin

    raw = yaml.safe_load(block.code)
    if not isinstance(raw, dict):
        return  # a scalar or list example: parsing it is all there is
    if {"module", "data", "extends"} & set(raw):
        path = here / (block.file_name or f"_block_{block.line}.yaml")
        if not block.file_name:
            path.write_text(block.code, encoding="utf-8")
        sailfin.load_config(path)
    elif "trainer" in raw:
        path = here / f"_fragment_{block.line}.yaml"
        path.write_text(yaml.safe_dump({"trainer": raw["trainer"]}), encoding="utf-8")
        sailfin.load_config(path)


def used_later(block: Block) -> bool:
    """A file-named module (``# my_recipe.py``) that the page's other blocks name (a
    config's class_path, then a command that trains it) runs there; running it alone too
    would only cost a torch import."""
    stem = Path(block.file_name).stem
    return any(other is not block and other.marker != "no-test" and stem in other.code
               for other in parse(block.page)[0] if other.lang in ("python", "yaml", "bash"))


@pytest.mark.parametrize("block", runnable())
def test_example(block: Block, _docs_root: Path):
    here = workdir(block.page, _docs_root)
    if block.lang == "yaml":
        check_yaml(block, here)
    elif block.lang == "python":
        if block.file_name and used_later(block):
            pytest.skip(f"{block.file_name} is written for the page's other blocks, which run it")
        script = here / (block.file_name or f"_block_{block.line}.py")
        if not block.file_name:
            script.write_text(block.code, encoding="utf-8")
        run([sys.executable, str(script)], here, block)
    else:
        sailfin = Path(sys.executable).parent / "sailfin"
        assert sailfin.exists(), (f"no sailfin entry point beside {sys.executable}: "
                                  "install the package (pip install -e .)")
        run(["bash", "-e", "-c", block.code], here, block)


def test_a_block_that_trains_nothing_fails(tmp_path):
    """A command or snippet reusing an earlier block's finished run trained nothing and
    passed (a snippet, in-process, ends without error): the runner fails it."""
    code = ("from sailfin import Trainer\n"
            "from tests.recipes import IdData, LinearRecipe, args\n"
            "for _ in range(2):\n"
            "    Trainer(LinearRecipe(IdData(20, 0)), args('runs/again', progress='none'))"
            ".train()\n")
    (tmp_path / "again.py").write_text(code)
    block = Block(ROOT / "README.md", 1, "python", code, None, "", None)
    with pytest.raises(AssertionError, match="trained nothing: an earlier block's finished"):
        run([sys.executable, str(tmp_path / "again.py")], tmp_path, block)
