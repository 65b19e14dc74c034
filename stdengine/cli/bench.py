"""`infer bench` (also installed as `infer-bench`, the same function): llama-bench's benchmark
(flags, semantics, output formats) for every engine.

    infer bench -m smollm2-135m-instruct -e reference,llamacpp -p 512 -n 128 -t 2
    infer bench -e openai --url http://127.0.0.1:8080 -p 512 -n 128 -d 0,1024
    infer bench -e openai --url http://127.0.0.1:8080 --concurrency 4 --requests 32 -p 128 -n 64
    infer bench compare base.jsonl candidate.jsonl --plot cmp.png
    infer bench vs-llamacpp --reps 3     # the reference engine against llama.cpp (compare_llamacpp)
    infer bench tune -m smollm2-135m-instruct --budget 5m   # tune, check, write a recipe
    infer bench --recipe none ...        # no recipe (by default the best one that applies is used)

Results go to stdout in the -o format (and to stderr in the -oe format); progress, warnings and
errors go to stderr. spec/bench-record.md defines every field and metric. The flags are
llama-bench's, parsed by stdengine.bench.params (not click's), so `infer bench` hands its
arguments over untouched.
"""

from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from stdengine.bench.params import USAGE, BenchParams, ParamError, instances, parse_args


class _Stderr(io.TextIOBase):
    """sys.stderr looked up at each write, so that a progress bar that redirects it sees it."""

    def write(self, text: str) -> int:
        sys.stderr.write(text)
        return len(text)

    def flush(self) -> None:
        sys.stderr.flush()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "compare":
        from stdengine.bench.compare import main as compare_main

        sys.exit(compare_main(argv[1:]))
    if argv and argv[0] == "vs-llamacpp":
        from stdengine.bench.compare_llamacpp import main as vs_main

        sys.exit(vs_main(argv[1:], prog="infer bench vs-llamacpp"))
    if argv and argv[0] == "tune":
        from stdengine.cli.common import run_cli as run_verb

        run_verb(tune, argv[1:], prog_name="infer bench tune")
    argv, recipe = take_recipe(argv)
    try:
        params = parse_args(argv)
    except ParamError as e:
        if e.detail:
            print(f"error: {e.detail}", file=sys.stderr)
        print(f"error: invalid parameter for argument: {e.arg}", file=sys.stderr)
        print(USAGE, end="", file=sys.stderr)
        sys.exit(1)
    try:
        status = run_cli(params, recipe)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    except Exception as e:
        from stdengine.errors import InferError

        if params.verbose:
            import traceback

            traceback.print_exc()
        if isinstance(e, InferError):
            print(f"error: {e.message}", file=sys.stderr)
            if e.hint:
                print(f"hint: {e.hint}", file=sys.stderr)
            sys.exit(e.exit_status)
        print(f"error: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        print("hint: rerun with -v for a traceback, and report it", file=sys.stderr)
        sys.exit(1)
    sys.exit(status)


def server_mode(params: BenchParams) -> bool:
    """Server mode: a load test was asked for, or every engine is one that cannot decode in-process.
    Decided before anything is loaded, so by each engine class's declared capabilities."""
    if params.concurrency:
        return True
    if not params.url:
        return False
    from stdengine import registry

    return all("logits" not in registry.engine_class(name).capabilities for name in params.engines)


def take_recipe(argv: list[str]) -> tuple[list[str], str | None]:
    """`--recipe PATH|NAME|none` (else INFER_RECIPE) out of llama-bench's flags."""
    rest: list[str] = []
    recipe = os.environ.get("INFER_RECIPE") or None
    it = iter(argv)
    for arg in it:
        if arg == "--recipe":
            recipe = next(it, "")
        elif arg.startswith("--recipe="):
            recipe = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return rest, recipe


def run_cli(params: BenchParams, recipe: str | None = None) -> int:
    from stdengine.bench.printers import make_printer

    if server_mode(params):
        from stdengine.bench.server import run_server_cli

        return run_server_cli(params, recipe)
    if not instances(params):  # llama-bench prints an empty table; an empty result helps nobody
        from stdengine.errors import UsageError

        raise UsageError(
            "nothing to measure: every test has 0 prompt and 0 generated tokens",
            hint="give -p, -n or -pg a value above 0 (the defaults are -p 512 -n 128)",
        )

    out = make_printer(params.output, sys.stdout, params)
    err = make_printer(params.output_err, _Stderr(), params) if params.output_err != "none" else None
    printers = [p for p in (out, err) if p is not None]
    started = False

    def on_start() -> None:
        nonlocal started
        started = True
        for p in printers:
            p.header()

    def on_record(rec: dict[str, Any]) -> None:
        for p in printers:
            p.record(rec)

    from stdengine.bench import runner

    run = runner.run
    events = runner.bench_emitter(params)
    runs = sum((0 if params.no_warmup else 1) + params.reps for _ in instances(params))
    try:
        if sys.stderr.isatty():
            from stdengine.bench.progress import BarProgress

            with BarProgress(runs) as bar:
                status = run(params, on_record, events, progress=bar, on_start=on_start, recipe=recipe)
        elif params.progress:
            from stdengine.bench.progress import LineProgress

            status = run(params, on_record, events, progress=LineProgress(), on_start=on_start, recipe=recipe)
        else:
            status = run(params, on_record, events, on_start=on_start, recipe=recipe)
    finally:
        if started:
            for p in printers:
                p.footer()
        events.close()
    return status


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args: tuple[str, ...]) -> None:
    """llama-bench's benchmark for any engine (`infer bench -h` lists its flags); `infer bench
    compare BASE CAND` compares two results files; `infer bench vs-llamacpp` runs the reference
    engine against llama.cpp on this machine. `infer-bench` is the same command."""
    main(list(args))


