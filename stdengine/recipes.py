"""Inference recipes: the settings tuned for one model on one machine with one engine, as a small
TOML file that any engine can use (spec/recipes.md).

A recipe says what it applies to (the model file's SHA256 and/or its architecture and
quantization; an engine name and version range; a machine signature), which canonical options it
sets, what was measured when it was made, by which command and when. `select()` finds the recipe
that fits a run best; config.resolve() applies it below flags and INFER_* variables and above the
config file.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shlex
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from stdengine.errors import ConfigError, read_text_file
from stdengine.options import OPTION_NAMES, Options, group

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# A recipe sets how an engine loads and samples, never what is run (model, engine, prompt) or
# where logs and servers go.
RECIPE_OPTIONS: tuple[str, ...] = tuple(
    n for n in OPTION_NAMES if group(n) in ("load", "sampling") and n not in ("model", "engine")
)

# The instruction-set flags a machine signature lists (those kernels are chosen by); other
# /proc/cpuinfo flags say nothing about speed.
ISA_FLAGS = re.compile(
    r"^(sse4_[12]|ssse3|avx|avx2|fma|f16c|avx512\w*|avx_vnni\w*|amx\w*|asimd\w*|sve\w*|i8mm|bf16)$"
)

PROJECT_DIR = Path(".infer") / "recipes"


def _optional(name: str) -> Any:
    info = Options.model_fields[name]
    params = (info.annotation, *info.metadata)
    typ = Annotated[params] if info.metadata else info.annotation
    return (Optional[typ], Field(None, description=info.description))  # noqa: UP045 - typ is a runtime value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# The options table of a recipe: every option a recipe may set, each optional, with the canonical
# option's type and range (made from Options, so the two cannot drift).
RecipeOptions: type[BaseModel] = create_model(
    "RecipeOptions",
    __base__=_Strict,
    __doc__="Canonical options the recipe sets (an option left out keeps its usual source).",
    **{n: _optional(n) for n in RECIPE_OPTIONS},
)


class Machine(_Strict):
    """The machine a recipe was tuned on. A field left out matches any machine."""

    cpu: str | None = Field(None, description="CPU model name (/proc/cpuinfo `model name`)")
    isa: list[str] = Field(
        default_factory=list, description="instruction-set flags; all must be present here"
    )
    cores: int | None = Field(None, ge=1, description="physical cores")
    logical_cpus: int | None = Field(None, ge=1, description="CPUs this process may run on")
    memory_bytes: int | None = Field(None, ge=0, description="RAM; this machine needs at least 90% of it")
    gpu: str | None = Field(None, description='GPU model, "" for none')


class AppliesTo(_Strict):
    engine: str = Field(description="engine name (`infer engines`)")
    engine_version: str | None = Field(
        None, description='PEP 440 version range of the engine, e.g. ">=0.3,<0.4"; none: any version'
    )
    model_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="SHA256 of the GGUF file")
    architecture: str | None = Field(None, description="general.architecture, e.g. llama, gemma3")
    file_type: str | None = Field(
        None, description="the file's quantization, e.g. Q8_0 (as `infer models show`)"
    )
    model_name: str | None = Field(None, description="what the model was called when tuned (informational)")
    machine: Machine | None = Field(None, description="the machine; none: any machine")


class Measured(_Strict):
    """llama-bench's figures (median t/s of each test, by its llama-bench name: pp512, tg128) for
    the tuned options and, in the same run, the defaults."""

    tuned: dict[str, float] = Field(default_factory=dict, description="test -> t/s with the recipe")
    default: dict[str, float] = Field(default_factory=dict, description="test -> t/s with the defaults")
    reps: int | None = Field(None, ge=1, description="repetitions behind each median")
    peak_rss_bytes: int | None = Field(None, ge=0, description="peak resident memory of the tuning process")
    model_size: int | None = Field(None, ge=0, description="bytes of the model's tensors")
    conformance: Literal["pass", "fail", "not_run"] = Field(
        "not_run", description="the conformance core with the recipe's options"
    )
    conformance_suite: str | None = Field(None, description="conformance suite version")


class Recipe(_Strict):
    """One recipe file."""

    format: Literal[1] = Field(1, description="recipe format version")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="the recipe's name (file stem)")
    description: str = ""
    date: str = Field(description="when it was made, UTC ISO 8601")
    command: str = Field("", description="the command that made it")
    applies_to: AppliesTo
    options: RecipeOptions = Field(default_factory=RecipeOptions)  # type: ignore[valid-type]
    measured: Measured = Measured.model_validate({})

    def set_options(self) -> dict[str, Any]:
        """The options the recipe sets (those present in the file)."""
        return self.options.model_dump(exclude_none=True)  # type: ignore[attr-defined]


# --- reading and writing ---------------------------------------------------------------------


def load(path: Path) -> Recipe:
    try:
        data = tomllib.loads(read_text_file(path, "the recipe", ConfigError))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}", hint="fix the recipe's syntax") from e
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ConfigError(
            f"{path}: invalid recipe: {where}: {err['msg']}",
            hint="spec/recipes.md describes the format (schema: spec/schema/recipe.schema.json)",
            key=where,
        ) from e


def dumps(recipe: Recipe) -> str:
    """TOML text of a recipe: top-level keys, then each table (a tiny writer; tomllib only reads)."""
    return _toml_table(recipe.model_dump(exclude_none=True), [])


def _toml_table(data: dict[str, Any], prefix: list[str]) -> str:
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    out = []
    if prefix and (scalars or not tables):
        out.append(f"[{'.'.join(_toml_key(p) for p in prefix)}]")
    out += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars.items()]
    text = "\n".join(out)
    for k, v in tables.items():
        sub = _toml_table(v, [*prefix, k])
        text = f"{text}\n\n{sub}" if text else sub
    return text + ("\n" if not prefix else "")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_value(key)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        escaped = v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
        return f'"{escaped}"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def save(recipe: Recipe, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(recipe), encoding="utf-8")
    return path


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- where recipes live -------------------------------------------------------------------------


def user_dir() -> Path:
    """$INFER_HOME/recipes, else $XDG_CACHE_HOME/stdengine/recipes (~/.cache/stdengine/recipes):
    beside the model cache."""
    from stdengine.store import cache_dir

    return cache_dir().parent / "recipes"


def folders() -> list[Path]:
    """Searched in this order: the project's ./.infer/recipes, then the user's folder."""
    return [PROJECT_DIR, user_dir()]


@dataclass
class Found:
    recipe: Recipe
    path: Path
    folder: int = 0  # index in folders(): 0 is the project's


def discover(dirs: Iterable[Path] | None = None) -> tuple[list[Found], list[str]]:
    """Every recipe in the folders, and a warning per file that is not a valid recipe (a broken
    file in a shared folder must not stop a run)."""
    found: list[Found] = []
    problems: list[str] = []
    for i, d in enumerate(folders() if dirs is None else dirs):
        if not d.is_dir():
            continue
        for path in sorted(d.glob("*.toml")):
            try:
                found.append(Found(load(path), path, i))
            except ConfigError as e:
                problems.append(e.message)
    return found, problems


def find_named(ref: str) -> Path:
    """--recipe's value: a file path, or the name of a recipe in the folders (its `name`, which
    is usually also its file's stem)."""
    path = Path(ref).expanduser()
    if path.is_file():
        return path
    for d in folders():
        candidate = d / f"{ref}.toml"
        if candidate.is_file():
            return candidate
    found = discover()[0]
    for f in found:
        if f.recipe.name == ref:
            return f.path
    raise ConfigError(
        f"recipe not found: {ref}",
        hint="give a recipe file or one of: "
        + (", ".join(f.recipe.name for f in found) or "(no recipes yet: infer bench tune)"),
    )


