"""`infer config show`: every effective option, its value and where it came from."""

from __future__ import annotations

import json
from typing import Any

import click

from stdengine.cli.common import canonical_options, resolve_cli


@click.group()
def config() -> None:
    """Show the effective configuration.

    Precedence: flag > INFER_* environment variable > recipe (--recipe, else the best one for
    the engine, model and machine) > config file (--config PATH, else ./infer.toml, else the
    user config dir) > default.
    """


def decided_defaults(options: Any) -> dict[str, Any]:
    """What the chosen engine will use for options left at null (model, threads...); nothing
    when the engine cannot be imported (`infer engines` says why)."""
    from stdengine import registry
    from stdengine.errors import InferError

    try:
        cls = registry.engine_class(options.engine)
    except InferError:
        return {}
    return cls.decided_defaults(options)


@config.command("show")
@canonical_options()
@click.option("--json", "as_json", is_flag=True, help="print one JSON object: {option: {value, source}}")
def show(as_json: bool, **kwargs: Any) -> None:
    """Print every option with its effective value and source.

    Any canonical flag may be given, to see how it combines with the environment and the file:
    `INFER_THREADS=3 infer config show -t 5` reports threads 5 from the flag. An option whose
    default is "the engine decides" shows what the chosen engine will use (the default model,
    the physical cores for threads), with the source `default`.
    """
    resolved = resolve_cli(kwargs, recipes=True)
    values = resolved.options.model_dump()
    values.update(decided_defaults(resolved.options))
    chosen = resolved.recipe
    if as_json:
        out = {name: {"value": values[name], "source": resolved.sources[name]} for name in values}
        doc = {
            "config_file": str(resolved.config_path) if resolved.config_path else None,
            "recipe": chosen.event_fields() if chosen else None,
            "options": out,
        }
        click.echo(json.dumps(doc, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    recipe = f"{chosen.recipe.name} ({chosen.path})" if chosen else "(none)"
    table = Table(title=f"config file: {resolved.config_path or '(none)'}; recipe: {recipe}")
    table.add_column("option")
    table.add_column("value")
    table.add_column("source")
    for name, value in values.items():
        src = resolved.sources[name]
        style = "" if src == "default" else "bold"
        table.add_row(name, json.dumps(value) if not isinstance(value, str) else value, src, style=style)
    console = Console()
    console.print(table)
    for warning in chosen.warnings if chosen else []:
        console.print(f"warning: {warning}", markup=False, style="yellow")
