"""`infer`: the entry point. Verbs are imported only when used, so `infer --help` stays fast."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from stdengine import __version__

# verb -> (module, attribute, one-line help shown by `infer --help` without importing the verb)
VERBS: dict[str, tuple[str, str, str]] = {
    "run": ("stdengine.cli.run", "run", "Generate a completion for a prompt (chat template applied)."),
    "chat": ("stdengine.cli.chat", "chat", "Talk with a model interactively."),
    "serve": ("stdengine.cli.serve", "serve", "Serve a model over an OpenAI-compatible HTTP API."),
    "models": ("stdengine.cli.models", "models", "Pull, list and inspect models."),
    "engines": ("stdengine.cli.engines", "engines", "List the installed engines and what they can do."),
    "config": ("stdengine.cli.config", "config", "Show the effective configuration and its sources."),
    "recipes": ("stdengine.cli.recipes", "recipes", "List, show, apply (install) and export tuned recipes."),
    "conformance": ("stdengine.cli.conformance", "conformance", "Check an engine against the standard."),
    "quantize": (
        "stdengine.cli.quantize",
        "quantize",
        "Quantize a GGUF model to a smaller type (Q4_K_M ...).",
    ),
    "bench": (
        "stdengine.cli.bench",
        "bench",
        "Benchmark any engine as llama-bench does (also `infer-bench`).",
    ),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(VERBS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in VERBS:
            return None
        module, attr, _ = VERBS[name]
        cmd: click.Command = getattr(importlib.import_module(module), attr)
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, short) for name, (_, _, short) in VERBS.items()])


@click.group(
    cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}
)
@click.version_option(__version__, "--version", prog_name="infer")
def cli() -> None:
    """One command line for every LLM inference engine.

    \b
    Examples:
      infer run -p "Why is the sky blue?"            # the default model on the reference engine
      infer run -m gemma-3-270m -e llamacpp -p Hi     # another model, another engine
      infer chat                                      # an interactive conversation
      infer models pull smollm2-135m-instruct         # fetch a catalogue model
      infer config show                               # every effective option and its source

    Options have the same names everywhere (llama.cpp's: -m -c -n -t -b -ub --temp --top-k ...),
    may also come from INFER_* environment variables and a config file (infer.toml), and are
    refused when the chosen engine cannot honour them. See spec/ for the standard.
    """


def main(argv: list[str] | None = None) -> Any:
    from stdengine.cli.common import run_cli

    return run_cli(cli, argv if argv is not None else sys.argv[1:], prog_name="infer")


if __name__ == "__main__":
    main()
