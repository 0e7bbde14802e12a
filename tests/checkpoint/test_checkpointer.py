"""The default checkpointer: atomic commit, damage detection, keep-last and best, async, fsspec."""

import json
import re
import os
import uuid

import pytest
import torch

from sailfin import Trainer
from sailfin.checkpoint import CheckpointCorrupt, CheckpointError, DirectoryCheckpointer
from sailfin.config import CheckpointArguments, ConfigError, load_config
from sailfin.distributed import DistEnv
from sailfin.checkpoint.manifest import seal
from tests.checkpoint.forge import rewrite_shards
from tests.checkpoint.helpers import (Crash, CrashAt, FailingCheckpointer, ScriptedMetric,
                                      assert_same_params, metric_lines, params, saved_model)
from tests.recipes import IdData, LinearRecipe, args

STEP = {"every_n_steps": 2, "at_epoch_end": False}


def train(tmp, module=None, callbacks=(), **kw):
    module = module or LinearRecipe(IdData(40, 6), dropout=0.2, momentum=0.9)
    trainer = Trainer(module, args(tmp, **kw), callbacks=list(callbacks))
    try:
        trainer.train()
    except Crash:
        pass
    return module, trainer


def names(ckpt_dir):
    return sorted(os.listdir(ckpt_dir))


# -- never damaged ---------------------------------------------------------------------
@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("fail_rank", [0, None], ids=["in the shards", "in the commit"])
def test_a_save_that_fails_midway_leaves_the_previous_one(tmp_path, async_save, monkeypatch,
                                                          fail_rank):
    monkeypatch.setattr(FailingCheckpointer, "fail_step", 4)
    monkeypatch.setattr(FailingCheckpointer, "fail_rank", fail_rank)
    path = "tests.checkpoint.helpers.FailingCheckpointer"
    ckpt = {**STEP, "class_path": path, "async_save": async_save}
    with pytest.raises(CheckpointError, match="no space left on device"):
        train(tmp_path, epochs=2, checkpoint=ckpt)
    root = tmp_path / "checkpoints"
    assert names(root) == ["latest", "step-00000002"]  # the partial save is removed
    assert (root / "latest").read_text().strip() == "step-00000002"
    monkeypatch.setattr(FailingCheckpointer, "fail_step", -1)
    ref, _ = train(tmp_path / "ref", epochs=2, checkpoint=STEP)
    module, trainer = train(tmp_path, epochs=2, checkpoint=ckpt)
    assert trainer.resumed_from.name == "step-00000002"
    assert_same_params(params(ref), params(module))


def test_corrupt_latest_falls_back_and_says_so(tmp_path, capfd):
    train(tmp_path, epochs=2, callbacks=[CrashAt(7)], checkpoint=STEP)
    root = tmp_path / "checkpoints"
    model = root / "step-00000006" / "shards" / "__0_0.distcp"  # the model and optimizers
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match=f"{model} does not match its crc32"):
        train(tmp_path / "other", epochs=2, resume=str(root / "step-00000006"))
    ref, _ = train(tmp_path / "ref", epochs=2, checkpoint=STEP)
    capfd.readouterr()
    module, trainer = train(tmp_path, epochs=2, checkpoint=STEP)
    err = capfd.readouterr().err
    assert f"{model} does not match its crc32" in err
    assert "skipped damaged checkpoint(s) step-00000006; falling back to" in err
    assert trainer.resumed_from.name == "step-00000004"
    assert_same_params(params(ref), params(module))
    assert metric_lines(tmp_path) == metric_lines(tmp_path / "ref")


