"""HFModule: a ``transformers`` model as a sailfin recipe (the part every task shares), and
HFStart: what it checks and settles when training starts."""

from __future__ import annotations

import inspect
import math
import os
import typing
from typing import Any, Callable, Optional

import torch

from ..backends.fsdp_units import select_units
from ..interfaces import ModuleInterface
from ..trainer import Callback
from ..utils.voice import say
from .errors import HFConfigError, require
from .text_data import TextData


class HFModule(ModuleInterface):
    """The model (``model_name_or_path`` or a ``config:`` block), AdamW with a linear
    schedule after warm-up (no weight decay on 1-D parameters, as HF ``Trainer``),
    dynamic-padding loaders, a loss per sample (``loss_per: sample``) or the model's
    own token mean (``token``), FSDP units and FLOPs from the model, ``final/hf/``.

    Subclasses set ``task`` and ``auto_class`` and implement ``val_step`` /
    ``on_end_val_epoch``. Example (a subclass in use)::

        module = CausalLM(data, config={"model_type": "gpt2", "n_layer": 2, "n_embd": 32,
                                        "n_head": 2, "n_positions": 128})
    """

    task = ""
    auto_class = ""
    shift_labels: Optional[bool] = None  # per-token labels: shifted (causal) or not
    per_sample_losses = False  # train_step returns each sample's loss (set by HFStart)
    save_bare_weights = False  # final/hf/ is the bare model (from_pretrained)

    def __init__(self, data: TextData, model_name_or_path: Optional[str] = None,
                 config: Optional[dict[str, Any]] = None, lr: float = 5e-5,
                 weight_decay: float = 0.0, warmup_steps: int = 0,
                 adam_betas: tuple[float, float] = (0.9, 0.999), adam_eps: float = 1e-8,
                 activation_checkpointing: bool = False,
                 fsdp_units: Optional[list[str]] = None, save_hf: bool = True,
                 loss_per: str = "sample", warmup_ratio: float = 0.0,
                 peft: Optional[dict[str, Any]] = None, peft_merge: bool = False,
                 load_best_model_at_end: bool = False) -> None:
        super().__init__()
        if not 0.0 <= warmup_ratio < 1.0:
            raise HFConfigError(f"module.init_args.warmup_ratio is {warmup_ratio}; use a "
                                "fraction of the run's steps in [0, 1)")
        if warmup_ratio and warmup_steps:
            raise HFConfigError(f"module.init_args.warmup_steps ({warmup_steps}) and "
                                f"warmup_ratio ({warmup_ratio}) are both set; keep one")
        if peft_merge and peft is None:
            raise HFConfigError("module.init_args.peft_merge is true but peft is not set; "
                                "give peft: {r: 8, ...} or remove peft_merge")
        if loss_per not in ("sample", "token"):
            raise HFConfigError(f"module.init_args.loss_per is '{loss_per}'; use 'sample' or "
                                "'token'")
        if not isinstance(data, TextData):
            raise HFConfigError(f"{type(self).__name__} needs data of class sailfin.hf.TextData "
                                f"(data.class_path), got {type(data).__name__}")
        if (model_name_or_path is None) == (config is None):
            raise HFConfigError(f"module.init_args: give exactly one of model_name_or_path "
                                f"(a save_pretrained directory) and config (a model from "
                                f"scratch), got {'both' if config else 'neither'}")
        self.data, self.tokenizer = data.prepare(self.task), data.tokenizer
        self.lr, self.weight_decay, self.loss_per = lr, weight_decay, loss_per
        self.warmup_steps, self.warmup_ratio = warmup_steps, warmup_ratio
        self.adam_betas, self.adam_eps = tuple(adam_betas), adam_eps
        self.peft_merge, self.load_best_model_at_end = peft_merge, load_best_model_at_end
        self.fsdp_units, self.save_hf = fsdp_units, save_hf
        self.model = self._build(model_name_or_path, config)
        self._check_model()
        if activation_checkpointing:  # the model's own per-block checkpointing
            if not getattr(self.model, "supports_gradient_checkpointing", False):
                raise HFConfigError(f"module.init_args.activation_checkpointing: "
                                    f"{type(self.model).__name__} does not support it; set it "
                                    "false")
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        self.peft = None
        if peft is not None:  # LoRA & co.: the base frozen, the adapters (and head) train
            from .adapters import TASK_TYPES, apply_peft, peft_config

            self.peft = peft_config(peft, TASK_TYPES[self.task])
            self.model = apply_peft(self, self.model, self.peft)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A task's __init__ passes **kwargs on to HFModule's: its signature is the union,
        # so the config loader refuses an unknown init_args key in one line.
        super().__init_subclass__(**kwargs)
        cls.__signature__ = _merged_signature(cls)

    # -- the model -------------------------------------------------------------------
    def model_kwargs(self) -> dict[str, Any]:
        """Task settings given to the model's config (``num_labels``, ...)."""
        return {}

    def _build(self, path: Optional[str], config: Optional[dict[str, Any]]) -> Any:
        transformers = require("transformers")
        auto = getattr(transformers, self.auto_class)
        if path is not None:
            if os.path.isabs(path) or path.startswith(".") or os.path.isdir(path):
                if not os.path.isfile(os.path.join(path, "config.json")):
                    raise HFConfigError(f"module.init_args.model_name_or_path: '{path}' has no "
                                        "config.json; give a directory written by "
                                        "save_pretrained (or use config: to start from scratch)")
            if torch.get_default_device().type == "meta":
                # Under fsdp, a rank other than 0 builds the same model on the meta device
                # from the config alone and receives its rows from rank 0: it reads no
                # weights file.
                cfg = transformers.AutoConfig.from_pretrained(path, **self.model_kwargs())
                return auto.from_config(cfg, dtype=_saved_dtype(cfg))
            return auto.from_pretrained(path, **self.model_kwargs())
        spec = dict(config)
        model_type = spec.pop("model_type", None)
        if not model_type:
            raise HFConfigError("module.init_args.config needs model_type (bert, gpt2, bart, "
                                "...) and that model's config fields")
        tok = self.tokenizer
        filled = {"vocab_size": len(tok), "pad_token_id": tok.pad_token_id,
                  "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
        if self.task == "seq2seq":
            filled["decoder_start_token_id"] = tok.bos_token_id
        cfg = transformers.AutoConfig.for_model(model_type, **{**filled, **spec},
                                                **self.model_kwargs())
        return auto.from_config(cfg)

    def _check_model(self) -> None:
        cfg = self.model.config
        vocab = getattr(cfg, "vocab_size", None)
        if vocab is not None and len(self.tokenizer) > vocab:
            raise HFConfigError(f"the tokenizer ({self.data.tokenizer_path}) has "
                                f"{len(self.tokenizer)} tokens, the model's vocab_size is "
                                f"{vocab}; use the model's own tokenizer or a larger vocab_size")
        offset = position_offset(self.model)
        lengths = [("max_length", self.data.max_length)]
        if self.task == "seq2seq":
            lengths.append(("target_max_length", self.data.target_max_length))
        for key in ("max_position_embeddings", "n_positions"):
            limit = getattr(cfg, key, None)
            if not isinstance(limit, int):
                continue
            for name, length in lengths:
                if limit - offset >= length:
                    continue
                why = (f" less its position offset {offset} (its positions start after "
                       f"padding_idx {offset - 1})" if offset else "")
                raise HFConfigError(f"data.init_args.{name} is {length}, more than the "
                                    f"{limit - offset} tokens {type(self.model).__name__} "
                                    f"takes (its {key} {limit}{why}); lower {name} to "
                                    f"{limit - offset}")

    # -- optimizer and schedule --------------------------------------------------------
    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: int, epochs: int
                                  ) -> tuple[list[torch.optim.Optimizer], list]:
        transformers = require("transformers")
        decay, no_decay = [], []
        for p in self.model.parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)  # biases, norm weights: 1-D
        # The fused kernel (one pass over all parameters) where torch has it for plain
        # tensors: several times faster than the per-parameter loop torch uses on CPU.
        fused = {"fused": True} if fusable(decay + no_decay) else {}
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": self.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=self.lr, betas=self.adam_betas, eps=self.adam_eps, **fused)
        total = estimated_global_steps_per_epoch * epochs
        # warmup_ratio as HF Trainer counts it: rounded up, of the run's optimizer steps.
        warmup = math.ceil(total * self.warmup_ratio) if self.warmup_ratio else self.warmup_steps
        self.warmup_in_effect = warmup
        sched = transformers.get_linear_schedule_with_warmup(opt, warmup, total)
        sched.total_steps = total  # the trainer checks a run fits in it
        return [opt], [sched]

    # -- data ---------------------------------------------------------------------------
    def get_train_dataloader(self, sampler: Callable[[Any], Any], batch_size: int
                             ) -> torch.utils.data.DataLoader:
        return self._loader(self.data.get_train_dataset(), sampler, batch_size)

    def get_val_dataloaders(self, sampler: Callable[[Any], Any], batch_size: int
                            ) -> dict[str, torch.utils.data.DataLoader]:
        return {name: self._loader(ds, sampler, batch_size)
                for name, ds in self.data.get_val_datasets().items()}

    def _loader(self, ds: Any, sampler: Callable[[Any], Any], batch_size: int) -> Any:
        return torch.utils.data.DataLoader(ds, batch_size=batch_size, sampler=sampler(ds),
                                           collate_fn=self.data.collate)

    # -- steps --------------------------------------------------------------------------
    def forward_batch(self, batch: dict[str, torch.Tensor], device: torch.device) -> Any:
        return self.model(**{k: v.to(device) for k, v in batch.items()})

    def train_step(self, global_step: int, batch: dict[str, torch.Tensor],
                   device: torch.device) -> torch.Tensor:
        out = self.forward_batch(batch, device)
        if self.per_sample_losses:  # DP-SGD's ghost clipping: each sample's loss (HFStart)
            labels = batch["labels"].to(device)
            if self.shift_labels is None:
                return torch.nn.functional.cross_entropy(out.logits.float(), labels,
                                                         reduction="none")
            nll, tokens = token_nll(out.logits, labels, self.shift_labels)
            return nll / tokens.clamp(min=1)
        if self.shift_labels is None or self.loss_per == "token":
            return out.loss  # the model's own: a mean over this micro-batch's tokens
        # The mean over samples of each sample's mean token loss: sailfin weights each
        # micro-batch by its samples, so this is the same whatever the micro-batch and
        # world size (a mean over one micro-batch's tokens is not: loss_per: token).
        nll, tokens = token_nll(out.logits, batch["labels"].to(device), self.shift_labels)
        return (nll / tokens.clamp(min=1)).mean()

    # -- sharding, FLOPs, outputs ---------------------------------------------------------
    def load_exported(self, path: str) -> None:
        """``sailfin evaluate/predict --checkpoint DIR``: a ``save_pretrained`` or PEFT
        adapter directory (``final/hf``) into this recipe's model."""
        from .predict import load_exported
        load_exported(self, path)

    def configure_sharding(self, shard: Callable[[torch.nn.Module], torch.nn.Module]) -> None:
        """FSDP units, innermost first: every submodule of a class in ``fsdp_units``, or
        the model's ``_no_split_modules`` (or, where it has none, its repeated blocks,
        less those holding one side of a tie)."""
        model, classes = self.model, self.fsdp_units
        if not classes:
            chosen = select_units(model, None)
        else:
            present = {type(m).__name__ for m in model.modules()}
            for i, name in enumerate(classes):
                if name not in present:
                    raise HFConfigError(f"module.init_args.fsdp_units[{i}] is '{name}', but "
                                        f"{type(model).__name__} has no submodule of that "
                                        "class")
            chosen = [(name, m) for name, m in model.named_modules()
                      if m is not model and type(m).__name__ in set(classes)]
            chosen.sort(key=lambda item: -item[0].count("."))  # children before their parents
        for _, module in chosen:
            shard(module)

    def flops_per_sample(self) -> Optional[float]:
        """The model's own count for a sample of the train set's mean length:
        ``floating_point_ops`` where the model has it (transformers < 5), else its
        formula, 6 x non-embedding parameters x tokens (forward and backward)."""
        if not self.data.mean_tokens:
            return None
        tokens = max(1, round(self.data.mean_tokens))
        count = getattr(self.model, "floating_point_ops", None)
        if callable(count):
            return float(count({"input_ids": torch.zeros(1, tokens, dtype=torch.long)}))
        return 6.0 * self.model.num_parameters(exclude_embeddings=True) * tokens

    def configure_callbacks(self) -> list:
        from .export import SavePretrained

        return [HFStart(self)] + ([SavePretrained(self)] if self.save_hf else [])


