"""Chat and text completions: one path from a request to its answer, whole or streamed.

`complete` parses the request, checks it against the loaded engine and turns its prompt (chat
messages, or text or token ids) into a GenerateRequest; `answer` waits for a slot and runs the
generation in the slot's worker thread. One interpreter (`Run.next`) reads the generation's
events for both kinds of answer: it counts the metrics and fills the request's log, and raises
the error that ended a generation; the whole answer collects the events, the stream sends each
as a chunk."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from stdengine.adapter import DoneEvent, GenerateRequest, PromptLogprobs, TokenEvent
from stdengine.errors import EngineFailure, InferError, InvalidRequest
from stdengine.server import api, tools
from stdengine.server.envelope import LOG_KEY, as_infer_error, error_parts, log_error
from stdengine.server.middleware import check_prompt_size, read_json
from stdengine.server.slots import GONE, ClientGone, DisconnectWatch, Generation
from stdengine.server.state import ServerState, state_of
from stdengine.structured import Constraint

Event = PromptLogprobs | TokenEvent | DoneEvent


@dataclass
class Prompt:
    """A request's prompt as the engine gets it, and what the log and the answer need of it."""

    shown: Any  # what request.done shows of it (with -v)
    messages: list[dict[str, str]] | None = None
    text: str | None = None
    ids: list[int] | None = None
    echo: str | None = None  # completions with echo: the prompt's text, put before the answer
    score: tuple[list[int], int] | None = None  # an echo with logprobs: score these (ids, top_n)


async def complete(request: Request, kind: Literal["chat", "text"]) -> Response:
    """POST /v1/chat/completions (kind "chat") and /v1/completions ("text")."""
    state = state_of(request)
    engine = state.engine
    shape = api.ChatRequest if kind == "chat" else api.CompletionRequest
    req = api.parse(shape, await read_json(request, state.max_body))
    model = state.check_model(req.model)
    api.refuse_unsupported(req)
    api.refuse_missing(req, engine.name, engine.capabilities)
    sampling = api.sampling_for(req, state.defaults, engine.name, engine.honoured_options())
    ignore_eos, min_tokens = api.eog_controls(req, engine.name, engine.eog_controls)
    plan = (
        tools.tool_plan(req, engine.name, engine.capabilities, getattr(engine, "template", None))
        if isinstance(req, api.ChatRequest)
        else None
    )
    # an engine with `tool_calls` passes the tools to its server, which constrains the answer
    forward = plan is not None and "tool_calls" in engine.capabilities
    constraint: Constraint | None = None
    if plan is not None and forward:
        plan = tools.forwarded(plan)
    elif plan is not None:
        constraint = plan.constraint()  # a tool plan refuses the other output constraints
    else:
        constraint = tools.constraint_for(req, engine.name, engine.capabilities)
    prompt = await (
        chat_prompt(state, req, plan, forward)
        if isinstance(req, api.ChatRequest)
        else text_prompt(state, req)
    )
    request.scope[LOG_KEY]["prompt"] = prompt.shown
    reply = api.Reply(
        kind,
        model,
        state.fingerprint,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        echo=prompt.echo,
        tools=plan,
    )
    n_logprobs = api.logprobs_wanted(req)
    if n_logprobs is not None:
        reply.logprobs = api.LogprobsReply(kind, len(prompt.echo or ""))
    gen_request = GenerateRequest(
        prompt=prompt.text,
        prompt_tokens=prompt.ids,
        messages=prompt.messages,
        sampling=sampling,
        logprobs=n_logprobs,
        constraint=constraint,
        tools=plan.template_tools() if plan is not None and not forward else None,
        tool_fields=tools.tool_fields(req) if forward and isinstance(req, api.ChatRequest) else None,
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
    )
    return await answer(request, state, gen_request, reply, req.stream, prompt.score)


async def chat_prompt(
    state: ServerState, req: api.ChatRequest, plan: tools.ToolPlan | None, forward: bool = False
) -> Prompt:
    """forward: the engine passes the tools on, so its server gets OpenAI's messages as they are."""
    if forward:
        messages = tools.upstream_messages(req)
        check_prompt_size(state.n_ctx(), len(json.dumps(messages)), len(messages))
        return Prompt(shown=messages, messages=messages)
    if not state.engine.has_chat_template():
        raise InvalidRequest(
            "this model has no chat template, so the server cannot render a conversation",
            hint="use /v1/completions, or start the server with --chat-template",
        )
    messages = tools.chat_messages(req, plan)
    check_prompt_size(state.n_ctx(), sum(len(m["content"]) for m in messages), len(messages))
    return Prompt(shown=messages, messages=messages)


