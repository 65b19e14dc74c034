"""The HTTP checks (`--url`): an OpenAI-compatible server's routes, shapes, streaming, usage,
errors and concurrency, and what it generates compared with the golden data (the exact
reference's greedy continuations, where every token wins by at least 1 nat, so every correct
engine reproduces them at temperature 0) and the log-probabilities it serves (restricted KL from
the exact reference, as in-process). Plain urllib, so the checks need nothing beyond the
standard library (and numpy for the metric).
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from stdengine.conformance.cases import (
    FFFD,
    GREEDY_SEEDS,
    GREEDY_TEMP,
    all_cases,
    eog_answer_tokens,
    eog_texts,
    find_case,
    first_difference,
    least_greedy_raw_case,
)
from stdengine.conformance.corpus import COMPLETION_PROMPT
from stdengine.conformance.suite import Check, Context, Level, NotSupported, Outcome, Skip

from stdengine.openai_wire import (
    DONE,
    ErrorReply,
    SseDecoder,
    WireError,
    bearer,
    choice_text,
    echo_body,
    logprob_entries,
    model_ids,
    parse_chunk,
    root_url,
    sse_events,
    tokens_of,
)

TIMEOUT_S = 120.0
MAX_TOKENS = 8


class Reply:
    def __init__(
        self, status: int, body: bytes, headers: dict[str, str], times: list[float] | None = None
    ) -> None:
        self.status = status
        self.body = body
        self.headers = headers
        self.times = times  # with request(timed=True): seconds from sending to each event's end

    def json(self) -> Any:
        return json.loads(self.body.decode("utf-8"))

    def sse(self) -> list[str]:
        """The data of each server-sent event of the body, in order."""
        return list(sse_events([self.body.decode("utf-8")]))


def request(
    ctx: Context,
    method: str,
    path: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    api_key: str | None = None,
    timed: bool = False,
) -> Reply:
    """One HTTP request; an HTTP error status is a Reply too. timed: read the body line by line
    as it arrives and note when each server-sent event came (for the streaming checks)."""
    assert ctx.url is not None
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": "application/json", **bearer(api_key if api_key is not None else ctx.api_key)}
    req = urllib.request.Request(root_url(ctx.url) + path, data=data, headers=headers, method=method)
    try:
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            if not timed:
                return Reply(r.status, r.read(), dict(r.headers))
            lines, times, events = [], [], SseDecoder()
            for line in iter(r.readline, b""):
                lines.append(line)
                times += [time.perf_counter() - t0 for _ in events.feed(line.decode("utf-8"))]
            times += [time.perf_counter() - t0 for _ in events.close()]
            return Reply(r.status, b"".join(lines), dict(r.headers), times)
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.read(), dict(e.headers or {}))


def probe(url: str, timeout_s: float = 10.0) -> None:
    """Raise EngineUnavailable when nothing answers HTTP at url (any HTTP status is an answer)."""
    from stdengine.errors import EngineUnavailable

    try:
        urllib.request.urlopen(root_url(url) + "/v1/models", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return
    except (OSError, ValueError) as e:
        raise EngineUnavailable(
            f"no server answers at {url}: {e}", hint="start the server first, or check --url"
        ) from e


def model_id(ctx: Context) -> str:
    def find() -> str:
        r = request(ctx, "GET", "/v1/models")
        try:
            return model_ids(r.json())[0]
        except Exception:
            return ctx.model or "default"

    return ctx.memo("http.model", find)


def chat_body(ctx: Context, **extra: Any) -> dict[str, Any]:
    return {
        "model": model_id(ctx),
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        **extra,
    }


def completion_body(ctx: Context, **extra: Any) -> dict[str, Any]:
    return {
        "model": model_id(ctx),
        "prompt": "Once upon a time",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        **extra,
    }


def _usage_ok(out: Outcome, usage: Any, where: str) -> None:
    ok = (
        isinstance(usage, dict)
        and all(isinstance(usage.get(k), int) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
        and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    )
    out.expect(
        ok,
        f"{where}: usage has prompt/completion/total tokens that add up"
        if ok
        else f"{where}: bad usage {usage!r}",
    )


def _status(out: Outcome, r: Reply, want: int, what: str) -> bool:
    return out.expect(
        r.status == want,
        f"{what}: HTTP {r.status}"
        if r.status == want
        else f"{what}: HTTP {r.status} (want {want}): {r.body[:200]!r}",
    )


# --- checks -------------------------------------------------------------------------------------
def models(ctx: Context, out: Outcome) -> None:
    r = request(ctx, "GET", "/v1/models")
    if not _status(out, r, 200, "GET /v1/models"):
        return
    body = r.json()
    data = body.get("data")
    out.expect(
        body.get("object") == "list" and isinstance(data, list) and len(data) > 0,
        "a list object with at least one model",
    )
    if data:
        out.expect(
            all(isinstance(m.get("id"), str) and m.get("object") == "model" for m in data),
            "each model has an id and object 'model'",
        )


def chat(ctx: Context, out: Outcome) -> None:
    r = request(ctx, "POST", "/v1/chat/completions", chat_body(ctx))
    if not _status(out, r, 200, "POST /v1/chat/completions"):
        return
    b = r.json()
    out.expect(b.get("object") == "chat.completion", f"object {b.get('object')!r}")
    out.expect(isinstance(b.get("id"), str) and isinstance(b.get("created"), int), "id and created")
    ch = (b.get("choices") or [{}])[0]
    msg = ch.get("message") or {}
    out.expect(
        msg.get("role") == "assistant" and isinstance(msg.get("content"), str),
        "choices[0].message is an assistant message with content",
    )
    out.expect(ch.get("finish_reason") in ("stop", "length"), f"finish_reason {ch.get('finish_reason')!r}")
    _usage_ok(out, b.get("usage"), "chat")
    if isinstance(b.get("usage"), dict):
        out.expect(b["usage"].get("completion_tokens", 0) <= MAX_TOKENS, f"max_tokens={MAX_TOKENS} honoured")


def completions(ctx: Context, out: Outcome) -> None:
    r = request(ctx, "POST", "/v1/completions", completion_body(ctx))
    if not _status(out, r, 200, "POST /v1/completions"):
        return
    b = r.json()
    out.expect(b.get("object") == "text_completion", f"object {b.get('object')!r}")
    ch = (b.get("choices") or [{}])[0]
    out.expect(isinstance(ch.get("text"), str), "choices[0].text is a string")
    out.expect(ch.get("finish_reason") in ("stop", "length"), f"finish_reason {ch.get('finish_reason')!r}")
    _usage_ok(out, b.get("usage"), "completions")


def _stream(
    route: str, chunk_object: str, body: Callable[[Context], dict[str, Any]], usage: bool
) -> Callable[[Context, Outcome], None]:
    def check(ctx: Context, out: Outcome) -> None:
        extra: dict[str, Any] = {"stream": True}
        if usage:
            extra["stream_options"] = {"include_usage": True}
        r = request(ctx, "POST", route, {**body(ctx), **extra})
        if not _status(out, r, 200, f"POST {route} stream"):
            return
        events = r.sse()
        out.expect(bool(events) and events[-1] == DONE, "the stream ends with data: [DONE]")
        chunks = []
        for e in events:
            if e == DONE:
                continue
            try:
                chunks.append(parse_chunk(e))
            except WireError as err:
                out.add("fail", f"not a JSON chunk: {err}")
        out.expect(len(chunks) >= 2, f"{len(chunks)} chunks")
        out.expect(all(c.get("object") == chunk_object for c in chunks), f"every chunk is a {chunk_object}")
        finishes = [
            ch.get("finish_reason")
            for c in chunks
            for ch in c.get("choices") or []
            if ch.get("finish_reason")
        ]
        out.expect(
            len(finishes) == 1 and finishes[0] in ("stop", "length"),
            f"exactly one finish_reason ({finishes})",
        )
        if usage:
            # OpenAI: the last chunk before [DONE] carries usage and empty choices
            last = chunks[-1] if chunks else {}
            _usage_ok(out, last.get("usage"), "the final chunk")
            out.expect(last.get("choices") == [], "the usage chunk has empty choices")
            early = [c for c in chunks[:-1] if c.get("usage")]
            out.expect(not early, "no usage before the final chunk", otherwise="warn")
        else:
            out.expect(
                not any(c.get("usage") for c in chunks),
                "no usage without stream_options.include_usage",
                otherwise="warn",
            )

    return check


def _envelope(out: Outcome, r: Reply, statuses: tuple[int, ...], what: str) -> None:
    out.expect(
        r.status in statuses,
        f"{what}: HTTP {r.status}" + ("" if r.status in statuses else f" (want {statuses})"),
    )
    ok = ErrorReply.of(r.status, r.body).openai_shape
    out.expect(
        ok,
        f"{what}: OpenAI error envelope" if ok else f"{what}: not an OpenAI error envelope: {r.body[:160]!r}",
    )


def bad_json(ctx: Context, out: Outcome) -> None:
    r = request(ctx, "POST", "/v1/chat/completions", raw=b'{"model": "x", "messages": [')
    _envelope(out, r, (400,), "malformed JSON")


def bad_param(ctx: Context, out: Outcome) -> None:
    r = request(ctx, "POST", "/v1/chat/completions", chat_body(ctx, temperature="hot"))
    _envelope(out, r, (400,), "temperature='hot'")
    r = request(ctx, "POST", "/v1/chat/completions", {"model": model_id(ctx), "max_tokens": 4})
    _envelope(out, r, (400,), "no messages")


def auth(ctx: Context, out: Outcome) -> None:
    if not ctx.api_key:
        raise Skip("give --api-key (the server's key) to check that a wrong key is refused")
    r = request(ctx, "POST", "/v1/chat/completions", chat_body(ctx), api_key=ctx.api_key + "-wrong")
    _envelope(out, r, (401,), "a wrong API key")


# --- generation compared with the golden data (cases.py) ------------------------------------------
STREAM_FIRST_FRACTION = 0.5  # http.stream.incremental: first content chunk by half the time
MIN_STREAM_CHUNKS = 4


class Answer:
    """One generation request's result, whatever the route: text, finish reason, usage."""

    def __init__(self, reply: Reply, chat: bool) -> None:
        self.reply = reply
        self.text: str | None = None
        self.finish: Any = None
        self.usage: Any = None
        if reply.status != 200:
            return
        body = reply.json()
        choice = (body.get("choices") or [{}])[0]
        self.text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
        self.finish = choice.get("finish_reason")
        self.usage = body.get("usage")
        self.body = body

    def ok(self, out: Outcome, what: str) -> bool:
        if not _status(out, self.reply, 200, what):
            return False
        return out.expect(isinstance(self.text, str), f"{what}: the answer has text")


