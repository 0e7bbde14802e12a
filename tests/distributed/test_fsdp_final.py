"""fsdp's final weights on 2 gloo processes: gathered one tensor at a time and streamed
to final/model.safetensors (and final/ema.safetensors) by rank 0. The files hold what the
gathered state dict holds, under sp's names, and rank 0 never holds the whole model."""

from __future__ import annotations

import resource

import torch
from safetensors.torch import load_file
from torch import nn

from sailfin import Trainer, sharded_build
from sailfin.backends.weights_file import save_weights
from sailfin.utils.memory import peak_rss_bytes
from tests.distributed.harness import errors, reset_peak_rss, run_ranks
from tests.recipes import IdData, LinearRecipe, WideRecipe, args

EMA = {"decay": 0.8, "every_n_steps": 1}
RUN = {"epochs": 2, "train_batch_size": 8, "ema": EMA}


class Tied(WideRecipe):
    """Sharded parameters with uneven rows, a tied pair in the root, buffers of several
    dtypes (a 0-d one and a non-persistent one), the hidden layer a unit."""

    def __init__(self, data, **kw) -> None:
        super().__init__(data, **kw)
        self.norm = nn.LayerNorm(32)
        self.emb = nn.Embedding(33, 32)  # 33 rows: uneven shards on 2 ranks
        self.head = nn.Linear(32, 33, bias=False)
        self.head.weight = self.emb.weight  # stored once, as emb.weight
        self.register_buffer("table", torch.arange(6).bfloat16())
        self.register_buffer("count", torch.tensor(3))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x):
        h = self.norm(self.hidden(self.dropout(x)))
        return self.linear(h).squeeze(-1) + 0.1 * self.head(h).mean(-1)


def train_tied(rank, world, dist_args, out):
    module = Tied(IdData(40, 0))
    with Trainer(module, args(out / "run", backend="fsdp", distributed=dist_args,
                              micro_batch_size=4 // world, fsdp={"units": ["hidden"]},
                              **RUN)) as t:
        t.train()
        # Rank 0 cannot write (a file where the directory should be): it raises, after
        # taking part in every gather, so the collectives below still pair up.
        (out / "blocked").write_text("not a directory")
        try:
            t.backend.save_final_weights(module, str(out / "blocked" / "w.safetensors"),
                                         rank == 0)
            failed = None
        except OSError as exc:
            failed = type(exc).__name__
        # The gathered path the files replaced: the full state dict on rank 0.
        gathered = {k: v.clone() for k, v in t.backend.final_state_dict(module).items()}
        with t.ema.swapped_in(module):
            ema = {k: v.clone() for k, v in t.backend.final_state_dict(module).items()}
    if rank == 0:
        torch.save({"model": gathered, "ema": ema, "failed": failed}, out / "gathered.pt")


def test_final_files_hold_the_gathered_weights_under_sp_names(tmp_path):
    with Trainer(Tied(IdData(40, 0)), args(tmp_path / "sp", micro_batch_size=8, **RUN)) as t:
        t.train()
    out = tmp_path / "fsdp"
    out.mkdir()
    assert run_ranks(train_tied, 2, out) == [0, 0], errors(out)
    gathered = torch.load(out / "gathered.pt", weights_only=True)
    assert gathered["failed"] in ("FileExistsError", "NotADirectoryError")
    assert sorted(p.name for p in out.iterdir()) == ["blocked", "gathered.pt", "run"]
    for name in ("model", "ema"):
        sp = load_file(str(tmp_path / "sp" / "final" / f"{name}.safetensors"))
        got = load_file(str(out / "run" / "final" / f"{name}.safetensors"))
        # sp's names, dtypes and shapes: the tied head once (under emb.weight), persistent
        # buffers only.
        assert list(got) == list(sp)
        assert "head.weight" not in got and "scratch" not in got
        assert {k: (v.dtype, v.shape) for k, v in got.items()} == \
            {k: (v.dtype, v.shape) for k, v in sp.items()}
        assert set(gathered[name]) == set(got) | {"head.weight"}
        for key, value in got.items():
            assert torch.equal(value, gathered[name][key]), (name, key)  # bit for bit
            torch.testing.assert_close(value, sp[key], rtol=1e-5, atol=1e-6)
    assert not torch.equal(load_file(str(out / "run" / "final" / "ema.safetensors"))["emb.weight"],
                           gathered["model"]["emb.weight"])  # the average, not the weights


class Big(LinearRecipe):
    """16 layers of 2048 x 2048: 256 MiB of float32 parameters. Records the RSS just
    before the final save (on_end_train is the trainer's last call before it)."""

    def __init__(self, data, **kw) -> None:
        super().__init__(data, **kw)
        self.layers = nn.Sequential(*(nn.Linear(2048, 2048, bias=False) for _ in range(16)))
        self.before_save = 0
        self.peak_reset = False

    def on_end_train(self, global_step: int) -> None:
        self.peak_reset = reset_peak_rss()
        self.before_save = rss_bytes()


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def save_big(rank, world, dist_args, out):
    data = IdData(20, 0)  # outside: the data interface is built for real on every rank
    with sharded_build(rank):
        module = Big(data)
    with Trainer(module, args(out / "run", backend="fsdp", distributed=dist_args,
                              micro_batch_size=5, max_steps=1,
                              checkpoint={"at_epoch_end": False},  # only the final save
                              fsdp={"units": ["Linear"]})) as t:
        t.train()  # the final save streams final/model.safetensors
        streamed = peak_rss_bytes() - module.before_save
        held = sum(p.to_local().numel() * 4 for p in module.parameters())
        # The gathered path, measured the same way: rank 0 holds every full tensor.
        before = rss_bytes()
        reset_peak_rss()
        state = t.backend.final_state_dict(module)
        if rank == 0:
            save_weights(state, str(out / "gathered.safetensors"))
        gathered = peak_rss_bytes() - before
        del state
    torch.save({"streamed": streamed, "gathered": gathered, "held": held,
                "reset": module.peak_reset}, out / f"rss-{rank}.pt")


def test_rank_0_never_holds_the_whole_model_at_the_final_save(tmp_path):
    assert run_ranks(save_big, 2, tmp_path, timeout=240) == [0, 0], errors(tmp_path)
    model_bytes = 16 * 2048 * 2048 * 4 + 4 * 4 + 4
    got = [torch.load(tmp_path / f"rss-{rank}.pt") for rank in range(2)]
    mib = {r: {k: v if isinstance(v, bool) else round(v / 2**20, 1) for k, v in g.items()}
           for r, g in enumerate(got)}
    print("memory over the RSS before the final save, MiB:", mib)
    for g in got:
        assert g["held"] <= model_bytes // 2 + 64
        # A layer or a few gathered at a time (16 MiB each: the tensor, the all-gather's
        # buffers), not the model: the shard plus the save's extra stay below the model.
        assert g["streamed"] < model_bytes // 2, mib
        assert g["held"] + g["streamed"] < model_bytes, mib
    # The same measure sees the gathered path put the whole model in rank 0's memory.
    assert got[0]["gathered"] > 0.9 * model_bytes, mib
    saved = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    want = load_file(str(tmp_path / "gathered.safetensors"))
    assert list(saved) == list(want)
    for key, value in want.items():
        assert torch.equal(saved[key], value), key
