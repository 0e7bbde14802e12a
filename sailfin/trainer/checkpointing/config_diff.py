"""On resume, compare this run's config with the one the checkpoint recorded.

The manifest's ``config`` (the ``trainer:`` section) and ``recipe`` (``module:`` and
``data:``) are compared with this run's: a key in :data:`MAY_CHANGE` is printed, any
other difference stops the run before its first step unless ``trainer.resume_config:
accept`` (docs/checkpoints-and-resume.md).

Example::

    changes = compare(recorded, current)
    [str(c) for c in changes]   # ['trainer.seed: 42 -> 7']
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

from ...config.trainer import TrainerArguments
from ...checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    from ..core.view import RunView

#: ``trainer.`` keys (or sections: a key under one matches) that may change when a run
#: resumes, and why. Anything not here defines the training and must match the checkpoint.
MAY_CHANGE: dict[str, str] = {
    # how long the run goes on (extending a run is checked against its schedulers)
    **dict.fromkeys(("epochs", "max_steps"), "the run's length"),
    # how and where a step executes: world size, strategy, precision, memory
    **dict.fromkeys(("backend", "compile", "compile_mode"), "how a step executes"),
    "amp_dtype": "precision",
    "activation_checkpointing": "memory, not the result",
    "device": "where the run executes",
    "threads": "how many CPU threads a step uses",
    **dict.fromkeys(("micro_batch_size", "gpu_batch_size_limit"),
                    "the global batch stays the same"),
    "val_batch_size": "validation batching, not the metric",
    "distributed": "process-group settings",
    "fsdp": "how the model is sharded",
    "hang_seconds": "the hang watchdog",
    # what the run reports, and when
    **dict.fromkeys(("writers", "mlflow_tracking_uri", "mlflow_experiment", "progress",
                     "progress_interval", "profile_steps", "count_flops", "peak_tflops"),
                    "reporting"),
    "log_every_n_steps": "reporting cadence",
    **dict.fromkeys(("val_every_n_epochs", "val_every_n_steps"), "validation cadence"),
    "max_val_steps_per_epoch": "validation extent",
    "sanity_val_batches": "a start-up check",
    "ema": "an averaged copy of the weights, beside the training",
    "early_stopping": "when the run ends",
    "compile_check": "a start-up measurement",
    "preemption_check_every_n_steps": "how soon a SIGTERM is acted on",
    "on_nonfinite": "what a non-finite loss does",
    # the privacy budget: the accountant composes what was spent with what follows
    "dp.noise_multiplier": "the noise of the steps to come (epsilon composes)",
    "dp.target_epsilon": "a bound on the whole run, checked before the first step",
    "dp.max_epsilon": "when the run stops",
    # where outputs and checkpoints go, how often, and how this run starts
    "output_dir": "where outputs go",
    "checkpoint": "checkpoint cadence and place",
    **dict.fromkeys(("resume", "resume_config"), "how this run starts"),
    "init_from": "not used when resuming",
}


@dataclass(frozen=True)
class Change:
    """One key whose value differs between the checkpoint and this run."""

    key: str
    before: Any
    after: Any
    allowed: bool

    def __str__(self) -> str:
        return f"{self.key}: {_show(self.before)} -> {_show(self.after)}"


class ConfigChanged(CheckpointError):
    """This run's config differs from the checkpoint's in keys that define the training."""


def may_change(key: str) -> bool:
    """Whether the dotted ``key`` (``trainer.checkpoint.every_n_steps``) may change on resume."""
    section, _, rest = key.partition(".")
    if section != "trainer":
        return False  # module and data arguments define the training
    parts = rest.split(".")
    return any(".".join(parts[:i]) in MAY_CHANGE for i in range(1, len(parts) + 1))


def compare(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[Change]:
    """The differing keys of two resolved configs (``{"trainer": ..., "module": ...}``).
    A section the checkpoint did not record is not compared; a ``trainer`` key it lacks
    (added to sailfin since) is compared with that key's default."""
    defaults = _flatten({"trainer": _plain(dataclasses.asdict(TrainerArguments()))})
    before = _flatten({k: v for k, v in _plain(recorded).items() if k in current})
    after = _flatten({k: v for k, v in _plain(current).items() if k in recorded})
    changes = []
    for key in sorted(set(after)):
        old = before.get(key, defaults.get(key, _ABSENT))
        if old is _ABSENT and key.startswith("trainer."):
            continue  # a key this sailfin does not know the default of
        if old != after[key]:
            changes.append(Change(key, old, after[key], may_change(key)))
    for key in sorted(set(before) - set(after)):
        if not key.startswith("trainer."):  # a module or data argument left out
            changes.append(Change(key, before[key], _ABSENT, False))
    return changes