def _route(case: dict[str, Any]) -> str:
    return "/v1/chat/completions" if case["kind"] == "chat" else "/v1/completions"


def gen_body(ctx: Context, case: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A temperature-0 request for a golden case, max_tokens = the golden continuation's length."""
    body: dict[str, Any] = {"model": model_id(ctx), "max_tokens": len(case["ids"]), "temperature": 0}
    if case["kind"] == "chat":
        body["messages"] = case["messages"]
    else:
        body["prompt"] = case["prompt"]
    return {**body, **extra}


def generate(ctx: Context, case: dict[str, Any], **extra: Any) -> Answer:
    return Answer(request(ctx, "POST", _route(case), gen_body(ctx, case, **extra)), case["kind"] == "chat")


def golden_answer(ctx: Context, case: dict[str, Any]) -> Answer:
    """The plain request of a golden case, sent once per run and shared by the checks."""
    answer: Answer = ctx.memo(f"http.answer:{case['name']}", lambda: generate(ctx, case))
    return answer


def expect_text(out: Outcome, got: str, want: str, what: str) -> bool:
    return out.expect(
        got == want,
        f"{what}: the golden text ({len(want)} characters)"
        if got == want
        else f"{what}: {first_difference(got, want)}",
    )


def expect_usage(out: Outcome, usage: Any, case: dict[str, Any], n: int, what: str) -> None:
    want = {"prompt_tokens": len(case["prompt_ids"]), "completion_tokens": n}
    got = {k: usage.get(k) for k in want} if isinstance(usage, dict) else usage
    out.expect(
        got == want,
        f"{what}: usage {got} (want {want}, golden prompt ids)" if got != want else f"{what}: usage {want}",
    )
    if isinstance(usage, dict):
        _usage_ok(out, usage, what)


def generation_golden(name: str) -> Callable[[Context, Outcome], None]:
    def check(ctx: Context, out: Outcome) -> None:
        case = find_case(ctx, name)
        a = golden_answer(ctx, case)
        if not a.ok(out, f"POST {_route(case)}"):
            return
        assert a.text is not None
        want = case["text"]
        out.details.update({"got": a.text, "want": want, "usage": a.usage, "finish_reason": a.finish})
        expect_text(out, a.text, want, "text")
        expect_usage(out, a.usage, case, len(case["ids"]), "usage")
        out.expect(
            a.finish == "length", f"finish_reason {a.finish!r} (want 'length': max_tokens was reached)"
        )
        if FFFD not in want:
            out.expect(FFFD not in a.text, "no U+FFFD in the text (bytes decoded one token at a time?)")
        leaked = [e for e in eog_texts(ctx) if e in a.text and e not in want]
        out.expect(not leaked, f"no end-of-generation token text in the answer (found {leaked})")

    return check


REPEATS = 3


def least_certain_case(ctx: Context) -> dict[str, Any]:
    """The golden case a sampler that is not greedy is likeliest to leave: the largest expected
    number of steps where the runner-up would be drawn at temperature 1 (sum of
    e^-margin / (1 + e^-margin)). Every step still wins by >= 1 nat, so greedy is unambiguous."""
    ctx.need_golden("generation")
    return max(
        all_cases(ctx), key=lambda c: sum(math.exp(-m) / (1 + math.exp(-m)) for m in c.get("margins") or [])
    )


def temperature0_repeat(ctx: Context, out: Outcome) -> None:
    case = least_certain_case(ctx)
    answers = [golden_answer(ctx, case)] + [generate(ctx, case) for _ in range(REPEATS - 1)]
    out.details["case"] = case["name"]
    if all(a.ok(out, f"request {i + 1} ({case['name']})") for i, a in enumerate(answers)):
        for i, a in enumerate(answers[1:], 2):
            expect_text(out, a.text or "", answers[0].text or "", f"answer {i} vs answer 1")


def sampler_is_greedy(label: str, **params: Any) -> Callable[[Context, Outcome], None]:
    """top_p 0.01 (or min_p 1, a llama.cpp extension) leaves only the top token: at temperature
    1.5 the answer is still the golden greedy text, whatever the seed. The case and the seeds
    leave a server that ignores the setting a small chance of passing (in the details)."""

    def check(ctx: Context, out: Outcome) -> None:
        case, chance = least_greedy_raw_case(ctx)
        out.details.update(case=case["name"], chance_if_ignored=f"{chance:.1e}")
        for seed in GREEDY_SEEDS:
            a = generate(ctx, case, temperature=GREEDY_TEMP, seed=seed, **params)
            if a.ok(out, f"{label}, seed {seed}"):
                expect_text(
                    out, a.text or "", case["text"], f"{label} at temperature {GREEDY_TEMP}, seed {seed}"
                )

    return check


def seed(ctx: Context, out: Outcome) -> None:
    """OpenAI's `seed`: temperature 1 on a prompt with near ties, seed 1234 twice gives one
    text; seeds 4321, 99 and 7 do not all give that text. Golden data says the model has near ties
    on that prompt (a server of another model may well answer it with certainty)."""
    ctx.need_golden("completion")
    body = {
        "model": model_id(ctx),
        "prompt": COMPLETION_PROMPT,
        "max_tokens": 16,
        "temperature": 1.0,
        "top_p": 1.0,
    }

    def sample(s: int) -> str | None:
        a = Answer(request(ctx, "POST", "/v1/completions", {**body, "seed": s}), False)
        return a.text if a.ok(out, f"seed {s}") else None

    first, again = sample(1234), sample(1234)
    others = {sample(s) for s in (4321, 99, 7)}
    if first is None or again is None or None in others:
        return
    out.expect(
        first == again,
        "seed 1234 twice: the same text" if first == again else f"seed 1234 gave {first!r}, then {again!r}",
    )
    out.expect(bool(others - {first}), f"seeds 4321, 99 and 7 do not all give seed 1234's text {first!r}")


def eog(ctx: Context, out: Outcome) -> None:
    """The golden prompt whose greedy continuation ends with an end-of-generation token: finish
    reason stop, the token neither counted in usage nor its text in the answer."""
    case = ctx.need_golden("eog").get("case")
    if not case:
        raise Skip("the golden data has no prompt that ends with an end-of-generation token")
    body = {"model": model_id(ctx), "prompt": case["prompt"], "max_tokens": 16, "temperature": 0}
    a = Answer(request(ctx, "POST", "/v1/completions", body), False)
    if not a.ok(out, "POST /v1/completions"):
        return
    n = eog_answer_tokens(case)
    out.expect(a.finish == "stop", f"finish_reason {a.finish!r} (want 'stop': an end-of-generation token)")
    leaked = [e for e in eog_texts(ctx) if e in (a.text or "")]
    out.expect(
        not leaked, "no end-of-generation text in the answer" + (f" (found {leaked})" if leaked else "")
    )
    got = a.usage.get("completion_tokens") if isinstance(a.usage, dict) else a.usage
    out.expect(
        got == n, f"usage.completion_tokens {got} (want {n}: the end-of-generation token is not counted)"
    )


def tokenize(name: str) -> Callable[[Context, Outcome], None]:
    """`POST /tokenize` (llama-server's and infer serve's extension), where the server has it:
    the golden ids of the tokenizer case with special tokens added (both servers parse special
    tokens by default)."""

    def check(ctx: Context, out: Outcome) -> None:
        case = next(
            (c for c in ctx.need_golden("tokenizer")["cases"] if c["name"] == name and c["add_special"]), None
        )
        if case is None:
            raise Skip(f"the golden data has no tokenizer case {name!r}")
        r = request(ctx, "POST", "/tokenize", {"content": case["text"], "add_special": True})
        if r.status in (404, 405, 501):
            raise NotSupported(f"the server has no /tokenize (HTTP {r.status})")
        if not _status(out, r, 200, "POST /tokenize"):
            return
        try:
            got: Any = tokens_of(r.json())
        except (KeyError, TypeError, ValueError):
            got = None
        if got is None:
            got = r.body[:200]
        out.expect(
            got == case["ids"],
            f"{len(case['ids'])} ids match llama.cpp's"
            if got == case["ids"]
            else f"ids {got}, want {case['ids']}",
        )

    return check


def max_tokens5(ctx: Context, out: Outcome) -> None:
    case = find_case(ctx, kind="raw")
    n = 5
    a = generate(ctx, case, max_tokens=n)
    if not a.ok(out, "POST /v1/completions"):
        return
    assert a.text is not None
    pieces = (ctx.golden or {}).get("pieces") or {}
    want5 = "".join(pieces.get(str(i), FFFD) for i in case["ids"][:n])
    # SentencePiece models may drop the first piece's leading space when detokenizing alone;
    # a piece that is part of a multi-byte character is U+FFFD alone: then any prefix will do.
    exact = next((w for w in (want5, want5.lstrip()) if FFFD not in w and case["text"].startswith(w)), None)
    if exact is not None:
        expect_text(out, a.text, exact, f"{n} tokens")
    else:
        out.expect(
            case["text"].startswith(a.text) and a.text != "",
            f"{n} tokens: a prefix of the golden text"
            if case["text"].startswith(a.text)
            else f"{n} tokens: {first_difference(a.text, case['text'])}",
        )
    completion = a.usage.get("completion_tokens") if isinstance(a.usage, dict) else None
    out.expect(completion == n, f"completion_tokens {completion} (want {n})")
    out.expect(a.finish == "length", f"finish_reason {a.finish!r} (want 'length')")


def stop_strings(text: str) -> tuple[int, str, str]:
    """A 4-character stop string from the middle of text whose first occurrence is there, neither
    starting nor ending with whitespace and not following it (so it likely spans tokens, and the
    answer before it has no trailing space to argue about); and a second one that occurs only
    later (or never). Returns (cut, first, second)."""
    n = 4

    def candidate(start: int) -> int | None:
        for k in range(max(start, 1), len(text) - n + 1):
            s = text[k : k + n]
            if not text[k - 1].isspace() and s == s.strip() and text.find(s) == k:
                return k
        return None

    k = candidate(len(text) // 2) or candidate(1)
    if k is None:
        raise Skip(f"no usable stop string in the golden text {text!r}")
    later = candidate(k + n)
    return k, text[k : k + n], text[later : later + n] if later is not None else "\x7f never \x7f"


def stop(ctx: Context, out: Outcome) -> None:
    case = find_case(ctx, kind="raw")
    k, s, later = stop_strings(case["text"])
    want = case["text"][:k]
    out.details.update({"stop": [s, later], "want": want})
    for stop_value, what in ((s, f"stop={s!r}"), ([later, s], f"stop=[{later!r}, {s!r}]")):
        a = generate(ctx, case, stop=stop_value)
        if a.ok(out, what):
            assert a.text is not None
            expect_text(out, a.text, want, f"{what}: the text before the stop string")
            out.expect(a.finish == "stop", f"{what}: finish_reason {a.finish!r} (want 'stop')")


def _stream_parts(r: Reply) -> tuple[list[str], list[float], Any, list[str]]:
    """A stream's content pieces, when each arrived, its usage, and its finish reasons."""
    texts, times, usage, finishes = [], [], None, []
    for payload, t in zip(r.sse(), r.times or [0.0] * len(r.sse()), strict=True):
        if payload == DONE:
            continue
        c = parse_chunk(payload)
        usage = c.get("usage") or usage
        for ch in c.get("choices") or []:
            piece = choice_text(ch)
            if piece:
                texts.append(piece)
                times.append(t)
            if ch.get("finish_reason"):
                finishes.append(ch["finish_reason"])
    return texts, times, usage, finishes


def stream_equals(kind: str) -> Callable[[Context, Outcome], None]:
    def check(ctx: Context, out: Outcome) -> None:
        case = find_case(ctx, kind=kind)
        whole = golden_answer(ctx, case)
        r = request(
            ctx,
            "POST",
            _route(case),
            gen_body(ctx, case, stream=True, stream_options={"include_usage": True}),
        )
        if not (whole.ok(out, "the plain request") and _status(out, r, 200, "the streamed request")):
            return
        assert whole.text is not None
        texts, _, usage, finishes = _stream_parts(r)
        expect_text(out, "".join(texts), whole.text, "the streamed text")
        out.expect(
            finishes == [whole.finish], f"finish reasons {finishes} (the plain request's: {whole.finish!r})"
        )
        if usage is None:
            out.add("warn", "NOT MET: no usage in the stream (http.chat.stream.usage checks it)")
        else:
            keys = ("prompt_tokens", "completion_tokens", "total_tokens")
            got = {k: usage.get(k) for k in keys}
            want = {k: (whole.usage or {}).get(k) for k in keys}
            out.expect(
                got == want,
                f"the stream's usage {got}" + ("" if got == want else f" (the plain request's: {want})"),
            )

    return check


def stream_incremental(ctx: Context, out: Outcome) -> None:
    """A stream must arrive as it is generated: at least 4 content chunks, and the first one by
    half of the time the last one took (from sending the request). A server that buffers the
    answer and sends it at the end delivers every chunk within milliseconds of the last."""
    case = find_case(ctx, kind="raw")
    r = request(ctx, "POST", "/v1/completions", gen_body(ctx, case, stream=True), timed=True)
    if not _status(out, r, 200, "POST /v1/completions stream"):
        return
    texts, times, _, _ = _stream_parts(r)
    out.details.update({"chunks": len(texts), "times_s": [round(t, 4) for t in times]})
    out.expect(
        len(texts) >= MIN_STREAM_CHUNKS,
        f"{len(texts)} content chunks for {len(case['ids'])} tokens (want at least {MIN_STREAM_CHUNKS})",
    )
    if times:
        first, last = times[0], times[-1]
        out.expect(
            first <= STREAM_FIRST_FRACTION * last,
            f"the first content chunk came at {first:.3f} s, the last at {last:.3f} s "
            f"(want the first by {STREAM_FIRST_FRACTION:.0%} of the last's time: a buffered stream?)",
        )


# --- log-probabilities served over HTTP --------------------------------------------------------
LOGPROBS_K = 20


class ServerFault(Exception):
    """The server answered something the check cannot use, which is the server's fault."""


def served_top_logprobs(ctx: Context, text: dict[str, Any]) -> tuple[list[Any], str]:
    """The echoed `top_logprobs` of a golden logits text, one per echoed token (OpenAI: entry j is
    the distribution that predicted token j, so golden position t, the distribution after
    ids[:t+1], is entry t + 1), and how the prompt was sent."""
    from stdengine.conformance.corpus import LOGIT_TEXTS

    ids = text["ids"]
    r = request(ctx, "POST", "/v1/completions", echo_body(model_id(ctx), ids, LOGPROBS_K))
    how = "token ids"
    if r.status != 200 and text["name"] in LOGIT_TEXTS:
        # a server that takes only text prompts (some answer 500 to a list of ids): its
        # tokenization must then give the golden ids, which the echoed tokens show
        refused = f"token ids refused (HTTP {r.status})"
        r = request(
            ctx, "POST", "/v1/completions", echo_body(model_id(ctx), LOGIT_TEXTS[text["name"]], LOGPROBS_K)
        )
        how = f"text; {refused}"
    if 400 <= r.status < 500:
        raise NotSupported(
            f"the server refuses echo + logprobs={LOGPROBS_K} ({how}): HTTP {r.status}: {r.body[:200]!r}"
        )
    if r.status != 200:
        raise ServerFault(f"echo + logprobs ({how}): HTTP {r.status}: {r.body[:200]!r}")
    try:
        entries = logprob_entries(((r.json().get("choices") or [{}])[0]).get("logprobs"))
    except WireError as e:
        raise ServerFault(f"choices[0].logprobs: {e}") from None
    if not entries:
        raise ServerFault("choices[0].logprobs has no echoed tokens")
    tokens = [tok.token for tok, _ in entries]
    tops = [{t.token: t.logprob for t in top} for _, top in entries]
    pieces = (ctx.golden or {}).get("pieces") or {}
    # the echoed prompt must be the golden ids, one for one (e.g. no second BOS), to line up
    if len(tokens) not in (len(ids), len(ids) + 1):
        raise Skip(
            f"prompt sent as {how}: {len(tokens)} tokens echoed for {len(ids)} golden ids (+1 generated)"
        )
    for j, (i, tok) in enumerate(zip(ids, tokens, strict=False)):
        want = pieces.get(str(i))
        if want is not None and FFFD not in want and tok != want:
            raise Skip(f"prompt sent as {how}: echoed token {j} is {tok!r}, the golden id {i} is {want!r}")
    return tops, how


def served_kls(
    texts: list[dict[str, Any]], served: list[list[Any]], pieces: dict[str, str], shift: int
) -> list[float]:
    """Restricted KL at every golden position t that has a served distribution at entry t + shift."""
    from stdengine.conformance.metrics import restricted_kl_by_text

    kls = []
    for t, tops in zip(texts, served, strict=True):
        for pos, (ids, lps, tail) in enumerate(
            zip(t["top_ids"], t["top_logprobs"], t["tail_logprob"], strict=True)
        ):
            top = tops[pos + shift] if pos + shift < len(tops) else None
            if isinstance(top, dict) and top:
                kls.append(restricted_kl_by_text(ids, lps, tail, pieces, top, LOGPROBS_K))
    return kls


def logprobs_kl(name: str) -> Callable[[Context, Outcome], None]:
    def check(ctx: Context, out: Outcome) -> None:
        from stdengine.conformance.metrics import kl_bound

        logits = ctx.need_golden("logits")
        pieces = ctx.need_golden("pieces")
        texts = [t for t in logits["texts"] if name in ("all", t["name"])]
        served, hows = [], set()
        for t in texts:
            try:
                tops, how = ctx.memo(f"http.logprobs:{t['name']}", lambda t=t: served_top_logprobs(ctx, t))
            except ServerFault as e:
                out.add("fail", str(e))
                return
            served.append(tops)
            hows.add(how)
        kls = served_kls(texts, served, pieces, 1)
        total = sum(len(t["ids"]) for t in texts)
        if len(kls) < total // 2:
            raise Skip(f"the server gave top_logprobs at {len(kls)} of {total} positions")
        ll = logits["llama_cpp"]["all" if name == "all" else "by_text"]
        ll_kl = float((ll if name == "all" else ll[name])["kl_mean"])
        mean, bound = sum(kls) / len(kls), kl_bound(ll_kl)
        out.details.update(
            {
                "kl_mean": round(mean, 6),
                "kl_max": round(max(kls), 6),
                "positions": len(kls),
                "bound": round(bound, 6),
                "llama_cpp": ll_kl,
                "prompt": sorted(hows),
            }
        )
        if not out.expect(
            mean <= bound,
            f"mean KL {mean:.5f} over {len(kls)} served positions (bound {bound:.5f}; llama.cpp {ll_kl:.5f})",
        ):
            # a common server bug: each echoed token carries the distribution that follows it
            shifted = served_kls(texts, served, pieces, 0)
            if shifted and sum(shifted) / len(shifted) <= bound:
                out.add(
                    "fail",
                    f"with entry t (not t + 1) taken for position t the mean KL is "
                    f"{sum(shifted) / len(shifted):.5f}: the echoed top_logprobs are off by one "
                    "(each token carries the distribution of the token after it)",
                )

    return check


def logprobs_chat(ctx: Context, out: Outcome) -> None:
    case = find_case(ctx, kind="chat")
    r = request(ctx, "POST", "/v1/chat/completions", gen_body(ctx, case, logprobs=True, top_logprobs=5))
    if 400 <= r.status < 500:
        raise NotSupported(f"the server refuses logprobs/top_logprobs: HTTP {r.status}: {r.body[:200]!r}")
    if not _status(out, r, 200, "POST /v1/chat/completions logprobs"):
        return
    a = Answer(r, chat=True)
    content = (((a.body.get("choices") or [{}])[0]).get("logprobs") or {}).get("content")
    if not isinstance(content, list) or not content:
        out.add("fail", f"choices[0].logprobs.content is not a list of tokens: {str(content)[:200]}")
        return
    not_greedy = [
        j
        for j, e in enumerate(content)
        if not e.get("top_logprobs")
        or abs(e["logprob"] - max(x["logprob"] for x in e["top_logprobs"])) > 1e-4
    ]
    out.expect(
        not not_greedy,
        f"each token's logprob is the best of its top_logprobs (temperature 0); not at {not_greedy[:5]}",
    )
    if all(isinstance(e.get("bytes"), list) for e in content):
        joined = bytes(b for e in content for b in e["bytes"]).decode("utf-8", errors="replace")
    else:
        joined = "".join(e.get("token", "") for e in content)
    expect_text(out, joined, a.text or "", "the tokens joined vs the message content")
    n = a.usage.get("completion_tokens") if isinstance(a.usage, dict) else None
    out.expect(len(content) == n, f"{len(content)} logprobs entries for {n} completion tokens")


def concurrent(n: int) -> Callable[[Context, Outcome], None]:
    """n requests at once. With golden data they are n different golden cases (the shortest
    prompts), and each answer must be its golden text, as when sent alone: engines that share one
    KV cache or batch requests wrongly answer garbage. Without, n chat requests answered at all."""

    def check(ctx: Context, out: Outcome) -> None:
        cases = sorted(
            all_cases(ctx),
            key=lambda c: len(c["prompt_ids"]),
        )
        answers: list[Answer | BaseException] = [RuntimeError("no reply")] * n

        def one(i: int) -> None:
            try:
                if cases:
                    answers[i] = generate(ctx, cases[i % len(cases)])
                else:
                    body = chat_body(ctx, messages=[{"role": "user", "content": f"Count to {i + 2}."}])
                    answers[i] = Answer(request(ctx, "POST", "/v1/chat/completions", body), chat=True)
            except BaseException as e:
                answers[i] = e

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S * 2)
        good = 0
        for i, a in enumerate(answers):
            if isinstance(a, Answer) and a.reply.status == 200 and a.text:
                good += 1
                if cases:
                    c = cases[i % len(cases)]
                    expect_text(out, a.text, c["text"], f"request {i} ({c['name']})")
            else:
                out.add("fail", f"request {i}: {a.reply.status if isinstance(a, Answer) else repr(a)}")
        out.expect(good == n, f"{good}/{n} concurrent requests answered")
        if not cases:
            out.add("pass", "no golden generation data: only checked that every request is answered")

    return check


def plan_http(ctx: Context) -> list[Check]:
    checks: list[Check] = []

    def add(id: str, level: Level, fn: Callable[[Context, Outcome], None], description: str) -> None:
        checks.append(Check(id, level, fn, frozenset(), False, description))

    if not ctx.url:
        return checks
    add("http.models", "core", models, "GET /v1/models lists the model")
    add("http.chat", "core", chat, "chat completion shape and usage")
    add("http.completions", "core", completions, "text completion shape and usage")
    add(
        "http.chat.stream",
        "core",
        _stream("/v1/chat/completions", "chat.completion.chunk", chat_body, False),
        "chat streaming chunks and [DONE]",
    )
    add(
        "http.completions.stream",
        "core",
        _stream("/v1/completions", "text_completion", completion_body, False),
        "completion streaming chunks and [DONE]",
    )
    add(
        "http.chat.stream.usage",
        "core",
        _stream("/v1/chat/completions", "chat.completion.chunk", chat_body, True),
        "stream_options.include_usage gives a final usage chunk",
    )
    add("http.errors.bad_json", "core", bad_json, "malformed JSON: 400 and the OpenAI error envelope")
    add("http.errors.bad_param", "core", bad_param, "bad parameters: 400 and the OpenAI error envelope")
    add("http.errors.auth", "core", auth, "a wrong API key: 401 and the OpenAI error envelope")
    g = ctx.golden or {}
    for name in [c["name"] for c in (g.get("generation") or {}).get("cases", [])] or ["(golden)"]:
        add(
            f"http.generation.golden:case={name}",
            "core",
            generation_golden(name),
            "temperature 0: the golden text, token counts and finish reason exactly",
        )
    add(
        "http.temperature0.repeat",
        "core",
        temperature0_repeat,
        f"the least certain golden case {REPEATS} times at temperature 0: the same text",
    )
    add(
        "http.max_tokens:n=5",
        "core",
        max_tokens5,
        "max_tokens=5: the golden first 5 tokens, finish reason length",
    )
    add("http.eog", "core", eog, "an end-of-generation token: finish reason stop, not counted, not shown")
    for name in sorted({c["name"] for c in (g.get("tokenizer") or {}).get("cases", [])}):
        add(f"http.tokenize:case={name}", "core", tokenize(name), "POST /tokenize gives llama.cpp's ids")
    add(
        "http.sampler:top_p=0.01",
        "core",
        sampler_is_greedy("top_p=0.01", top_p=0.01),
        "top_p 0.01 at temperature 1.5 gives the golden greedy text",
    )
    add(
        "http.sampler:min_p=1",
        "optional",
        sampler_is_greedy("min_p=1", min_p=1.0),
        "min_p 1 (llama.cpp's extension) at temperature 1.5 gives the golden greedy text",
    )
    add("http.seed", "core", seed, "a seed reproduces a sample; other seeds give other samples")
    add(
        "http.stop",
        "core",
        stop,
        "a stop string (and a list of two) from the golden text cuts the answer before it",
    )
    for kind, route in (("chat", "chat"), ("raw", "completions")):
        add(
            f"http.stream.equals:route={route}",
            "core",
            stream_equals(kind),
            "streaming gives the plain request's text, finish reason and usage",
        )
    add(
        "http.stream.incremental",
        "core",
        stream_incremental,
        "a stream arrives as it is generated, in several chunks",
    )
    texts = [t["name"] for t in (g.get("logits") or {}).get("texts", [])]
    for name in texts + ["all"]:
        add(
            f"http.logprobs.kl:text={name}",
            "core",
            logprobs_kl(name),
            "served top-20 log-probabilities (echo): restricted KL from the exact reference within the bound",
        )
    add("http.logprobs.chat", "core", logprobs_chat, "chat logprobs: greedy tokens that spell the content")
    add(
        "http.concurrent:n=4",
        "core",
        concurrent(4),
        "four different golden requests at once: each answer is its golden text",
    )
    return checks
