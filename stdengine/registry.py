"""Finding engines: the entry-point group `stdengine.engines`, loaded lazily.

Built-in engines are registered the same way as third-party ones (in pyproject.toml), so
`infer engines` lists them all alike. An engine that fails to import is reported, never fatal.
load() is the one place an engine is loaded.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stdengine.adapter import Engine
from stdengine.errors import EngineUnavailable, UnsupportedOption, UsageError

if TYPE_CHECKING:
    from stdengine.events import Emitter
    from stdengine.options import Options

GROUP = "stdengine.engines"

# In-process registrations (tests, embedding applications): name -> "module:Class" or a class.
_extra: dict[str, str | type[Engine]] = {}


def register(name: str, target: str | type[Engine]) -> None:
    _extra[name] = target


def unregister(name: str) -> None:
    _extra.pop(name, None)


@dataclass
class EngineEntry:
    name: str
    target: str | type[Engine]
    distribution: str | None = None


def entries() -> dict[str, EngineEntry]:
    found: dict[str, EngineEntry] = {}
    for ep in entry_points(group=GROUP):
        dist = ep.dist.name if ep.dist is not None else None
        found.setdefault(ep.name, EngineEntry(ep.name, ep.value, dist))
    for name, target in _extra.items():
        found[name] = EngineEntry(name, target, None)
    return dict(sorted(found.items()))


def _import(target: str | type[Engine]) -> type[Engine]:
    if not isinstance(target, str):
        return target
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Engine)):
        raise TypeError(f"{target} is not a subclass of stdengine.adapter.Engine")
    return obj


def engine_class(name: str) -> type[Engine]:
    known = entries()
    if name not in known:
        close = difflib.get_close_matches(name, list(known), n=1)
        raise UsageError(
            f"unknown engine '{name}'",
            hint=(f"did you mean '{close[0]}'? " if close else "")
            + f"installed engines: {', '.join(known)}"
            + " (see `infer engines`)",
        )
    try:
        return _import(known[name].target)
    except Exception as e:  # an engine's import failure is reported, not a crash
        raise EngineUnavailable(
            f"engine '{name}' failed to import: {type(e).__name__}: {e}",
            hint="reinstall the package that provides it; `infer engines` shows its state",
        ) from e


def describe() -> list[dict[str, Any]]:
    """Every engine with its version, build, capabilities, honoured options and whether it can load
    here. Nothing is loaded here, so the capabilities are each class's declaration; a loaded
    instance's `capabilities` may differ (an openai engine's upstream that tokenizes, a llama.cpp
    build with a GPU) and is what everything that runs an engine reads."""
    out = []
    for entry in entries().values():
        row: dict[str, Any] = {"name": entry.name, "distribution": entry.distribution}
        try:
            cls = _import(entry.target)
            available, reason = cls.availability()
            devices = _devices(cls) if available else []
            row.update(
                version=cls.version(),
                build=_build_info(cls) if available else "",
                description=cls.description,
                capabilities=sorted(cls.capabilities | ({"gpu"} if devices else set())),
                devices=devices,
                honoured_options=sorted(cls.honoured_options()),
                # options honoured at these values only (others are refused): name -> values
                option_values={k: list(v) for k, v in sorted(cls.accepted_values.items())},
                engine_args=dict(cls.engine_args),  # -E key -> what it does
                available=available,
                reason=reason,
            )
        except Exception as e:
            row.update(
                version=None,
                build="",
                description="",
                capabilities=[],
                devices=[],
                honoured_options=[],
                option_values={},
                engine_args={},
                available=False,
                reason=f"failed to import: {type(e).__name__}: {e}",
            )
        out.append(row)
    return out


def _devices(cls: type[Engine]) -> list[str]:
    try:
        return cls.devices()
    except Exception:  # a broken GPU runtime is no device, never fatal to the listing
        return []


def _build_info(cls: type[Engine]) -> str:
    try:
        return cls.build_info()
    except Exception as e:  # a broken build is reported in the row, never fatal
        return f"unknown ({type(e).__name__}: {e})"


# Options that are about the command itself, not the engine, and so never refused.
UNIVERSAL = frozenset(
    {
        "engine",
        "model",
        "prompt",
        "file",
        "system",
        "chat_template",
        "log_format",
        "log_file",
        "verbosity",
        "host",
        "port",
        "parallel",
    }
)


def check_options(cls: type[Engine], explicitly_set: set[str], values: dict[str, Any] | None = None) -> None:
    """An option the user set that the engine cannot honour is an error, never silently dropped.
    Options the engine honours only at some values (accepted_values) are refused at others."""
    values = values or {}
    refused = sorted(
        explicitly_set
        - UNIVERSAL
        - cls.honoured_options()
        - {"engine_args"}
        - {k for k in cls.accepted_values if values.get(k) in cls.accepted_values[k]}
    )
    if refused:
        raise UnsupportedOption(
            f"engine '{cls.name}' cannot honour {', '.join(refused)}",
            hint=f"remove {'it' if len(refused) == 1 else 'them'}, or choose another engine; "
            f"'{cls.name}' honours: {', '.join(sorted(cls.honoured_options()))}",
            options=refused,
        )


@dataclass
class Loaded:
    """What load() gives back: the engine and what loading it resolved, so that no caller
    resolves the model again or reads it back off the log emitter."""

    engine: Engine
    # the options the engine was loaded with; for an engine that loads a file, `model` is its path
    options: Options
    # the model as the user named it (alias, path, hf://...), or the default model; for an engine
    # without a model file, -m if given, else --url, else the engine's name
    model_ref: str
    # the local GGUF file; None for an engine that takes no model file (a remote server)
    model_path: Path | None


def load(options: Options, events: Emitter, explicitly_set: Iterable[str] = ()) -> Loaded:
    """The one way to load an engine (every verb, infer-bench, conformance, the server): find the
    engine, refuse the options the user set (explicitly_set) that it cannot honour, check it can
    run here, resolve the model reference to a local file (pulling a catalogue model), load.
    A command passes its config.Resolved's `options` and `explicitly_set()`."""
    from stdengine import DEFAULT_MODEL

    cls = engine_class(options.engine)
    check_options(cls, set(explicitly_set), options.model_dump())
    ok, reason = cls.availability()
    if not ok:
        raise EngineUnavailable(f"engine '{cls.name}' cannot load here: {reason}")
    model_path: Path | None = None
    if cls.needs_model_file:
        from stdengine.store import resolve_model

        model_ref = options.model or DEFAULT_MODEL
        model_path = resolve_model(model_ref, events=events)
        options = options.model_copy(update={"model": str(model_path)})
    else:
        model_ref = options.model or options.url or cls.name
    # every later event of the run is labelled with the engine and the model it loaded
    events.engine = cls.name
    events.model = options.model
    return Loaded(cls.load(options, events), options, model_ref, model_path)
