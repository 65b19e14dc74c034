"""What stands between a connection and the routes: the API key, the Server header and one
`request.done` log event per request (`Gate`, ASGI middleware), and the limits on what one request
may cost before it reaches the engine (spec/server.md, "Limits"): its body's size and nesting,
and its prompt's length."""

from __future__ import annotations

import hmac
import json
import re
import time
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request

from stdengine import __version__
from stdengine.errors import ContextOverflow, InvalidRequest, RequestTooLarge, Unauthorized
from stdengine.events import Level
from stdengine.server.envelope import LOG_KEY, error_response, log_error

if TYPE_CHECKING:
    from stdengine.server.state import ServerState

# Routes anyone may call even when the server has an API key (as in llama-server).
PUBLIC_ROUTES = frozenset({"/", "/health", "/models", "/v1/models"})
DEFAULT_MAX_BODY = 4 * 1024 * 1024  # bytes of request body; --max-body raises it
MAX_JSON_DEPTH = 64  # nested arrays and objects; a real request nests 5 deep
# A prompt of more characters than this per context position cannot fit (real text has about 4
# per token), so it is refused before the engine tokenizes it: tokenizing costs time in a slot.
PROMPT_CHARS_PER_POSITION = 16
_SURROGATE = re.compile("[\ud800-\udfff]")  # JSON's "\ud800" escapes give them; no UTF-8 can carry one


class Gate:
    """Pure ASGI middleware (it must not buffer streamed responses)."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        log: dict[str, Any] = {"status": None}
        scope[LOG_KEY] = log
        self.state.events.debug("request.start", method=scope["method"], route=scope["path"])
        started = False

        async def send_logged(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                log["status"] = log.get("status") or message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"server", f"stdengine/{__version__}".encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            if self.state.api_key and scope["path"] not in PUBLIC_ROUTES and not self._authorized(scope):
                await error_response(Unauthorized("Invalid API Key"))(scope, receive, send_logged)
                return
            await self.app(scope, receive, send_logged)
        except Exception as e:
            log["status"] = log["status"] or 500
            if started:
                raise
            # A bug outside the routes' own handling: still the envelope, and the error in
            # request.done (its traceback with -v) instead of a plain-text 500 and a traceback.
            log_error(log, e, self.state.verbose)
            await error_response(e)(scope, receive, send_logged)
        finally:
            self._log_done(scope, log, t0)

    def _authorized(self, scope: dict[str, Any]) -> bool:
        assert self.state.api_key is not None
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer" and hmac.compare_digest(
                    token.strip().encode(), self.state.api_key.encode()
                ):
                    return True
        return False

    def _log_done(self, scope: dict[str, Any], log: dict[str, Any], t0: float) -> None:
        duration_ms = round((time.perf_counter() - t0) * 1e3, 1)
        status = log.pop("status")
        fields: dict[str, Any] = {"method": scope["method"], "route": scope["path"], "status": status}
        fields.update(log)
        fields["duration_ms"] = duration_ms
        if not self.state.verbose:
            fields.pop("prompt", None)  # prompt text only with -v
        summary = f"{scope['method']} {scope['path']} {status}"
        if "prompt_tokens" in fields:
            summary += f" | {fields['prompt_tokens']} prompt + {fields.get('completion_tokens', 0)} completion tokens"
        if fields.get("ttft_ms") is not None:
            summary += f" | ttft {fields['ttft_ms']:.0f} ms"
        summary += f" | {duration_ms:.0f} ms"
        if fields.get("error"):
            summary += f" | error {fields['error']}"
        level: Level = "error" if isinstance(status, int) and status >= 500 else "info"
        self.state.events.emit("request.done", level, summary=summary, **fields)


# --- limits -------------------------------------------------------------------------------------


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is over `limit` bytes (before reading it
    when Content-Length says so)."""
    too_large = RequestTooLarge(
        f"the request body is larger than this server accepts ({limit} bytes; "
        "start the server with --max-body BYTES to raise the limit)",
    )
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        # uvicorn answers a malformed body (bad chunked encoding) with its own 400 and tells us the
        # client is gone; this answer, never sent, makes the log say 400 too
        raise InvalidRequest(
            "the request body ended before it was complete (the connection closed, "
            "or its chunked encoding is malformed)"
        ) from None
    return b"".join(chunks)


def check_json(value: Any) -> None:
    """Refuse JSON nested deeper than MAX_JSON_DEPTH and strings (keys too) with a lone surrogate,
    which no UTF-8 text can hold (they would fail when the answer or the log is written)."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            raise _too_deep()
        for key, item in node.items() if isinstance(node, dict) else enumerate(node):
            if isinstance(item, (dict, list)):
                stack.append((item, (*path, key)))
            elif (isinstance(item, str) and _SURROGATE.search(item)) or (
                isinstance(key, str) and _SURROGATE.search(key)
            ):
                where = ".".join(_SURROGATE.sub("?", str(k))[:40] for k in (*path, key))
                raise InvalidRequest(
                    f"{where}: a string holds a lone surrogate (a \\uD800-\\uDFFF escape without its "
                    "pair), which is not valid Unicode"
                )


def _not_json(name: str) -> None:
    """NaN, Infinity and -Infinity, which Python's parser takes and JSON does not have."""
    raise ValueError(f"{name} is not a JSON value (JSON has no NaN or infinite numbers)")


def _too_deep() -> InvalidRequest:
    return InvalidRequest(f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels")


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object, within the limits."""
    raw = await read_body(request, limit)
    try:
        body = json.loads(raw, parse_constant=_not_json)
    except RecursionError:  # deeper than the parser can go: far over MAX_JSON_DEPTH
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    check_json(body)
    return body


def check_prompt_size(n_ctx: int | None, n_chars: int, n_messages: int = 0) -> None:
    """A prompt of more than PROMPT_CHARS_PER_POSITION characters per context position, or a
    conversation of more messages than the context has positions (each takes one at least, for
    its role's markers), is a context overflow at once: it cannot fit, and rendering and
    tokenizing it would hold a slot for nothing."""
    if n_ctx is not None and n_messages > n_ctx:
        raise ContextOverflow(
            f"the conversation has {n_messages} messages, more than the {n_ctx} positions of the "
            "context (each message takes one at least), so it cannot fit; it was not rendered",
            hint="send fewer messages, or start the server with a larger -c",
            n_ctx=n_ctx,
        )
    if n_ctx is None or n_chars <= PROMPT_CHARS_PER_POSITION * n_ctx:
        return
    raise ContextOverflow(
        f"the text has {n_chars} characters: over this server's limit of {PROMPT_CHARS_PER_POSITION} "
        f"characters per position of the {n_ctx}-token context, so it cannot be a prompt that fits; "
        "it was not tokenized",
        hint="shorten the prompt, or start the server with a larger -c",
        n_prompt_chars=n_chars,
        n_ctx=n_ctx,
    )
