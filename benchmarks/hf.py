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

``--peft``: the same comparison with LoRA (the same ``peft`` config: r 8, alpha 16,
dropout 0, the model's default target modules) on both sides, sailfin's
``module.init_args.peft`` against ``get_peft_model`` handed to ``Trainer``; also run each
round: sailfin's full fine-tune, for the peak memory of LoRA against it. Printed too:
training tokens per second of each arm and its peak memory (CUDA: peak allocated; CPU:
peak RSS). ``--model llama`` trains a Llama-shaped classifier from a config
(``--hidden``, ``--layers``: a few hundred million parameters by default) instead of the
tiny BERT; ``--amp`` runs both in bfloat16 autocast (sailfin ``sp-amp``, Trainer
``bf16``).

    python benchmarks/hf.py                    # 3 rounds, each in both orders
    python benchmarks/hf.py --rounds 1 --allow-load    # a quick look
    python benchmarks/hf.py --peft --model llama --amp --rounds 1   # on a GPU
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
sys.path.insert(0, ROOT)  # prepare() imports sailfin in this process
BERT = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "intermediate_size": 128, "max_position_embeddings": 128}
TRAIN_ROWS, VAL_ROWS, BATCH, EPOCHS, LR = 3000, 300, 32, 3, 5e-4
PEFT = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0}  # --peft: the same on both sides
BERT_BASE = {"model_type": "bert", "hidden_size": 768, "num_hidden_layers": 12,
             "num_attention_heads": 12, "intermediate_size": 3072,
             "max_position_embeddings": 512}  # --model bert-base: BERT-base's shape
MODEL = dict(BERT)  # --model llama: llama(--hidden, --layers)
EXTRA = {"peft": None, "amp": False}  # what --peft and --amp give every arm


