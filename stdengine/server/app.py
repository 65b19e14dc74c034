"""The server: OpenAI-compatible routes in front of one loaded engine, on FastAPI and uvicorn.

Routes follow llama-server's (spec/server.md has the table). Every error is OpenAI's envelope
`{"error": {"message", "type", "code"}}` with the HTTP status in `code`; no request can crash the
server or keep a slot: generation runs in a worker thread per slot, and every way out of a
request (answer, error, client gone) releases its slot.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import re
import signal
import struct
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from stdengine import __version__
from stdengine.adapter import DoneEvent, Engine, GenerateRequest, PromptLogprobs, SamplingParams, TokenEvent
from stdengine.errors import ContextOverflow, EngineFailure, InferError, InvalidRequest, ModelNotFound
from stdengine.events import Emitter, Level
from stdengine.server import api
from stdengine.server.metrics import Metrics
from stdengine.server.slots import END, ClientGone, DisconnectWatch, Generation, ServerBusy, SlotPool

LOG_KEY = "stdengine.log"  # per-request fields for the request.done event, kept in the ASGI scope
# Routes anyone may call even when the server has an API key (as in llama-server).
PUBLIC_ROUTES = frozenset({"/", "/health", "/models", "/v1/models"})
DEFAULT_QUEUE = 16
# Limits on what one request may cost before it reaches the engine (spec/server.md, "Limits").
DEFAULT_MAX_BODY = 4 * 1024 * 1024  # bytes of request body; --max-body raises it
MAX_JSON_DEPTH = 64  # nested arrays and objects; a real request nests 5 deep
# A prompt of more characters than this per context position cannot fit (real text has about 4
# per token), so it is refused before the engine tokenizes it: tokenizing costs time in a slot.
PROMPT_CHARS_PER_POSITION = 16
_SURROGATE = re.compile("[\ud800-\udfff]")  # JSON's "\ud800" escapes give them; no UTF-8 can carry one


class HttpError(Exception):
    """An HTTP answer that is not one of stdengine's error kinds (401, 501, 503 busy, 404 route)."""

    def __init__(self, status: int, type_: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.headers = headers


@dataclass
class ServerState:
    """Everything the routes need: the engine, its slots, the defaults and the log."""

    engine: Engine  # the instance load() returned; tokenize/detokenize/templates go through it
    slots: SlotPool
    defaults: SamplingParams  # the server's sampling flags: what a request's omitted fields get
    events: Emitter
    model_id: str  # what /v1/models lists and responses echo
    model_names: frozenset[str]  # the names a request's `model` may use for this model
    model_path: str | None = None
    api_key: str | None = None
    verbose: bool = False
    max_body: int = DEFAULT_MAX_BODY
    started: float = field(default_factory=time.time)
    metrics: Metrics = field(default_factory=Metrics)

    @property
    def fingerprint(self) -> str:
        return f"stdengine-{__version__}-{self.engine.name}-{type(self.engine).version()}"


def build_state(
    engine: Engine,
    *,
    parallel: int,
    defaults: SamplingParams,
    events: Emitter,
    model_ref: str,
    model_path: str | None = None,
    api_key: str | None = None,
    queue_size: int = DEFAULT_QUEUE,
    verbose: bool = False,
    max_body: int = DEFAULT_MAX_BODY,
) -> ServerState:
    """Make the slots (N contexts on the one loaded model, when the engine can) and the state."""
    contexts: list[Engine] = [engine]
    while len(contexts) < parallel:
        ctx = engine.new_context()
        if ctx is None:  # one context only: requests take turns on it (the caller says so)
            break
        contexts.append(ctx)
    names = {model_ref}
    if model_path:
        names |= {model_path, Path(model_path).name, Path(model_path).stem}
    return ServerState(
        engine=engine,
        slots=SlotPool(contexts, queue_size),
        defaults=defaults,
        events=events,
        model_id=model_ref,
        model_names=frozenset(names),
        model_path=model_path,
        api_key=api_key,
        verbose=verbose,
        max_body=max_body,
    )


def close_state(state: ServerState) -> None:
    """Release the extra contexts first, then the engine that owns the model."""
    state.slots.close()
    for ctx in state.slots.contexts[1:]:
        ctx.close()
    state.engine.close()


# --- errors -------------------------------------------------------------------------------------


def error_body(status: int, type_: str, message: str, **details: Any) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": status, **details}}


def error_parts(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str] | None]:
    """Any exception -> (HTTP status, the OpenAI envelope, extra headers)."""
    if isinstance(exc, InferError):
        body = exc.openai_envelope()
        if exc.hint:
            body["error"]["message"] = f"{exc.message} ({exc.hint})"
        return exc.http_status, body, None
    if isinstance(exc, HttpError):
        return exc.status, error_body(exc.status, exc.type, exc.message), exc.headers
    if isinstance(exc, ServerBusy):
        return 503, error_body(503, "unavailable_error", str(exc)), {"Retry-After": "1"}
    failure = EngineFailure(f"internal error: {type(exc).__name__}: {exc}")
    return failure.http_status, failure.openai_envelope(), None


