"""`infer conformance`: the conformance suite (lands with the conformance issue)."""

from __future__ import annotations

from typing import Any

import click

from stdengine.cli.common import canonical_options
from stdengine.errors import NotImplementedYet


@click.command()
@canonical_options("engine", "model", "url", "api_key", "log_format", "log_file", "verbosity", "engine_args")
@click.option("--level", type=click.Choice(["core", "optional", "all"]), default="core", show_default=True,
              help="which checks to run")
@click.option("--only", "only", metavar="PATTERN", help="run only checks whose ID matches this glob")
@click.option("--report", "report", metavar="DIR", help="write results.json, junit.xml, summary.md, ENGINE.yaml here")
def conformance(**kwargs: Any) -> None:
    """Check an engine against the standard: tokenizer, logits against the exact reference,
    batch invariance, generation semantics, chat template, errors and (with --url) HTTP.

    Not built yet in this version: it exits with status 9 (not_implemented).
    """
    raise NotImplementedYet("`infer conformance` is not built yet in this version of stdengine",
                            hint="the suite's checks and levels are specified in spec/conformance.md")
