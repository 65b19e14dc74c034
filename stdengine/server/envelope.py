"""Every error the server answers, as OpenAI's envelope `{"error": {"message", "type", "code"}}`.

The server raises only InferError kinds (stdengine/errors.py: each carries its HTTP status and
OpenAI type); the framework's own errors (no such route, wrong method) and anything unexpected (a
bug, an engine's stray exception: 500 engine_failure) are mapped here, in one place, and every
error is put in the request's `request.done` log fields."""

from __future__ import annotations

import json
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from stdengine.errors import EngineFailure, InferError, ServerBusy

LOG_KEY = "stdengine.log"  # per-request fields for the request.done event, kept in the ASGI scope


def error_parts(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str] | None]:
    """Any exception -> (HTTP status, the OpenAI envelope, extra headers)."""
    err = as_infer_error(exc, "internal error")
    body = err.openai_envelope()
    if err.hint:
        body["error"]["message"] = f"{err.message} ({err.hint})"
    headers = {"Retry-After": "1"} if isinstance(err, ServerBusy) else None
    return err.http_status, body, headers


def as_infer_error(exc: BaseException, what: str = "the engine failed") -> InferError:
    """An unexpected exception (an engine's, or a bug of the server: `what` says which) is an
    engine failure (500), with what it said."""
    if isinstance(exc, InferError):
        return exc
    return EngineFailure(f"{what}: {type(exc).__name__}: {exc}")


class EnvelopeResponse(JSONResponse):
    """An error's JSON, in ASCII: whatever text an error quotes, writing it cannot fail."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(exc: BaseException) -> JSONResponse:
    status, body, headers = error_parts(exc)
    return EnvelopeResponse(body, status_code=status, headers=headers)


def log_error(log: dict[str, Any] | None, exc: BaseException, verbose: bool) -> None:
    """Put what request.done should say about an error in the request's log fields."""
    if log is None:
        return
    log["error"] = exc.code if isinstance(exc, InferError) else type(exc).__name__
    if not isinstance(exc, InferError):
        # a bug in the server or an engine: keep what is needed to fix it
        log["message"] = f"{type(exc).__name__}: {exc}"
        if verbose:
            log["traceback"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def guarded(route: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Every error a route raises becomes the OpenAI envelope (never a crash or a bare 500)."""

    async def wrapper(request: Request) -> Response:
        try:
            return await route(request)
        except Exception as e:
            log_error(request.scope.get(LOG_KEY), e, request.app.state.stdengine.verbose)
            return error_response(e)

    wrapper.__name__ = route.__name__
    wrapper.__doc__ = route.__doc__
    return wrapper


async def framework_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no such route, a method the route does not take) in the envelope."""
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == 404:
        kind, message = "not_found_error", f"no route {request.url.path}"
    elif status == 405:
        kind, message = "invalid_request_error", f"{request.method} is not allowed on {request.url.path}"
    else:
        kind, message = "invalid_request_error", str(exc.detail)
    body = {"error": {"message": message, "type": kind, "code": status}}
    return JSONResponse(body, status_code=status, headers=exc.headers)