class EnvelopeResponse(JSONResponse):
    """An error's JSON, in ASCII: whatever text an error quotes, writing it cannot fail."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(exc: BaseException) -> JSONResponse:
    status, body, headers = error_parts(exc)
    return EnvelopeResponse(body, status_code=status, headers=headers)


def as_infer_error(exc: BaseException) -> BaseException:
    """An engine's unexpected exception is an engine failure (500), with what it said."""
    if isinstance(exc, (InferError, HttpError, ServerBusy)):
        return exc
    return EngineFailure(f"the engine failed: {type(exc).__name__}: {exc}")


def note_error(request: Request, exc: BaseException, state: ServerState) -> None:
    log = request.scope.get(LOG_KEY)
    if log is not None:
        log_error(log, exc, state.verbose)


def log_error(log: dict[str, Any], exc: BaseException, verbose: bool) -> None:
    """Put what request.done should say about an error in the request's log fields."""
    log["error"] = getattr(exc, "code", None) if isinstance(exc, InferError) else type(exc).__name__
    if not isinstance(exc, (InferError, HttpError, ServerBusy)):
        # a bug in the server or an engine: keep what is needed to fix it
        log["message"] = f"{type(exc).__name__}: {exc}"
        if verbose:
            log["traceback"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


# --- middleware: API key, Server header, one request.done per request ---------------------------


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
                response = JSONResponse(
                    error_body(401, "authentication_error", "Invalid API Key"), status_code=401
                )
                await response(scope, receive, send_logged)
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


# --- the app ------------------------------------------------------------------------------------


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is over `limit` bytes (before reading it
    when Content-Length says so)."""
    too_large = HttpError(
        413,
        "invalid_request_error",
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


def _too_deep() -> InvalidRequest:
    return InvalidRequest(f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels")


async def read_json(request: Request, state: ServerState) -> dict[str, Any]:
    raw = await read_body(request, state.max_body)
    try:
        body = json.loads(raw)
    except RecursionError:  # deeper than the parser can go: far over MAX_JSON_DEPTH
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    check_json(body)
    return body


def check_prompt_size(state: ServerState, n_chars: int) -> None:
    """A prompt of more than PROMPT_CHARS_PER_POSITION characters per context position is a
    context overflow at once: it cannot fit, and tokenizing it would hold a slot for nothing."""
    n_ctx = _n_ctx(state.engine)
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


def create_app(state: ServerState) -> FastAPI:
    # No /docs: FastAPI's docs page loads its scripts from the internet, and the server must not.
    app = FastAPI(title="stdengine", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Gate, state=state)
    app.state.stdengine = state

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        if exc.status_code == 404:
            message = f"no route {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return JSONResponse(
            error_body(exc.status_code, kind, message), status_code=exc.status_code, headers=exc.headers
        )

    def guarded(route: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """Every error a route raises becomes the OpenAI envelope (never a crash or a bare 500)."""

        async def wrapper(request: Request) -> Response:
            try:
                return await route(request)
            except Exception as e:
                note_error(request, e, state)
                return error_response(e)

        wrapper.__name__ = route.__name__
        return wrapper

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        page = resources.files("stdengine.server").joinpath("static/index.html").read_text(encoding="utf-8")
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    async def models(request: Request) -> Response:
        info = state.engine.info()
        meta: dict[str, Any] = {
            "engine": info.name,
            "engine_version": info.version,
            "backend": info.backend,
            "n_ctx": _n_ctx(state.engine),
            **_plain(info.model),
        }
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": state.model_id,
                        "object": "model",
                        "created": int(state.started),
                        "owned_by": "stdengine",
                        "meta": meta,
                    }
                ],
            }
        )

    app.get("/v1/models")(guarded(models))
    app.get("/models")(guarded(models))

    async def props(request: Request) -> Response:
        """llama-server's /props: defaults and slots, plus what this engine honours (the web chat
        uses it to offer only the settings the engine can honour)."""
        info = state.engine.info()
        d = state.defaults
        honoured = type(state.engine).honoured_options()
        return JSONResponse(
            {
                "default_generation_settings": {
                    "temperature": d.temp,
                    "top_k": d.top_k,
                    "top_p": d.top_p,
                    "min_p": d.min_p,
                    "repeat_penalty": d.repeat_penalty,
                    "repeat_last_n": d.repeat_last_n,
                    "presence_penalty": d.presence_penalty,
                    "frequency_penalty": d.frequency_penalty,
                    "seed": d.seed,
                    "n_predict": d.n_predict,
                    "stop": d.stop,
                    "n_ctx": _n_ctx(state.engine),
                },
                "total_slots": state.slots.total,
                "model": state.model_id,
                "model_path": state.model_path,
                "build_info": f"stdengine {__version__}; {info.name} {info.version} {info.build}".strip(),
                "engine": info.name,
                "capabilities": sorted(state.engine.capabilities),
                "supported_params": [f for f, opt in api.SAMPLING_FIELDS.items() if opt in honoured],
                "chat": state.engine.has_chat_template(),
            }
        )

    app.get("/props")(guarded(props))

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        n_ctx = _n_ctx(state.engine) or 0
        text = state.metrics.render(
            n_ctx_total=n_ctx * state.slots.total, processing=state.slots.busy, deferred=state.slots.waiting
        )
        return PlainTextResponse(
            text,
            media_type="text/plain; version=0.0.4",
            headers={"Process-Start-Time-Unix": str(int(state.started))},
        )

    async def chat_completions(request: Request) -> Response:
        req = api.parse(api.ChatRequest, await read_json(request, state))
        model = _check_model(state, req.model)
        api.refuse_unsupported(req)
        api.refuse_missing(req, state.engine.name, state.engine.capabilities)
        sampling = api.sampling_for(
            req, state.defaults, state.engine.name, type(state.engine).honoured_options()
        )
        if not state.engine.has_chat_template():
            raise InvalidRequest(
                "this model has no chat template, so the server cannot render a conversation",
                hint="use /v1/completions, or start the server with --chat-template",
            )
        messages = api.chat_messages(req)
        check_prompt_size(state, sum(len(m["content"]) for m in messages))
        request.scope[LOG_KEY]["prompt"] = messages
        reply = api.Reply(
            "chat",
            model,
            state.fingerprint,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
        )
        n_logprobs = api.logprobs_wanted(req)
        if n_logprobs is not None:
            reply.logprobs = api.LogprobsReply("chat")
        gen_request = GenerateRequest(messages=messages, sampling=sampling, logprobs=n_logprobs)
        return await generate(request, gen_request, reply, req.stream)

    async def completions(request: Request) -> Response:
        req = api.parse(api.CompletionRequest, await read_json(request, state))
        model = _check_model(state, req.model)
        api.refuse_unsupported(req)
        api.refuse_missing(req, state.engine.name, state.engine.capabilities)
        sampling = api.sampling_for(
            req, state.defaults, state.engine.name, type(state.engine).honoured_options()
        )
        prompt = api.completion_prompt(req)
        if isinstance(prompt, str):
            check_prompt_size(state, len(prompt))
        request.scope[LOG_KEY]["prompt"] = prompt
        reply = api.Reply(
            "text",
            model,
            state.fingerprint,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
        )
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
        if req.echo:
            # token ids are echoed as their text (which also checks that they are in the vocabulary)
            reply.echo = (
                prompt
                if isinstance(prompt, str)
                else await run_in_threadpool(state.engine.detokenize, prompt)
            )
        score: tuple[list[int], int] | None = None
        if req.echo and req.logprobs is not None:
            if isinstance(prompt, str):
                # an echo's log-probabilities are of the prompt's tokens: tokenized as generate() would
                ids, text = await run_in_threadpool(state.engine.tokenize, prompt, True, True), None
            assert ids is not None
            score = (ids, req.logprobs)
        if req.logprobs is not None:
            reply.logprobs = api.LogprobsReply("text", len(reply.echo or ""))
        if ids is not None and not type(state.engine).takes_prompt_tokens:
            # an engine that completes text only gets the ids' text (which it may tokenize differently)
            text, ids = reply.echo or await run_in_threadpool(state.engine.detokenize, ids), None
        gen_request = GenerateRequest(
            prompt=text, prompt_tokens=ids, sampling=sampling, logprobs=req.logprobs
        )
        return await generate(request, gen_request, reply, req.stream, score)

    app.post("/v1/chat/completions")(guarded(chat_completions))
    app.post("/chat/completions")(guarded(chat_completions))
    app.post("/v1/completions")(guarded(completions))

    async def generate(
        request: Request,
        gen_request: GenerateRequest,
        reply: api.Reply,
        stream: bool,
        score: tuple[list[int], int] | None = None,
    ) -> Response:
        """Wait for a slot, run the generation in its worker thread (after scoring the prompt's
        tokens (ids, top_n) for an echo with logprobs), answer whole or streamed."""
        log = request.scope[LOG_KEY]
        t0 = time.perf_counter()
        watch = DisconnectWatch(request.receive)
        gen: Generation | None = None
        handed_over = False  # True once the streamed body owns the generation and the watch
        try:
            ctx = await watch.guard(state.slots.acquire())
            log["slot"] = state.slots.slot_id(ctx)
            log["queued_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
            gen = Generation(state.slots, ctx, gen_request, score)
            gen.start()
            first = await watch.guard(gen.next())
            # Errors that come before any token (a prompt over the context, an empty prompt) are
            # a plain HTTP error, also for a streamed request: nothing has been sent yet.
            if isinstance(first, BaseException):
                await gen.finish()  # the worker has ended: let it give the slot back first
                raise as_infer_error(first)
            if first is END:
                raise EngineFailure("the engine ended generate() without a DoneEvent")
            if stream:
                handed_over = True
                return ClosingStream(
                    [gen.cancel, watch.close],
                    stream_body(request, gen, watch, first, reply, t0),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            tokens: list[TokenEvent] = []
            scores: PromptLogprobs | None = None
            item = first
            while True:
                if isinstance(item, BaseException):
                    await gen.finish()
                    raise as_infer_error(item)
                if item is END:
                    raise EngineFailure("the engine ended generate() without a DoneEvent")
                if isinstance(item, PromptLogprobs):
                    scores = item
                elif isinstance(item, TokenEvent):
                    _count_token(state, log, t0, item)
                    tokens.append(item)
                elif isinstance(item, DoneEvent):
                    _record_done(state, log, ctx, item)
                    await gen.finish()
                    text = (reply.echo or "") + "".join(t.text for t in tokens)
                    return JSONResponse(reply.final(text, item, _final_logprobs(reply, scores, tokens)))
                item = await watch.guard(gen.next())
        except ClientGone:
            log["status"] = 499  # nginx's "client closed request": nobody read an answer
            return Response(status_code=499)
        finally:
            if not handed_over:
                if gen is not None:
                    gen.cancel()
                watch.close()

    async def stream_body(
        request: Request, gen: Generation, watch: DisconnectWatch, first: Any, reply: api.Reply, t0: float
    ) -> AsyncIterator[bytes]:
        log = request.scope[LOG_KEY]
        item = first
        try:
            if reply.kind == "chat":
                yield _sse(reply.chunk(role=True))
            elif reply.echo is not None and not isinstance(item, PromptLogprobs):
                yield _sse(reply.chunk(reply.echo))
            while True:
                if isinstance(item, PromptLogprobs):
                    assert reply.logprobs is not None and reply.echo is not None
                    yield _sse(reply.chunk(reply.echo, logprobs=reply.logprobs.prompt(item)))
                elif isinstance(item, TokenEvent):
                    _count_token(state, log, t0, item)
                    lp = reply.logprobs.tokens([item]) if reply.logprobs is not None else None
                    if item.text or (lp is not None and item.token is not None):
                        yield _sse(reply.chunk(item.text, logprobs=lp))
                elif isinstance(item, DoneEvent):
                    _record_done(state, log, gen.ctx, item)
                    await watch.guard(gen.finish())
                    yield _sse(reply.chunk(done=item))
                    if reply.include_usage:
                        yield _sse(reply.usage_chunk(item))
                    yield b"data: [DONE]\n\n"
                    return
                else:
                    # Headers are sent: a failure mid-stream is an error event (OpenAI's shape,
                    # which its clients raise as an APIError), then the end of the stream.
                    err = as_infer_error(
                        item
                        if isinstance(item, BaseException)
                        else EngineFailure("the engine ended generate() without a DoneEvent")
                    )
                    note_error(request, err, state)
                    await watch.guard(gen.finish())
                    yield _sse(error_parts(err)[1])
                    yield b"data: [DONE]\n\n"
                    return
                item = await watch.guard(gen.next())
        except ClientGone:  # seen by our watch
            log["status"] = 499
        except asyncio.CancelledError:  # seen by Starlette first, which cancels the body
            log["status"] = 499
            raise
        finally:
            gen.cancel()
            watch.close()

    async def tokenize(request: Request) -> Response:
        _need(state, "tokenize")
        req = api.parse(api.TokenizeRequest, await read_json(request, state))
        check_prompt_size(state, len(req.content))
        engine = state.engine
        tokens = await run_in_threadpool(engine.tokenize, req.content, req.add_special, True)
        if not req.with_pieces:
            return JSONResponse({"tokens": tokens})
        pieces = await run_in_threadpool(lambda: [engine.detokenize([t]) for t in tokens])
        return JSONResponse({"tokens": [{"id": t, "piece": p} for t, p in zip(tokens, pieces, strict=True)]})

    async def detokenize(request: Request) -> Response:
        _need(state, "tokenize")
        req = api.parse(api.DetokenizeRequest, await read_json(request, state))
        try:
            content = await run_in_threadpool(state.engine.detokenize, req.tokens)
        except InferError:
            raise
        except Exception as e:
            raise InvalidRequest(
                f"cannot detokenize these tokens: {type(e).__name__}: {e}",
                hint="every token must be an id of the model's vocabulary",
            ) from None
        return JSONResponse({"content": content})

    app.post("/tokenize")(guarded(tokenize))
    app.post("/detokenize")(guarded(detokenize))

    async def embeddings(request: Request) -> Response:
        _need(state, "embeddings")
        req = api.parse(api.EmbeddingsRequest, await read_json(request, state))
        model = _check_model(state, req.model)
        texts = [req.input] if isinstance(req.input, str) else list(req.input)
        if not texts or any(t == "" for t in texts):
            raise InvalidRequest("input must be a non-empty string or a list of non-empty strings")
        for t in texts:
            check_prompt_size(state, len(t))
        watch = DisconnectWatch(request.receive)
        try:
            ctx = await watch.guard(state.slots.acquire())
        finally:
            watch.close()
        loop = asyncio.get_running_loop()
        try:
            vectors = await loop.run_in_executor(state.slots.executor, ctx.embed, texts)
            n_tokens = 0
            if "tokenize" in state.engine.capabilities:
                n_tokens = sum(len(state.engine.tokenize(t)) for t in texts)
        except Exception as e:
            raise as_infer_error(e) from e
        finally:
            state.slots.release(ctx)
        data = []
        for i, vec in enumerate(vectors):
            emb: Any = [float(x) for x in vec]
            if req.encoding_format == "base64":
                emb = base64.b64encode(struct.pack(f"<{len(emb)}f", *emb)).decode("ascii")
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": model,
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
            }
        )

    app.post("/v1/embeddings")(guarded(embeddings))
    return app


class ClosingStream(StreamingResponse):
    """A streamed response that runs its clean-ups however it ends, even when the client leaves
    before the body starts (then Starlette never enters the body generator, whose own `finally`
    would not run)."""

    def __init__(self, cleanups: list[Callable[[], None]], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cleanups = cleanups

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for cleanup in self.cleanups:
                cleanup()


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


def _check_model(state: ServerState, name: str | None) -> str:
    """The request's model must be the served one (by its id, path or file name); none = it."""
    if name is None or name == "":
        return state.model_id
    if name not in state.model_names:
        raise ModelNotFound(
            f"model '{name}' is not served here",
            hint=f"this server serves '{state.model_id}' (GET /v1/models)",
        )
    return name