async def text_prompt(state: ServerState, req: api.CompletionRequest) -> Prompt:
    engine = state.engine
    given = api.completion_prompt(req)
    if isinstance(given, str):
        check_prompt_size(state.n_ctx(), len(given))
    prompt = Prompt(shown=given)
    prompt.text, prompt.ids = (given, None) if isinstance(given, str) else (None, given)
    if req.echo:
        # token ids are echoed as their text (which also checks that they are in the vocabulary)
        prompt.echo = given if isinstance(given, str) else await run_in_threadpool(engine.detokenize, given)
    if req.echo and req.logprobs is not None:
        if isinstance(given, str):
            # an echo's log-probabilities are of the prompt's tokens: tokenized as generate() would
            prompt.ids, prompt.text = await run_in_threadpool(engine.tokenize, given, True, True), None
        assert prompt.ids is not None
        prompt.score = (prompt.ids, req.logprobs)
    if prompt.ids is not None and not engine.takes_prompt_tokens:
        # an engine that completes text only gets the ids' text (which it may tokenize differently)
        prompt.text = prompt.echo or await run_in_threadpool(engine.detokenize, prompt.ids)
        prompt.ids = None
    return prompt


class Run:
    """One request's generation as the server reads it: its events, counted in the metrics and
    the request's log, up to the DoneEvent."""

    def __init__(
        self, state: ServerState, gen: Generation, watch: DisconnectWatch, log: dict[str, Any], t0: float
    ) -> None:
        self.state = state
        self.gen = gen
        self.watch = watch
        self.log = log
        self.t0 = t0  # when the request started waiting for its slot: ttft counts from there
        self.t_token: float | None = None  # when the last token came (inter-token latency)
        watch.notify(gen.queue)

    async def next(self) -> Event:
        """The next event; after the DoneEvent the worker has left its slot. Raises the
        InferError that ended the generation instead, or ClientGone when the client leaves."""
        item = await self.gen.next()
        if item is GONE:
            raise ClientGone()
        state, log = self.state, self.log
        if isinstance(item, PromptLogprobs):
            return item
        if isinstance(item, TokenEvent):
            state.metrics.count_decode(state.slots.busy)
            now = time.perf_counter()
            if item.id >= 0:  # a generated token (-1: text held back until the end)
                m = state.metrics
                m.observe(m.ttft if self.t_token is None else m.itl, now - (self.t_token or self.t0))
                self.t_token = now
            if item.text and "ttft_ms" not in log:
                log["ttft_ms"] = round((now - self.t0) * 1e3, 1)
            return item
        if isinstance(item, DoneEvent):
            state.metrics.count_decode(state.slots.busy)  # the prompt's decode
            state.metrics.record(self.gen.ctx, item)
            log.update(
                prompt_tokens=item.usage.prompt_tokens,
                completion_tokens=item.usage.completion_tokens,
                finish_reason=item.finish_reason,
                timings=item.timings.to_dict(),
            )
            await self.watch.guard(self.gen.finish())
            return item
        # the worker's exception, or END (or a stray object) before any DoneEvent: the worker has
        # ended, let it give the slot back first
        await self.watch.guard(self.gen.finish())
        if isinstance(item, BaseException):
            raise as_infer_error(item)
        raise EngineFailure("the engine ended generate() without a DoneEvent")

    def close(self) -> None:
        self.gen.cancel()
        self.watch.close()