def position_offset(model: torch.nn.Module) -> int:
    """Positions a model's embeddings skip: RoBERTa and XLM-R number positions from
    ``padding_idx + 1``, so ``max_position_embeddings - padding_idx - 1`` tokens fit."""
    for module in model.modules():
        pad = getattr(module, "padding_idx", None)
        if hasattr(module, "position_embeddings") and isinstance(pad, int):
            return pad + 1
    return 0


def _merged_signature(cls: type) -> inspect.Signature:
    """The keyword parameters of ``cls.__init__`` and of each ``__init__`` up the MRO its
    ``**kwargs`` reach (to HFModule's), with their evaluated annotations."""
    params: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        hints = typing.get_type_hints(init)
        more = False
        for p in list(inspect.signature(init).parameters.values())[1:]:
            if p.kind is p.VAR_KEYWORD:
                more = True
            elif p.kind is not p.VAR_POSITIONAL and p.name not in params:
                params[p.name] = p.replace(kind=p.KEYWORD_ONLY,
                                           annotation=hints.get(p.name, p.annotation))
        if not more or klass is HFModule:
            break
    return inspect.Signature(list(params.values()))


def _saved_dtype(cfg: Any) -> Optional[torch.dtype]:
    """The dtype ``from_pretrained`` gives the weights: the one saved in the config."""
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def token_nll(logits: torch.Tensor, labels: torch.Tensor, shift: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's summed token loss and its count of labelled tokens (-100: skipped);
    ``shift``: token t predicts label t + 1 (causal)."""
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), labels,
                                            ignore_index=-100, reduction="none")
    return nll.sum(1), (labels != -100).sum(1)


def fusable(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW takes ``params``: plain floating-point tensors (not
    fsdp's DTensors) on the CPU or a CUDA device."""
    return bool(params) and all(
        type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda")
        and p.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
        for p in params)


class HFStart(Callback):
    """Before the first step: ``load_best_model_at_end`` needs a best metric; a run that
    does not clip gradients says so once (``transformers.Trainer`` clips at 1.0); under
    ghost clipping ``train_step`` returns each sample's loss.

    Example (the HF modules add it themselves)::

        Trainer(module, args, callbacks=[HFStart(module)]).train()
    """

    def __init__(self, module: HFModule) -> None:
        self.module = module

    def on_train_start(self, trainer: Any) -> None:
        args, module = trainer.args, self.module
        if module.load_best_model_at_end and not args.checkpoint.best_metric:
            raise HFConfigError("module.init_args.load_best_model_at_end needs "
                                "trainer.checkpoint.best_metric (the validation metric that "
                                "picks the best checkpoint, e.g. loss)")
        private = args.backend.endswith("-dp")
        module.per_sample_losses = private and args.dp.clipping == "ghost"
        if module.per_sample_losses and module.loss_per == "token":
            raise HFConfigError("module.init_args.loss_per token does not combine with "
                                "trainer.dp.clipping ghost (Opacus needs each sample's "
                                "loss); use loss_per: sample")
        if args.max_grad_norm is None and not private and trainer.dist.is_main \
                and trainer.global_step == 0:
            # The one default that changes results when a Trainer script is ported.
            say("sailfin.hf: trainer.max_grad_norm is null: gradients are not clipped "
                "(transformers.Trainer clips at 1.0 by default; set trainer.max_grad_norm: "
                "1.0 for the same)")
