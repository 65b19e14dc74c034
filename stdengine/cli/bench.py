"""`infer bench`: the project's benchmarks as verbs. `infer bench compare` runs the reference engine
and llama.cpp side by side (stdengine.bench.compare_llamacpp); its options are that module's.
llama-bench's own benchmark for any engines is the `infer-bench` command."""

from __future__ import annotations

import sys

import click


@click.group()
def bench() -> None:
    """The project's benchmarks (llama-bench's benchmark for any engines: `infer-bench`)."""


@bench.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def compare(args: tuple[str, ...]) -> None:
    """The reference engine against llama.cpp on this machine: pp512/tg128 records, ratios, peak
    memory and a plot, written to --out (default ./bench-results). `infer bench compare --help`
    lists the options."""
    from stdengine.bench.compare_llamacpp import main

    sys.exit(main(list(args), prog="infer bench compare"))
