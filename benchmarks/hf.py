"""sailfin.hf vs Hugging Face ``Trainer``: the same run, as each one's user writes it.

The same tiny BERT classifier (a ``save_pretrained`` directory both start from), the
same generated rows (3,000 to train, 300 to validate, JSON lines), batch 32, 3 epochs,
AdamW at lr 5e-4 with a linear schedule, validation (loss, accuracy) after each epoch,
the final model saved. sailfin: ``sailfin train run.yaml`` with default settings
(``sailfin.hf.TextData`` + ``SequenceClassification``). Hugging Face: a script that
tokenizes the rows with the tokenizer, pads with ``DataCollatorWithPadding``, trains with
``Trainer`` (``eval_strategy="epoch"``, ``compute_metrics`` for accuracy) and calls
``save_model``. Each run is a fresh process; the rounds alternate which goes first.

Printed per round, as sailfin / HF time ratios (below 1: sailfin is faster):

- whole command: from starting the process to its exit (imports, tokenizing, building,
  training, validating, saving);
- training loop: the epochs' optimizer steps alone (sailfin's ``train_seconds``; HF's
  ``train_runtime`` less its evaluations' ``eval_runtime``).

A third run in each round is the floor: a plain PyTorch loop over the same model, rows,
tokenizer, padding per batch, fused AdamW and linear schedule, with nothing but the
forward, backward and optimizer step in its timed loop (``--no-floor`` leaves it out).
Each framework's loop time over the floor's is what that framework adds to the model's
own work; sailfin / HF cannot go below floor / HF on this model.

    python benchmarks/hf.py                    # 3 rounds, each in both orders
    python benchmarks/hf.py --rounds 1 --allow-load    # a quick look
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
from _measure import add_load_options, spread, start, summary  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BERT = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "intermediate_size": 128, "max_position_embeddings": 128}
TRAIN_ROWS, VAL_ROWS, BATCH, EPOCHS, LR = 3000, 300, 32, 3, 5e-4

SAILFIN_CONFIG = """
data:
  class_path: sailfin.hf.TextData
  init_args: {{tokenizer: {init}, train_file: {train}, val_file: {val}, max_length: 128}}
module:
  class_path: sailfin.hf.SequenceClassification
  init_args: {{model_name_or_path: {init}, lr: {lr}}}
trainer:
  epochs: {epochs}
  train_batch_size: {batch}
  seed: 0
  output_dir: {out}
