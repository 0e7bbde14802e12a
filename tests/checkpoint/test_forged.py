"""No code runs from a checkpoint: a forged DCP index (``shards/.metadata``), a forged
small-state entry (the trainer's) and a forged small entry of the optimizers, each with a
manifest that matches
it, are refused in one line by every way a checkpoint is opened (``resume: auto`` falls
back: tests/checkpoint/test_damaged_files.py) and no payload runs."""

import pytest

from sailfin.cli import main
from tests.checkpoint.forge import NEEDS, forge_metadata, forge_shard_entry, forge_trainer_entry

FORGE = {"metadata": forge_metadata, "trainer entry": forge_trainer_entry,
         "shard entry": forge_shard_entry}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run with checkpoints at steps 1 and 2."""
    base = tmp_path_factory.mktemp("forged")
    config = base / "run.yaml"
    config.write_text(f"""
data: {{class_path: tests.recipes.IdData, init_args: {{n_train: 20, n_val: 0}}}}
module: {{class_path: tests.recipes.LinearRecipe}}
trainer: {{train_batch_size: 10, writers: [jsonl], output_dir: {base / 'out'},
           checkpoint: {{every_n_steps: 1}}}}
""")
    assert main(["train", str(config)]) == 0
    return base, config


@pytest.fixture(params=sorted(FORGE))
def forged(request, run, tmp_path):
    """A copy of step 2 with one forgery; the payload would create ``tmp_path/marker``."""
    import shutil

    base, config = run
    step = tmp_path / "step-00000002"
    shutil.copytree(base / "out" / "checkpoints" / "step-00000002", step)
    FORGE[request.param](step, tmp_path / "marker")
    return step, config, request.param


@pytest.mark.parametrize("how", ["resume", "init_from"])
def test_a_forged_checkpoint_ends_in_one_line_and_runs_nothing(forged, tmp_path, how, capfd):
    step, config, kind = forged
    capfd.readouterr()
    code = main(["train", str(config), f"--trainer.{how}", str(step),
                 "--trainer.output_dir", str(tmp_path / "again")])
    err = capfd.readouterr().err
    assert not (tmp_path / "marker").exists()
    if how == "init_from" and kind == "shard entry":  # the forged optimizer entry
        assert code == 0  # is never read: init_from reads the model's entries only
        return
    assert code == 2 and len(err.splitlines()) == 1, err
    assert str(step) in err and "unpickling" in err, err


@pytest.mark.parametrize("kind", ["metadata", "trainer entry"])
def test_export_of_a_forgery_ends_in_one_line_and_runs_nothing(run, tmp_path, capfd, kind):
    import shutil

    base, _ = run
    step = tmp_path / "copied" / "step-00000002"  # OUT below lies outside it
    shutil.copytree(base / "out" / "checkpoints" / "step-00000002", step)
    FORGE[kind](step, tmp_path / "marker")
    capfd.readouterr()
    assert main(["export", str(step), str(tmp_path / "exported")]) != 0
    err = capfd.readouterr().err
    said = ("shards/.metadata is not DCP's metadata" if kind == "metadata" else
            "shards/__0_0.distcp (entry 'trainer') holds a value that only arbitrary "
            f"unpickling could rebuild (it needs {NEEDS})")
    assert len(err.splitlines()) == 1 and said in err, err
    assert not (tmp_path / "marker").exists() and not (tmp_path / "exported").exists()


@pytest.mark.parametrize("file", ["shards/__0_0.distcp", "manifest.json", "shards/.metadata"])
@pytest.mark.parametrize("kind", ["socket", "link loop"])
def test_a_special_file_under_init_from_is_one_line(run, tmp_path, capfd, file, kind):
    """A Unix socket or a loop of symbolic links in place of a checkpoint file: one line
    naming it (init_from; resume: tests/checkpoint/test_damaged_files.py)."""
    import shutil

    from tests.checkpoint.test_damaged_files import link_loop, unix_socket

    base, config = run
    step = tmp_path / "step-00000002"
    shutil.copytree(base / "out" / "checkpoints" / "step-00000002", step)
    (unix_socket if kind == "socket" else link_loop)(step / file)
    capfd.readouterr()
    code = main(["train", str(config), "--trainer.init_from", str(step),
                 "--trainer.output_dir", str(tmp_path / "again")])
    err = capfd.readouterr().err
    said = "it is a socket" if kind == "socket" else "a loop of symbolic links"
    assert code == 2 and len(err.splitlines()) == 1, err
    assert str(step / file) in err and said in err, err
