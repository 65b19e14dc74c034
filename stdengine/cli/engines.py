"""`infer engines`: the installed engines, what they can do, and whether they can load here."""

from __future__ import annotations

import json
from typing import Any

import click


@click.command()
@click.option("--json", "as_json", is_flag=True, help="print a JSON list instead of a table")
def engines(as_json: bool) -> None:
    """List every engine registered under the `stdengine.engines` entry point.

    For each: version, the build it found on this machine (e.g. the reference engine's SIMD path,
    llama.cpp's CPU features), capabilities, the canonical options it honours, and whether it can
    load here (with the reason when not, e.g. an extra that is not installed). Nothing is loaded,
    so the capabilities are the declared ones; a loaded engine may have more (an openai engine
    whose server tokenizes, llamacpp with a GPU).
    """
    from stdengine.registry import describe

    rows = describe()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console

    render(rows, Console())


def render(rows: list[dict[str, Any]], console: Any) -> None:
    """One block per engine, so that it reads at 80 columns: a heading line (name, version,
    whether it loads here), then build, capabilities and honoured options as wrapped lines.
    Every text from an engine is escaped: rich markup would swallow `[llamacpp]` in a hint."""
    from rich.markup import escape
    from rich.padding import Padding
    from rich.table import Table

    for i, r in enumerate(rows):
        state = "[green]available[/green]" if r["available"] else "[red]not available[/red]"
        console.print(f"[bold]{escape(r['name'])}[/bold] {escape(r['version'] or '?')}  {state}")
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="dim", no_wrap=True)
        grid.add_column(overflow="fold")
        if not r["available"]:
            grid.add_row("why", escape(str(r["reason"])))
        if r.get("description"):
            grid.add_row("what", escape(r["description"]))
        if r["build"]:
            grid.add_row("build", escape(r["build"]))
        grid.add_row("capabilities", escape(", ".join(r["capabilities"])) or "-")
        for i, dev in enumerate(r.get("devices", [])):
            grid.add_row("devices" if i == 0 else "", escape(dev))
        grid.add_row("options", escape(", ".join(r["honoured_options"])) or "-")
        only = [f"{k} {'|'.join(json.dumps(v) for v in vs)}" for k, vs in r["option_values"].items()]
        if only:
            grid.add_row("only at", escape(", ".join(only)))
        for j, (key, what) in enumerate(r["engine_args"].items()):
            grid.add_row("-E" if j == 0 else "", escape(f"{key}: {what}"))
        console.print(Padding(grid, (0, 0, 0 if i == len(rows) - 1 else 1, 2)))
