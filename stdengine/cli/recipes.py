"""`infer recipes list|show|apply|export`: the recipes this machine has (spec/recipes.md)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import click

from stdengine.errors import ConfigError, UsageError


@click.group()
def recipes() -> None:
    """Recipes: options tuned for a model, an engine and a machine (`infer bench tune` makes them).

    \b
    Folders, searched in this order: ./.infer/recipes (the project's), then $INFER_HOME/recipes
    (else ~/.cache/stdengine/recipes). `infer run/chat/serve/bench` use the most specific recipe
    that applies to their engine, model and this machine; --recipe PATH|NAME picks one.
    """


def _fit(found: Any, engine: str | None, model: str | None) -> str:
    """'yes', or why the recipe does not apply here (to this engine and model when given)."""
    from stdengine import recipes as r

    rec = found.recipe
    if engine is None and model is None:
        why = r.machine_mismatch(rec.applies_to.machine, r.this_machine())
        return "yes" if why is None else why
    eng = engine or rec.applies_to.engine
    version, _ = r.engine_version(eng)
    reasons = r.mismatches(
        rec, eng, version, r.model_id(model, rec.applies_to.model_sha256 is not None), r.this_machine()
    )
    return "yes" if not reasons else "; ".join(reasons)


def _model_text(rec: Any) -> str:
    a = rec.applies_to
    parts = [a.model_name or (a.model_sha256[:12] if a.model_sha256 else "any model")]
    parts += [x for x in (a.architecture, a.file_type) if x]
    return " ".join(parts)


@recipes.command("list")
@click.option("-m", "--model", default=None, help="say which recipes apply to this model")
@click.option("-e", "--engine", default=None, help="say which recipes apply to this engine")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per recipe")
def list_recipes(model: str | None, engine: str | None, as_json: bool) -> None:
    """Every recipe in the folders, and whether it applies on this machine (with -m/-e: to that
    model and engine here; the one a run would use is marked *)."""
    from stdengine import recipes as r

    found, problems = r.discover()
    chosen = None
    if engine is not None or model is not None:
        from stdengine.options import DEFAULTS

        chosen = r.select(None, engine or str(DEFAULTS["engine"]), model)
    rows: list[dict[str, Any]] = []
    for f in found:
        rec = f.recipe
        rows.append(
            {
                "name": rec.name,
                "path": str(f.path),
                "engine": rec.applies_to.engine,
                "model": _model_text(rec),
                "date": rec.date,
                "options": rec.set_options(),
                "measured": rec.measured.tuned,
                "applies": _fit(f, engine, model),
                "chosen": chosen is not None and chosen.path == f.path,
            }
        )
    for p in problems:
        click.echo(f"warning: {p}", err=True)
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
        return
    if not rows:
        click.echo("no recipes (make one with `infer bench tune -m MODEL`)", err=True)
        return
    for row in rows:
        mark = "*" if row["chosen"] else " "
        click.echo(f"{mark} {row['name']}  [{row['engine']}; {row['model']}; {row['date']}]  {row['path']}")
        opts = " ".join(f"{k}={json.dumps(v)}" for k, v in row["options"].items())
        meas = ", ".join(f"{k} {v:.1f} t/s" for k, v in row["measured"].items())
        click.echo(f"    options: {opts or '(none)'}" + (f"; measured: {meas}" if meas else ""))
        click.echo(f"    applies here: {row['applies']}")


@recipes.command("show")
@click.argument("recipe")
def show(recipe: str) -> None:
    """Print a recipe (a file or a name) and whether it applies on this machine."""
    from stdengine import recipes as r

    path = r.find_named(recipe)
    rec = r.load(path)
    click.echo(f"# {path}")
    click.echo(r.dumps(rec), nl=False)
    why = r.machine_mismatch(rec.applies_to.machine, r.this_machine())
    click.echo(f"# applies on this machine: {'yes' if why is None else 'no: ' + why}", err=True)


@recipes.command("apply")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--project", is_flag=True, help="into ./.infer/recipes instead of the user folder")
@click.option("--force", is_flag=True, help="replace a recipe of the same name")
def apply(file: Path, project: bool, force: bool) -> None:
    """Install a recipe file (one someone shared) so that runs that fit it use it. It is checked
    first; one made on another machine is installed with a warning (runs here will not use it
    unless named by --recipe)."""
    from stdengine import recipes as r

    if not file.is_file():
        raise UsageError(f"no such recipe file: {file}", hint="give the path of a recipe .toml file")
    rec = r.load(file)
    folder = r.PROJECT_DIR if project else r.user_dir()
    target = folder / f"{rec.name}.toml"
    if target.exists() and not force and target.resolve() != file.resolve():
        raise ConfigError(
            f"a recipe named {rec.name} is already installed: {target}", hint="add --force to replace it"
        )
    folder.mkdir(parents=True, exist_ok=True)
    if target.resolve() != file.resolve():
        shutil.copyfile(file, target)
    click.echo(f"installed {rec.name} -> {target}")
    why = r.machine_mismatch(rec.applies_to.machine, r.this_machine())
    if why is not None:
        click.echo(
            f"warning: recipe {rec.name} was {why}; runs here use it only with --recipe {rec.name}", err=True
        )


@recipes.command("export")
@click.argument("recipe")
@click.option(
    "--as",
    "fmt",
    type=click.Choice(["toml", "json", "config", "flags"]),
    default="toml",
    help="toml: the recipe; json: the same as JSON; config: an infer.toml of its options; flags: "
    "its options as command-line flags (llama.cpp's names)",
)
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="write here, not stdout"
)
def export(recipe: str, fmt: str, output: Path | None) -> None:
    """Print a recipe to share it, or its options as a config file or as flags."""
    from stdengine import recipes as r

    rec = r.load(r.find_named(recipe))
    if fmt == "toml":
        text = r.dumps(rec)
    elif fmt == "json":
        text = json.dumps(rec.model_dump(exclude_none=True), indent=2) + "\n"
    elif fmt == "config":
        text = r.config_text(rec)
    else:
        text = r.flags_text(rec) + "\n"
    if output is None:
        sys.stdout.write(text)
    else:
        output.write_text(text, encoding="utf-8")
        click.echo(f"wrote {output}", err=True)
