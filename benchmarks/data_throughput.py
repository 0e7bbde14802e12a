"""Samples per second reading and decoding small images: files vs webdataset vs sailfin.

The same data set (N PNG images of 32x32x3 with a class label each) is stored
three ways and read into batches of 64 (uint8 image tensor, label tensor),
shuffled, by a torch DataLoader with 0 and 2 workers:

  files       one PNG file per sample in class directories (ImageFolder layout),
              a map-style dataset; over HTTP, one GET per sample
  webdataset  the tar shards read by the ``webdataset`` package (shard shuffle,
              a 1,000-sample shuffle buffer, ``decode("rgb8")``); over HTTP it
              streams each shard with curl
  sailfin     the same tar shards through ``ShardDataset`` with the trainer's
              resumable sampler (window shuffle); over HTTP each shard is
              downloaded into a fresh cache directory during the timed run
  sailfin-nocrc  the same with ``verify_checksums=False``: the "crc cost" column
              is what checking every member's CRC-32 costs (1 - with/without)

"local" reads from disk with a warm page cache; "http" reads from a Python
file server on 127.0.0.1 (a separate process, stopped at the end). Each round
runs every reader once, in an order that alternates between rounds (A B C,
C B A, ...); the table gives medians over rounds, and the ratios are medians
of the per-round ratios, so machine noise hits all readers alike. Dataset
construction (indexing, for sailfin) is inside the timing.

    python benchmarks/data_throughput.py                # 10,000 samples, 5 rounds
    python benchmarks/data_throughput.py --full         # 50,000 samples
    python benchmarks/data_throughput.py --samples 2000 --rounds 3 --where local
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import add_load_options, start as load_check, summary  # noqa: E402

from sailfin.data import BatchPlan, ResumableSampler, ShardDataset, ShardWriter  # noqa: E402

BATCH = 64
PER_SHARD = 1000
CLASSES = 10


# -- the data set ------------------------------------------------------------------------
def make_images(n: int, seed: int = 0):
    """Smooth colour gradients plus a little noise: PNGs of about natural-image size."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 1, 32, dtype=np.float32)
    for i in range(n):
        a, b = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
        mix = (ramp[:, None] * rng.uniform(0.3, 1) + ramp[None, :] * rng.uniform(0, 0.7))
        img = a * mix[..., None] + b * (1 - mix[..., None]) + rng.normal(0, 8, (32, 32, 3))
        buf = io.BytesIO()
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="PNG")
        yield i, buf.getvalue(), int(rng.integers(CLASSES))


def write_data(root: str, n: int) -> None:
    with ShardWriter(os.path.join(root, "shards"), samples_per_shard=PER_SHARD) as writer:
        for i, png, label in make_images(n):
            writer.write({"__key__": f"{i:07d}", "png": png, "cls": label})
            d = os.path.join(root, "files", str(label))
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"{i:07d}.png"), "wb") as f:
                f.write(png)


def shard_names(n: int) -> list[str]:
    return [f"shards/shard-{s:06d}.tar" for s in range(-(-n // PER_SHARD))]


def file_names(root: str) -> list[tuple[str, int]]:
    out = []
    for label in sorted(os.listdir(os.path.join(root, "files")), key=int):
        for name in sorted(os.listdir(os.path.join(root, "files", label))):
            out.append((f"files/{label}/{name}", int(label)))
    return out


# -- the three readers ---------------------------------------------------------------------
def decode_png(data: bytes) -> np.ndarray:
    from PIL import Image

    image = Image.open(io.BytesIO(data), formats=("PNG",))
    return np.array(image if image.mode == "RGB" else image.convert("RGB"))


class Files(torch.utils.data.Dataset):
    def __init__(self, base: str, names: list[tuple[str, int]]) -> None:
        self.base, self.names = base, names

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int):
        name, label = self.names[i]
        if self.base.startswith("http"):
            with urllib.request.urlopen(f"{self.base}/{name}", timeout=60) as r:
                data = r.read()
        else:
            with open(os.path.join(self.base, name), "rb") as f:
                data = f.read()
        return decode_png(data), label


def read_files(base: str, names, n: int, workers: int, cache: str) -> int:
    loader = torch.utils.data.DataLoader(Files(base, names), batch_size=BATCH, shuffle=True,
                                         num_workers=workers)
    return count(loader)


def read_sailfin(base: str, names, n: int, workers: int, cache: str,
                 verify_checksums: bool = True) -> int:
    urls = [f"{base}/{s}" for s in shard_names(n)]
    ds = ShardDataset(urls, fields=("png", "cls"), cache_dir=cache,
                      verify_checksums=verify_checksums)
    plan = BatchPlan.create(BATCH, BATCH, 1)
    sampler = ResumableSampler(len(ds), plan, seed=0, order=ds.epoch_order)
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=sampler,
                                         num_workers=workers)
    return count(loader)


def read_webdataset(base: str, names, n: int, workers: int, cache: str) -> int:
    import webdataset as wds

    urls = [f"{base}/{s}" for s in shard_names(n)]
    ds = (wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False)
          .shuffle(1000).decode("rgb8").to_tuple("png", "cls").batched(BATCH))
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    return count(loader)