def test_truncated_file_and_broken_manifest(tmp_path, capfd):
    train(tmp_path, epochs=2, callbacks=[CrashAt(7)], checkpoint={**STEP, "keep_last": None})
    root = tmp_path / "checkpoints"
    shard = root / "step-00000006" / "shards" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    (root / "step-00000004" / "manifest.json").write_text('{"format": "sailfin-checkp')
    ref, _ = train(tmp_path / "ref", epochs=2, checkpoint=STEP)
    module, trainer = train(tmp_path, epochs=2, checkpoint=STEP)
    err = capfd.readouterr().err
    assert f"{shard} has 100 bytes; the manifest says" in err
    assert "manifest.json is not valid JSON" in err
    assert trainer.resumed_from.name == "step-00000002"
    assert_same_params(params(ref), params(module))


def test_every_checkpoint_damaged_is_an_error(tmp_path):
    train(tmp_path, epochs=1, callbacks=[CrashAt(3)], checkpoint=STEP)
    os.remove(tmp_path / "checkpoints" / "step-00000002" / "shards" / "__0_0.distcp")
    with pytest.raises(CheckpointError, match="every checkpoint in .* is damaged"):
        train(tmp_path, epochs=1, checkpoint=STEP)


def test_files_needing_arbitrary_unpickling_are_refused(tmp_path, capfd):
    """A checkpoint whose small entry holds a pickled class is refused even with valid
    checksums: it
    was rewritten after the save (saves refuse such objects), so resume: auto falls back
    to the checkpoint before it, as from any other damage."""
    train(tmp_path, epochs=2, callbacks=[CrashAt(5)], checkpoint=STEP)
    step = tmp_path / "checkpoints" / "step-00000004"
    rewrite_shards(step, lambda state: state.update(trainer={"payload": uuid.UUID(int=7)}))
    said = (r"\(entry 'trainer'\) holds a value that only arbitrary unpickling could rebuild "
            r"\(it needs uuid.UUID\): it was rewritten after the save")
    with pytest.raises(CheckpointCorrupt, match=said):
        train(tmp_path / "other", epochs=2, resume=str(step))
    capfd.readouterr()
    _, trainer = train(tmp_path, epochs=2, checkpoint=STEP)
    assert trainer.resumed_from.name == "step-00000002"
    err = capfd.readouterr().err
    assert re.search(said, err) and "falling back to" in err


def test_get_state_with_objects_is_refused_at_save(tmp_path):
    class Objects(LinearRecipe):
        def get_state(self):
            return {"ok": [1, 2.0, torch.ones(2)], "bad": uuid.UUID(int=1)}

    with pytest.raises(CheckpointError, match=r"module.get_state\(\)\['bad'\] is a uuid.UUID.*"
                                              "weights_only"):
        train(tmp_path, Objects(IdData(40, 0)), checkpoint=STEP)
    assert not (tmp_path / "checkpoints" / "latest").exists()


# -- keep-last and best -----------------------------------------------------------------
def test_keep_last_and_best(tmp_path):
    """Four epochs of 2 steps; scores 5, 1, 3, 4: the best is epoch 1 (step 4)."""
    module = ScriptedMetric(IdData(40, 6), scores=[5.0, 1.0, 3.0, 4.0])
    ckpt = {"every_n_steps": 1, "keep_last": 2, "best_metric": "score", "best_mode": "min"}
    _, trainer = train(tmp_path, module, epochs=4, train_batch_size=20, micro_batch_size=20,
                       checkpoint=ckpt)
    root = tmp_path / "checkpoints"
    assert names(root) == ["best", "latest", "step-00000004", "step-00000007", "step-00000008"]
    assert (root / "best").read_text().strip() == "step-00000004"
    manifest = json.loads((root / "step-00000004" / "manifest.json").read_text())
    assert manifest["is_best"] and manifest["best"] == {"metric": "score", "mode": "min",
                                                        "value": 1.0, "step": 4}
    assert manifest["validated_at_step"]
    # The best carries over a resume: a later, worse score does not replace it.
    module = ScriptedMetric(IdData(40, 6), scores=[5.0, 1.0, 3.0, 4.0, 2.0])
    train(tmp_path, module, epochs=5, train_batch_size=20, micro_batch_size=20,
          checkpoint=ckpt)
    assert (root / "best").read_text().strip() == "step-00000004"
    assert names(root) == ["best", "latest", "step-00000004", "step-00000009", "step-00000010"]


