"""The OpenAI wire protocol, client side: what every HTTP client of an OpenAI-compatible server
here (the `openai` engine, the HTTP benchmark, the HTTP conformance checks) reads and writes the
same way -- URL roots, server-sent events, stream chunks, error envelopes, log-probability entries
and the tokenize extensions of llama-server and llama-cpp-python.

No transport: the callers send requests with their own client (httpx, urllib) and hand the bytes'
text here. Standard library only, so the conformance checks need nothing more. spec/engines.md
(the openai engine) describes the dialects.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from stdengine.adapter import TopLogprob
from stdengine.errors import UsageError

DONE = "[DONE]"  # the data of the event that ends an OpenAI stream


class WireError(ValueError):
    """The server sent something that is not the protocol (a malformed event, an unknown shape)."""


# --- URL roots ------------------------------------------------------------------------------------
def root_url(url: str) -> str:
    """A server's root (scheme://host:port[/prefix]) from --url, which may end in /v1 (OpenAI's
    SDKs take the API base) or not (llama-server's routes /tokenize, /props sit at the root)."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise UsageError(
            f"--url must start with http:// or https://, not '{url}'", hint="e.g. --url http://127.0.0.1:8080"
        )
    return url[: -len("/v1")] if url.endswith("/v1") else url


def api_base(url: str) -> str:
    """The OpenAI API base (the root + /v1) of --url."""
    return root_url(url) + "/v1"


def bearer(api_key: str | None) -> dict[str, str]:
    """The request headers that carry an API key (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def model_ids(listing: Any) -> list[str]:
    """The model ids of a GET /v1/models answer, in its order."""
    data = listing.get("data") if isinstance(listing, dict) else None
    return [str(m.get("id")) for m in data or [] if isinstance(m, dict)]


# --- server-sent events -------------------------------------------------------------------------------
_EOL = re.compile(
    r"\r\n|\r|\n"
)  # SSE's line ends (str.splitlines knows more, e.g. U+2028, which JSON may hold)


class SseDecoder:
    """Server-sent events from text as it arrives, in chunks cut anywhere (a line, even a CR LF,
    may be split across chunks). Each event's data lines are joined with newlines; comments
    (`: ping`) and the fields id, event and retry are skipped. llama-server's non-standard
    `error: {...}` field becomes the data {"error": {...}}, the shape OpenAI sends an error in
    mid-stream, so that callers read one shape. An event still open when the stream ends is
    delivered too (servers that close without the last blank line)."""

    def __init__(self) -> None:
        self._buf = ""
        self._data: list[str] = []
        self._skip_lf = False  # the last chunk ended in CR: a LF first in the next one ends nothing

    def feed(self, text: str) -> list[str]:
        """The data of each event that text completes."""
        if self._skip_lf and text.startswith("\n"):
            text = text[1:]
        self._skip_lf = False
        buf, start, out = self._buf + text, 0, []
        for m in _EOL.finditer(buf):
            event = self._line(buf[start : m.start()])
            if event is not None:
                out.append(event)
            start = m.end()
        self._skip_lf = start == len(buf) and buf.endswith("\r")
        self._buf = buf[start:]
        return out

    def close(self) -> list[str]:
        """The end of the stream: the event still open, if any."""
        out = self.feed("\n") if self._buf else []
        if self._data:
            out.append("\n".join(self._data))
            self._data = []
        return out

    def _line(self, line: str) -> str | None:
        if line == "":
            event, self._data = ("\n".join(self._data) if self._data else None), []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            self._data.append(value)
        elif name == "error":
            return '{"error": ' + value + "}"
        return None


def sse_events(chunks: Iterable[str]) -> Iterator[str]:
    """The data of each server-sent event of a stream given as text chunks (see SseDecoder)."""
    decoder = SseDecoder()
    for chunk in chunks:
        yield from decoder.feed(chunk)
    yield from decoder.close()


def parse_chunk(data: str) -> dict[str, Any]:
    """One stream event's JSON object (a chunk, or {"error": ...})."""
    try:
        obj = json.loads(data)
    except ValueError:
        raise WireError(f"a malformed stream event: {data[:200]!r}") from None
    if not isinstance(obj, dict):
        raise WireError(f"a stream event that is not an object: {data[:200]!r}")
    return obj


def choice_text(choice: dict[str, Any]) -> str:
    """The text a choice carries: chat's `delta.content` (streamed) or `message.content`, or a
    completion's `text`."""
    for key in ("delta", "message"):
        part = choice.get(key)
        if isinstance(part, dict):
            return str(part.get("content") or "")
    return str(choice.get("text") or "")


