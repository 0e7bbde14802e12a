"""Parallel preprocessing: DataProcessor.multi_process_data with 1 and 2 processes.

The job is CPU-bound text processing: split the Python standard library's
top-level modules (about 170 files, 4-5 MB of code, comments and docstrings;
each file three times by default, about 14 MB) into sentences and words,
counting sentences, words and distinct words per file. Each round runs 1
process and 2 processes, interleaved (A B, then B A), and checks both give
the same answer; the figure is the median over rounds of
(time with 1 process) / (time with 2 processes). On an idle machine with two
free cores the ceiling is 2.0.

A shared machine may not have a second core free, so each round also times
the ceiling: the same number of plain busy loops split over 1 and 2 forked
processes with nothing to send between them. The closing lines give sailfin's
speedup, the ceiling measured alongside, and their ratio (the efficiency of
multi_process_data: 1.00 means nothing lost to start-up, pickling or
imbalance).

    python benchmarks/preprocess.py [--rounds 5] [--copies 3] [--start-method fork]
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import statistics
import sys
import sysconfig
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import add_load_options, start as load_check, summary  # noqa: E402

from sailfin import DataProcessor  # noqa: E402

_PARAGRAPH = re.compile(r"\n\s*\n")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_']*")
ABBREVIATIONS = frozenset({"e.g.", "i.e.", "etc.", "vs.", "cf.", "mr.", "dr.", "no.", "fig."})


class SentenceStats(DataProcessor):
    """Per file: (sentences, words, distinct lower-cased words)."""

    def process(self, path: str) -> tuple[int, int, int]:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        sentences = words = 0
        vocab: set[str] = set()
        for paragraph in _PARAGRAPH.split(text):
            pending = ""
            for piece in _SENTENCE_END.split(paragraph):
                pending = f"{pending} {piece}" if pending else piece
                last = pending.rsplit(None, 1)[-1].lower() if pending.strip() else ""
                if last in ABBREVIATIONS:
                    continue  # "e.g. Foo" does not end a sentence
                tokens = [t.lower() for t in _WORD.findall(pending)]
                if tokens:
                    sentences += 1
                    words += len(tokens)
                    vocab.update(tokens)
                pending = ""
        return sentences, words, len(vocab)


def inputs(copies: int) -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    return files * copies


def burn(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def timed_ceiling(n: int, processes: int) -> float:
    import multiprocessing

    start = time.perf_counter()
    if processes == 1:
        burn(n)
    else:
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            pool.map(burn, [n // processes] * processes)
    return time.perf_counter() - start


def timed(files: list[str], processes: int, start_method) -> tuple[float, list]:
    start = time.perf_counter()
    out = SentenceStats().multi_process_data(files, process_count=processes,
                                             mp_context=start_method)
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--copies", type=int, default=3, help="process each file N times")
    parser.add_argument("--start-method", default=None,
                        help="multiprocessing start method (default: sailfin's choice)")
    add_load_options(parser)
    opts = parser.parse_args()
    load = load_check(opts, "preprocess.py")
    files = inputs(opts.copies)
    size = sum(os.path.getsize(f) for f in files) / 1e6
    print(f"{len(files)} files, {size:.1f} MB, start method {opts.start_method or 'default'}, "
          f"{os.cpu_count()} CPUs", flush=True)
    reference = SentenceStats().multi_process_data(files[:5])  # warm the page cache a bit
    # Size the busy loop to take about as long as the job on one process.
    job_seconds, _ = timed(files, 1, opts.start_method)
    probe = 2_000_000
    loop_n = int(probe * job_seconds / timed_ceiling(probe, 1))
    speedups, one, two, ceilings = [], [], [], []
    for i in range(opts.rounds):
        order = [1, 2] if i % 2 == 0 else [2, 1]
        seconds = {}
        results = {}
        for n in order:
            seconds[n], results[n] = timed(files, n, opts.start_method)
        ceiling = {n: timed_ceiling(loop_n, n) for n in order[::-1]}
        ceilings.append(ceiling[1] / ceiling[2])
        assert results[1] == results[2], "1 and 2 processes disagree"
        assert results[1][:5] == reference
        one.append(seconds[1])
        two.append(seconds[2])
        speedups.append(seconds[1] / seconds[2])
        print(f"round {i + 1}: 1 process {seconds[1]:.2f} s | 2 processes {seconds[2]:.2f} s | "
              f"speedup {speedups[-1]:.2f} | ceiling {ceilings[-1]:.2f}", flush=True)
    total = [sum(x) for x in zip(*results[1])]
    print(f"\n{total[0]:,} sentences, {total[1]:,} words")
    print(f"1 process: median {statistics.median(one):.2f} s; 2 processes: median "
          f"{statistics.median(two):.2f} s")
    print(f"speedup with 2 processes: median {statistics.median(speedups):.2f} "
          f"(min {min(speedups):.2f}, max {max(speedups):.2f})")
    efficiency = [s / c for s, c in zip(speedups, ceilings)]
    print(f"ceiling on this machine now (busy loops, 2 processes): median "
          f"{statistics.median(ceilings):.2f}; efficiency (speedup / ceiling): median "
          f"{statistics.median(efficiency):.2f}")
    summary("preprocess.py", "1-process / 2-process time (per-round speedup)", speedups, load,
            "1 per process", extra=f"ceiling {statistics.median(ceilings):.2f}, efficiency "
            f"{statistics.median(efficiency):.2f}")


if __name__ == "__main__":
    main()
