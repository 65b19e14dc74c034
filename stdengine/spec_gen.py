"""Generates the parts of spec/ that are made from code, so the standard cannot drift from it.

    python -m stdengine.spec_gen            # rewrite spec/schema/*.json and the generated tables
    python -m stdengine.spec_gen --check    # exit 1 and list what differs (CI and a test run this)

Generated tables sit between `<!-- BEGIN GENERATED: name -->` and `<!-- END GENERATED: name -->`
markers in the spec's Markdown; the prose around them is written by hand.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from stdengine.errors import all_error_classes
from stdengine.events import EVENT_FIELDS, KNOWN_EVENTS, LogEvent
from stdengine.options import GROUPS, ConfigFile, Options, env_var, flags, group

# Built-in engines documented in the options table, in column order (module:Class, so that a
# third-party plugin installed here never changes the generated spec).
BUILTIN_ENGINES: dict[str, str] = {
    "reference": "stdengine.reference.adapter:ReferenceEngine",
    "llamacpp": "stdengine.engines.llamacpp:LlamaCppEngine",
    "openai": "stdengine.engines.openai:OpenAIEngine",
}


def schemas() -> dict[str, dict[str, Any]]:
    made = {
        "options.schema.json": Options.model_json_schema(),
        "config.schema.json": ConfigFile.model_json_schema(),
        "event.schema.json": event_schema(),
        "recipe.schema.json": recipe_schema(),
    }
    return {name: _float_bounds(schema) for name, schema in made.items()}


def recipe_schema() -> dict[str, Any]:
    from stdengine.recipes import Recipe

    return Recipe.model_json_schema()


def _float_bounds(node: Any) -> Any:
    """The bounds of a "number" as floats. Pydantic writes some (the recipe's optional copies of the
    options' bounds) as 0 or as 0.0 depending on what the process built before (serving a request
    flips it), and the committed schemas must not depend on that."""
    if isinstance(node, list):
        return [_float_bounds(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _float_bounds(v) for k, v in node.items()}
    if out.get("type") == "number":
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if isinstance(out.get(key), int):
                out[key] = float(out[key])
    return out


def event_schema() -> dict[str, Any]:
    """A log line: the fixed fields, and for each event of the standard the fields it carries."""
    schema = LogEvent.model_json_schema()
    schema["allOf"] = [
        {"if": {"properties": {"event": {"const": name}}}, "then": {"required": list(fields)}}
        for name, fields in EVENT_FIELDS.items()
    ]
    return schema


def _type_name(name: str) -> str:
    ann = str(Options.model_fields[name].annotation)
    ann = re.sub(r"<class '(\w+)'>", r"\1", ann).replace("typing.", "")
    return ann.replace("NoneType", "None")


def _engine_maps() -> dict[str, Any]:
    from stdengine.registry import _import

    return {name: _import(target) for name, target in BUILTIN_ENGINES.items()}


def options_table() -> str:
    engines = _engine_maps()
    head = ["option", "type", "default", "flags", "environment", "meaning", *engines]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    defaults = Options().model_dump()
    for gkey, gtitle in GROUPS.items():
        lines.append(f"| **{gtitle}** |" + " |" * (len(head) - 1))
        for name, info in Options.model_fields.items():
            if group(name) != gkey:
                continue
            cells = [
                f"`{name}`",
                _type_name(name).replace("|", "\\|"),
                f"`{json.dumps(defaults[name])}`",
                " ".join(f"`{f}`" for f in flags(name)),
                f"`{env_var(name)}`",
                (info.description or "").replace("|", "\\|"),
            ]
            for cls in engines.values():
                cells.append(_mapping_cell(cls, name))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mapping_cell(cls: Any, name: str) -> str:
    if name in (
        "engine",
        "log_format",
        "log_file",
        "verbosity",
        "prompt",
        "file",
        "system",
        "chat_template",
        "host",
        "port",
        "parallel",
    ):
        return "core"
    if name in cls.option_map:
        return str(cls.option_map[name]).replace("|", "\\|")
    if name in cls.accepted_values:
        return "only " + ", ".join(f"`{json.dumps(v)}`" for v in cls.accepted_values[name])
    if name == "engine_args":
        return ", ".join(f"`{k}`" for k in cls.engine_args) or "none"
    return "refused"


def errors_table() -> str:
    lines = [
        "| code | class | exit status | HTTP status | OpenAI type | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for cls in all_error_classes():
        lines.append(
            f"| `{cls.code}` | `{cls.__name__}` | {cls.exit_status} | {cls.http_status} | "
            f"`{cls.openai_type}` | {cls.summary} |"
        )
    return "\n".join(lines)


def events_table() -> str:
    lines = ["| event | meaning | always carries |", "|---|---|---|"]
    lines += [
        f"| `{name}` | {meaning} | {', '.join(f'`{f}`' for f in EVENT_FIELDS.get(name, ()))} |"
        for name, meaning in KNOWN_EVENTS.items()
    ]
    return "\n".join(lines)


TABLES = {
    "options.md": {"options-table": options_table},
    "errors.md": {"errors-table": errors_table},
    "events.md": {"events-table": events_table},
}


def render(spec_dir: Path) -> dict[Path, str]:
    """Every generated file's full expected content."""
    out: dict[Path, str] = {}
    for fname, schema in schemas().items():
        out[spec_dir / "schema" / fname] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    for doc, tables in TABLES.items():
        path = spec_dir / doc
        text = path.read_text(encoding="utf-8")
        for name, make in tables.items():
            pattern = re.compile(
                rf"(<!-- BEGIN GENERATED: {name} -->\n).*?(<!-- END GENERATED: {name} -->)", re.S
            )
            if not pattern.search(text):
                raise SystemExit(f"{path}: missing the markers for generated table '{name}'")
            table = make()

            def fill(m: re.Match[str], table: str = table) -> str:
                return m.group(1) + table + "\n" + m.group(2)

            text = pattern.sub(fill, text)
        out[path] = text
    return out


def default_spec_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "spec"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec_dir = default_spec_dir()
    stale = []
    for path, content in render(spec_dir).items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current != content:
            stale.append(path)
            if "--check" not in argv:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(content, encoding="utf-8")
    if "--check" in argv and stale:
        print("spec is out of date with the code; run `python -m stdengine.spec_gen`:", file=sys.stderr)
        for p in stale:
            print(f"  {p}", file=sys.stderr)
        return 1
    for p in stale:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
