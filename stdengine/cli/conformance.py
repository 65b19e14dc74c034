"""`infer conformance`: check an engine against the standard (spec/conformance.md).

Thin: resolve options, load the engine, find the golden data, run the suite (library:
stdengine.conformance.runner), show progress on stderr and a summary table on stdout, write the
report bundle. Exit 0 when no core check failed, 1 when one did; other errors keep their own
exit statuses (2 usage, 3 model not found, 6 engine unavailable, ...).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click

from stdengine.cli.common import canonical_options, load, make_emitter, resolve_cli

STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim", "not_supported": "cyan"}


@click.command()
@canonical_options(
    "engine",
    "model",
    "ctx_size",
    "threads",
    "threads_batch",
    "batch_size",
    "ubatch_size",
    "cache_type_k",
    "cache_type_v",
    "flash_attn",
    "n_gpu_layers",
    "device",
    "url",
    "api_key",
    "log_format",
    "log_file",
    "verbosity",
    "engine_args",
)
@click.option(
    "--level",
    type=click.Choice(["core", "optional", "all"]),
    default="core",
    show_default=True,
    help="core checks only; optional adds the optional ones; all adds ext",
)
@click.option(
    "--only",
    "only",
    metavar="PATTERN",
    help="run only checks whose ID matches this glob (a bare word matches anywhere in the ID)",
)
@click.option(
    "--report", "report", metavar="DIR", help="write results.json, junit.xml, summary.md, ENGINE.yaml here"
)
@click.option("--list", "list_only", is_flag=True, help="list the checks that would run, and exit")
def conformance(level: str, only: str | None, report: str | None, list_only: bool, **kwargs: Any) -> None:
    """Check an engine against the standard: tokenizer, logits against the exact reference, batch
    invariance, generation semantics, chat template, errors and, with --url, the HTTP API.

    \b
    Exit status: 0 when no core check failed, 1 when one did (see spec/conformance.md);
    2 for bad usage, 3 model not found, 6 engine unavailable, as for every verb.
    With --url and no -e, only the HTTP checks run (against the server at URL).
    """
    from stdengine.conformance import report as rep
    from stdengine.conformance.runner import find_golden, plan, run_suite
    from stdengine.conformance.suite import Context, exit_status, select

    if report is not None and not list_only:
        _check_report_dir(report)  # before the suite runs, not after it (and exit 2, not 1)
    explicit_engine = kwargs.get("engine") is not None
    # a modest context keeps the over-long-prompt checks quick (-c overrides it), for the engines
    # that have one to set (not a remote server's)
    resolved = resolve_cli(dict(kwargs), engine_defaults={"ctx_size": 2048})
    if resolved.options.engine and "ctx_size" not in _honoured(resolved.options.engine):
        resolved = resolve_cli(kwargs)
    options = resolved.options
    events = make_emitter(options)
    http_only = bool(options.url) and not explicit_engine and "engine" not in resolved.explicitly_set()

    engine = None
    model_path: Path | None = None
    if not http_only:
        loaded = load(resolved, events)
        engine, model_path = loaded.engine, loaded.model_path
    model_ref = options.model or ("(server)" if http_only else None)
    if model_ref is None:
        from stdengine import DEFAULT_MODEL

        model_ref = DEFAULT_MODEL
    golden, note = find_golden(model_ref, model_path)
    ctx = Context(
        engine=engine,
        golden=golden,
        golden_note=note,
        model=model_ref,
        model_path=model_path or _local_copy(model_ref),
        url=options.url,
        api_key=options.api_key,
    )

    checks = plan(ctx)
    if only and not select(checks, level, only):
        # a typo in --only would otherwise run nothing and pass
        _no_check_selected(checks, level, only)
    if list_only:
        for c in select(checks, level, only):
            click.echo(f"{c.id}\t{c.level}\t{c.description}")
        return

    if options.url:
        from stdengine.conformance.http import probe

        probe(options.url)
    info = engine.info().to_dict() if engine is not None else {"name": "(http)", "version": None}
    adapter = options.engine if not http_only else "http"
    meta = rep.bundle_meta(info, adapter, model_ref, note, options.url, level, only)
    events.info("run.start", command="conformance", suite_level=level, only=only, golden=note)

    results = _run_with_progress(ctx, level, only, events, options.log_format == "json", run_suite)
    if engine is not None:
        engine.close()

    _print_summary(results, meta)
    if report:
        d = rep.write_bundle(report, results, meta)
        click.echo(f"report: {d}/ (results.json, junit.xml, summary.md, ENGINE.yaml)", err=True)
    sys.exit(exit_status(results))


def _check_report_dir(report: str) -> None:
    """Refuse a --report DIR the bundle cannot be written to, before any work: the error would
    otherwise come after the whole suite, as exit 1, which also means "a core check failed". A
    missing DIR is made (with its parents); in an existing one the bundle's files are replaced."""
    from stdengine.conformance.report import BUNDLE
    from stdengine.errors import UsageError

    hint = "give --report a new directory, or an existing one (its bundle files are replaced)"
    d = Path(report)
    if not report or (d.exists() and not d.is_dir()):
        raise UsageError(f"--report {report!r} is not a directory", hint=hint)
    if d.is_dir():
        taken = [n for n in BUNDLE if (d / n).exists() and not (d / n).is_file()]
        if taken:
            raise UsageError(f"--report {d}: {d / taken[0]} is not a file", hint=hint)
    parent = next(p for p in (d, *d.parents) if p.exists())  # the directory the first mkdir is in
    if not parent.is_dir():
        raise UsageError(f"--report {d}: {parent} is not a directory", hint=hint)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--report {d}: cannot write in {parent}", hint=hint)


