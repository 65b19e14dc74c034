"""Hostile requests to `infer serve` (issue 18): each one gets a documented 4xx in OpenAI's error
envelope, never a 5xx, a plain-text answer or a traceback on stderr, and the server serves a
normal request afterwards. The limits are spec/server.md's "Limits": request body size (413),
JSON nesting depth, lone surrogates, prompt characters per context position (refused before the
engine tokenizes), malformed or cut-off bodies. The last test is the tokenizer's special-token
cutting on Gemma text dense in distinct special tokens: it must stay linear and give llama.cpp's ids.
"""

from __future__ import annotations

import io
import json
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from served import KEY, N_CTX, InProcessServer
from test_server_toy import ToyEngine

from stdengine.adapter import GenerateRequest, GenerationEvent
from stdengine.events import Emitter
from stdengine.server.app import DEFAULT_MAX_BODY, MAX_JSON_DEPTH, PROMPT_CHARS_PER_POSITION

AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
PROMPT_LIMIT = PROMPT_CHARS_PER_POSITION * N_CTX


class CountingToy(ToyEngine):
    """The toy engine, counting the generations it was asked for (on every context)."""

    generations = 0

    def new_context(self) -> CountingToy:
        return CountingToy(self.weights, self._n_ctx, self.delay_ms, self.clone)

    def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
        CountingToy.generations += 1
        yield from super().generate(request)


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    s = InProcessServer(CountingToy, Path("toy"))
    s.state.events = Emitter(log_format="json", stream=io.StringIO())  # request.done, to read back
    yield s
    s.stop()


@pytest.fixture
def http(server: InProcessServer, capfd: pytest.CaptureFixture[str]) -> Iterator[httpx.Client]:
    """A client; after the test: no 5xx logged, no traceback on stderr, a normal request served."""
    stream = server.state.events.stream
    assert isinstance(stream, io.StringIO)
    stream.seek(0)
    stream.truncate()
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client
        r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    statuses = [e["status"] for e in logged(server)]
    assert statuses and all(s < 500 for s in statuses), statuses
    assert "Traceback" not in capfd.readouterr().err


def logged(server: InProcessServer) -> list[dict[str, Any]]:
    stream = server.state.events.stream
    assert isinstance(stream, io.StringIO)
    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    return [e for e in events if e["event"] == "request.done"]


def envelope(r: httpx.Response, status: int, type_: str = "invalid_request_error", match: str = "") -> str:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["type"] == type_ and err["code"] == status, err
    assert match.lower() in err["message"].lower(), err["message"]
    return str(err["message"])