"""

# Both scripts start alike: the arguments, the tokenizer, the rows and their labels.
READ_ROWS = r'''
import json, sys, time
from transformers import AutoTokenizer

init, train_file, val_file, out, batch, epochs, lr = sys.argv[1:8]
tok = AutoTokenizer.from_pretrained(init)
rows = {name: [json.loads(line) for line in open(path)]
        for name, path in (("train", train_file), ("val", val_file))}
labels = sorted({r["label"] for r in rows["train"]})
label2id = {x: i for i, x in enumerate(labels)}
'''

HF_SCRIPT = READ_ROWS + r'''
import numpy as np
import transformers
from transformers import (AutoModelForSequenceClassification, DataCollatorWithPadding,
                          Trainer, TrainingArguments)

def encode(part):
    enc = tok([r["text"] for r in part], truncation=True, max_length=128)
    return [{"input_ids": ids, "attention_mask": mask, "labels": label2id[r["label"]]}
            for ids, mask, r in zip(enc["input_ids"], enc["attention_mask"], part)]

train, val = encode(rows["train"]), encode(rows["val"])
model = AutoModelForSequenceClassification.from_pretrained(init)

def accuracy(pred):
    return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())}

args = TrainingArguments(output_dir=out, per_device_train_batch_size=int(batch),
                         per_device_eval_batch_size=int(batch), num_train_epochs=int(epochs),
                         learning_rate=float(lr), eval_strategy="epoch", save_strategy="no",
                         report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val,
                  data_collator=DataCollatorWithPadding(tok), compute_metrics=accuracy)
result = trainer.train()
trainer.save_model(out + "/final")
evals = sum(e["eval_runtime"] for e in trainer.state.log_history if "eval_runtime" in e)
accuracy = [e["eval_accuracy"] for e in trainer.state.log_history if "eval_accuracy" in e]
print(json.dumps({"loop_s": result.metrics["train_runtime"] - evals,
                  "accuracy": accuracy[-1]}))
'''

FLOOR_SCRIPT = READ_ROWS + r'''
import torch
import transformers
from transformers import AutoModelForSequenceClassification

batch, epochs, lr = int(batch), int(epochs), float(lr)

def encode(part):
    ids = tok([r["text"] for r in part], truncation=True, max_length=128)["input_ids"]
    return [(torch.tensor(x), label2id[r["label"]]) for x, r in zip(ids, part)]

def collate(samples):
    ids = torch.nn.utils.rnn.pad_sequence([s[0] for s in samples], batch_first=True,
                                          padding_value=tok.pad_token_id)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(s[0]), dtype=torch.long)
                                            for s in samples], batch_first=True)
    return ids, mask, torch.tensor([s[1] for s in samples])

train, val = encode(rows["train"]), encode(rows["val"])
torch.manual_seed(0)
model = AutoModelForSequenceClassification.from_pretrained(init)
loader = torch.utils.data.DataLoader(train, batch_size=batch, shuffle=True, collate_fn=collate,
                                     generator=torch.Generator().manual_seed(0))
params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                        lr=lr, weight_decay=0.0, fused=True)
sched = transformers.get_linear_schedule_with_warmup(opt, 0, len(loader) * epochs)
loop, accuracy = 0.0, 0.0
for epoch in range(epochs):
    model.train()
    began = time.perf_counter()
    for ids, mask, y in loader:
        model(input_ids=ids, attention_mask=mask, labels=y).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    loop += time.perf_counter() - began
    model.eval()
    right = 0
    with torch.inference_mode():
        for ids, mask, y in torch.utils.data.DataLoader(val, batch_size=batch,
                                                        collate_fn=collate):
            right += int((model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
                          == y).sum())
    accuracy = right / len(val)
model.save_pretrained(out + "/final")
print(json.dumps({"loop_s": loop, "accuracy": accuracy}))
'''


def prepare(work: str) -> dict[str, str]:
    """Rows, tokenizer and the initial model directory (once, shared by every run)."""
    from sailfin import seed_everything
    from sailfin.hf import SequenceClassification, TextData
    from sailfin.hf.examples_data import stdlib_functions
    from sailfin.hf.tokenizers import train_tokenizer

    functions = list(stdlib_functions(per_package=600))
    rows = [{"text": f["source"], "label": f["package"]} for f in functions]
    if len(rows) < TRAIN_ROWS + VAL_ROWS:  # fewer functions here: each is used twice
        rows = (rows * 2)[:TRAIN_ROWS + VAL_ROWS]
    paths = {"train": os.path.join(work, "train.jsonl"), "val": os.path.join(work, "val.jsonl"),
             "init": os.path.join(work, "init")}
    # Every 11th row to validation: both splits cover every package.
    parts = {"val": rows[::11][:VAL_ROWS], "train": [r for i, r in enumerate(rows) if i % 11]}
    parts["train"] = parts["train"][:TRAIN_ROWS]
    for name in ("train", "val"):
        with open(paths[name], "w") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in parts[name]))
    tok_dir = os.path.join(work, "tokenizer")
    train_tokenizer((r["text"] for r in parts["train"]), tok_dir, vocab_size=3000)
    data = TextData(tok_dir, paths["train"], task="classification", max_length=128)
    seed_everything(0)
    module = SequenceClassification(data, config=dict(BERT), save_hf=False)
    module.model.save_pretrained(paths["init"])
    data.tokenizer.save_pretrained(paths["init"])
    params = sum(p.numel() for p in module.model.parameters())
    print(f"model: BERT hidden 64, 2 layers, {params / 1e3:.0f} k parameters; "
          f"{len(parts['train'])} train rows, {len(parts['val'])} validation rows, batch "
          f"{BATCH}, {EPOCHS} epochs, lr {LR}", flush=True)
    return paths


def run_sailfin(paths: dict[str, str], work: str, env: dict) -> dict:
    out = tempfile.mkdtemp(dir=work)
    config = os.path.join(out, "run.yaml")
    with open(config, "w") as fh:
        fh.write(SAILFIN_CONFIG.format(init=paths["init"], train=paths["train"],
                                       val=paths["val"], lr=LR, epochs=EPOCHS, batch=BATCH,
                                       out=os.path.join(out, "run")))
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "sailfin", "train", config], env=env,
                          capture_output=True, text=True, cwd=out)
    wall = time.perf_counter() - began
    if proc.returncode:
        raise SystemExit(f"sailfin failed:\n{proc.stderr[-3000:]}")
    done = json.load(open(os.path.join(out, "run", "summary.json")))
    return {"command_s": wall, "loop_s": done["train_seconds"],
            "accuracy": done["val"]["accuracy"]}


def run_script(script: str, who: str, paths: dict[str, str], work: str, env: dict) -> dict:
    out = tempfile.mkdtemp(dir=work)
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script, paths["init"], paths["train"],
                           paths["val"], out, str(BATCH), str(EPOCHS), str(LR)], env=env,
                          capture_output=True, text=True, cwd=out)
    wall = time.perf_counter() - began
    if proc.returncode:
        raise SystemExit(f"{who} failed:\n{proc.stderr[-3000:]}")
    return {"command_s": wall, **json.loads(proc.stdout.strip().splitlines()[-1])}


def run_hf(paths: dict[str, str], work: str, env: dict) -> dict:
    return run_script(HF_SCRIPT, "HF Trainer", paths, work, env)


def run_floor(paths: dict[str, str], work: str, env: dict) -> dict:
    return run_script(FLOOR_SCRIPT, "the plain loop", paths, work, env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds; each runs both, in both orders")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS for both (default: as set, else torch's choice)")
    parser.add_argument("--no-floor", action="store_true",
                        help="leave out the plain PyTorch loop (the floor)")
    add_load_options(parser)
    opts = parser.parse_args()
    load = start(opts, "hf.py")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if opts.threads is not None:
        env["OMP_NUM_THREADS"] = str(opts.threads)
    threads = env.get("OMP_NUM_THREADS", "torch default")
    runs = {"sailfin": run_sailfin, "hf": run_hf, **({} if opts.no_floor else
                                                     {"floor": run_floor})}
    with tempfile.TemporaryDirectory() as work:
        paths = prepare(work)
        command, loop = [], []
        over_floor: dict[str, list[float]] = {"sailfin": [], "hf": []}
        for i in range(opts.rounds):
            for order in (tuple(runs), tuple(reversed(runs))):
                got = {name: runs[name](paths, work, env) for name in order}
                command.append(got["sailfin"]["command_s"] / got["hf"]["command_s"])
                loop.append(got["sailfin"]["loop_s"] / got["hf"]["loop_s"])
                if "floor" in got:
                    for name in over_floor:
                        over_floor[name].append(got[name]["loop_s"] / got["floor"]["loop_s"])
                print(f"round {i + 1} ({' first, '.join(order)} second): " + " | ".join(
                    f"{k} command {v['command_s']:.2f} s, loop {v['loop_s']:.2f} s, "
                    f"accuracy {v['accuracy']:.3f}" for k, v in got.items())
                    + f" | load1 {os.getloadavg()[0]:.2f}", flush=True)
        print(f"sailfin.hf / HF Trainer time (below 1: sailfin faster), threads {threads}:")
        print(f"  whole command  {spread(command)}")
        print(f"  training loop  {spread(loop)}")
        floor = ""
        if over_floor["hf"]:
            print("training loop over the plain PyTorch loop's (the model's own work; the "
                  "floor for sailfin / HF is their quotient):")
            for name, values in over_floor.items():
                print(f"  {name:<8}       {spread(values)}")
            floor = (f"; over the plain loop: sailfin {statistics.median(over_floor['sailfin']):.3f}"
                     f", HF {statistics.median(over_floor['hf']):.3f}")
        summary("hf.py", "sailfin.hf / HF Trainer whole-command time", command, load,
                threads, extra=f"training loop {statistics.median(loop):.3f} "
                               f"(min {min(loop):.3f}, max {max(loop):.3f}){floor}; goal <= 0.9")


if __name__ == "__main__":
    main()
