"""Resolving the effective options from their sources.

Precedence: command-line flag > INFER_* environment variable > recipe > config file > default.
The recipe (stdengine.recipes) is chosen for the engine and model the other sources name. The config
file is `--config PATH`, else `./infer.toml`, else `<user config dir>/stdengine/infer.toml`; it
may be TOML or JSON (by extension). Every value keeps the name of its source so that
`infer config show` can say where it came from.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from stdengine.errors import ConfigError, read_text_file
from stdengine.options import ALIASES, DEFAULTS, OPTION_NAMES, ConfigFile, Options, env_var

if TYPE_CHECKING:
    from stdengine.recipes import Chosen

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

FILE_KEYS = (*OPTION_NAMES, "match")


@dataclass
class Resolved:
    options: Options
    sources: dict[str, str]  # option name -> "flag", "env INFER_X", "recipe:NAME", "file PATH", "default"
    config_path: Path | None = None
    match: dict[str, Any] | None = field(default=None)
    recipe: Chosen | None = None

    def explicitly_set(self) -> set[str]:
        """Options a user set (not left at their default): these must be honoured or refused."""
        return {k for k, src in self.sources.items() if src != "default"}


def user_config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "stdengine"


def find_config_file(explicit: str | None) -> Path | None:
    if explicit:
        path = Path(explicit)
        if not path.exists():
            raise ConfigError(f"config file not found: {explicit}", hint="check the path given to --config")
        return path
    for candidate in (Path("infer.toml"), user_config_dir() / "infer.toml"):
        if candidate.is_file():
            return candidate
    return None


def load_config_file(path: Path) -> dict[str, Any]:
    text = read_text_file(path, "the config file", ConfigError)
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(
            f"{path}: not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {e}",
            hint="fix the syntax of the config file",
        ) from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a table of options")
    for key in data:
        if key not in FILE_KEYS:
            raise unknown_key_error(key, FILE_KEYS, where=f"{path}{_line_of(text, key)}")
    for key, value in data.items():
        _validate({key: value}, where=f"{path}{_line_of(text, key)}", model=ConfigFile)
    return data


def _line_of(text: str, key: str) -> str:
    pattern = re.compile(rf'^[ \t]*"?{re.escape(key)}"?[ \t]*[=:]', re.M)
    m = pattern.search(text)
    return f":{text.count(chr(10), 0, m.start()) + 1}" if m else ""


def unknown_key_error(key: str, valid: tuple[str, ...], where: str) -> ConfigError:
    # Other tools' names for our options (temperature, n_ctx, max_tokens...) count as near misses.
    candidates = {name: name for name in valid}
    candidates.update({alias: name for alias, name in ALIASES.items() if name in valid})
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    best = candidates[close[0]] if close else None
    suggestion = f"did you mean '{best}'? " if best else ""
    return ConfigError(
        f"{where}: unknown option '{key}'",
        hint=f"{suggestion}valid options: {', '.join(valid)}",
        key=key,
        suggestion=best,
    )


def _validate(values: dict[str, Any], where: str, model: type[Options] = Options) -> None:
    try:
        model.model_validate(values)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "?"
        expected = _expected_type(key.split(".")[0])
        raise ConfigError(
            f"{where}: option '{key}' has an invalid value {err.get('input')!r}: {err['msg']}",
            hint=f"'{key}' expects {expected}",
            key=key,
        ) from e


def _expected_type(name: str) -> str:
    info = Options.model_fields.get(name)
    if info is None:
        return "a valid value"
    return str(info.annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")


def parse_env_value(name: str, raw: str) -> Any:
    """INFER_* values are strings: booleans accept 1/true/on/yes and 0/false/off/no, lists and
    tables accept JSON, everything else is converted by the option's type."""
    default = DEFAULTS[name]
    if isinstance(default, bool):
        low = raw.strip().lower()
        if low in ("1", "true", "on", "yes"):
            return True
        if low in ("0", "false", "off", "no"):
            return False
        raise ConfigError(
            f"{env_var(name)}={raw!r} is not a boolean", hint="use 1/true/on/yes or 0/false/off/no"
        )
    if isinstance(default, (list, dict)):
        if raw.strip().startswith(("[", "{")):
            try:
                return json.loads(raw)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{env_var(name)} is not valid JSON: {e}") from e
        return [raw] if isinstance(default, list) else raw
    return raw


