"""`infer bench` (also installed as `infer-bench`, the same function): llama-bench's benchmark
(flags, semantics, output formats) for every engine.

    infer bench -m smollm2-135m-instruct -e reference,llamacpp -p 512 -n 128 -t 2
    infer bench -e openai --url http://127.0.0.1:8080 -p 512 -n 128 -d 0,1024
    infer bench -e openai --url http://127.0.0.1:8080 --concurrency 4 --requests 32 -p 128 -n 64
    infer bench compare base.jsonl candidate.jsonl --plot cmp.png
    infer bench vs-llamacpp --reps 3     # the reference engine against llama.cpp (compare_llamacpp)

Results go to stdout in the -o format (and to stderr in the -oe format); progress, warnings and
errors go to stderr. spec/bench-record.md defines every field and metric. The flags are
llama-bench's, parsed by stdengine.bench.params (not click's), so `infer bench` hands its
arguments over untouched.
"""

from __future__ import annotations

import io
import sys
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
    try:
        params = parse_args(argv)
    except ParamError as e:
        if e.detail:
            print(f"error: {e.detail}", file=sys.stderr)
        print(f"error: invalid parameter for argument: {e.arg}", file=sys.stderr)
        print(USAGE, end="", file=sys.stderr)
        sys.exit(1)
    try:
        status = run_cli(params)
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


def run_cli(params: BenchParams) -> int:
    from stdengine.bench.printers import make_printer

    if server_mode(params):
        from stdengine.bench.server import run_server_cli

        return run_server_cli(params)

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
                status = run(params, on_record, events, progress=bar, on_start=on_start)
        elif params.progress:
            from stdengine.bench.progress import LineProgress

            status = run(params, on_record, events, progress=LineProgress(), on_start=on_start)
        else:
            status = run(params, on_record, events, on_start=on_start)
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


if __name__ == "__main__":
    main()
