"""The HTTP checks (`--url`): an OpenAI-compatible server's routes, shapes, streaming, usage,
errors and concurrency. Plain urllib, so the checks need nothing beyond the standard library.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from stdengine.conformance.suite import Check, Context, Level, Outcome, Skip

TIMEOUT_S = 120.0
MAX_TOKENS = 8


class Reply:
    def __init__(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.status = status
        self.body = body
        self.headers = headers

    def json(self) -> Any:
        return json.loads(self.body.decode("utf-8"))

    def sse(self) -> list[str]:
        """The `data:` payloads of a server-sent-events body, in order."""
        out = []
        for line in self.body.decode("utf-8").splitlines():
            if line.startswith("data:"):
                out.append(line[5:].strip())
        return out


def root(url: str) -> str:
    """The server root: a URL given with /v1 (or /v1/) works as well as one without."""
    u = url.rstrip("/")
    return u[:-3] if u.endswith("/v1") else u


def request(
    ctx: Context,
    method: str,
    path: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    api_key: str | None = None,
) -> Reply:
    assert ctx.url is not None
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(root(ctx.url) + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    key = api_key if api_key is not None else ctx.api_key
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            return Reply(r.status, r.read(), dict(r.headers))
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.read(), dict(e.headers or {}))


def probe(url: str, timeout_s: float = 10.0) -> None:
    """Raise EngineUnavailable when nothing answers HTTP at url (any HTTP status is an answer)."""
    from stdengine.errors import EngineUnavailable

    try:
        urllib.request.urlopen(root(url) + "/v1/models", timeout=timeout_s).close()
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
            return str(r.json()["data"][0]["id"])
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
        out.expect(bool(events) and events[-1] == "[DONE]", "the stream ends with data: [DONE]")
        chunks = []
        for e in events:
            if e == "[DONE]":
                continue
            try:
                chunks.append(json.loads(e))
            except ValueError:
                out.add("fail", f"a data line is not JSON: {e[:80]!r}")
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
    try:
        err = r.json().get("error")
    except Exception:
        err = None
    ok = isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)
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


def concurrent(n: int) -> Callable[[Context, Outcome], None]:
    def check(ctx: Context, out: Outcome) -> None:
        replies: list[Reply | BaseException] = [RuntimeError("no reply")] * n

        def one(i: int) -> None:
            try:
                replies[i] = request(
                    ctx,
                    "POST",
                    "/v1/chat/completions",
                    chat_body(ctx, messages=[{"role": "user", "content": f"Count to {i + 2}."}]),
                )
            except BaseException as e:
                replies[i] = e

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S * 2)
        good = 0
        for i, r in enumerate(replies):
            if (
                isinstance(r, Reply)
                and r.status == 200
                and (r.json().get("choices") or [{}])[0].get("message")
            ):
                good += 1
            else:
                out.add("fail", f"request {i}: {r.status if isinstance(r, Reply) else r!r}")
        out.expect(good == n, f"{good}/{n} concurrent requests answered")

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
    add("http.concurrent:n=4", "core", concurrent(4), "four concurrent requests are all answered")
    return checks
