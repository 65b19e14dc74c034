"""`infer engines`: the installed engines, what they can do, and whether they can load here."""

from __future__ import annotations

import json

import click


@click.command()
@click.option("--json", "as_json", is_flag=True, help="print a JSON list instead of a table")
def engines(as_json: bool) -> None:
    """List every engine registered under the `stdengine.engines` entry point.

    For each: version, the build it found on this machine (e.g. the reference engine's SIMD path,
    llama.cpp's CPU features), capabilities, the canonical options it honours, and whether it can
    load here (with the reason when not, e.g. an extra that is not installed).
    """
    from stdengine.registry import describe

    rows = describe()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table()
    for col in ("engine", "version", "build", "available", "capabilities", "honoured options"):
        table.add_column(col, overflow="fold")
    for r in rows:
        avail = "yes" if r["available"] else f"no: {r['reason']}"
        table.add_row(
            r["name"],
            r["version"] or "?",
            r["build"],
            avail,
            ", ".join(r["capabilities"]),
            ", ".join(r["honoured_options"]),
        )
    Console().print(table)
