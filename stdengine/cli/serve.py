"""`infer serve`: an OpenAI-compatible server and web chat for any engine (stdengine.server)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import click

from stdengine.adapter import SamplingParams
from stdengine.cli.common import canonical_options, load, make_emitter, resolve_cli
from stdengine.errors import EngineUnavailable
from stdengine.options import OPTION_NAMES, Options

# Prompt options make no sense for a server: requests bring their own prompts.
SERVE_OPTIONS = tuple(n for n in OPTION_NAMES if n not in ("prompt", "file", "system"))


def _require_server_extra() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise EngineUnavailable(
            f"`infer serve` needs the server extra (FastAPI and uvicorn), which is not installed ({e})",
            hint="pip install 'stdengine[server]'",
        ) from None


@click.command()
@canonical_options(*SERVE_OPTIONS)
@click.option(
    "--queue",
    "queue_size",
    type=click.IntRange(min=0),
    default=None,
    metavar="N",
    help="requests that may wait for a busy slot; one more gets 503 at once [default: 16]",
)
@click.option(
    "--max-body",
    "max_body",
    type=click.IntRange(min=1),
    default=None,
    metavar="BYTES",
    help="largest request body accepted; a larger one gets 413 [default: 4194304 (4 MiB)]",
)
@click.option(
    "--no-batching",
    "no_batching",
    is_flag=True,
    default=False,
    help="with -np N: each slot decodes on its own instead of in shared steps (continuous batching)",
)
def serve(queue_size: int | None, max_body: int | None, no_batching: bool, **kwargs: Any) -> None:
    """Serve a model over an OpenAI-compatible HTTP API, with a web chat page at /.

    \b
    Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
    GET /metrics, GET /props, POST /tokenize, POST /detokenize, and POST /v1/embeddings for
    engines that declare embeddings. The default host is 127.0.0.1 (this machine only).
    -np N serves N requests at once, on contexts that share the loaded weights (an engine
    that cannot make more contexts serves them in turns); an engine with `batch_decode` steps
    them together, one forward pass for all (continuous batching; --no-batching turns it off,
    each slot then decodes on its own in its own thread); --api-key KEY requires
    `Authorization: Bearer KEY` on every route but /, /health and /v1/models. The sampling flags
    (--temp, --top-k, -n, ...) are the defaults for fields a request leaves out.
    SIGINT or SIGTERM drains the requests in flight, then exits with status 0.
    Needs the server extra (pip install 'stdengine[server]'); without it, exit status 6.

    \b
    Examples:
      infer serve -m smollm2-135m-instruct
      infer serve -e llamacpp -m model.gguf --port 8081 -np 4 --api-key secret
    """
    _require_server_extra()  # first: nothing under stdengine.server imports without it
    from stdengine.server.app import DEFAULT_MAX_BODY, DEFAULT_QUEUE, build_state, close_state, run_server
    from stdengine.server.lifecycle import bind

    resolved = resolve_cli(kwargs, recipes=True)
    options: Options = resolved.options
    events = make_emitter(options)
    events.debug("config.resolved", options=options.model_dump(), sources=resolved.sources)
    # --api-key is the key this server requires of its clients; it is not handed to the engine
    # (which would refuse it, or send it on to a remote server).
    server_key = options.api_key
    resolved = dataclasses.replace(
        resolved,
        options=options.model_copy(update={"api_key": None}),
        sources={**resolved.sources, "api_key": "default"},
    )
    sock = bind(options.host, options.port)  # a port in use is an error before the model loads
    try:
        loaded = load(resolved, events)
    except BaseException:
        sock.close()
        raise
    engine, model_ref = loaded.engine, loaded.model_ref
    state = None
    try:
        state = build_state(
            engine,
            parallel=options.parallel,
            defaults=SamplingParams.from_options(options),
            events=events,
            model_ref=model_ref,
            model_path=None if loaded.model_path is None else str(loaded.model_path),
            api_key=server_key,
            queue_size=DEFAULT_QUEUE if queue_size is None else queue_size,
            verbose=options.verbosity > 0,
            max_body=DEFAULT_MAX_BODY if max_body is None else max_body,
            batching=False if no_batching else None,
        )
        slots = state.slots.total
        turns = (
            ""
            if slots == options.parallel
            else f" (engine '{engine.name}' has one context: -np {options.parallel} requests take turns on it)"
        )

        def listening(url: str) -> None:
            events.info(
                "run.start",
                command="serve",
                argv=sys.argv[1:],
                url=url,
                slots=slots,
                queue=state.slots.queue_size if state else None,
                summary=f"listening on {url} | model {model_ref} | {slots} slot(s)"
                f"{' stepping together' if state and state.slots.scheduler else ''}, "
                f"queue {state.slots.queue_size if state else 0}{turns} | web chat at {url}/",
            )

        def stopped(url: str, sig: str | None) -> None:
            events.info(
                "server.stop",
                url=url,
                signal=sig,
                summary=f"stopped listening on {url}{f' ({sig})' if sig else ''}; requests in flight answered",
            )

        run_server(state, sock, on_listening=listening, on_stopped=stopped)
    finally:
        sock.close()
        if state is not None:
            close_state(state)
        else:
            engine.close()
        events.close()