def recorded_config(manifest: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """The resolved config a checkpoint recorded (None: written before sailfin recorded it)."""
    if not isinstance(manifest.get("config"), dict):
        return None
    out: dict[str, Any] = {"trainer": manifest["config"]}
    recipe = manifest.get("recipe")
    if isinstance(recipe, dict):
        out.update(recipe)
    return out


def current_config(trainer: "RunView") -> dict[str, Any]:
    """This run's resolved config, in the form :func:`recorded_config` returns."""
    return {"trainer": dataclasses.asdict(trainer.args), **(recipe_spec(trainer) or {})}


def recipe_spec(trainer: "RunView") -> Optional[dict[str, Any]]:
    """The ``module:``/``data:`` sections this run was built from, when known: from the
    hparams ``sailfin train`` passes, or from ``RunConfig.build()`` (``module.sailfin_config``)."""
    for source in (trainer.hparams,
                   getattr(trainer.module, "sailfin_config", None)):
        if isinstance(source, Mapping) and isinstance(source.get("module"), Mapping) \
                and source["module"].get("class_path"):
            return {k: source[k] for k in ("module", "data") if k in source}
    return None


def check_config(trainer: "RunView", manifest: Mapping[str, Any], where: str,
                 say: Any) -> list[Change]:
    """Stop on a change that defines the training (unless accepted); print the others."""
    recorded = recorded_config(manifest)
    if recorded is None:
        if trainer.dist.is_main:
            say(f"resume: {where} records no config (an older sailfin wrote it); not compared")
        return []
    changes = compare(recorded, current_config(trainer))
    blocking = [c for c in changes if not c.allowed]
    if blocking and trainer.args.resume_config != "accept":
        raise ConfigChanged(_refusal(trainer, where, blocking))
    if trainer.dist.is_main:
        for change in changes:
            note = ("accepted (trainer.resume_config: accept)" if not change.allowed
                    else MAY_CHANGE.get(change.key.split(".")[1], "may change on a resume"))
            say(f"resume: config changed since the checkpoint: {change} ({note})")
    return changes


def _refusal(trainer: "RunView", where: str, blocking: list[Change]) -> str:
    from .memory_snapshots import start_afresh  # (it imports the saver, which imports us)

    lines = "\n".join(f"    {c}" for c in blocking)
    return (
        f"this run's config differs from that of checkpoint {where} in "
        f"{len(blocking)} key(s) that define the training (checkpoint value -> this run's):\n"
        f"{lines}\n"
        "Resuming would continue the checkpoint's run with other settings. Either:\n"
        "  - start a new run: --trainer.output_dir NEW_DIR (add --trainer.init_from "
        f"{where} to start it from these weights only), or "
        f"{start_afresh(trainer)} to start afresh here;\n"
        "  - or continue this run with the new values: --trainer.resume_config accept")


_ABSENT = type("Absent", (), {"__repr__": lambda self: "(not set)"})()


def _show(value: Any) -> str:
    return repr(value) if value is _ABSENT else json.dumps(value)


def _plain(value: Any) -> Any:
    """The value as the JSON manifest holds it (tuples become lists...)."""
    return json.loads(json.dumps(value, default=str))


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):  # an empty mapping adds no key: {} and unset agree
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out
