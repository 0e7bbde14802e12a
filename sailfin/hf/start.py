"""What a ``sailfin.hf`` module checks and settles when training starts (before step 1)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..trainer import Callback
from ..utils.voice import say
from .errors import HFConfigError

if TYPE_CHECKING:
    from .module import HFModule


class HFStart(Callback):
    """Before the first step: ``load_best_model_at_end`` needs a best metric; a run that
    does not clip gradients says so once (``transformers.Trainer`` clips at 1.0); under
    DP-SGD's ghost clipping, ``train_step`` returns each sample's loss (Opacus needs them).

    Example (the HF modules add it themselves)::

        Trainer(module, args, callbacks=[HFStart(module)]).train()
    """

    def __init__(self, module: "HFModule") -> None:
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
