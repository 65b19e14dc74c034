"""The HTTP benchmark's client: streamed completions timed as the client sees them, random prompts
of a given token count, the API latency and the served model, on the OpenAI wire module
(stdengine/openai_wire.py) for everything the protocol says. Used by llama-bench over HTTP
(bench/server.py) and the load test (bench/load.py); spec/bench-record.md defines the metrics.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stdengine.bench.params import BenchParams

from stdengine.errors import EngineFailure, EngineUnavailable
from stdengine.openai_wire import (
    DONE,
    TOKENIZE_ROUTES,
    ErrorReply,
    SseDecoder,
    WireError,
    api_base,
    bearer,
    choice_text,
    model_ids,
    parse_chunk,
    root_url,
    tokenize_body,
    tokens_of,
)

# Plain English words; prompts are random sequences of them, fresh for every request.
WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community "
    "name president team minute idea kid body information back parent face others level office door health "
    "person art war history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death experience effect "
    "class control care field development role effort rate heart drug show leader light voice wife police "
    "mind price report decision son view relationship town road arm difference value building action model "
    "season society tax director position player record paper space ground form event official matter "
    "center couple site project activity star table need court oil situation cost industry figure street "
    "image phone data picture practice piece land product doctor wall patient worker news test movie north "
    "love support technology step baby computer type attention film tree source organization hair window "
    "evidence population truth song river garden stone bread cloud summer winter apple table bridge"
).split()


def httpx_module() -> Any:
    try:
        import httpx
    except ImportError as e:
        raise EngineUnavailable(
            "server mode needs httpx", hint="pip install httpx (or 'stdengine[dev]')"
        ) from e
    return httpx


@dataclass(frozen=True)
class Target:
    """Where the requests go: --url's root and API base, and the key's headers."""

    url: str
    root: str
    api: str
    headers: dict[str, str]

    @classmethod
    def of(cls, params: BenchParams) -> Target:
        assert params.url
        return cls(params.url, root_url(params.url), api_base(params.url), bearer(params.api_key))

    def client(self) -> Any:
        httpx = httpx_module()
        return httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0), headers=self.headers)


@dataclass
class Stream:
    """What one streamed completion looked like from the client. Fed the response's text as it
    arrives (feed), then finished (finish)."""

    t_start: float
    t_first_chunk: float | None = None
    t_end: float | None = None
    content_times: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int | None = None  # from usage, when the server sends it
    completion_tokens: int | None = None
    server_prompt_n: int | None = None  # llama-server's timings.prompt_n: prompt tokens it evaluated
    error: str | None = None
    _sse: SseDecoder = field(default_factory=SseDecoder, repr=False, compare=False)

    @property
    def n_out(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.content_times)

    @property
    def ttfr(self) -> float:
        return (self.t_first_chunk or math.nan) - self.t_start

    @property
    def ttft(self) -> float:
        return (self.content_times[0] if self.content_times else math.nan) - self.t_start

    @property
    def e2e(self) -> float:
        return (self.t_end or math.nan) - self.t_start

    def feed(self, text: str, now: float) -> bool:
        """Take the next text of the event stream; True at its end ([DONE]) or at an error."""
        for data in self._sse.feed(text):
            if data == DONE or self._absorb(data, now):
                return True
        return False

    def refused(self, status: int, body: bytes) -> None:
        self.error = f"HTTP {status}: {ErrorReply.of(status, body).message[:200]}"

    def finish(self, now: float) -> None:
        for data in self._sse.close():
            if data == DONE or self._absorb(data, now):
                break
        self.t_end = now
        if self.error is None and not self.content_times and self.n_out == 0:
            self.error = "the stream carried no content"

    def _absorb(self, data: str, now: float) -> bool:
        """One event; True when it is an error."""
        if self.t_first_chunk is None:
            self.t_first_chunk = now
        try:
            obj = parse_chunk(data)
        except WireError as e:
            self.error = str(e)
            return True
        if "error" in obj:
            self.error = ErrorReply.of(500, obj).message[:200]
            return True
        for choice in obj.get("choices") or []:
            text = choice_text(choice)
            if text:
                self.content_times.append(now)
                self.text += text
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
        timings = obj.get("timings")
        if isinstance(timings, dict) and "prompt_n" in timings:
            self.server_prompt_n = int(timings["prompt_n"])
        return False


EXTENSIONS = ("min_tokens", "ignore_eos")


def completion_body(model: str, prompt: str, max_tokens: int, extensions: bool = True) -> dict[str, Any]:
    """A streamed completion, greedily, that generates exactly max_tokens tokens where the server
    allows it (the EXTENSIONS: min_tokens: llama-cpp-python, vLLM, infer serve; ignore_eos:
    llama-server, vLLM, infer serve); without extensions, a plain OpenAI request."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if extensions:
        body.update(min_tokens=max_tokens, ignore_eos=True)
    return body