# --- infer bench tune -----------------------------------------------------------------------


class _LineView:
    """Progress as lines on stderr (not a terminal, or -v)."""

    def trying(self, option: str, config: dict[str, Any], round_: int, rounds: int) -> None:
        shown = config.get(option, "") if option != "final" else "default vs tuned"
        print(f"infer-bench tune: {option}={shown} (round {round_}/{rounds})", file=sys.stderr, flush=True)

    def result(self, option: str, best: dict[str, Any], best_ts: dict[str, float | None]) -> None:
        print(f"infer-bench tune: best after {option}: {_setting(best)} {_speeds(best_ts)}", file=sys.stderr)

    def note(self, text: str) -> None:
        print(f"infer-bench tune: {text}", file=sys.stderr, flush=True)


class _RichView(_LineView):
    """A live view on a terminal: what is being tried, and the best setting so far."""

    def __init__(self, budget_s: float) -> None:
        from rich.console import Console
        from rich.live import Live

        self.console = Console(stderr=True)
        self.live = Live(console=self.console, transient=False, refresh_per_second=4)
        self.budget_s = budget_s
        self.current = ""
        self.best = "(defaults, not measured yet)"
        self.t0 = time.monotonic()

    def __enter__(self) -> _RichView:
        self.live.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.live.stop()

    def _render(self) -> Any:
        from rich.table import Table

        t = Table.grid(padding=(0, 1))
        t.add_row("[bold]trying[/]", self.current)
        t.add_row("[bold]best so far[/]", self.best)
        t.add_row("[bold]elapsed[/]", f"{time.monotonic() - self.t0:.0f} s of {self.budget_s:.0f} s")
        return t

    def trying(self, option: str, config: dict[str, Any], round_: int, rounds: int) -> None:
        shown = f"{option}={config.get(option)}" if option != "final" else "final: default vs tuned"
        self.current = f"{shown}   (round {round_}/{rounds})"
        self.live.update(self._render())

    def result(self, option: str, best: dict[str, Any], best_ts: dict[str, float | None]) -> None:
        self.best = f"{_setting(best)}  {_speeds(best_ts)}"
        self.live.update(self._render())

    def note(self, text: str) -> None:
        self.console.print(text, markup=False)


def _setting(config: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items())


def _speeds(ts: dict[str, float | None]) -> str:
    return " ".join(f"{k} {v:.1f} t/s" for k, v in ts.items() if v is not None)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-m", "--model", default=None, help="model (alias, path); default: the default model")