# --- what a run is: machine, engine, model -----------------------------------------------------


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _gpu() -> str:
    """The first NVIDIA GPU's model from the driver's /proc entry; "" when there is none."""
    base = Path("/proc/driver/nvidia/gpus")
    try:
        for info in sorted(base.glob("*/information")):
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=1)
def this_machine() -> Machine:
    from stdengine.bench.params import physical_cores
    from stdengine.bench.record import cpu_info

    try:
        logical = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        logical = os.cpu_count() or 1
    return Machine(
        cpu=cpu_info(),
        isa=sorted(f for f in _cpu_flags() if ISA_FLAGS.match(f)),
        cores=physical_cores(),
        logical_cpus=logical,
        memory_bytes=_memory_bytes(),
        gpu=_gpu(),
    )


@dataclass(frozen=True)
class ModelId:
    sha256: str | None = None
    architecture: str | None = None
    file_type: str | None = None
    name: str | None = None


@functools.lru_cache(maxsize=32)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_id(ref: str | None, need_sha: bool = True) -> ModelId:
    """What a model reference is, without downloading anything: a catalogue model's SHA256 comes
    from the catalogue; a file's is computed (once per size and mtime) only when need_sha. A
    model that is not here yet (or an hf:// reference) is known by nothing."""
    from stdengine import DEFAULT_MODEL
    from stdengine.modelinfo import model_info
    from stdengine.store import load_catalogue, resolve_model

    ref = ref or DEFAULT_MODEL
    if ref.startswith("hf://"):
        return ModelId(name=ref)
    try:
        path = resolve_model(ref, pull=False)
        info = model_info(str(path))
    except Exception:  # not pulled, not a GGUF file: no recipe can match it by its contents
        return ModelId(name=ref)
    sha = None
    catalogue = load_catalogue()
    if ref in catalogue:
        sha = catalogue[ref].sha256
    elif need_sha:
        st = path.stat()
        sha = _file_sha256(str(path), st.st_size, st.st_mtime_ns)
    name = ref if ref in catalogue else path.stem
    return ModelId(sha, info.architecture, info.file_type_name, name)


