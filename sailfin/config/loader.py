"""Load a run config from YAML and dotted command-line overrides.

A run config has three sections::

    data:    {class_path: pkg.module.MyData,   init_args: {...}}
    module:  {class_path: pkg.module.MyModule, init_args: {...}}   # also receives data=
    trainer: {epochs: 3, train_batch_size: 64, ...}

Overrides are ``--trainer.backend sp-amp`` or ``--trainer.backend=sp-amp``; their
types come from the schema, or for ``init_args`` from the class's signature. A top-level
``extends:`` names base files merged underneath (docs/config.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from .coerce import build_dataclass, coerce, field_types, parse_cli_value
from .errors import ConfigError, short_repr, suggest, unknown_key
from .pymarlin_args import gather_pymarlin_args, takes_pymarlin_args
from .strict_yaml import check_limits, load_yaml_file
from .trainer import TrainerArguments

SECTIONS = ("data", "module", "trainer")


@dataclass
class ComponentSpec:
    """``class_path`` plus ``init_args``: how to build a user's class."""

    class_path: str = ""
    init_args: dict = field(default_factory=dict)

    def resolve(self, section: str) -> type:
        module_name, _, attr = self.class_path.rpartition(".")
        if not module_name:
            raise ConfigError(
                f"{section}.class_path must be 'package.module.ClassName', "
                f"got {short_repr(self.class_path)}")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(
                f"{section}.class_path: cannot import module '{module_name}' ({exc}); "
                "check the name and that its directory is on PYTHONPATH") from None
        try:
            return getattr(module, attr)
        except AttributeError:
            names = [n for n in dir(module) if not n.startswith("_")]
            raise ConfigError(
                f"{section}.class_path: module '{module_name}' has no '{attr}'"
                f"{suggest(attr, names)}") from None


@dataclass
class RunConfig:
    """A whole run: the user's data and module classes and the trainer settings.

    Example::

        cfg = sailfin.load_config("config.yaml", ["--trainer.epochs", "5"])
        module = cfg.build()
        sailfin.Trainer(module, cfg.trainer).train()
    """

    data: Optional[ComponentSpec] = None
    module: ComponentSpec = field(default_factory=ComponentSpec)
    trainer: TrainerArguments = field(default_factory=TrainerArguments)

    def build(self, construct: Optional[Callable[..., Any]] = None):
        """Seed with ``trainer.seed``, then instantiate the data interface (if any) and the
        module, passing ``data=``: the same initial weights on every run and rank, as
        ``sailfin train`` builds them. The module keeps its sections as ``sailfin_config``,
        so a resume can compare them with the checkpoint's. ``construct(cls, **kwargs)``
        builds the module class (default: calls it); ``sailfin train`` passes
        one that builds under ``sailfin.sharded_build`` under fsdp (on the meta device on
        ranks but 0); the data interface is built as usual."""
        from ..utils.seed import seed_everything  # torch only when building

        seed_everything(self.trainer.seed)
        data = _instantiate(self.data, "data") if self.data is not None else None
        extra = {"data": data} if data is not None else {}
        module = _instantiate(self.module, "module", extra, construct)
        spec = {"module": dataclasses.asdict(self.module),
                "data": dataclasses.asdict(self.data) if self.data is not None else None}
        with contextlib.suppress(AttributeError):  # __slots__: the resume check sees no recipe
            module.sailfin_config = spec
        return module

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _instantiate(spec: ComponentSpec, section: str, extra: Optional[dict] = None,
                 construct: Optional[Callable[..., Any]] = None) -> Any:
    cls = spec.resolve(section)
    _check_interface(cls, spec.class_path, section)  # before anything calls it
    kwargs = _check_init_args(cls, spec.init_args, section)
    if extra:
        params = inspect.signature(cls).parameters
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for name, value in extra.items():
            if name in params or takes_kwargs:
                kwargs[name] = value
    return construct(cls, **kwargs) if construct is not None else cls(**kwargs)