def llama(hidden: int, layers: int) -> dict:
    """A Llama-shaped model from a config: ``hidden`` wide, ``layers`` deep."""
    heads = max(1, hidden // 64)
    return {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": heads,
            "intermediate_size": hidden * 11 // 4, "max_position_embeddings": 128}

SAILFIN_CONFIG = """
data:
  class_path: sailfin.hf.TextData
  init_args: {{tokenizer: {init}, train_file: {train}, val_file: {val}, max_length: 128}}
module:
  class_path: sailfin.hf.SequenceClassification
  init_args: {{model_name_or_path: {init}, lr: {lr}{peft}}}
trainer:
  backend: {backend}
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
extra = json.loads(sys.argv[8])  # {"peft": fields or null, "amp": bool}
tok = AutoTokenizer.from_pretrained(init)
rows = {name: [json.loads(line) for line in open(path)]
        for name, path in (("train", train_file), ("val", val_file))}
labels = sorted({r["label"] for r in rows["train"]})
label2id = {x: i for i, x in enumerate(labels)}

def peak_bytes():
    import resource, torch
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
'''

HF_SCRIPT = READ_ROWS + r'''
import numpy as np
import torch
import transformers
from transformers import (AutoModelForSequenceClassification, DataCollatorWithPadding,
                          Trainer, TrainingArguments)

def encode(part):
    enc = tok([r["text"] for r in part], truncation=True, max_length=128)
    return [{"input_ids": ids, "attention_mask": mask, "labels": label2id[r["label"]]}
            for ids, mask, r in zip(enc["input_ids"], enc["attention_mask"], part)]

train, val = encode(rows["train"]), encode(rows["val"])
model = AutoModelForSequenceClassification.from_pretrained(init)
if extra["peft"]:
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", **extra["peft"]))

def accuracy(pred):
    return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())}

args = TrainingArguments(output_dir=out, per_device_train_batch_size=int(batch),
                         per_device_eval_batch_size=int(batch), num_train_epochs=int(epochs),
                         learning_rate=float(lr), eval_strategy="epoch", save_strategy="no",
                         report_to=[], seed=0, disable_tqdm=True, bf16=extra["amp"],
                         use_cpu=not torch.cuda.is_available())
trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val,
                  data_collator=DataCollatorWithPadding(tok), compute_metrics=accuracy)
result = trainer.train()
trainer.save_model(out + "/final")
evals = sum(e["eval_runtime"] for e in trainer.state.log_history if "eval_runtime" in e)
accuracy = [e["eval_accuracy"] for e in trainer.state.log_history if "eval_accuracy" in e]
print(json.dumps({"loop_s": result.metrics["train_runtime"] - evals,
                  "accuracy": accuracy[-1], "peak_bytes": peak_bytes()}))
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
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = AutoModelForSequenceClassification.from_pretrained(init)
if extra["peft"]:
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", **extra["peft"]))
model.to(device)
amp = torch.autocast(device.type, torch.bfloat16, enabled=extra["amp"])
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
        with amp:
            loss = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                         labels=y.to(device)).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    loop += time.perf_counter() - began
    model.eval()
    right = 0
    with torch.inference_mode():
        for ids, mask, y in torch.utils.data.DataLoader(val, batch_size=batch,
                                                        collate_fn=collate):
            with amp:
                logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            right += int((logits.argmax(-1).cpu() == y).sum())
    accuracy = right / len(val)
model.save_pretrained(out + "/final")
print(json.dumps({"loop_s": loop, "accuracy": accuracy, "peak_bytes": peak_bytes()}))
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
    module = SequenceClassification(data, config=dict(MODEL), save_hf=False)
    module.model.save_pretrained(paths["init"])
    data.tokenizer.save_pretrained(paths["init"])
    params = sum(p.numel() for p in module.model.parameters())
    # Tokens one epoch trains on (padding aside): the same for every arm.
    paths["tokens"] = sum(len(x["input_ids"]) for x in data.datasets["train"])
    print(f"model: {MODEL['model_type']} hidden {MODEL['hidden_size']}, "
          f"{MODEL['num_hidden_layers']} layers, {params / 1e6:.2f} M parameters; "
          f"{len(parts['train'])} train rows, {len(parts['val'])} validation rows, batch "
          f"{BATCH}, {EPOCHS} epochs, lr {LR}", flush=True)
    return paths


def run_sailfin(paths: dict[str, str], work: str, env: dict, full: bool = False) -> dict:
    """``full``: without peft, whatever --peft says (LoRA's memory is measured against it)."""
    out = tempfile.mkdtemp(dir=work)
    config = os.path.join(out, "run.yaml")
    peft = None if full else EXTRA["peft"]
    with open(config, "w") as fh:
        fh.write(SAILFIN_CONFIG.format(init=paths["init"], train=paths["train"],
                                       val=paths["val"], lr=LR, epochs=EPOCHS, batch=BATCH,
                                       out=os.path.join(out, "run"),
                                       peft=f", peft: {json.dumps(peft)}" if peft else "",
                                       backend="sp-amp" if EXTRA["amp"] else "sp"))
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "sailfin", "train", config], env=env,
                          capture_output=True, text=True, cwd=out)
    wall = time.perf_counter() - began
    if proc.returncode:
        raise SystemExit(f"sailfin failed:\n{proc.stderr[-3000:]}")
    done = json.load(open(os.path.join(out, "run", "summary.json")))
    peak = done["peak_memory"]
    return {"command_s": wall, "loop_s": done["train_seconds"],
            "accuracy": done["val"]["accuracy"],
            "peak_bytes": peak["cuda_max_allocated_bytes"] or peak["cpu_rss_bytes"]}


def run_sailfin_full(paths: dict[str, str], work: str, env: dict) -> dict:
    return run_sailfin(paths, work, env, full=True)


def run_script(script: str, who: str, paths: dict[str, str], work: str, env: dict) -> dict:
    out = tempfile.mkdtemp(dir=work)
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script, paths["init"], paths["train"],
                           paths["val"], out, str(BATCH), str(EPOCHS), str(LR),
                           json.dumps(EXTRA)], env=env,
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
    parser.add_argument("--peft", action="store_true",
                        help="LoRA on every arm (the same peft config), and sailfin's full "
                             "fine-tune for the peak memory")
    parser.add_argument("--model", choices=("bert", "bert-base", "llama"), default="bert",
                        help="the tiny BERT, BERT-base's shape (110 M parameters with its "
                             "vocabulary; here the generated rows' small one), or a "
                             "Llama-shaped model of --hidden x --layers")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where every arm trains (auto: the GPU when torch sees one)")
    parser.add_argument("--hidden", type=int, default=1024, help="--model llama: width")
    parser.add_argument("--layers", type=int, default=24, help="--model llama: depth")
    parser.add_argument("--amp", action="store_true", help="bfloat16 autocast on every arm")
    add_load_options(parser)
    opts = parser.parse_args()
    global MODEL
    if opts.model == "llama":
        MODEL = llama(opts.hidden, opts.layers)
    elif opts.model == "bert-base":
        MODEL = dict(BERT_BASE)
    EXTRA.update(peft=dict(PEFT) if opts.peft else None, amp=opts.amp)
    load = start(opts, "hf.py")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if opts.threads is not None:
        env["OMP_NUM_THREADS"] = str(opts.threads)
    if opts.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device here")
        print(f"hf.py: on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    elif opts.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # every arm's process sees no GPU
    threads = env.get("OMP_NUM_THREADS", "torch default")
    runs = {"sailfin": run_sailfin, "hf": run_hf,
            **({"sailfin-full": run_sailfin_full} if opts.peft else {}),
            **({} if opts.no_floor else {"floor": run_floor})}
    with tempfile.TemporaryDirectory() as work:
        paths = prepare(work)
        command, loop, memory = [], [], []
        over_floor: dict[str, list[float]] = {"sailfin": [], "hf": []}
        for i in range(opts.rounds):
            for order in (tuple(runs), tuple(reversed(runs))):
                got = {name: runs[name](paths, work, env) for name in order}
                command.append(got["sailfin"]["command_s"] / got["hf"]["command_s"])
                loop.append(got["sailfin"]["loop_s"] / got["hf"]["loop_s"])
                if "floor" in got:
                    for name in over_floor:
                        over_floor[name].append(got[name]["loop_s"] / got["floor"]["loop_s"])
                if opts.peft:
                    memory.append(got["sailfin"]["peak_bytes"] / got["sailfin-full"]["peak_bytes"])
                print(f"round {i + 1} (in order: {', '.join(order)}): " + " | ".join(
                    f"{k} command {v['command_s']:.2f} s, loop {v['loop_s']:.2f} s, "
                    f"{EPOCHS * paths['tokens'] / v['loop_s']:.0f} tokens/s, peak "
                    f"{v['peak_bytes'] / 2**20:.0f} MiB, accuracy {v['accuracy']:.3f}"
                    for k, v in got.items())
                    + f" | load1 {os.getloadavg()[0]:.2f}", flush=True)
        print(f"sailfin.hf / HF Trainer time (below 1: sailfin faster), threads {threads}:")
        print(f"  whole command  {spread(command)}")
        print(f"  training loop  {spread(loop)}")
        if memory:
            print(f"peak memory, sailfin LoRA / sailfin full fine-tune: {spread(memory)}")
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
                               f"(min {min(loop):.3f}, max {max(loop):.3f}){floor}; goal <= "
                               + ("0.95 (LoRA)" if opts.peft else "0.9"))


if __name__ == "__main__":
    main()