@click.option("-e", "--engine", default="reference", show_default=True, help="engine to tune")
@click.option(
    "--budget",
    default="10m",
    show_default=True,
    help="time for all of it: the search, the final comparison and the conformance check",
)
@click.option(
    "-r", "--reps", default=3, show_default=True, type=click.IntRange(1), help="repetitions per setting"
)
@click.option(
    "-p", "--n-prompt", default=512, show_default=True, type=click.IntRange(1), help="prompt test (pp)"
)
@click.option(
    "-n", "--n-gen", default=128, show_default=True, type=click.IntRange(1), help="generation test (tg)"
)
@click.option(
    "--search-gen", default=32, show_default=True, type=click.IntRange(1), help="tg tokens while searching"
)
@click.option(
    "--min-gain", default=0.03, show_default=True, type=float, help="smallest gain that changes a value"
)
@click.option(
    "-E", "engine_args", multiple=True, metavar="KEY=VALUE", help="engine setting, kept in the recipe"
)
@click.option("--name", default=None, help="the recipe's name (default: MODEL.ENGINE.MACHINE)")
@click.option(
    "--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="write the recipe here"
)
@click.option("--no-conformance", is_flag=True, help="skip the conformance core (the recipe says not_run)")
@click.option("-v", "--verbose", is_flag=True, help="engine logs on stderr, and tracebacks")
def tune(
    model: str | None,
    engine: str,
    budget: str,
    reps: int,
    n_prompt: int,
    n_gen: int,
    search_gen: int,
    min_gain: float,
    engine_args: tuple[str, ...],
    name: str | None,
    out: Path | None,
    no_conformance: bool,
    verbose: bool,
) -> None:
    """Search the options ENGINE honours for MODEL on this machine, check the best setting with the
    conformance core, and write it as a recipe (by default into $INFER_HOME/recipes, where runs
    find it). The table on stdout compares the defaults and the tuned setting, measured in
    alternation in the same run (spec/recipes.md)."""
    from stdengine import DEFAULT_MODEL, recipes, registry
    from stdengine.bench import tune as t
    from stdengine.config import parse_engine_args
    from stdengine.errors import EngineUnavailable, UnsupportedOption
    from stdengine.events import Emitter
    from stdengine.store import resolve_model

    budget_s = t.parse_budget(budget)
    cls = registry.engine_class(engine)
    ok, reason = cls.availability()
    if not ok:
        raise EngineUnavailable(f"engine '{engine}' cannot load here: {reason}")
    if "logits" not in cls.capabilities:
        raise UnsupportedOption(
            f"engine '{engine}' cannot decode in-process, so its load options cannot be tuned here",
            hint="a remote server is tuned on its own machine; its recipe may still set request options",
        )
    events = Emitter(verbosity=1 if verbose else 0, stream=None if verbose else io.StringIO())
    model_ref = model or DEFAULT_MODEL
    model_path = str(resolve_model(model_ref, events=events)) if cls.needs_model_file else model
    machine = recipes.this_machine()
    gpu = bool(machine.gpu)
    default_all = t.defaults(cls)
    options = t.tunable(cls, gpu)
    default = {k: default_all[k] for k in options}
    cpus = machine.logical_cpus or 1
    spaces = {o: t.space(o, cpus, n_prompt, gpu) for o in options}
    args = parse_engine_args(engine_args)
    measurer = t.Measurer(cls, model_path, events, args, n_prompt)

    view: Any = _LineView() if verbose or not sys.stderr.isatty() else _RichView(budget_s)
    tuner = t.Tuner(
        measurer,
        options,
        default,
        spaces,
        budget_s=budget_s,
        reps=reps,
        search_gen=search_gen,
        n_gen=n_gen,
        min_gain=min_gain,
        view=view,
        conformance=not no_conformance,
    )

    def check(config: dict[str, Any]) -> tuple[str, list[str]]:
        return t.check_conformance(cls, model_ref, model_path, config, events)

    checker = None if no_conformance else check
    if isinstance(view, _RichView):
        with view:
            outcome = t.tune(tuner, default, n_prompt, checker)
    else:
        outcome = t.tune(tuner, default, n_prompt, checker)

    recipe = _make_recipe(cls, model_ref, model_path, outcome, args, name)
    _print_table(recipe, outcome, model_ref, cls.name, budget_s)
    if outcome.conformance == "fail":
        import shlex

        from stdengine.errors import InferError
        from stdengine.options import env_var

        # as INFER_* variables: `infer conformance` has no flag for some of the tuned options
        env = " ".join(
            f"{env_var(k)}={'true' if v is True else 'false' if v is False else shlex.quote(str(v))}"
            for k, v in outcome.tuned.items()
        )
        raise InferError(
            "the conformance core fails even with the tuned options back at their defaults; "
            "no recipe written",
            hint=f"run `{env} infer conformance -e {cls.name} -m {model_ref} --recipe none` to see why",
        )
    path = out or recipes.user_dir() / f"{recipe.name}.toml"
    recipes.save(recipe, path)
    print(f"recipe: {path}", file=sys.stderr)