def resolve(
    flags: Mapping[str, Any],
    *,
    config: str | None = None,
    env: Mapping[str, str] | None = None,
    engine_defaults: Mapping[str, Any] | None = None,
    recipes: bool = False,
    recipe: str | None = None,
) -> Resolved:
    """Merge the sources. `flags` holds only what was given on the command line (None = not given).
    With `recipes` (the verbs that run an engine), the recipe named by `recipe` (a file or name;
    "none" for no recipe), else the best one for the engine and model, sits between the
    environment and the config file."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in OPTION_NAMES:
        values[name] = DEFAULTS[name]
        sources[name] = "default"
    for name, value in (engine_defaults or {}).items():
        values[name] = value
        sources[name] = "engine default"

    path = find_config_file(config)
    match = None
    if path is not None:
        data = load_config_file(path)
        match = data.pop("match", None)
        for name, value in data.items():
            values[name] = value
            sources[name] = f"file {path}"
    # what the file and defaults say, under the recipe (if one is applied below)
    below = (dict(values), dict(sources))

    for name in OPTION_NAMES:
        var = env_var(name)
        if var in env and env[var] != "":
            value = parse_env_value(name, env[var])
            _validate({name: value}, where=f"environment variable {var}")
            values[name] = value
            sources[name] = f"env {var}"

    for name, value in flags.items():
        if name not in DEFAULTS:
            raise unknown_key_error(name, OPTION_NAMES, where="command line")
        if value is None or value == () or value == []:
            continue
        if name == "engine_args":
            merged = dict(values.get("engine_args") or {})
            merged.update(value)
            value = merged
        values[name] = list(value) if isinstance(value, tuple) else value
        sources[name] = "flag"

    env_args = env.get(env_var("engine_args"), "") != ""
    chosen = (
        _apply_recipe(values, sources, below, recipe, flags.get("engine_args"), env_args) if recipes else None
    )

    model = values.get("model")
    if isinstance(model, str) and not model.strip():
        src = sources["model"]
        where = {"flag": "-m", f"env {env_var('model')}": env_var("model")}.get(src, src)
        raise ConfigError(
            f"the model reference is empty ({where} {model!r})",
            hint="give a .gguf path, a catalogue alias (`infer models list`) or hf://owner/repo/file, "
            "or leave the option out for the default model",
            key="model",
        )
    _validate(values, where="options")
    return Resolved(
        options=Options.model_validate(values),
        sources=sources,
        config_path=path,
        match=match,
        recipe=chosen,
    )


def _apply_recipe(
    values: dict[str, Any],
    sources: dict[str, str],
    below: tuple[dict[str, Any], dict[str, str]],
    ref: str | None,
    flag_args: Mapping[str, str] | None,
    env_args: bool,
) -> Chosen | None:
    """Choose the recipe for the engine and model the other sources name, and let it set what no
    flag or INFER_* variable set (a config file's value gives way to it). What the engine does not
    honour is left out (a recipe never makes a run fail); engine arguments merge key by key."""
    from stdengine import recipes

    chosen = recipes.select(ref, values["engine"], values.get("model"))
    if chosen is None:
        return None
    _, cls = recipes.engine_version(values["engine"])
    same_engine = chosen.recipe.applies_to.engine == values["engine"]
    below_values, below_sources = below
    for name, value in chosen.recipe.set_options().items():
        if name == "engine_args":
            if not same_engine:  # another engine's arguments mean nothing here
                chosen.ignored.append(name)
            elif env_args:  # INFER_ENGINE_ARGS replaces the lower layers
                chosen.overridden.append(name)
            else:  # file < recipe < -E, key by key
                values[name] = {**below_values[name], **value, **dict(flag_args or {})}
                sources[name] = "flag" if flag_args else chosen.source
                chosen.applied[name] = value
        elif not recipes.honoured(cls, name, value):
            chosen.ignored.append(name)
        elif sources[name] != below_sources[name]:  # a flag or variable set it
            chosen.overridden.append(name)
        else:
            values[name] = value
            sources[name] = chosen.source
            chosen.applied[name] = value
    return chosen


def parse_engine_args(items: tuple[str, ...] | list[str]) -> dict[str, str]:
    """-E key=value pairs into a dict."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"-E expects key=value, got {item!r}",
                hint="for example: -E timeout=120 (each engine's settings are in spec/engines.md)",
            )
        out[key.strip()] = value
    return out