def _check_interface(cls: Any, class_path: str, section: str) -> None:
    """A config is code (class_path imports a module, which runs it), but only a class of
    the section's interface is called: not ``subprocess.getoutput`` or ``os.system``."""
    # Known by name: the config layer sits below sailfin.interfaces (and torch).
    expected = {"data": "DataInterface", "module": "ModuleInterface"}[section]
    if not (isinstance(cls, type) and any(
            base.__module__ == "sailfin.interfaces" and base.__qualname__ == expected
            for base in cls.__mro__)):
        what = ("a class that does not derive from it" if isinstance(cls, type)
                else f"a {type(cls).__name__}, not a class")
        raise ConfigError(
            f"{section}.class_path must name a subclass of sailfin.{expected}; "
            f"{class_path} is {what}. sailfin calls nothing else that a config names")
    if cls.__module__ == "sailfin.interfaces" and cls.__qualname__ == expected:
        # The interface itself, known by name as above (``expected`` is a string).
        raise ConfigError(
            f"{section}.class_path names sailfin.{expected} itself, which holds no "
            f"{'data' if section == 'data' else 'model'}: name your subclass of it "
            f"(e.g. {'mypkg.MyData' if section == 'data' else 'mypkg.MyRecipe'})")


def _check_init_args(cls: type, init_args: dict, section: str) -> dict:
    """Reject init_args the class does not take; convert values to annotated types."""
    params = inspect.signature(cls).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(init_args)
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # annotations that do not evaluate: leave the values as given
        hints = {}
    if takes_pymarlin_args(params, hints):  # PyMarlin's def __init__(self, args, data)
        init_args = gather_pymarlin_args(init_args, params)
    out = {}
    for key, value in init_args.items():
        if key not in params or key == "self":
            choices = [p for p in params if p not in ("self", "data")]
            raise unknown_key(key, choices, f"{section}.init_args.")
        tp = hints.get(key)
        if tp is None and not isinstance(params[key].annotation, str) \
                and params[key].annotation is not params[key].empty:
            tp = params[key].annotation  # a class's __signature__ with evaluated types
        out[key] = coerce(value, tp, f"{section}.init_args.{key}") if tp is not None else value
    return out


def load_config(path: Optional[str | os.PathLike] = None,
                overrides: Sequence[str] = ()) -> RunConfig:
    """Read a YAML run config and apply ``--section.key value`` overrides."""
    raw: dict = {}
    extended = False
    if path is not None:
        raw = _read_mapping(path)
        extended = EXTENDS in raw
        if extended:  # base files first
            here = os.path.realpath(os.fspath(path))
            raw = _resolve_extends(raw, here, [here])
    pairs = parse_overrides(overrides)
    for key, text in pairs:
        _replace_per_device_batch(raw, key, [k for k, _ in pairs])
        apply_override(raw, key, text)
    if extended or pairs:  # each file was checked as it was read; the sum may be more
        parts = ([f"config file {path}"] if path is not None else []) + (
            ["its 'extends:' bases"] if extended else []) + (
            ["the command-line overrides"] if pairs else [])
        check_limits(raw, " with ".join(parts[:2]) + (" and " + parts[2] if len(parts) > 2
                                                      else ""))
    return from_dict(raw)


EXTENDS = "extends"


def _read_mapping(path: str | os.PathLike, named_in: Optional[str] = None) -> dict:
    raw = load_yaml_file(path, named_in) or {}  # UTF-8, safe tags, no key given twice
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping with sections "
                          f"{', '.join(SECTIONS)}; got {type(raw).__name__}")
    return raw


def _resolve_extends(raw: dict, here: str, chain: list[str]) -> dict:
    bases = _base_paths(raw.get(EXTENDS), here)
    merged: dict = {}
    for base in bases:
        if base in chain:
            loop = " -> ".join(chain[chain.index(base):] + [base])
            raise ConfigError(f"config files extend each other in a cycle: {loop}; "
                              f"remove one 'extends:'")
        content = _read_mapping(base, named_in=here)  # the same checks as the file named
        if EXTENDS in content:
            content = _resolve_extends(content, base, chain + [base])
        merged = merge(merged, content)
    own = {k: v for k, v in raw.items() if k != EXTENDS}
    return merge(merged, own)


def _base_paths(value: Any, here: str) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(
            isinstance(v, str) and v.strip() for v in items):
        raise ConfigError(f"'extends:' in {here} must be a file path or a list of them, "
                          f"got {short_repr(value)}")
    folder = os.path.dirname(here)
    return [os.path.realpath(os.path.join(folder, os.path.expanduser(v))) for v in items]