def raw_request(server: InProcessServer, data: bytes) -> bytes:
    """Send bytes on a raw connection, half-close it, read what the server answers."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def wait_logged(server: InProcessServer, n: int) -> list[dict[str, Any]]:
    """The request.done events once there are n (the server logs after the connection is done)."""
    deadline = time.monotonic() + 30
    while len(done := logged(server)) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return done


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_deep_json_is_a_400(http: httpx.Client) -> None:
    for route in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        # deeper than Python's parser goes (a RecursionError before), and just over the limit
        for body in (
            nested(5000),
            '{"prompt": "x", "x": ' + nested(5000) + "}",
            '{"x": ' + nested(MAX_JSON_DEPTH) + "}",
        ):
            envelope(http.post(route, content=body), 400, match=f"deeper than {MAX_JSON_DEPTH} levels")
    # at the limit, the request is judged on its fields (an unknown one here)
    at_limit = '{"x": ' + nested(MAX_JSON_DEPTH - 1) + "}"
    envelope(
        http.post("/v1/completions", content=at_limit), 400, match="Unrecognized request argument supplied: x"
    )


@pytest.mark.parametrize(
    ("route", "body", "where"),
    [
        (
            "/v1/chat/completions",
            '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}',
            "model",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "a\\udfffb"}]}',
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
            "messages.0.content.0.text",
        ),
        ("/v1/completions", '{"model": "\\udc00", "prompt": "hi"}', "model"),
        ("/v1/completions", '{"prompt": "\\ud800"}', "prompt"),
        ("/v1/completions", '{"prompt": ["x\\ud800"], "echo": true}', "prompt.0"),
        ("/v1/completions", '{"prompt": "hi", "stop": "\\ud800"}', "stop"),
        ("/v1/completions", '{"prompt": "hi", "stop": ["a", "\\udbff"]}', "stop.1"),
        ("/v1/completions", '{"prompt": "hi", "\\ud800": 1}', "?"),
        ("/tokenize", '{"content": "\\ud800"}', "content"),
    ],
)
def test_lone_surrogates_are_a_400(http: httpx.Client, route: str, body: str, where: str) -> None:
    message = envelope(http.post(route, content=body), 400, match="lone surrogate")
    assert message.startswith(f"{where}:"), message


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json(http: httpx.Client, literal: str) -> None:
    """Python's parser takes them; JSON has no such values, and a temperature of Infinity would
    sample uniformly."""
    body = '{"prompt": "hi", "max_tokens": 2, "temperature": ' + literal + "}"
    envelope(http.post("/v1/completions", content=body), 400, match=f"{literal} is not a JSON value")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**63),
        ("seed", 2**64),
        ("seed", -2),
        ("top_k", 2**32),
        ("top_k", 2**32 + 1),
        ("repeat_last_n", 2**40),
    ],
)
def test_integers_past_the_samplers_fields_are_a_400(http: httpx.Client, field: str, value: int) -> None:
    """Not wrapped into the C sampler's 64- and 32-bit fields (2**32 + 1 would be top_k 1, 2**63
    a negative seed: random)."""
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value})
    envelope(r, 400, match=field)


def test_best_of_below_one_is_a_400(http: httpx.Client) -> None:
    for value in (0, -3):
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "best_of": value})
        envelope(r, 400, match="best_of")


def test_a_surrogate_pair_is_one_character(http: httpx.Client) -> None:
    r = http.post("/tokenize", content='{"content": "\\ud83d\\ude00"}')
    assert r.status_code == 200 and r.json()["tokens"] == [0x1F600]


def test_an_oversize_body_is_a_413(server: InProcessServer, http: httpx.Client) -> None:
    big = json.dumps({"prompt": "x" * DEFAULT_MAX_BODY}).encode()
    # with Content-Length: refused before it is read
    envelope(http.post("/v1/completions", content=big), 413, match="--max-body")

    def chunks() -> Iterator[bytes]:  # chunked: refused once it has passed the limit
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]

    envelope(http.post("/v1/completions", content=chunks()), 413, match=str(DEFAULT_MAX_BODY))
    # just under the limit is read, then judged: here a prompt far over the context
    fits = json.dumps({"prompt": "x" * (DEFAULT_MAX_BODY - 20)}).encode()
    assert len(fits) <= DEFAULT_MAX_BODY
    envelope(http.post("/v1/completions", content=fits), 400, "exceed_context_size_error")


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(
    server: InProcessServer, http: httpx.Client
) -> None:
    before = CountingToy.generations
    over = "y" * (PROMPT_LIMIT + 1)
    for route, body in (
        ("/v1/completions", {"prompt": over}),
        ("/v1/completions", {"prompt": [over], "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": over}]}),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "system", "content": over[:PROMPT_LIMIT]},
                    {"role": "user", "content": "y"},
                ]
            },
        ),
        ("/tokenize", {"content": over}),
    ):
        r = http.post(route, json=body)
        envelope(r, 400, "exceed_context_size_error", match="not tokenized")
        err = r.json()["error"]
        assert err["n_ctx"] == N_CTX and err["n_prompt_chars"] == PROMPT_LIMIT + 1
    assert CountingToy.generations == before  # the engine never saw them
    # at the limit the engine judges it (the toy tokenizes a character per token: over the context)
    envelope(http.post("/v1/completions", json={"prompt": over[1:]}), 400, "exceed_context_size_error")
    assert CountingToy.generations == before + 1


def test_more_messages_than_positions_are_refused_before_rendering(
    server: InProcessServer, http: httpx.Client
) -> None:
    """Empty messages pass the characters' limit, but each takes a position at least."""
    before = CountingToy.generations
    many = [{"role": "user", "content": ""}] * (N_CTX + 1)
    r = http.post("/v1/chat/completions", json={"messages": many})
    envelope(r, 400, "exceed_context_size_error", match=f"{N_CTX + 1} messages")
    assert r.json()["error"]["n_ctx"] == N_CTX
    assert CountingToy.generations == before


