"""`infer serve`: an OpenAI-compatible server for any engine (lands with the server issue)."""

from __future__ import annotations

from typing import Any

import click

from stdengine.cli.common import canonical_options
from stdengine.errors import NotImplementedYet


@click.command()
@canonical_options()
def serve(**kwargs: Any) -> None:
    """Serve a model over an OpenAI-compatible HTTP API with a web chat page.

    \b
    Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
    GET /metrics, POST /tokenize, POST /detokenize. Default host is 127.0.0.1.
    Not built yet in this version: it exits with status 9 (not_implemented).
    """
    raise NotImplementedYet("`infer serve` is not built yet in this version of stdengine",
                            hint="use `infer run` or `infer chat` for now")