def _need(state: ServerState, capability: str) -> None:
    if capability not in state.engine.capabilities:
        raise HttpError(
            501,
            "not_supported_error",
            f"engine '{state.engine.name}' does not declare the '{capability}' capability",
        )


def _n_ctx(engine: Engine) -> int | None:
    try:
        return int(engine.n_ctx())
    except Exception:  # an engine may not know (e.g. a remote server)
        return None


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    """Model metadata made JSON-safe (engines may put numpy scalars or paths in it)."""
    return json.loads(json.dumps(d, default=str))


def _count_token(state: ServerState, log: dict[str, Any], t0: float, ev: TokenEvent) -> None:
    state.metrics.count_decode(state.slots.busy)
    if ev.text and "ttft_ms" not in log:
        log["ttft_ms"] = round((time.perf_counter() - t0) * 1e3, 1)


def _final_logprobs(
    reply: api.Reply, scores: PromptLogprobs | None, tokens: list[TokenEvent]
) -> dict[str, Any] | None:
    if reply.logprobs is None:
        return None
    generated = reply.logprobs.tokens(tokens)
    return generated if scores is None else api.join_legacy(reply.logprobs.prompt(scores), generated)


def _record_done(state: ServerState, log: dict[str, Any], ctx: Engine, done: DoneEvent) -> None:
    state.metrics.count_decode(state.slots.busy)  # the prompt's decode
    state.metrics.record(ctx, done)
    log.update(
        prompt_tokens=done.usage.prompt_tokens,
        completion_tokens=done.usage.completion_tokens,
        finish_reason=done.finish_reason,
        timings=done.timings.to_dict(),
    )


