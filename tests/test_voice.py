"""sailfin's one voice (``sailfin/utils/voice.py``) and the command's one table from an
error to its exit code (``sailfin/cli.py``)."""

from __future__ import annotations

import logging
import sys

import pytest

from sailfin.utils import voice


@pytest.fixture
def rank_back():
    yield
    voice.configure(0)


def test_a_notice_is_one_flushed_line_on_stderr_and_a_record(capsys, caplog):
    with caplog.at_level(logging.INFO, logger="sailfin"):
        voice.say("trainer.ema: starts from the resumed weights")
    assert capsys.readouterr().err == "sailfin: trainer.ema: starts from the resumed weights\n"
    assert [r.getMessage() for r in caplog.records] == [
        "trainer.ema: starts from the resumed weights"]


def test_other_ranks_show_only_warnings_with_their_rank(capsys, rank_back):
    voice.configure(3)
    voice.say("a notice rank 0 gives")
    voice.say("a bad sample skipped", warning=True)
    assert capsys.readouterr().err == "sailfin[rank 3]: a bad sample skipped\n"
    voice.configure(0)
    voice.say("a notice rank 0 gives")
    assert capsys.readouterr().err == "sailfin: a notice rank 0 gives\n"


def test_an_application_that_prints_its_logging_gets_each_line_once(capsys, monkeypatch):
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("app %(name)s: %(message)s"))
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])
    voice.say("one line")
    assert capsys.readouterr().err == "app sailfin: one line\n"


def test_line_writes_a_commands_last_word_as_it_is(capsys):
    voice.line("sailfin: config error: trainer.epohcs")
    assert capsys.readouterr().err == "sailfin: config error: trainer.epohcs\n"


def _errors():
    from sailfin.config import ConfigError
    from sailfin.data.shards.errors import ShardError
    from sailfin.interfaces import RecipeError
    from sailfin.logging.writers import WriterError
    from sailfin.trainer.safety.run_lock import RunLockError

    return [(ConfigError("bad key"), "sailfin: config error: bad key"),
            (RecipeError("no train_step"), "sailfin: recipe error: no train_step"),
            (WriterError("cannot write"), "sailfin: cannot write"),
            (RunLockError("held"), "sailfin: held"),
            (ShardError("bad shard"), "sailfin: shard error: bad shard")]


def test_each_error_a_user_can_fix_ends_with_one_line_and_exit_2(capsys, monkeypatch):
    from sailfin.cli import _user_error_code

    monkeypatch.delenv("RANK", raising=False)
    for exc, said in _errors():
        assert _user_error_code(exc) == 2
        assert capsys.readouterr().err == said + "\n"
    assert _user_error_code(RuntimeError("a bug")) is None
    assert capsys.readouterr().err == ""


def test_only_a_shard_error_is_said_by_a_rank_other_than_0(capsys, monkeypatch):
    from sailfin.cli import _user_error_code

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for exc, said in _errors():
        assert _user_error_code(exc) == 2
        assert capsys.readouterr().err == (said + "\n" if "shard" in said else "")


# Modules that write lines of their own, and why; everything else speaks through voice.
OWN_LINES = {
    "cli.py", "shard_cli.py", "after_cli.py", "report.py", "launch.py",  # commands: their result (stdout)
    "__main__.py",
    #                                                      and the error they end on
    "utils/voice.py",
}
# Python's warnings, for what they are for (sailfin/utils/voice.py says which).
WARNS = {"trainer/core/loaders.py",     # the user's loader: persistent_workers with set_epoch
         "trainer/safety/nonfinite.py"}  # NonFiniteLossWarning, which a user may filter


def test_every_other_line_goes_through_the_voice():
    import ast
    import pathlib

    package = pathlib.Path(voice.__file__).resolve().parents[1]
    found = []
    for path in sorted(package.rglob("*.py")):
        name = str(path.relative_to(package))
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            call = ast.unparse(node.func)
            if ((call == "print" and name not in OWN_LINES)
                    or (call.endswith("getLogger") and name != "utils/voice.py")
                    or (call == "warnings.warn" and name not in WARNS)):
                found.append(f"sailfin/{name}:{node.lineno}: {call}")
    assert not found, "say it with sailfin.utils.voice.say:\n" + "\n".join(found)
