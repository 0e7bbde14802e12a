"""A config file written to hurt: alias bombs, code tags, pipes and devices. Each ends in
one line naming the file, fast, and nothing hangs or prints a whole value."""

import os
import subprocess
import sys
import time

import pytest

from sailfin.config import ConfigError, load_config
from sailfin.config.coerce import coerce
from sailfin.config.limits import CONFIG_MAX_BYTES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def laughs(indent: str, levels: int = 9, item: str = "l{i}: ") -> str:
    """A "billion laughs": 9 lines of YAML that expand to 9**9 strings (mapping entries
    ``l0: ...`` or, with ``item="- "``, list items)."""
    lines = [f'{indent}{item.format(i=0)}&l0 ["lol","lol","lol","lol","lol","lol","lol","lol",'
             '"lol"]']
    lines += [f"{indent}{item.format(i=i)}&l{i} [{', '.join([f'*l{i - 1}'] * 9)}]"
              for i in range(1, levels)]
    return "\n".join(lines) + "\n"


BOMBS = {"module.init_args": ("module:\n  class_path: tests.recipes.LinearRecipe\n"
                              "  init_args:\n" + laughs("    "))}
BOMBS["trainer.writers"] = ("module: {class_path: tests.recipes.LinearRecipe}\n"
                            "trainer:\n  writers:\n" + laughs("    ", item="- "))


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


def sailfin_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "sailfin", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.parametrize("where", sorted(BOMBS))
def test_an_alias_bomb_is_one_line_and_fast(tmp_path, where):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMBS[where])
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert time.perf_counter() - start < 5  # unbounded, this expands 387 million strings
    message = str(err.value)
    assert "\n" not in message and len(message) < 400
    assert f"config file {path} takes more than" in message
    for extra in ([], ["--print-config"]):
        line = one_line_error(sailfin_cli("train", str(path), *extra))
        assert f"takes more than {CONFIG_MAX_BYTES // 2**20} MiB written out (its YAML aliases" in line


def test_an_alias_bomb_on_the_command_line_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("module:\n  class_path: tests.recipes.LinearRecipe\n")
    value = "{" + laughs("").strip().replace("\n", ", ") + "}"
    with pytest.raises(ConfigError, match=r"^override value .* takes more than .* MiB written out"):
        load_config(path, ["--module.init_args.x", value])


def test_too_many_aliases_are_refused(tmp_path):
    path = tmp_path / "many.yaml"
    path.write_text("a: &a 1\nb: [" + ", ".join(["*a"] * 1001) + "]\n")
    with pytest.raises(ConfigError, match="uses YAML aliases .* 1001 times, more than 1000"):
        load_config(path)


def test_a_few_aliases_still_work(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("module:\n  class_path: tests.recipes.LinearRecipe\n"
                    "  init_args: &args {lr: 0.25}\ntrainer: {seed: 3}\n")
    assert load_config(path).module.init_args == {"lr": 0.25}


def test_a_wrong_value_is_named_in_a_bounded_repr():
    huge = ["x" * 1000] * 100_000  # what an alias bomb hands coerce, as one shared list
    with pytest.raises(ConfigError) as err:
        coerce({"a": huge}, int, "trainer.epochs")
    assert len(str(err.value)) < 300 and "trainer.epochs" in str(err.value)
    with pytest.raises(ConfigError) as err:
        coerce("y" * 10**6, bool, "trainer.drop_last")
    assert len(str(err.value)) < 300


def test_a_python_tag_is_refused_in_one_line(tmp_path):
    path = tmp_path / "tag.yaml"
    marker = tmp_path / "ran"
    path.write_text(f'module:\n  class_path: !!python/object/apply:os.system ["touch {marker}"]\n')
    line = one_line_error(sailfin_cli("train", str(path)))
    assert f"config file {path} is not valid YAML" in line
    assert "python/object/apply:os.system" in line and "remove the tag" in line
    assert "line 2, column 15" in line and not marker.exists()


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_extends_naming_a_pipe_or_device_says_what_it_is(tmp_path, kind):
    if kind == "fifo":
        base = tmp_path / "base.yaml"
        os.mkfifo(base)
        expected = "is a FIFO (named pipe), not a regular file"
    else:
        base = kind
        expected = "is a character device, not a regular file"
    path = tmp_path / "run.yaml"
    path.write_text(f"extends: {base}\nmodule: {{class_path: tests.recipes.LinearRecipe}}\n")
    line = one_line_error(sailfin_cli("train", str(path), timeout=30))
    assert f"config file {base} (in 'extends:' of {path}) {expected}" in line
    if kind == "fifo":  # the config itself a pipe: named too, not waited on
        line = one_line_error(sailfin_cli("train", str(base), timeout=30))
        assert f"config file {base} is a FIFO (named pipe)" in line


def test_a_directory_as_the_config_or_its_base_is_one_line(tmp_path, capsys):
    from sailfin.cli import main

    (tmp_path / "conf").mkdir()
    assert main(["train", str(tmp_path / "conf")]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"sailfin: config error: config file {tmp_path / 'conf'} is a directory, not a regular "
        "file; give a YAML file"], err
    path = tmp_path / "run.yaml"
    path.write_text("extends: conf\nmodule: {class_path: tests.recipes.LinearRecipe}\n")
    with pytest.raises(ConfigError, match=f"config file {tmp_path / 'conf'} \\(in 'extends:' "
                                          f"of {path}\\) is a directory, not a regular file"):
        load_config(path)