async def answer(
    request: Request,
    state: ServerState,
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
    run: Run | None = None
    handed_over = False  # True once the streamed body owns the run
    try:
        ctx = await watch.guard(state.slots.acquire())
        log["slot"] = state.slots.slot_id(ctx)
        queued = time.perf_counter() - t0
        log["queued_ms"] = round(queued * 1e3, 1)
        state.metrics.observe(state.metrics.queue, queued)
        gen = Generation(state.slots, ctx, gen_request, score)
        run = Run(state, gen, watch, log, t0)
        gen.start()
        # Errors that come before any event (a prompt over the context, an empty prompt) are a
        # plain HTTP error, also for a streamed request: nothing has been sent yet.
        first = await run.next()
        if stream:
            handed_over = True
            return ClosingStream(
                [run.close],
                stream_body(request, run, first, reply),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return JSONResponse(await whole_body(run, first, reply))
    except ClientGone:
        log["status"] = 499  # nginx's "client closed request": nobody read an answer
        return Response(status_code=499)
    finally:
        if not handed_over:
            if run is not None:
                run.close()
            else:
                watch.close()


async def whole_body(run: Run, item: Event, reply: api.Reply) -> dict[str, Any]:
    tokens: list[TokenEvent] = []
    scores: PromptLogprobs | None = None
    while not isinstance(item, DoneEvent):
        if isinstance(item, PromptLogprobs):
            scores = item
        else:
            tokens.append(item)
        item = await run.next()
    text = (reply.echo or "") + "".join(t.text for t in tokens)
    logprobs = None
    if reply.logprobs is not None:
        logprobs = reply.logprobs.tokens(tokens)
        if scores is not None:
            logprobs = api.join_legacy(reply.logprobs.prompt(scores), logprobs)
    calls = tools.answer_calls(reply.tools, text) if reply.tools is not None else None
    return reply.final(text, item, logprobs, calls)


async def stream_body(request: Request, run: Run, item: Event, reply: api.Reply) -> AsyncIterator[bytes]:
    try:
        if reply.kind == "chat":
            yield _sse(reply.chunk(role=True))
        elif reply.echo is not None and not isinstance(item, PromptLogprobs):
            yield _sse(reply.chunk(reply.echo))
        text_frame = TextFrames(reply)
        # with tools, what is sent of the answer is the CallStream's to say (a text, or calls)
        calls_stream = tools.CallStream(reply.tools) if reply.tools is not None else None
        while True:
            if isinstance(item, PromptLogprobs):
                assert reply.logprobs is not None and reply.echo is not None
                yield _sse(reply.chunk(reply.echo, logprobs=reply.logprobs.prompt(item)))
            elif isinstance(item, TokenEvent) and calls_stream is not None:
                for chunk in calls_stream.feed(item.text):
                    yield _sse(reply.chunk(**chunk))
            elif isinstance(item, TokenEvent) and reply.logprobs is not None:
                if item.text or item.token is not None:
                    yield _sse(reply.chunk(item.text, logprobs=reply.logprobs.tokens([item])))
            elif isinstance(item, TokenEvent):
                if item.text:
                    yield text_frame(item.text)
            else:
                calls = None
                if calls_stream is not None:
                    last, calls = calls_stream.end()
                    for chunk in last:
                        yield _sse(reply.chunk(**chunk))
                yield _sse(reply.chunk(done=item, finish=api.finish_reason(item, calls)))
                if reply.include_usage:
                    yield _sse(reply.usage_chunk(item))
                yield b"data: [DONE]\n\n"
                return
            try:
                item = await run.next()
            except InferError as e:
                # Headers are sent: a failure mid-stream is an error event (OpenAI's shape,
                # which its clients raise as an APIError), then the end of the stream.
                log_error(run.log, e, run.state.verbose)
                yield _sse(error_parts(e)[1])
                yield b"data: [DONE]\n\n"
                return
    except ClientGone:  # seen by our watch
        run.log["status"] = 499
    except asyncio.CancelledError:  # seen by Starlette first, which cancels the body
        run.log["status"] = 499
        raise
    finally:
        run.close()


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


def _json(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _sse(obj: Any) -> bytes:
    return b"data: " + _json(obj) + b"\n\n"


class TextFrames:
    """The SSE frame of a chunk that carries only text, as _sse(reply.chunk(text)) makes it, by
    encoding the text alone between the stream's fixed head and tail: a streamed token costs one
    string's encoding instead of building and encoding the whole chunk."""

    MARK = "\x00text\x00"  # JSON writes it \u0000text\u0000, which nothing else in a chunk is

    def __init__(self, reply: api.Reply) -> None:
        self.head, _, self.tail = _sse(reply.chunk(self.MARK)).partition(_json(self.MARK))

    def __call__(self, text: str) -> bytes:
        return self.head + _json(text) + self.tail