def refused_extensions(s: Stream) -> list[str]:
    """The extension fields a refused request's error names (a 400 such as OpenAI's
    "Unrecognized request argument supplied: min_tokens")."""
    if s.error is None or not s.error.startswith("HTTP 4"):
        return []
    return [f for f in EXTENSIONS if f in s.error]


def check_extensions(s: Stream) -> None:
    """A clear error when the server refused the length-fixing extension fields."""
    named = refused_extensions(s)
    if named:
        raise EngineFailure(
            f"the server refused the benchmark's extension field(s) {', '.join(named)}: {s.error}",
            hint="rerun with --no-extensions to send plain OpenAI requests (answers may then end "
            "before -n tokens; the load test counts them as 'short')",
        )


def stream_completion(
    client: Any,
    api: str,
    body: dict[str, Any],
    clock: Callable[[], float] = time.perf_counter,
) -> Stream:
    s = Stream(t_start=clock())
    try:
        with client.stream("POST", f"{api}/completions", json=body) as r:
            if r.status_code != 200:
                s.refused(r.status_code, r.read())
            else:
                for text in r.iter_text():
                    if s.feed(text, clock()):
                        break
    except Exception as e:  # a refused connection, a timeout, a dropped stream: an error, counted
        s.error = f"{type(e).__name__}: {e}"
    s.finish(clock())
    return s


class Prompts:
    """Random word prompts of about n tokens, counted with the server's tokenizer when it has a
    tokenize route (llama-server /tokenize, llama-cpp-python /extras/tokenize)."""

    def __init__(self, client: Any, root: str, model: str = "", rng: random.Random | None = None) -> None:
        self.client = client
        self.root = root
        self.model = model
        self.rng = rng or random.Random()
        self.route: str | None = None
        for route in TOKENIZE_ROUTES:
            try:
                r = client.post(root + route, json=tokenize_body(route, "hello world", model=model))
                if r.status_code == 200 and tokens_of(r.json()) is not None:
                    self.route = route
                    break
            except Exception:
                continue
        self.tokens_per_word = 1.0
        if self.route is not None:
            sample = self.words(200)
            n = self.count(sample)
            if n:
                self.tokens_per_word = max(0.2, n / 200)

    def words(self, k: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(max(1, k)))

    def count(self, text: str) -> int | None:
        if self.route is None:
            return None
        r = self.client.post(self.root + self.route, json=tokenize_body(self.route, text, model=self.model))
        tokens = tokens_of(r.json()) if r.status_code == 200 else None
        return len(tokens) if tokens is not None else None

    def make(self, n_tokens: int) -> tuple[str, int | None]:
        """A fresh prompt of about n_tokens tokens, and its exact count when the server can tell."""
        k = max(1, round(n_tokens / self.tokens_per_word))
        text = self.words(k)
        n = self.count(text)
        for _ in range(4):  # adjust to the server's own count
            if n is None or n == n_tokens:
                break
            k = max(1, k + (round((n_tokens - n) / self.tokens_per_word) or (1 if n < n_tokens else -1)))
            text = self.words(k)
            n = self.count(text)
        return text, n


def measure_latency(client: Any, api: str, tries: int = 3) -> float:
    """llama-benchy's `api` latency: the time to the response headers of GET /v1/models (median)."""
    times = []
    for _ in range(tries):
        t0 = time.perf_counter()
        try:
            r = client.get(f"{api}/models")
        except Exception as e:
            raise EngineUnavailable(
                f"cannot reach {api}/models: {type(e).__name__}: {e}", hint="start the server, or fix --url"
            ) from e
        times.append(time.perf_counter() - t0)
        if r.status_code != 200:
            raise EngineUnavailable(
                f"{api}/models answered HTTP {r.status_code}", hint="is --url an OpenAI-compatible server?"
            )
    return statistics.median(times)


def served_model(client: Any, api: str, params: BenchParams) -> str:
    if "model" in params.given:
        return params.models[0]
    ids = model_ids(client.get(f"{api}/models").json())
    if not ids:
        raise EngineFailure(f"{api}/models lists no model", hint="name one with -m")
    return ids[0]