# --- matching ---------------------------------------------------------------------------------


def machine_mismatch(want: Machine | None, here: Machine) -> str | None:
    """Why a recipe's machine is not this one, or None when it is (or the recipe names none)."""
    if want is None:
        return None
    if want.cpu is not None and want.cpu != here.cpu:
        return f"made on another CPU ({want.cpu}; here {here.cpu})"
    missing = sorted(set(want.isa) - set(here.isa))
    if missing:
        return f"needs CPU features this machine lacks: {', '.join(missing)}"
    if want.cores is not None and want.cores != here.cores:
        return f"made on {want.cores} cores (here {here.cores})"
    if want.logical_cpus is not None and want.logical_cpus != here.logical_cpus:
        return f"made with {want.logical_cpus} CPUs (here {here.logical_cpus})"
    if want.memory_bytes and (here.memory_bytes or 0) < 0.9 * want.memory_bytes:
        return f"made with {want.memory_bytes / 2**30:.1f} GiB of RAM (here {(here.memory_bytes or 0) / 2**30:.1f})"
    if want.gpu is not None and want.gpu != here.gpu:
        return f"made with GPU {want.gpu or '(none)'} (here {here.gpu or '(none)'})"
    return None


def version_mismatch(spec: str | None, version: str) -> str | None:
    if not spec:
        return None
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        ok = Version(version) in SpecifierSet(spec)
    except (InvalidSpecifier, InvalidVersion):
        ok = False
    return None if ok else f"engine version {version} is not {spec}"


def model_mismatch(want: AppliesTo, have: ModelId) -> str | None:
    if want.model_sha256 is not None and want.model_sha256 != have.sha256:
        return "made for another model file (SHA256)"
    for attr in ("architecture", "file_type"):
        w = getattr(want, attr)
        if w is not None and w != getattr(have, attr):
            return f"made for {attr} {w} (this model: {getattr(have, attr) or 'unknown'})"
    return None


def mismatches(
    recipe: Recipe, engine: str, engine_version: str, model: ModelId, machine: Machine
) -> list[str]:
    """Every reason the recipe does not apply to this run; empty when it does."""
    a = recipe.applies_to
    reasons = [] if a.engine == engine else [f"made for engine {a.engine} (this run: {engine})"]
    reasons += [
        r
        for r in (
            version_mismatch(a.engine_version, engine_version),
            model_mismatch(a, model),
            machine_mismatch(a.machine, machine),
        )
        if r
    ]
    return reasons


def specificity(recipe: Recipe) -> tuple[int, int, int]:
    """Of the recipes that apply, the most specific wins: the exact file over its architecture and
    quantization over any model; a named machine over any; then an engine version range."""
    a = recipe.applies_to
    model = 2 if a.model_sha256 else 1 if (a.architecture or a.file_type) else 0
    return model, int(a.machine is not None), int(a.engine_version is not None)