# --- error envelopes --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ErrorReply:
    """An error answer, read from any of the envelopes servers use: OpenAI's and llama-server's
    {"error": {"message", "type", "code", ...}}, a bare {"error": "text"}, FastAPI's
    {"detail": ...}, or a body that is not JSON at all."""

    status: int
    message: str
    type: str = ""
    code: Any = None
    details: dict[str, Any] = field(default_factory=dict)  # llama-server's n_prompt_tokens, n_ctx
    openai_shape: bool = False  # {"error": {"message": str, "type": str, ...}}

    @classmethod
    def of(cls, status: int, body: bytes | str | dict[str, Any]) -> ErrorReply:
        """status: the HTTP status (500 for an error inside a 200 stream: then the envelope's
        numeric code, when it is one, is the status)."""
        if not isinstance(body, dict):
            text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = None
            body = parsed if isinstance(parsed, dict) else {"error": {"message": text.strip()[:500]}}
        err = body.get("error")
        if not isinstance(err, dict):
            return cls(status, str(err or body.get("detail") or body))
        code = err.get("code")
        if isinstance(code, int) and status == 500 and code >= 400:
            status = code
        return cls(
            status,
            str(err.get("message", "")),
            str(err.get("type", "")),
            code,
            {k: err[k] for k in ("n_prompt_tokens", "n_ctx") if k in err},
            isinstance(err.get("message"), str) and isinstance(err.get("type"), str),
        )

    @property
    def context_overflow(self) -> bool:
        """The prompt does not fit the server's context (llama-server's type, OpenAI's code, or
        words to that effect from servers that have neither)."""
        low = self.message.lower()
        return (
            self.type == "exceed_context_size_error"
            or self.code == "context_length_exceeded"
            or ("context" in low and ("exceed" in low or "too long" in low or "maximum" in low))
        )


# --- log-probabilities ---------------------------------------------------------------------------------
Entry = tuple[TopLogprob, list[TopLogprob]]


def logprob_entries(obj: Any) -> list[Entry]:
    """(token, its top alternatives) for each token of a choice's `logprobs`: chat's
    {"content": [...]} (also what llama-server answers on completions; ids when it gives them),
    or the completions shape {tokens, token_logprobs, top_logprobs: [{text: logprob}]} (no ids).
    A null logprob (an echoed first token) is NaN; null or missing logprobs: no entries. An
    unknown shape is a WireError."""
    if not obj:
        return []
    try:
        if isinstance(obj.get("content"), list):
            return [
                (_top_entry(e), [_top_entry(t) for t in e.get("top_logprobs") or []]) for e in obj["content"]
            ]
        return [
            (TopLogprob(str(text), _lp(lp)), [TopLogprob(str(t), _lp(v)) for t, v in (top or {}).items()])
            for text, lp, top in zip(obj["tokens"], obj["token_logprobs"], obj["top_logprobs"], strict=True)
        ]
    except (AttributeError, KeyError, IndexError, TypeError, ValueError) as e:
        raise WireError(f"logprobs in an unknown shape ({type(e).__name__}: {e}): {str(obj)[:200]}") from None


def _top_entry(e: dict[str, Any]) -> TopLogprob:
    raw = e.get("bytes")
    return TopLogprob(str(e["token"]), _lp(e["logprob"]), int(e.get("id", -1)), bytes(raw) if raw else None)


def _lp(value: Any) -> float:
    return math.nan if value is None else float(value)


def echo_body(model: str, prompt: Any, top_n: int) -> dict[str, Any]:
    """A completion that echoes the prompt with each token's log-probability and top_n
    alternatives (OpenAI's legacy echo; entry j is the distribution that predicted token j)."""
    return {
        "model": model,
        "prompt": prompt,
        "echo": True,
        "logprobs": top_n,
        "max_tokens": 1,
        "temperature": 0.0,
    }


# --- tokenize extensions ----------------------------------------------------------------------------
# route -> its detokenize route; llama-server (and infer serve) first, then llama-cpp-python
TOKENIZE_ROUTES = {"/tokenize": "/detokenize", "/extras/tokenize": "/extras/detokenize"}


def tokenize_body(
    route: str, text: str, add_special: bool = True, parse_special: bool = True, model: str = ""
) -> dict[str, Any]:
    """A tokenize request for the route: llama-server's {"content", "add_special", "parse_special"}
    or llama-cpp-python's {"input", "model"} (which always adds and parses special tokens)."""
    if route == "/tokenize":
        return {"content": text, "add_special": add_special, "parse_special": parse_special}
    return {"input": text, **({"model": model} if model else {})}


def detokenize_body(route: str, tokens: list[int], model: str = "") -> dict[str, Any]:
    return {"tokens": tokens, **({"model": model} if model and route != "/tokenize" else {})}


def tokens_of(answer: Any) -> list[int] | None:
    """The ids of a tokenize answer ({"tokens": [id, ...]}, or [{"id": ...}, ...] with pieces);
    None when it is not one."""
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list):
        return None
    return [int(t["id"]) if isinstance(t, dict) else int(t) for t in tokens]


def detokenized(route: str, answer: Any) -> str:
    return str(answer["content"] if route == "/tokenize" else answer["text"])