def test_best_max_mode_saves_on_improvement_only(tmp_path):
    module = ScriptedMetric(IdData(40, 6), scores=[0.5, 0.4, 0.9])
    ckpt = {"at_epoch_end": False, "best_metric": "val/score", "best_mode": "max",
            "keep_last": None}
    train(tmp_path, module, epochs=3, train_batch_size=20, micro_batch_size=20,
          checkpoint=ckpt)
    root = tmp_path / "checkpoints"
    assert names(root) == ["best", "latest", "step-00000002", "step-00000006"]
    assert (root / "best").read_text().strip() == "step-00000006"


def test_unknown_best_metric_names_the_available_ones(tmp_path):
    with pytest.raises(CheckpointError, match="best_metric 'acc' is not among the validation "
                                              "metrics of this run: val/count, val/mse"):
        train(tmp_path, epochs=1, checkpoint={"best_metric": "acc"})


# -- async -----------------------------------------------------------------------------------
def same(a, b, path="") -> None:
    """Equal structure and bit-identical tensors; wall-clock times aside."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            if k != "train_seconds":
                same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def test_async_save_gives_the_same_checkpoints(tmp_path):
    ref, ref_trainer = train(tmp_path / "sync", epochs=2, checkpoint=STEP)
    module, trainer = train(tmp_path / "async", epochs=2, checkpoint={**STEP, "async": True})
    saver = [c for c in trainer.callbacks if hasattr(c, "stall_seconds")][0]
    assert len(saver.stall_seconds) == 4
    for step in ("step-00000006", "step-00000008"):
        a, b = (DirectoryCheckpointer(str(tmp_path / run / "checkpoints"),
                                      CheckpointArguments(), DistEnv()).load(step)
                for run in ("sync", "async"))
        same(a.shared, b.shared, f"{step} trainer")
        same(a.rank_state, b.rank_state, f"{step} rng/rank00000")
        like = dict(module.state_dict())
        same(saved_model(tmp_path / "sync" / "checkpoints" / step, like),
             saved_model(tmp_path / "async" / "checkpoints" / step, like), f"{step}/shards")
    # Resuming from an async checkpoint is exact too.
    train(tmp_path / "async2", epochs=2, callbacks=[CrashAt(5)],
          checkpoint={**STEP, "async": True})
    resumed, _ = train(tmp_path / "async2", epochs=2, checkpoint={**STEP, "async": True})
    assert_same_params(params(ref), params(resumed))


def test_an_async_save_copies_the_small_state_at_the_save_ties_kept(tmp_path):
    """The small state's bytes are made when the save starts (they are its copy): a change
    after it is not in the checkpoint, and tensors that shared storage share it again."""
    from sailfin.checkpoint import SaveRequest

    ckpt = DirectoryCheckpointer(str(tmp_path), CheckpointArguments(async_save=True), DistEnv())
    tied = torch.arange(6.0)
    facts = {"step": 1, "epoch": 0, "step_in_epoch": 1, "samples_seen": 1, "world_size": 1}
    ckpt.save(SaveRequest(1, facts, {"trainer": {"a": tied, "b": tied[2:]}},
                          {"torch": torch.get_rng_state()}, sharded={"module": {}}))
    tied.add_(1.0)  # the next step, while the save is written
    ckpt.close()
    saved = ckpt.load(ckpt.latest()).shared["trainer"]
    assert torch.equal(saved["a"], torch.arange(6.0))
    assert saved["a"].untyped_storage().data_ptr() == saved["b"].untyped_storage().data_ptr()


# -- fsspec ------------------------------------------------------------------------------------
def test_memory_url_round_trip(tmp_path):
    pytest.importorskip("fsspec")
    import fsspec

    url = f"memory://sailfin-test-{uuid.uuid4().hex}/ckpt"
    ckpt = {**STEP, "dir": url}
    ref, _ = train(tmp_path / "ref", epochs=2, checkpoint=STEP)
    train(tmp_path / "run", epochs=2, callbacks=[CrashAt(5)], checkpoint=ckpt)
    fs = fsspec.filesystem("memory")
    root = url[len("memory://"):]
    assert fs.cat(f"{root}/latest").decode().strip() == "step-00000004"
    try:
        module, trainer = train(tmp_path / "run", epochs=2, checkpoint=ckpt)
        assert trainer.resumed_from.location.endswith(f"{root}/step-00000004")
        assert_same_params(params(ref), params(module))
        assert metric_lines(tmp_path / "run") == metric_lines(tmp_path / "ref")
    finally:
        fs.rm(root.split("/")[0], recursive=True)


def test_remote_save_without_manifest_is_incomplete(tmp_path, monkeypatch):
    """Object stores have no rename: files go in place, and no manifest means incomplete."""
    pytest.importorskip("fsspec")
    import fsspec

    monkeypatch.setattr(FailingCheckpointer, "fail_step", 4)
    url = f"memory://sailfin-test-{uuid.uuid4().hex}"
    ckpt = {**STEP, "dir": url, "class_path": "tests.checkpoint.helpers.FailingCheckpointer"}
    fs = fsspec.filesystem("memory")
    root = url[len("memory://"):]
    try:
        with pytest.raises(CheckpointError, match="no space left on device"):
            train(tmp_path, epochs=2, checkpoint=ckpt)
        assert fs.exists(f"{root}/step-00000002/manifest.json")
        assert not fs.exists(f"{root}/step-00000004")  # the failed save's files are removed
        monkeypatch.setattr(FailingCheckpointer, "fail_step", -1)
        module, trainer = train(tmp_path, epochs=2, checkpoint=ckpt)
        assert trainer.resumed_from.name == "step-00000002"
        assert fs.exists(f"{root}/step-00000004/manifest.json")  # saved again, completely
    finally:
        fs.rm(root, recursive=True)


# -- configuration ---------------------------------------------------------------------------------
def test_custom_checkpointer_from_config(tmp_path, monkeypatch):
    monkeypatch.setenv("SAILFIN_TEST_SAVE_MARKER", str(tmp_path))
    cfg = load_config(None, ["--module.class_path", "tests.recipes.LinearRecipe",
                             "--data.class_path", "tests.recipes.IdData",
                             "--trainer.output_dir", str(tmp_path / "out"),
                             "--trainer.writers", "[jsonl]",
                             "--trainer.checkpoint.class_path",
                             "tests.checkpoint.helpers.SlowCheckpointer"])
    trainer = Trainer(cfg.build(), cfg.trainer)
    trainer.train()
    assert type(trainer.checkpointer).__name__ == "SlowCheckpointer"
    used = json.loads((tmp_path / "custom-checkpointer.json").read_text())
    assert used == {"class": "SlowCheckpointer", "last_step": trainer.global_step}


def test_checkpoint_config_keys():
    cfg = load_config(None, ["--module.class_path", "x.Y", "--trainer.checkpoint.every_n_steps",
                             "50", "--trainer.checkpoint.async", "true",
                             "--trainer.checkpoint.dir", "s3://bucket/run",
                             "--trainer.resume", "never"])
    ckpt = cfg.trainer.checkpoint
    assert ckpt.every_n_steps == 50 and ckpt.async_save and ckpt.dir == "s3://bucket/run"
    assert cfg.trainer.resume == "never"
    with pytest.raises(ConfigError, match="'trainer.checkpoint.every_n_step'.*did you mean "
                                          "'every_n_steps'"):
        load_config(None, ["--trainer.checkpoint.every_n_step", "5"])
    with pytest.raises(ConfigError, match="keep_last must be >= 1 or null, got 0"):
        load_config(None, ["--trainer.checkpoint.keep_last", "0"])
    with pytest.raises(ConfigError, match="best_mode' got 'maximum'.*expected one of: min, max"):
        load_config(None, ["--trainer.checkpoint.best_mode", "maximum"])
    with pytest.raises(ConfigError, match="storage_options are for a URL dir"):
        load_config(None, ["--trainer.checkpoint.storage_options", "{anon: true}"])
    with pytest.raises(ConfigError, match="not a subclass of sailfin.checkpoint.Checkpointer"):
        train_args = args("unused", checkpoint={"class_path": "tests.recipes.IdData"})
        from sailfin.checkpoint import build_checkpointer
        build_checkpointer(train_args, DistEnv())


def test_no_trigger_no_checkpoints(tmp_path):
    _, trainer = train(tmp_path, epochs=2, checkpoint={"at_epoch_end": False})
    assert not (tmp_path / "checkpoints").exists()
    assert not any(hasattr(c, "stall_seconds") for c in trainer.callbacks)


class StagesOnce:
    """A stand-in for torch 2.11's DefaultStager: its second ``stage`` fails as that one's
    does (``KeyError: <class 'type'>``, found on a GPU machine running torch 2.11)."""

    def __init__(self, options):
        self.inner, self.staged = self.real(options), 0

    def stage(self, state_dict, **kwargs):
        self.staged += 1
        if self.staged > 1:
            raise KeyError(type)
        return self.inner.stage(state_dict, **kwargs)

    def close(self):
        self.inner.close()


def test_async_saves_stage_on_fresh_stagers_where_torchs_cannot_stage_twice(tmp_path,
                                                                            monkeypatch):
    import torch.distributed.checkpoint.staging as dcp_staging

    monkeypatch.setattr(StagesOnce, "real", dcp_staging.DefaultStager, raising=False)
    from sailfin.checkpoint.staging import stager_reusable

    assert stager_reusable()  # this torch keeps one stager's copies from save to save
    monkeypatch.setattr(dcp_staging, "DefaultStager", StagesOnce)
    stager_reusable.cache_clear()
    try:
        assert not stager_reusable()
        module, trainer = train(tmp_path / "async", epochs=2, checkpoint={**STEP, "async": True})
    finally:
        stager_reusable.cache_clear()
    ref, _ = train(tmp_path / "sync", epochs=2, checkpoint=STEP)
    saver = [c for c in trainer.callbacks if hasattr(c, "stall_seconds")][0]
    assert len(saver.stall_seconds) == 4  # every save written, none failed
    like = dict(module.state_dict())
    for step in ("step-00000006", "step-00000008"):
        same(saved_model(tmp_path / "sync" / "checkpoints" / step, like),
             saved_model(tmp_path / "async" / "checkpoints" / step, like), f"{step}/shards")


def test_each_rank_reads_the_trainers_entry_and_only_its_own_streams(tmp_path):
    """A checkpoint of one rank read by rank 1 of 2 (a grown world): rank 1 gets the
    trainer's state and no random streams (it derives its own); rank 0 gets its own."""
    from sailfin.checkpoint import SaveRequest

    ckpt = DirectoryCheckpointer(str(tmp_path), CheckpointArguments(), DistEnv())
    facts = {"step": 1, "epoch": 0, "step_in_epoch": 1, "samples_seen": 1, "world_size": 1}
    streams = {"torch": torch.get_rng_state()}
    ckpt.save(SaveRequest(1, facts, {"trainer": {"counters": {"global_step": 1}}}, streams,
                          sharded={"module": {"w": torch.ones(2)}}))
    ckpt.close()
    for rank, own in ((0, streams), (1, None)):
        reader = DirectoryCheckpointer(str(tmp_path), CheckpointArguments(),
                                       DistEnv(rank=rank, world_size=2))
        loaded = reader.load(reader.latest())
        assert loaded.shared == {"trainer": {"counters": {"global_step": 1}}}
        if own is None:
            assert loaded.rank_state is None
        else:
            assert torch.equal(loaded.rank_state["torch"], own["torch"])
