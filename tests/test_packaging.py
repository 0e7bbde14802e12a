"""What the README says installing brings, and the wheel its build command makes."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.pyproject_toml import project

ROOT = Path(__file__).resolve().parents[1]


def direct_dependencies() -> list[str]:
    return [re.match(r"[A-Za-z0-9_.-]+", req).group() for req in project()["dependencies"]]


def test_the_readme_names_the_dependencies_pip_install_brings():
    """It said "five dependencies" where pip brings torch's too (on Linux from PyPI, the
    CUDA build's ~20 packages): the README names the five, says theirs come along, and
    how to take the CPU wheel first."""
    text = (ROOT / "README.md").read_text()
    said = re.search(r"`pip install \.` brings sailfin's (\w+) dependencies \(([^)]*)\)",
                     re.sub(r"\s+", " ", text))
    assert said, "the README no longer says what `pip install .` brings"
    names = [n.strip() for n in said.group(2).split(",")]
    assert sorted(n.lower() for n in names) == sorted(d.lower() for d in direct_dependencies())
    assert said.group(1) == {5: "five", 6: "six", 4: "four"}[len(names)]
    assert ("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
            in text)


@pytest.mark.slow
def test_the_documented_wheel_command_builds_an_installable_wheel(tmp_path):
    """`pip wheel . --no-deps -w dist`, as the README gives it (pip fetches setuptools into
    its build environment), in a copy of the checkout."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "sailfin", src / "sailfin",
                    ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-w",
                           "dist"], cwd=src, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [wheel] = (src / "dist").glob("sailfin-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry = next(n for n in names if n.endswith("entry_points.txt"))
        metadata = zf.read(next(n for n in names if n.endswith("METADATA"))).decode()
        assert "sailfin = sailfin.__main__:run" in zf.read(entry).decode()
    assert "sailfin/cli.py" in names and not any(n.startswith("tests/") for n in names)
    required = [line.split(":", 1)[1].strip() for line in metadata.splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert sorted(re.match(r"[A-Za-z0-9_.-]+", r).group().lower() for r in required) == \
        sorted(d.lower() for d in direct_dependencies())