def merge(base: dict, over: dict) -> dict:
    """``over`` on top of ``base``: mappings merge at every depth; other values replace."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


# One setting in two spellings: the exact micro batch, or PyMarlin's ceiling.
_PER_DEVICE_BATCH = ("micro_batch_size", "gpu_batch_size_limit")


def _replace_per_device_batch(raw: dict, dotted: str, given: list[str]) -> None:
    """``--trainer.gpu_batch_size_limit`` on the command line replaces the file's
    ``micro_batch_size`` (and the reverse); both on the command line stay an error."""
    section, _, key = dotted.partition(".")
    if section != "trainer" or key not in _PER_DEVICE_BATCH or not isinstance(
            raw.get("trainer"), dict):
        return
    other = _PER_DEVICE_BATCH[1 - _PER_DEVICE_BATCH.index(key)]
    if f"trainer.{other}" not in given:
        raw["trainer"].pop(other, None)


def from_dict(raw: dict) -> RunConfig:
    """A :class:`RunConfig` from the mapping a YAML file holds (checked as a file is: keys,
    types, and the limits a checkpoint's manifest can hold)."""
    check_limits(raw, "the config")
    for key in raw:
        if key not in SECTIONS:
            raise unknown_key(str(key), SECTIONS, "")
    kwargs: dict[str, Any] = {}
    for name in ("data", "module"):
        if raw.get(name) is not None:
            kwargs[name] = _component(raw[name], name)
    trainer = raw.get("trainer") or {}
    if not isinstance(trainer, dict):
        raise ConfigError(f"config section 'trainer' must be a mapping, got {short_repr(trainer)}")
    kwargs["trainer"] = build_dataclass(TrainerArguments, trainer, prefix="trainer.")
    return RunConfig(**kwargs)


def _component(value: Any, name: str) -> ComponentSpec:
    if not isinstance(value, dict):
        raise ConfigError(f"config section '{name}' must be a mapping with class_path and "
                          f"init_args, got {short_repr(value)}")
    spec = build_dataclass(ComponentSpec, value, prefix=name + ".")
    if not spec.class_path:
        raise ConfigError(f"config section '{name}' needs class_path: package.module.ClassName")
    return spec


def parse_overrides(argv: Sequence[str]) -> list[tuple[str, str]]:
    """``['--a.b', '1', '--c=2']`` -> ``[('a.b', '1'), ('c', '2')]``."""
    out = []
    args = iter(argv)
    for arg in args:
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError("expected an override like --trainer.epochs 3, "
                              f"got {short_repr(arg)}")
        key, given, text = arg[2:].partition("=")
        if not given:
            text = next(args, None)
            if text is None:
                raise ConfigError(f"override --{key} needs a value (--{key} VALUE)")
        out.append((key, text))
    return out


def apply_override(raw: dict, dotted: str, text: str) -> None:
    """Set ``raw[a][b][c] = value`` for ``a.b.c``, typed by the schema."""
    parts = dotted.split(".")
    if parts[0] not in SECTIONS:
        raise unknown_key(parts[0], SECTIONS, "")
    tp, parts = _type_at(parts)
    node = raw
    for part in parts[:-1]:
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"cannot set --{dotted}: '{part}' is {short_repr(nxt)}, "
                              "not a section")
        node = nxt
    node[parts[-1]] = parse_cli_value(text, tp)


def _type_at(parts: list[str]) -> tuple[Any, list[str]]:
    """The schema type for a dotted key and its canonical spelling (aliases resolved)."""
    section = parts[0]
    cls: Any = TrainerArguments if section == "trainer" else ComponentSpec
    prefix = section + "."
    canonical = [section]
    for i, part in enumerate(parts[1:], start=1):
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"--{'.'.join(parts)}: '{prefix.rstrip('.')}' is a value, "
                              f"not a section; set it with --{prefix.rstrip('.')} VALUE")
        types_ = field_types(cls)
        aliases = getattr(cls, "_aliases", {})
        part = aliases.get(part, part)
        if part not in types_:
            raise unknown_key(part, list(types_) + list(aliases), prefix)
        cls = types_[part]
        canonical.append(part)
        if section != "trainer" and part == "init_args":
            return Any, canonical + parts[i + 1:]  # typed later against the signature
        prefix += part + "."
    if dataclasses.is_dataclass(cls) and len(parts) > 1:
        raise ConfigError(f"--{'.'.join(parts)} is a section; set one of its keys: "
                          f"{', '.join(field_types(cls))}")
    return cls, canonical