@dataclass
class Chosen:
    """The recipe a run uses and what became of it (reported by the `recipe.applied` event)."""

    recipe: Recipe
    path: Path
    explicit: bool  # named by --recipe / INFER_RECIPE
    warnings: list[str] = field(default_factory=list)
    applied: dict[str, Any] = field(default_factory=dict)  # option -> value it took effect with
    overridden: list[str] = field(default_factory=list)  # set by a flag or INFER_* instead
    ignored: list[str] = field(default_factory=list)  # options this engine does not honour

    @property
    def source(self) -> str:
        return f"recipe:{self.recipe.name}"

    def event_fields(self) -> dict[str, Any]:
        return {
            "name": self.recipe.name,
            "path": str(self.path),
            "explicit": self.explicit,
            "applied": self.applied,
            "overridden": self.overridden,
            "ignored": self.ignored,
            "warnings": self.warnings,
        }


def engine_version(engine: str) -> tuple[str, Any]:
    """The engine's version and class; ("", None) for an engine that cannot be imported."""
    from stdengine import registry
    from stdengine.errors import InferError

    try:
        cls = registry.engine_class(engine)
        return cls.version(), cls
    except InferError:
        return "", None


def select(ref: str | None, engine: str, model: str | None) -> Chosen | None:
    """The recipe for this run: `ref` (--recipe: a file or a name; "none" turns recipes off)
    whatever it was made for (a warning says what differs), else the most specific recipe in the
    folders that applies to this engine, model and machine (the project's folder first, then
    the newest)."""
    if ref is not None and ref.strip().lower() in ("none", "off", ""):
        return None
    version, _ = engine_version(engine)
    machine = this_machine()
    if ref is not None:
        path = find_named(ref)
        recipe = load(path)
        need_sha = recipe.applies_to.model_sha256 is not None
        reasons = mismatches(recipe, engine, version, model_id(model, need_sha), machine)
        warnings = [f"recipe {recipe.name} is used as given, though it was {r}" for r in reasons]
        return Chosen(recipe, path, explicit=True, warnings=warnings)
    found, problems = discover()
    candidates = [f for f in found if f.recipe.applies_to.engine == engine]
    if not candidates:
        return None
    need_sha = any(f.recipe.applies_to.model_sha256 for f in candidates)
    mid = model_id(model, need_sha)
    fits = [f for f in candidates if not mismatches(f.recipe, engine, version, mid, machine)]
    if not fits:
        return None
    # the most specific; among equals the project's folder before the user's, then the newest
    best = max(fits, key=lambda f: (specificity(f.recipe), -f.folder, f.recipe.date))
    return Chosen(best.recipe, best.path, explicit=False, warnings=problems)


def honoured(engine_cls: Any, name: str, value: Any) -> bool:
    """Whether the engine honours this option at this value (so a recipe can never make a run
    fail: what the engine cannot honour is left out and reported)."""
    if engine_cls is None:
        return False
    if name in engine_cls.honoured_options():
        return True
    return value in engine_cls.accepted_values.get(name, ())


# --- exporting ----------------------------------------------------------------------------------


def config_text(recipe: Recipe) -> str:
    """The recipe's options as a config file (infer.toml), with where they came from."""
    head = f"# options of recipe {recipe.name} ({recipe.applies_to.engine}, {recipe.date})\n"
    return head + _toml_table(recipe.set_options(), [])


def flags_text(recipe: Recipe) -> str:
    """The recipe's options as canonical flags (llama.cpp's names): `-t 2 -ub 256 -E key=value`."""
    from stdengine.options import flags

    out: list[str] = []
    for name, value in recipe.set_options().items():
        flag = flags(name)[0]
        if name == "engine_args":
            out += [f"-E {k}={v}" for k, v in value.items()]
        elif isinstance(value, bool):
            long = next(f for f in flags(name) if f.startswith("--"))
            out.append(long if value else f"--no-{long[2:]}")
        elif isinstance(value, list):
            out += [f"{flag} {shlex.quote(str(v))}" for v in value]
        else:
            out.append(f"{flag} {shlex.quote(str(value))}")
    return " ".join(out)
