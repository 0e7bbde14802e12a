"""``trainer.resume_config: accept``: the accepted values take effect.

Loading a checkpoint puts back the saved ``param_groups`` and schedulers' state, whose
old ``lr``, ``betas``, ``base_lrs``... would silently win over the recipe's new values.
These are captured before the load and put back on top after it; the schedule is
replayed from its new start to the saved step.

Example::

    fresh = FreshHyperparameters.capture(optimizers, schedulers)  # before the load
    ...                                                           # load the checkpoint
    fresh.reapply(optimizers, schedulers)   # ['optimizer 0 lr: 0.05 -> 0.5', ...]
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from .config_diff import compare, current_config, recorded_config

#: What a scheduler's state holds about where it is in the schedule (not its settings).
_POSITION = frozenset({"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step",
                       "_is_initial", "best", "num_bad_epochs", "cooldown_counter"})


@dataclass(frozen=True)
class FreshHyperparameters:
    """The hyper-parameters of optimizers and schedulers as the recipe built them."""

    groups: list[list[dict[str, Any]]]
    schedulers: list[dict[str, Any]]

    @classmethod
    def capture(cls, optimizers: Sequence[torch.optim.Optimizer],
                schedulers: Sequence[Any]) -> "FreshHyperparameters":
        groups = [[{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                   for g in opt.param_groups] for opt in optimizers]
        return cls(groups, [copy.deepcopy(s.state_dict()) for s in schedulers])

    def reapply(self, optimizers: Sequence[torch.optim.Optimizer],
                schedulers: Sequence[Any]) -> list[str]:
        """Put the captured values back over a loaded checkpoint; return what changed."""
        before = [[dict(g) for g in opt.param_groups] for opt in optimizers]
        for opt, fresh_groups in zip(optimizers, self.groups):
            for group, fresh in zip(opt.param_groups, fresh_groups):
                group.update(copy.deepcopy(fresh))  # lr: the new schedule's start
        for scheduler, fresh in zip(schedulers, self.schedulers):
            _reapply_scheduler(scheduler, fresh)
        changed = []
        for i, (opt, old_groups) in enumerate(zip(optimizers, before)):
            for j, (group, old) in enumerate(zip(opt.param_groups, old_groups)):
                for key, value in group.items():
                    if key != "params" and _differs(old.get(key), value):
                        where = f"optimizer {i}" + (f" group {j}" if len(old_groups) > 1 else "")
                        changed.append(f"{where} {key}: {_show(old.get(key))} -> {_show(value)}")
        return changed


def _reapply_scheduler(scheduler: Any, fresh: Mapping[str, Any]) -> None:
    saved = scheduler.state_dict()
    if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) and "last_epoch" in saved:
        # Replay the new schedule from its start (the lr just put back) to the saved step:
        # exact for any scheduler, chainable or not, and cheap (no tensors involved).
        steps = int(saved["last_epoch"]) - int(fresh.get("last_epoch", 0))
        scheduler.load_state_dict(copy.deepcopy(dict(fresh)))
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()"
            warnings.simplefilter("ignore")
            for _ in range(max(0, steps)):
                scheduler.step()
        return
    # ReduceLROnPlateau and others: new settings, the saved position (and lr) kept.
    merged = dict(saved)
    merged.update({k: copy.deepcopy(v) for k, v in fresh.items() if k not in _POSITION})
    scheduler.load_state_dict(merged)


def apply_accepted(trainer: Any, fresh: FreshHyperparameters, say: Any) -> Optional[list[str]]:
    """After a resume that accepted changes (``resume_config: accept``) of keys that define
    the training: the recipe's new hyper-parameters take effect."""
    loaded = trainer.resumed_from
    if loaded is None or trainer.args.resume_config != "accept":
        return None
    recorded = recorded_config(loaded.manifest)
    if recorded is None or all(c.allowed for c in compare(recorded, current_config(trainer))):
        return None
    changed = fresh.reapply(trainer.optimizers, trainer.schedulers)
    if trainer.dist.is_main:
        say("resume: accepted values in effect from step "
            f"{trainer.global_step + 1}: " + ("; ".join(changed) if changed else
                                              "optimizers and schedulers as the checkpoint had"))
    return changed


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    and a.shape == b.shape and bool(torch.equal(a, b)))
    return bool(a != b)


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_show(v) for v in value) + ")"
    return repr(value)
