"""Loading a tokenizer with one-line errors, and training a small one on local text."""

from __future__ import annotations

import os
import shutil
from typing import Any, Iterable

from .errors import HFConfigError, require

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json",
                   "spiece.model", "sentencepiece.bpe.model", "tokenizer.model")
SPECIAL = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]",
           "sep_token": "[SEP]", "mask_token": "[MASK]", "bos_token": "[CLS]",
           "eos_token": "[SEP]"}


def load_tokenizer(path: str, key: str = "data.init_args.tokenizer") -> Any:
    """``AutoTokenizer.from_pretrained(path)`` (a fast tokenizer); a local directory
    without tokenizer files is one line naming it."""
    transformers = require("transformers")
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f))
                                       for f in TOKENIZER_FILES):
        raise HFConfigError(f"{key}: '{path}' has no tokenizer (none of "
                            f"{', '.join(TOKENIZER_FILES[:3])}...); save one there with "
                            "tokenizer.save_pretrained(dir) or point tokenizer at one")
    if not os.path.isdir(path) and (os.path.isabs(path) or path.startswith(".")):
        raise HFConfigError(f"{key}: no directory '{path}'")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:  # GPT-2 style: pad with the end-of-text token
        tok.pad_token = tok.eos_token
    return tok


def train_tokenizer(texts: Iterable[str], out_dir: str, vocab_size: int = 2000) -> Any:
    """A byte-level BPE tokenizer trained on ``texts`` (the ``tokenizers`` library),
    saved to ``out_dir`` with ``save_pretrained``: [CLS] text [SEP], [PAD] padding.

    Example::

        tok = train_tokenizer(["def f(x):", "return x"], "outputs/tok", vocab_size=300)
    """
    tk = require("tokenizers")
    transformers = require("transformers")
    model = tk.Tokenizer(tk.models.BPE(unk_token="[UNK]"))
    model.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tk.decoders.ByteLevel()
    specials = list(dict.fromkeys(SPECIAL.values()))
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                     show_progress=False)
    model.train_from_iterator(texts, trainer)
    cls, sep = model.token_to_id("[CLS]"), model.token_to_id("[SEP]")
    model.post_processor = tk.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=model, **SPECIAL)
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    fast.save_pretrained(tmp)
    if not os.path.exists(out_dir):
        os.replace(tmp, out_dir)  # whole or not at all
    else:  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return transformers.AutoTokenizer.from_pretrained(out_dir)
