"""The server's app: OpenAI-compatible routes in front of one loaded engine, on FastAPI and uvicorn.

Routes follow llama-server's (spec/server.md has the table). Every error is OpenAI's envelope
`{"error": {"message", "type", "code"}}` with the HTTP status in `code`; no request can crash the
server or keep a slot: generation runs in a worker thread per slot, and every way out of a
request (answer, error, client gone) releases its slot.

This module puts the pieces together; each job has its module: state.py (the engine, slots and
defaults the routes read), middleware.py (API key, log, request limits), envelope.py (errors),
routes.py and completion.py (the handlers), lifecycle.py (uvicorn and draining).
"""

from __future__ import annotations

import socket
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

from stdengine import __version__
from stdengine.server import lifecycle
from stdengine.server.envelope import framework_error, guarded
from stdengine.server.middleware import DEFAULT_MAX_BODY, MAX_JSON_DEPTH, PROMPT_CHARS_PER_POSITION, Gate
from stdengine.server.routes import ROUTES
from stdengine.server.state import DEFAULT_QUEUE, ServerState, build_state, close_state

__all__ = [
    "DEFAULT_MAX_BODY",
    "DEFAULT_QUEUE",
    "MAX_JSON_DEPTH",
    "PROMPT_CHARS_PER_POSITION",
    "ServerState",
    "build_state",
    "close_state",
    "create_app",
    "run_server",
]


def create_app(state: ServerState) -> FastAPI:
    # No /docs: FastAPI's docs page loads its scripts from the internet, and the server must not.
    app = FastAPI(title="stdengine", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Gate, state=state)
    app.state.stdengine = state  # what the routes read (state.state_of)
    app.add_exception_handler(StarletteHTTPException, framework_error)
    for method, path, handler in ROUTES:
        app.add_api_route(path, guarded(handler), methods=[method])
    return app


def run_server(state: ServerState, sock: socket.socket, **hooks: Any) -> None:
    """Serve the app on `state` on the socket (lifecycle.bind's) until SIGINT or SIGTERM, then
    drain; `hooks` are lifecycle.serve's (on_listening, on_stopped, ready)."""
    lifecycle.serve(create_app(state), sock, **hooks)