def test_a_malformed_chunked_body_is_a_400(server: InProcessServer, http: httpx.Client) -> None:
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\n"
    )
    for body in (
        'Transfer-Encoding: chunked\r\n\r\n5\r\n{"pro\r\nZZ not a chunk size\r\n\r\n',  # malformed
        'Content-Length: 1000\r\n\r\n{"prompt": ',  # cut off: the client closes before the end
    ):
        n = len(logged(server))
        answer = raw_request(server, (head + body).encode())
        assert answer == b"" or answer.startswith(b"HTTP/1.1 400"), answer[:200]
        assert wait_logged(server, n + 1)[-1]["status"] == 400


def test_special_token_dense_gemma_text_is_linear_and_matches_llamacpp(gemma3_path: Path) -> None:
    """Text made of Gemma's distinct special tokens (6,414 of them, all control, user-defined or
    unknown) used to cost (special tokens present) x (stretches of text): 255 KB took 6 s. Now
    200 KB tokenizes in one pass; a sample's ids are llama.cpp's, with and without parse_special."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the oracle) is not installed")
    from stdengine.reference.tokenizer import ATTR_CONTROL, ATTR_UNKNOWN, ATTR_USER_DEFINED, Tokenizer

    tok = Tokenizer.from_gguf(gemma3_path)
    special = [
        t
        for t, a in zip(tok.tokens, tok.attrs, strict=True)
        if a & (ATTR_CONTROL | ATTR_UNKNOWN | ATTR_USER_DEFINED)
    ]
    assert len(special) > 6000
    rng = random.Random(18)
    glue = ["", "", "x", " ", "<", "\n", "unused", "a b"]

    def dense(n_chars: int) -> str:
        parts: list[str] = []
        size = 0
        while size < n_chars:
            parts.append(rng.choice(special) + rng.choice(glue))
            size += len(parts[-1])
        return "".join(parts)

    text = dense(200_000)
    ids = tok.encode(text, add_special=False)
    assert len(ids) > 15_000 and tok.decode(ids, special=True) == text
    oracle = llama_cpp.Llama(model_path=str(gemma3_path), vocab_only=True, verbose=False)
    try:
        sample = dense(20_000)
        for parse_special in (True, False):
            want = oracle.tokenize(sample.encode(), add_bos=True, special=parse_special)
            assert tok.encode(sample, add_special=True, parse_special=parse_special) == want
    finally:
        oracle.close()


def test_max_body_option_raises_the_limit(tmp_path: Path) -> None:
    """`infer serve --max-body BYTES`: the limit is the option's, and a body under it is served."""
    from test_server_toy import toy_server

    server = toy_server(tmp_path, "--max-body", "300")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            r = client.post("/v1/completions", json={"prompt": "x" * 300})
            envelope(r, 413, match="(300 bytes")
            assert (
                client.post("/v1/completions", json={"prompt": "x" * 200, "max_tokens": 2}).status_code == 200
            )
        assert [e["status"] for e in server.events("request.done")] == [413, 200]
    finally:
        assert server.stop() == 0
    assert "Traceback" not in server.log_path.read_text()