def _no_check_selected(checks: list[Any], level: str, only: str) -> None:
    """The usage error for an --only that selects no check: what it would match at another
    level, else the closest check IDs and the groups there are."""
    import difflib

    from stdengine.conformance.suite import select
    from stdengine.errors import UsageError

    other = select(checks, "all", only)
    if other:
        levels = sorted({c.level for c in other})
        raise UsageError(
            f"--only {only!r} selects no {level} check; it matches {len(other)} {'/'.join(levels)} check(s)",
            hint=f"add --level {'optional' if levels == ['optional'] else 'all'}",
        )
    groups = sorted({c.id.split(":", 1)[0].split(".", 1)[0] for c in checks})
    ids = sorted({c.id.split(":", 1)[0] for c in checks})
    close = difflib.get_close_matches(only, ids + groups, n=3, cutoff=0.5)
    raise UsageError(
        f"--only {only!r} matches no check"
        + (f" (closest: {', '.join(close)})" if close else "")
        + f"; the groups are {', '.join(groups)}",
        hint="`infer conformance --list --level all` lists every check ID; --only takes a glob or a word",
    )


def _run_with_progress(
    ctx: Any, level: str, only: str | None, events: Any, json_logs: bool, run_suite: Any
) -> Any:
    """Run the suite with a live view on stderr (rich), or JSON events when logs are JSON."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    use_live = console.is_terminal and not json_logs

    def emit(check: Any, result: Any) -> None:
        # every check is a conformance.check event: in the log file always, on the console
        # (as JSON or text) when no live view shows it
        level_name = "info" if not use_live else "debug"
        events.emit(
            "conformance.check",
            level_name,
            id=result.id,
            check_level=result.level,
            status=result.status,
            duration_ms=round(result.duration_ms, 1),
            message=result.message,
            summary=f"{result.status:<13} {result.id}  {result.message[:120]}",
        )

    if not use_live:
        return run_suite(ctx, level, only, on_result=emit)

    progress = Progress(
        TextColumn("[bold]conformance"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
        transient=True,
    )
    task = None

    def on_start(checks: list[Any]) -> None:
        nonlocal task
        task = progress.add_task("", total=len(checks))

    def on_result(check: Any, result: Any) -> None:
        emit(check, result)
        if result.status in ("fail", "warn"):
            progress.console.print(
                f"[{STYLE[result.status]}]{result.status:<5}[/] {result.id}: {result.message}"
            )
        progress.update(task, advance=1, description=check.id)  # type: ignore[arg-type]

    with progress:
        return run_suite(ctx, level, only, on_start=on_start, on_result=on_result)


def _print_summary(results: list[Any], meta: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from stdengine.conformance.report import groups
    from stdengine.conformance.suite import counts, exit_status

    console = Console()
    table = Table(title=f"conformance: {meta.get('adapter')} on {meta.get('model')}", show_lines=False)
    for col in ("group", "status", "pass", "warn", "fail", "skip", "not_supported"):
        table.add_column(col, justify="left" if col in ("group", "status") else "right")
    by: dict[str, list[Any]] = {}
    for r in results:
        by.setdefault(r.id.split(":", 1)[0].split(".", 1)[0], []).append(r)
    gstat = groups(results)
    for g, rs in by.items():
        c = counts(rs)
        table.add_row(
            g,
            f"[{STYLE[gstat[g]]}]{gstat[g]}[/]",
            *(str(c[s]) for s in ("pass", "warn", "fail", "skip", "not_supported")),
        )
    console.print(table)
    bad = [r for r in results if r.status in ("fail", "warn")]
    for r in bad:
        console.print(f"[{STYLE[r.status]}]{r.status}[/] [{r.level}] {r.id}: {r.message}")
    c = counts(results)
    verdict = (
        "[green]PASS[/]: no core check failed"
        if exit_status(results) == 0
        else "[bold red]FAIL[/]: a core check failed"
    )
    console.print(
        f"{verdict} ({', '.join(f'{n} {s}' for s, n in c.items() if n)}); golden: {meta.get('golden')}"
    )


def _honoured(engine: str) -> frozenset[str]:
    from stdengine.registry import engine_class

    try:
        return frozenset(engine_class(engine).honoured_options())
    except Exception:  # an unknown engine: load() reports it
        return frozenset({"ctx_size"})


def _local_copy(ref: str) -> Path | None:
    """For an engine without a model file (a server): the model's file when this machine has it
    (a path, or a catalogue model already pulled), for the exact reference's checks; never pulled."""
    from stdengine.store import resolve_model

    try:
        return resolve_model(ref, pull=False)
    except Exception:
        return None
