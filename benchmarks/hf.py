"""sailfin.hf vs Hugging Face ``Trainer`` on the same tiny BERT classifier, data and batch.

Each variant runs in a fresh process (its own peak memory, its own imports), in
interleaved rounds; both load the same initial weights (a ``save_pretrained``
directory) and the same tokenized samples, padded per batch, AdamW with a linear
schedule, no evaluation, no checkpoints. Printed: steps/s (steady: after the first
step), peak RSS, and time to first step (building the trainer and running step 1,
after the imports and the tokenizing both share), as sailfin / HF ratios per round;
then the tokenizing throughput of ``TokenizeText`` with 1 and 2 processes.

    python benchmarks/hf.py                 # 3 rounds of 60 steps, batch 16
    python benchmarks/hf.py --rounds 1 --steps 20 --allow-load     # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import add_load_options, interleave, spread, start, summary  # noqa: E402

BERT = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "intermediate_size": 128, "max_position_embeddings": 128}


def prepare(work: str) -> None:
    """Rows, tokenizer and the initial model directory (once)."""
    from sailfin import seed_everything
    from sailfin.hf import SequenceClassification
    from sailfin.hf.examples_data import StdlibTextData

    data = StdlibTextData("classification", work, per_package=60, max_length=128)
    seed_everything(0)
    module = SequenceClassification(data, config=dict(BERT), save_hf=False)
    module.model.save_pretrained(os.path.join(work, "init"))
    data.tokenizer.save_pretrained(os.path.join(work, "init"))


def child(variant: str, work: str, steps: int, batch: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from sailfin.hf import TextData

    data = TextData(os.path.join(work, "init"), os.path.join(work, "classification-train.jsonl"),
                    task="classification", max_length=128)
    stamps: list[float] = []
    started = time.perf_counter()
    if variant == "sailfin":
        from sailfin import Callback, Trainer, TrainerArguments
        from sailfin.hf import SequenceClassification

        class Stamp(Callback):
            def on_step_end(self, trainer) -> None:
                stamps.append(time.perf_counter())

        module = SequenceClassification(data, model_name_or_path=os.path.join(work, "init"),
                                        lr=1e-3, weight_decay=0.01, warmup_steps=5,
                                        save_hf=False)
        args = TrainerArguments(epochs=100, max_steps=steps, train_batch_size=batch,
                                micro_batch_size=batch, seed=0, writers=[],
                                output_dir=tempfile.mkdtemp(dir=work), count_flops=False,
                                checkpoint={"at_epoch_end": False, "keep_last": None})
        Trainer(module, args, callbacks=[Stamp()]).train()
    else:
        import transformers

        class HFStamp(transformers.TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                stamps.append(time.perf_counter())

        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            os.path.join(work, "init"))
        targs = transformers.TrainingArguments(
            output_dir=tempfile.mkdtemp(dir=work), per_device_train_batch_size=batch,
            max_steps=steps, learning_rate=1e-3, weight_decay=0.01, warmup_steps=5,
            logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True, seed=0,
            dataloader_num_workers=0, disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=targs,
                                       train_dataset=data.datasets["train"].samples,
                                       data_collator=data.collate, callbacks=[HFStamp()])
        trainer.train()
    steady = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    from sailfin.utils.memory import peak_rss_bytes  # this child's own peak, not its parent's

    return {"steps_per_s": steady, "first_step_s": stamps[0] - started,
            "peak_rss_mib": peak_rss_bytes() / 2**20}


def run_child(variant: str, work: str, steps: int, batch: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--child", variant, "--work", work,
                          "--steps", str(steps), "--batch", str(batch)], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def tokenize_rate(work: str, processes: int) -> float:
    from sailfin.hf import TokenizeText

    train = os.path.join(work, "classification-train.jsonl")
    rows = sum(1 for _ in open(train))
    labels = sorted({json.loads(line)["label"] for line in open(train)})
    proc = TokenizeText(os.path.join(work, "init"), "classification",
                        label2id={x: i for i, x in enumerate(labels)}, max_length=128)
    per = -(-rows // (processes * 4))
    jobs = [(train, a, min(a + per, rows)) for a in range(0, rows, per)] * 4  # 4 passes
    began = time.perf_counter()
    proc.multi_process_data(jobs, process_count=processes)
    return 4 * rows / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--child", choices=["sailfin", "hf"])
    parser.add_argument("--work")
    add_load_options(parser)
    opts = parser.parse_args()
    if opts.child:
        print(json.dumps(child(opts.child, opts.work, opts.steps, opts.batch)))
        return
    load = start(opts, "hf.py")
    with tempfile.TemporaryDirectory() as work:
        prepare(work)
        variants = {name: (lambda i, n=name: run_child(n, work, opts.steps, opts.batch))
                    for name in ("sailfin", "hf")}

        def on_round(i, r):
            print(f"round {i}: " + " | ".join(
                f"{k} {v['steps_per_s']:.1f} steps/s, first step {v['first_step_s']:.2f} s, "
                f"peak {v['peak_rss_mib']:.0f} MiB" for k, v in r.items())
                + f" | load1 {os.getloadavg()[0]:.2f}", flush=True)

        rounds = interleave(opts.rounds, variants, warmup=0, on_round=on_round)
        rate = [r["sailfin"]["steps_per_s"] / r["hf"]["steps_per_s"] for r in rounds]
        first = [r["sailfin"]["first_step_s"] / r["hf"]["first_step_s"] for r in rounds]
        peak = [r["sailfin"]["peak_rss_mib"] / r["hf"]["peak_rss_mib"] for r in rounds]
        print(f"sailfin / HF Trainer, {opts.steps} steps of batch {opts.batch} "
              f"(BERT hidden 64, 2 layers), per-round ratios:")
        print(f"  steps/s        {spread(rate)}")
        print(f"  time to step 1 {spread(first)}")
        print(f"  peak RSS       {spread(peak)}")
        one, two = tokenize_rate(work, 1), tokenize_rate(work, 2)
        print(f"tokenizing (TokenizeText): {one:.0f} rows/s with 1 process, {two:.0f} with 2 "
              f"({two / one:.2f}x)")
        summary("hf.py", "sailfin.hf / HF Trainer steps/s", rate, load, 1,
                extra=f"time to first step {statistics.median(first):.3f}, peak RSS "
                      f"{statistics.median(peak):.3f}; tokenizing 2/1 processes "
                      f"{two / one:.2f}x")


if __name__ == "__main__":
    main()