def _make_recipe(
    cls: Any,
    model_ref: str,
    model_path: str | None,
    outcome: Any,
    engine_args: dict[str, str],
    name: str | None,
) -> Any:
    import hashlib
    import shlex

    from stdengine import recipes
    from stdengine.bench.record import model_fields
    from stdengine.conformance.runner import SUITE_VERSION

    machine = recipes.this_machine()
    mid = recipes.model_id(model_ref)
    if mid.sha256 is None and model_path:
        mid = recipes.model_id(model_path)
    sig = hashlib.sha256(
        f"{machine.cpu}|{machine.cores}|{machine.logical_cpus}|{machine.gpu}".encode()
    ).hexdigest()
    stem = (model_ref if "/" not in model_ref else Path(model_ref).stem).replace(" ", "_")
    version = cls.version()
    parts = version.split(".")
    span = (
        f">={parts[0]}.{parts[1]},<{parts[0]}.{int(parts[1]) + 1}"
        if len(parts) >= 2 and parts[1].isdigit()
        else None
    )
    opts: dict[str, Any] = dict(outcome.tuned)
    if engine_args:
        opts["engine_args"] = engine_args
    return recipes.Recipe.model_validate(
        {
            "name": name or f"{stem}.{cls.name}.{sig[:8]}",
            "description": f"{cls.name} on {machine.cpu} ({machine.logical_cpus} CPUs), tuned by infer bench tune",
            "date": recipes.utc_now(),
            "command": "infer bench " + " ".join(shlex.quote(a) for a in sys.argv[2:] if a)
            if len(sys.argv) > 2
            else "infer bench tune",
            "applies_to": {
                "engine": cls.name,
                "engine_version": span,
                "model_sha256": mid.sha256,
                "architecture": mid.architecture,
                "file_type": mid.file_type,
                "model_name": mid.name or model_ref,
                "machine": machine.model_dump(),
            },
            "options": opts,
            "measured": {
                "tuned": outcome.table["tuned"],
                "default": outcome.table["default"],
                "reps": max(outcome.final_rounds, 1),
                "peak_rss_bytes": outcome.peak_rss_bytes,
                "model_size": model_fields(model_path)["model_size"] if model_path else None,
                "conformance": outcome.conformance,
                "conformance_suite": SUITE_VERSION if outcome.conformance != "not_run" else None,
            },
        }
    )


def _print_table(recipe: Any, outcome: Any, model_ref: str, engine: str, budget_s: float) -> None:
    """The result as Markdown on stdout: default vs tuned, and what was chosen."""
    conformance = recipe.measured.conformance
    if outcome.fell_back:
        conformance += (
            f" after putting back {', '.join(outcome.fell_back)} (the tuned setting failed); "
            f"{len(outcome.fell_back) + 1} checks"
        )
    if conformance != "not_run":
        conformance += (
            f" in {outcome.conformance_s:.0f} s (the budget kept {outcome.conformance_estimate_s:.0f} s)"
        )
    lines = [
        f"model {model_ref}, engine {engine}: {outcome.evaluations} settings measured in "
        f"{outcome.search_s:.0f} s (search ended: {outcome.stopped}); conformance core: "
        f"{conformance}; final comparison: {outcome.final_rounds} A/B round(s), medians"
        + (
            f"; generation samples cut at {outcome.capped_s:.0f} s (t/s over the tokens decoded by then)"
            if outcome.capped_s
            else ""
        )
        + f"; {outcome.total_s:.0f} s in all, budget {budget_s:.0f} s",
        "",
        "| test | default t/s | tuned t/s | tuned/default | setting for this test |",
        "|---|---:|---:|---:|---|",
    ]
    from stdengine.bench.tune import AFFECTS

    for test, d in outcome.table["default"].items():
        tuned = outcome.table["tuned"][test]
        # the options that decide this test; when the tuned values equal the defaults the two
        # columns measured one setting twice, and their difference is the machine's noise
        kind = "pp" if test.startswith("pp") else "tg"
        same = all(
            outcome.tuned[k] == outcome.default[k] for k in outcome.tuned if AFFECTS[k] in (kind, "both")
        )
        setting = "same as default (difference = noise)" if same else "tuned"
        ratio = tuned / d if d else float("nan")
        lines.append(f"| {test} | {d:.2f} | {tuned:.2f} | {ratio:.3f} | {setting} |")
    lines += ["", "| option | default | tuned |", "|---|---|---|"]
    for k, v in outcome.tuned.items():
        why = ""
        if k in outcome.fell_back:
            why = " (fails conformance)"
        elif k in outcome.reverted:
            why = " (reverted)"
        lines.append(f"| {k} | {outcome.default[k]} | {v}{why} |")
    click.echo("\n".join(lines))


if __name__ == "__main__":
    main()
