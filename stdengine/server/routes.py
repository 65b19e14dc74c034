"""The routes (spec/server.md has the table): module-level handlers that read the server's state
from their request (`state_of`); `ROUTES` lists them for create_app. Chat and text completions
are in completion.py."""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from stdengine import __version__
from stdengine.errors import InferError, InvalidRequest
from stdengine.server import api
from stdengine.server.completion import complete
from stdengine.server.envelope import as_infer_error
from stdengine.server.middleware import check_prompt_size, read_json
from stdengine.server.slots import DisconnectWatch
from stdengine.server.state import state_of


async def index(request: Request) -> Response:
    page = resources.files("stdengine.server").joinpath("static/index.html").read_text(encoding="utf-8")
    return HTMLResponse(page, headers={"Cache-Control": "no-cache"})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def models(request: Request) -> Response:
    state = state_of(request)
    model = {
        "id": state.model_id,
        "object": "model",
        "created": int(state.started),
        "owned_by": "stdengine",
        "meta": state.model_meta(),
    }
    return JSONResponse({"object": "list", "data": [model]})


async def props(request: Request) -> Response:
    """llama-server's /props: defaults and slots, plus what this engine honours (the web chat
    uses it to offer only the settings the engine can honour)."""
    state = state_of(request)
    engine = state.engine
    info = engine.info()
    honoured = engine.honoured_options()
    return JSONResponse(
        {
            "default_generation_settings": {**api.props_defaults(state.defaults), "n_ctx": state.n_ctx()},
            "total_slots": state.slots.total,
            "model": state.model_id,
            "model_path": state.model_path,
            "build_info": f"stdengine {__version__}; {info.name} {info.version} {info.build}".strip(),
            "engine": info.name,
            "capabilities": sorted(engine.capabilities),
            "supported_params": [f for f, opt in api.SAMPLING_FIELDS.items() if opt in honoured],
            "chat": engine.has_chat_template(),
        }
    )


async def metrics(request: Request) -> Response:
    state = state_of(request)
    text = state.metrics.render(
        n_ctx_total=(state.n_ctx() or 0) * state.slots.total,
        processing=state.slots.busy,
        deferred=state.slots.waiting,
        batch=state.slots.scheduler.stats if state.slots.scheduler is not None else None,
    )
    return PlainTextResponse(
        text,
        media_type="text/plain; version=0.0.4",
        headers={"Process-Start-Time-Unix": str(int(state.started))},
    )


async def chat_completions(request: Request) -> Response:
    return await complete(request, "chat")


async def completions(request: Request) -> Response:
    return await complete(request, "text")


async def tokenize(request: Request) -> Response:
    """The loaded engine's tokenizer (a remote one for the openai engine, when its server has one)."""
    state = state_of(request)
    state.need("tokenize")
    req = api.parse(api.TokenizeRequest, await read_json(request, state.max_body))
    check_prompt_size(state.n_ctx(), len(req.content))
    engine = state.engine
    tokens = await run_in_threadpool(engine.tokenize, req.content, req.add_special, True)
    if not req.with_pieces:
        return JSONResponse({"tokens": tokens})
    pieces = await run_in_threadpool(lambda: [engine.detokenize([t]) for t in tokens])
    return JSONResponse({"tokens": [{"id": t, "piece": p} for t, p in zip(tokens, pieces, strict=True)]})


async def detokenize(request: Request) -> Response:
    state = state_of(request)
    state.need("tokenize")
    req = api.parse(api.DetokenizeRequest, await read_json(request, state.max_body))
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


async def embeddings(request: Request) -> Response:
    state = state_of(request)
    state.need("embeddings")
    req = api.parse(api.EmbeddingsRequest, await read_json(request, state.max_body))
    model = state.check_model(req.model)
    texts = [req.input] if isinstance(req.input, str) else list(req.input)
    if not texts or any(t == "" for t in texts):
        raise InvalidRequest("input must be a non-empty string or a list of non-empty strings")
    for t in texts:
        check_prompt_size(state.n_ctx(), len(t))
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


Route = Callable[[Request], Awaitable[Response]]
# (method, path, handler): llama-server's routes, and OpenAI's with and without /v1
ROUTES: list[tuple[str, str, Route]] = [
    ("GET", "/", index),
    ("GET", "/health", health),
    ("GET", "/v1/models", models),
    ("GET", "/models", models),
    ("GET", "/props", props),
    ("GET", "/metrics", metrics),
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/chat/completions", chat_completions),
    ("POST", "/v1/completions", completions),
    ("POST", "/tokenize", tokenize),
    ("POST", "/detokenize", detokenize),
    ("POST", "/v1/embeddings", embeddings),
]