def count(loader) -> int:
    seen = 0
    for images, labels in loader:
        seen += len(labels)
    return seen


READERS = {"files": read_files, "webdataset": read_webdataset, "sailfin": read_sailfin,
           "sailfin-nocrc": lambda *a: read_sailfin(*a, verify_checksums=False)}


# -- the file server -------------------------------------------------------------------------
def start_server(root: str):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                             "127.0.0.1", "--directory", root], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            urllib.request.urlopen(base + "/", timeout=1).close()
            return proc, base
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                stop_server(proc)
                raise RuntimeError("the benchmark's HTTP server did not start") from None
            time.sleep(0.1)


def stop_server(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


# -- rounds ------------------------------------------------------------------------------------
def run(root: str, n: int, rounds: int, wheres: list[str], workers_list: list[int],
        readers: list[str]) -> list[dict]:
    names = file_names(root)
    rows = []
    server = None
    try:
        for where in wheres:
            if where == "http":
                server, base = start_server(root)
            else:
                base = root
            for workers in workers_list:
                rates: dict[str, list[float]] = {r: [] for r in readers}
                for rnd in range(rounds + 1):  # round 0 warms caches and is not counted
                    order = readers if rnd % 2 == 0 else readers[::-1]
                    for name in order:
                        cache = tempfile.mkdtemp(prefix="sailfin-bench-cache-")
                        try:
                            start = time.perf_counter()
                            seen = READERS[name](base, names, n, workers, cache)
                            seconds = time.perf_counter() - start
                        finally:
                            shutil.rmtree(cache, ignore_errors=True)
                        if seen != n:
                            raise RuntimeError(f"{name} read {seen} samples, expected {n}")
                        if rnd:
                            rates[name].append(n / seconds)
                rows.append({"where": where, "workers": workers, "rates": rates})
                print_row(rows[-1], readers)
            if server is not None:
                stop_server(server)
                server = None
    finally:
        if server is not None:
            stop_server(server)
    return rows


def ratio(rates: dict, a: str, b: str) -> str:
    if a not in rates or b not in rates:
        return "-"
    return f"{statistics.median(x / y for x, y in zip(rates[a], rates[b])):.2f}"


def print_row(row: dict, readers: list[str]) -> None:
    rates = row["rates"]
    cells = [f"{statistics.median(rates[r]):>12,.0f}" if r in rates else f"{'-':>12}"
             for r in ("files", "webdataset", "sailfin")]
    # The CRC-32 check of every member (verify_checksums, on by default): its cost is
    # 1 - (rate with it / rate without it), a median over the interleaved rounds.
    crc = ratio(rates, "sailfin", "sailfin-nocrc")
    crc_cost = f"{(1 - float(crc)) * 100:+.1f}%" if crc != "-" else "-"
    print(f"{row['where']:<6} {row['workers']:>7} {''.join(cells)} "
          f"{ratio(rates, 'sailfin', 'webdataset'):>18} {ratio(rates, 'sailfin', 'files'):>14}"
          f"{crc_cost:>10}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--full", action="store_true", help="50,000 samples, as in the issue")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--where", choices=["local", "http", "both"], default="both")
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--data-dir", default=None, help="keep the generated data here")
    add_load_options(parser)
    args = parser.parse_args()
    load = load_check(args, "data_throughput.py")
    n = 50_000 if args.full else args.samples
    readers = ["files", "sailfin", "sailfin-nocrc"]
    if importlib.util.find_spec("webdataset") is not None:
        readers.insert(1, "webdataset")
    else:
        print("webdataset is not installed (pip install -e '.[bench]'): comparing files "
              "and sailfin only")
    torch.set_num_threads(1)
    root = args.data_dir or tempfile.mkdtemp(prefix="sailfin-bench-data-")
    try:
        if not os.path.exists(os.path.join(root, "shards", shard_names(n)[-1])):
            started = time.perf_counter()
            write_data(root, n)
            print(f"wrote {n} samples as files and {len(shard_names(n))} shards in "
                  f"{time.perf_counter() - started:.1f} s")
        print(f"{n} PNG samples 32x32x3 + label, batches of {BATCH}, median of "
              f"{args.rounds} interleaved rounds (samples/s)")
        print(f"{'where':<6} {'workers':>7} {'files':>12}{'webdataset':>12}{'sailfin':>12} "
              f"{'sailfin/webdataset':>18} {'sailfin/files':>14}{'crc cost':>10}")
        wheres = ["local", "http"] if args.where == "both" else [args.where]
        workers = [int(w) for w in args.workers.split(",")]
        rows = run(root, n, args.rounds, wheres, workers, readers)
        other = "webdataset" if "webdataset" in readers else "files"
        per_round = [x / y for row in rows
                     for x, y in zip(row["rates"]["sailfin"], row["rates"][other])]
        summary("data_throughput.py", f"sailfin shards / {other} samples/s (per-round, all "
                "rows)", per_round, load, 1, extra=", ".join(
                    f"{r['where']} {r['workers']} workers {ratio(r['rates'], 'sailfin', other)}"
                    for r in rows))
    finally:
        if args.data_dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