# --- running it ---------------------------------------------------------------------------------


def run_server(
    state: ServerState,
    host: str,
    port: int,
    *,
    on_listening: Callable[[str], None] | None = None,
    on_stopped: Callable[[str, str | None], None] | None = None,
    ready: threading.Event | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM, then drain: stop accepting connections, let requests in
    flight (and those queued) finish, return. Returns normally, so the caller can close the engine.

    on_listening(url) is called once the socket listens (a client may connect from then on; the
    URL has the real port, also for port 0); on_stopped(url, signal name or None) once the
    requests in flight are drained."""
    import uvicorn

    received: list[str] = []

    class DrainingServer(uvicorn.Server):
        # uvicorn re-raises the signal after its graceful shutdown, which would kill the process
        # before the engine is closed; we only ask it to shut down and return.
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            received.append(signal.Signals(sig).name)
            super().handle_exit(sig, frame)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)  # the socket listens once this returns
            if on_listening is not None:
                on_listening(url)
            if ready is not None:
                ready.set()

    config = uvicorn.Config(
        create_app(state),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        server_header=False,
        lifespan="off",
    )
    sock = config.bind_socket()  # bound here (not yet listening) so that --port 0 knows its port
    bound_port = sock.getsockname()[1]
    shown_host = f"[{host}]" if ":" in host else host
    url = f"http://{shown_host}:{bound_port}"
    server = DrainingServer(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if on_stopped is not None and server.started:
        on_stopped(url, received[0] if received else None)
