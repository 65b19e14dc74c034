"""`infer serve` end to end: the real `openai` client and raw HTTP against a server started in a
subprocess (tests/test_server_toy.py: the CLI with a small test engine registered)."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_server_toy import DEFAULT_LENGTH, WORDS, Server, toy_server

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = toy_server(tmp_path_factory.mktemp("serve"), "-np", "2", "--api-key", KEY)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        yield c


def chat(text: str = "hello") -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def sse_events(response: httpx.Response) -> list[str]:
    """The data fields of a server-sent event stream, in order."""
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(f"stdengine:{name} "):
            return float(line.split()[1])
    raise AssertionError(f"metric {name} missing")


# --- the OpenAI shapes, through the real client --------------------------------------------------


def test_chat_completion(client: openai.OpenAI) -> None:
    before = int(time.time())
    r = client.chat.completions.create(model="toy", messages=chat(), max_tokens=5, temperature=0)  # type: ignore[arg-type]
    assert r.id.startswith("chatcmpl-") and len(r.id) > len("chatcmpl-") + 20
    assert r.object == "chat.completion" and r.model == "toy" and before - 1 <= r.created <= time.time() + 1
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.message.content.split()) == 5 and set(choice.message.content.split()) <= set(WORDS)
    assert r.usage is not None and r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    timings = r.to_dict()["timings"]  # llama-server's timings object, keys in its order
    assert list(timings) == [
        "prompt_n",
        "prompt_ms",
        "prompt_per_token_ms",
        "prompt_per_second",
        "predicted_n",
        "predicted_ms",
        "predicted_per_token_ms",
        "predicted_per_second",
    ]
    assert timings["predicted_n"] == 5


def test_text_completion(client: openai.OpenAI) -> None:
    r = client.completions.create(model="toy", prompt="Once upon a time", max_tokens=4, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    (choice,) = r.choices
    assert len(choice.text.split()) == 4 and choice.finish_reason == "length" and choice.logprobs is None
    assert r.usage is not None and r.usage.completion_tokens == 4
    assert "timings" in r.to_dict()
    # without max_tokens the engine stops by itself: finish_reason "stop"
    r = client.completions.create(model="toy", prompt="Once upon a time", temperature=0)
    assert r.choices[0].finish_reason == "stop" and r.usage is not None
    assert r.usage.completion_tokens == DEFAULT_LENGTH


def test_streaming_chat_with_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model="toy", messages=chat("stream me"), max_tokens=6, temperature=0
    )  # type: ignore[arg-type]
    chunks = list(
        client.chat.completions.create(
            model="toy",
            messages=chat("stream me"),
            max_tokens=6,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    assert "timings" in chunks[-2].to_dict()  # the finish chunk carries llama-server's timings


def test_streaming_completion_raw_sse(http: httpx.Client) -> None:
    with http.stream(
        "POST", "/v1/completions", json={"model": "toy", "prompt": "abc", "max_tokens": 3, "stream": True}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = sse_events(r)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)  # no include_usage
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "timings" in chunks[-1]
    assert len("".join(c["choices"][0]["text"] for c in chunks).split()) == 3


def test_stop_strings(client: openai.OpenAI) -> None:
    words = (
        client.completions.create(model="toy", prompt="stop test", max_tokens=6, temperature=0)
        .choices[0]
        .text.split()
    )
    stop_word = words[2]
    assert stop_word not in words[:2]
    for stop in (stop_word, [stop_word, "never-generated"]):
        r = client.completions.create(model="toy", prompt="stop test", max_tokens=6, temperature=0, stop=stop)
        assert r.choices[0].text == " ".join(words[:2]) + " " and r.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model="toy",
        messages=chat("stop test"),
        temperature=0,
        stream=True,  # type: ignore[arg-type]
        stop=[WORDS[0], WORDS[1], WORDS[2]],
        max_tokens=40,
    )
    finishes = [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        r = client.chat.completions.create(
            model="toy", messages=chat(), temperature=1.0, seed=seed, max_tokens=10
        )  # type: ignore[arg-type]
        return str(r.choices[0].message.content)

    assert sample(42) == sample(42)
    assert sample(42) != sample(43)


def test_max_completion_tokens_and_extra_sampling_fields(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="toy",
        messages=chat(),
        max_completion_tokens=3,  # type: ignore[arg-type]
        extra_body={"top_k": 5, "top_p": 0.9},
    )
    assert r.usage is not None and r.usage.completion_tokens == 3


def test_errors_as_openai_exceptions(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as e404:
        client.chat.completions.create(model="gpt-4o", messages=chat())  # type: ignore[arg-type]
    assert "gpt-4o" in str(e404.value)
    for extra in ({"n": 2}, {"logprobs": True}, {"tools": [{"type": "function", "function": {"name": "f"}}]}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="toy", messages=chat(), **extra)  # type: ignore[call-overload]
    # the toy engine does not honour min_p: refused, never silently ignored
    with pytest.raises(openai.BadRequestError, match="min_p"):
        client.chat.completions.create(model="toy", messages=chat(), extra_body={"min_p": 0.1})  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as overflow:
        client.completions.create(model="toy", prompt="x" * 5000)
    body: Any = overflow.value.body
    assert body["type"] == "exceed_context_size_error" and body["n_ctx"] == 4096
    assert body["n_prompt_tokens"] > 4096
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model="toy", messages=chat()
        )  # type: ignore[arg-type]


# --- errors over raw HTTP: the envelope and the status ----------------------------------------------


def envelope(r: httpx.Response, status: int, type_: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == type_ and err["code"] == status and err["message"]
    return dict(err)


def test_raw_http_errors(http: httpx.Client) -> None:
    url = "/v1/chat/completions"
    msg = envelope(http.post(url, content=b"{not json"), 400, "invalid_request_error")["message"]
    assert "not valid JSON" in msg
    envelope(http.post(url, content=b"[1, 2]"), 400, "invalid_request_error")
    for bad in (
        {"messages": "hello"},
        {"messages": chat(), "temperature": "hot"},
        {"messages": chat(), "max_tokens": 1.5},
        {"messages": chat(), "stream": "yes"},
        {"messages": [{"role": "user"}]},
        {"messages": []},
        {"messages": chat(), "top_p": 3},
    ):
        envelope(http.post(url, json=bad), 400, "invalid_request_error")
    msg = envelope(http.post(url, json={"messages": chat(), "typical_p": 0.5}), 400, "invalid_request_error")[
        "message"
    ]
    assert "Unrecognized request argument supplied: typical_p" in msg
    envelope(http.post(url, json={"messages": chat(), "model": "nope"}), 404, "not_found_error")
    envelope(
        http.post("/v1/completions", json={"prompt": "a", "stream_options": {"include_usage": True}}),
        400,
        "invalid_request_error",
    )
    for stream in (False, True):  # a prompt over the context is a 400 before any byte of a stream
        err = envelope(
            http.post(url, json={"messages": chat("y" * 6000), "stream": stream}),
            400,
            "exceed_context_size_error",
        )
        assert err["n_ctx"] == 4096 and err["n_prompt_tokens"] > 4096
    envelope(http.get("/no/such/route"), 404, "not_found_error")
    assert "not allowed" in envelope(http.get(url), 405, "invalid_request_error")["message"]
    envelope(http.post("/v1/embeddings", json={"input": "x"}), 501, "not_supported_error")
    # the API key: missing or wrong is 401; /health, /v1/models and / stay public
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
        r = httpx.post(str(http.base_url) + url, json={"messages": chat()}, headers=headers)
        envelope(r, 401, "authentication_error")
        assert httpx.get(str(http.base_url) + "/metrics", headers=headers).status_code == 401
    assert httpx.get(str(http.base_url) + "/health").json() == {"status": "ok"}
    assert httpx.get(str(http.base_url) + "/v1/models").json()["data"][0]["id"] == "toy"
    assert "<title>stdengine chat</title>" in httpx.get(str(http.base_url) + "/").text
    # after all that, the server still answers
    assert http.post(url, json={"messages": chat(), "max_tokens": 2}).status_code == 200


def test_engine_failure_never_takes_the_server_down(http: httpx.Client) -> None:
    url = "/v1/chat/completions"
    err = envelope(http.post(url, json={"messages": chat("[[crash]]")}), 500, "server_error")
    assert "crashed on purpose" in err["message"]
    with http.stream("POST", url, json={"messages": chat("[[crash]]"), "stream": True}) as r:
        assert r.status_code == 200  # the failure came after the first tokens: an error event
        data = sse_events(r)
    assert data[-1] == "[DONE]" and json.loads(data[-2])["error"]["type"] == "server_error"
    with pytest.raises(openai.APIError, match="crashed on purpose"):
        client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key=KEY, max_retries=0)
        list(client.chat.completions.create(model="toy", messages=chat("[[crash]]"), stream=True))  # type: ignore[arg-type]
    assert http.post(url, json={"messages": chat(), "max_tokens": 2}).status_code == 200
    assert metric(http, "requests_processing") == 0


def test_models_tokenize_detokenize(http: httpx.Client) -> None:
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    assert models["data"][0]["meta"]["engine"] == "toy"
    r = http.post("/tokenize", json={"content": "héllo"}).json()
    assert r == {"tokens": [ord(c) for c in "héllo"]}
    assert http.post("/tokenize", json={"content": "hi", "add_special": True}).json()["tokens"] == [
        1,
        104,
        105,
    ]
    pieces = http.post("/tokenize", json={"content": "hé", "with_pieces": True}).json()["tokens"]
    assert pieces == [{"id": 104, "piece": "h"}, {"id": 233, "piece": "é"}]
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"content": "héllo"}
    envelope(http.post("/detokenize", json={"tokens": ["a"]}), 400, "invalid_request_error")
    props = http.get("/props").json()
    assert props["total_slots"] == 2 and "min_p" not in props["supported_params"]


def test_logprobs_need_the_capability_and_token_prompts_the_tokenizer(http: httpx.Client) -> None:
    """The toy engine declares neither logits nor logprobs: asking for them is a 400 naming the
    field. It tokenizes, so a token-id prompt is completed as the ids' text."""
    for route, body, field in (
        ("/v1/chat/completions", {"messages": chat(), "logprobs": True}, "logprobs / top_logprobs"),
        ("/v1/completions", {"prompt": "a", "logprobs": 0}, "logprobs"),
        ("/v1/completions", {"prompt": "a", "echo": True, "logprobs": 1}, "logprobs"),
    ):
        msg = envelope(http.post(route, json=body), 400, "invalid_request_error")["message"]
        assert field in msg and "'logprobs' capability" in msg
    ids = [ord(c) for c in "hello world"]
    body = {"prompt": [ids], "max_tokens": 2, "temperature": 0, "echo": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    same = http.post("/v1/completions", json={**body, "prompt": "hello world"}).json()["choices"][0]
    assert choice["text"] == same["text"] and choice["text"].startswith("hello world")
    assert choice["logprobs"] is None


def test_metrics(http: httpx.Client) -> None:
    http.post("/v1/completions", json={"prompt": "count me", "max_tokens": 2})
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert int(r.headers["process-start-time-unix"]) <= time.time()
    names = [
        "prompt_tokens_total",
        "prompt_seconds_total",
        "tokens_predicted_total",
        "tokens_predicted_seconds_total",
        "n_decode_total",
        "n_busy_slots_per_decode",
        "prompt_tokens_seconds",
        "predicted_tokens_seconds",
        "kv_cache_usage_ratio",
        "kv_cache_tokens",
        "requests_processing",
        "requests_deferred",
    ]
    for name in names:
        assert f"# HELP stdengine:{name} " in r.text and f"# TYPE stdengine:{name} " in r.text
    assert metric(http, "prompt_tokens_total") > 0 and metric(http, "tokens_predicted_total") >= 2
    assert metric(http, "requests_processing") == 0 and metric(http, "requests_deferred") == 0


def test_request_done_log(http: httpx.Client, server: Server) -> None:
    http.post("/v1/chat/completions", json={"messages": chat("secret prompt text"), "max_tokens": 2})
    http.get("/health")
    done = server.events("request.done")
    chats = [e for e in done if e["route"] == "/v1/chat/completions" and e["status"] == 200]
    last = chats[-1]
    assert last["method"] == "POST" and last["prompt_tokens"] > 0 and last["completion_tokens"] == 2
    assert last["ttft_ms"] >= 0 and last["duration_ms"] >= last["ttft_ms"] and last["slot"] in (0, 1)
    assert "prompt" not in last and "secret prompt text" not in server.log_path.read_text()  # only with -v
    assert any(e["route"] == "/health" and e["status"] == 200 for e in done)
    # -np 2: the weights were loaded once
    assert len(server.events("model.loaded")) == 1


# --- concurrency: slots, queue, disconnects ------------------------------------------------------------


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Two slots, room for two waiting requests, 40 ms per token."""
    s = toy_server(tmp_path_factory.mktemp("slow"), "-np", "2", "--queue", "2", "-E", "delay_ms=40")
    yield s
    assert s.stop() == 0


def stream_in_thread(url: str, results: list[Any], max_tokens: int = 8) -> threading.Thread:
    def run() -> None:
        try:
            with httpx.stream(
                "POST",
                url + "/v1/chat/completions",
                timeout=60,
                json={"messages": chat(), "max_tokens": max_tokens, "stream": True},
            ) as r:
                results.append((r.status_code, sse_events(r)))
        except Exception as e:  # reported by the test
            results.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t


def wait_for(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_two_slots_serve_four_streams_then_503(slow: Server) -> None:
    with httpx.Client(base_url=slow.url, timeout=30) as http:
        results: list[Any] = []
        seen: set[tuple[float, float]] = set()
        threads = [stream_in_thread(slow.url, results, max_tokens=20) for _ in range(4)]

        def full() -> bool:
            state = (metric(http, "requests_processing"), metric(http, "requests_deferred"))
            seen.add(state)
            return state == (2, 2)

        wait_for(full)
        # two running, two waiting: the queue is full, so one more is refused at once
        r = http.post("/v1/chat/completions", json={"messages": chat(), "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "unavailable_error" and "busy" in r.json()["error"]["message"]
        for t in threads:
            t.join(60)
        assert all(state[0] <= 2 for state in seen)
        assert len(results) == 4
        for res in results:
            assert not isinstance(res, Exception), res
            status, data = res
            assert status == 200 and data[-1] == "[DONE]"
            text = "".join(json.loads(d)["choices"][0]["delta"].get("content", "") for d in data[:-1])
            assert len(text.split()) == 20
        assert metric(http, "requests_processing") == 0 and metric(http, "requests_deferred") == 0
    slots = [
        e["slot"] for e in slow.events("request.done") if e.get("slot") is not None and e["status"] == 200
    ]
    assert sorted(set(slots)) == [0, 1]


def test_disconnecting_clients_free_their_slots(slow: Server) -> None:
    with httpx.Client(base_url=slow.url, timeout=30) as http:
        # a streaming client that leaves after two chunks: its generation (of up to 100000 tokens
        # at 40 ms each) stops at the next token, or the wait below gives up
        with http.stream(
            "POST", "/v1/chat/completions", json={"messages": chat(), "max_tokens": 100000, "stream": True}
        ) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
        wait_for(lambda: metric(http, "requests_processing") == 0, timeout=30)
        # a non-streaming client that times out
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", json={"messages": chat(), "max_tokens": 500}, timeout=0.3)
        wait_for(lambda: metric(http, "requests_processing") == 0, timeout=5)
        # a client that leaves while waiting in the queue
        results: list[Any] = []
        threads = [stream_in_thread(slow.url, results, max_tokens=15) for _ in range(2)]
        wait_for(lambda: metric(http, "requests_processing") == 2)
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", json={"messages": chat(), "max_tokens": 2}, timeout=0.2)
        wait_for(lambda: metric(http, "requests_deferred") == 0, timeout=5)
        for t in threads:
            t.join(60)
        assert all(not isinstance(r, Exception) and r[0] == 200 for r in results)
        # and the slots serve the next request normally
        assert (
            http.post("/v1/chat/completions", json={"messages": chat(), "max_tokens": 2}).status_code == 200
        )
    gone = [e for e in slow.events("request.done") if e["status"] == 499]
    assert len(gone) == 3


def test_one_context_engine_takes_turns_and_embeddings(tmp_path: Path) -> None:
    """An engine without new_context() still serves -np 2: one slot, requests take turns (the toy
    engine raises if two generations ever share its context). This one also declares embeddings."""
    s = toy_server(tmp_path, "-e", "toy-embed", "-np", "2", "-E", "clone=0", "-E", "delay_ms=10")
    try:
        (start,) = s.events("run.start")
        assert start["slots"] == 1 and "take turns" in start["summary"]
        results: list[Any] = []
        threads = [stream_in_thread(s.url, results, max_tokens=5) for _ in range(3)]
        for t in threads:
            t.join(60)
        assert [r[0] for r in results] == [200, 200, 200] and all(r[1][-1] == "[DONE]" for r in results)
        with httpx.Client(base_url=s.url, timeout=30) as http:
            assert http.get("/props").json()["total_slots"] == 1
            r = http.post("/v1/embeddings", json={"input": ["abca", "zz"]}).json()
            assert r["object"] == "list" and r["model"] == "toy" and r["usage"]["prompt_tokens"] == 8
            vectors = [d["embedding"] for d in r["data"]]
            assert [d["index"] for d in r["data"]] == [0, 1] and vectors[0][:3] == [2.0, 1.0, 1.0]
            assert vectors[1][25] == 2.0
            b64 = http.post("/v1/embeddings", json={"input": "abca", "encoding_format": "base64"}).json()
            raw = base64.b64decode(b64["data"][0]["embedding"])
            assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == vectors[0]
            envelope(http.post("/v1/embeddings", json={"input": [1, 2]}), 400, "invalid_request_error")
    finally:
        assert s.stop() == 0


# --- the process: SIGTERM drains, -v logs prompts, the server extra ---------------------------------------


def test_sigterm_drains_in_flight_requests(tmp_path: Path) -> None:
    s = toy_server(tmp_path, "-E", "delay_ms=30", "-v")
    results: list[Any] = []
    with httpx.Client(base_url=s.url, timeout=30) as http:
        t = stream_in_thread(s.url, results, max_tokens=30)  # about 0.9 s
        wait_for(lambda: metric(http, "requests_processing") == 1)
    s.proc.send_signal(signal.SIGTERM)
    t.join(30)
    assert s.proc.wait(30) == 0
    status, data = results[0]
    assert status == 200 and data[-1] == "[DONE]"
    assert json.loads(data[-2])["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/health")
    chats = [e for e in s.events("request.done") if e["route"] == "/v1/chat/completions"]
    assert chats and chats[-1]["prompt"] == chat()  # -v: the prompt is in the log
    s.stop()


def test_without_the_server_extra(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['fastapi'] = None; sys.modules['uvicorn'] = None\n"
        "from stdengine.cli.main import main; main()"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "serve", "-m", "x.gguf"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "INFER_LOG_FORMAT": "text"},
    )
    assert r.returncode == 6, r.stderr
    assert "server extra" in r.stderr and "pip install 'stdengine[server]'" in r.stderr


def test_a_port_in_use_is_a_usage_error_before_the_model_loads(tmp_path: Path) -> None:
    """Exit 2 naming the port, with a hint; the model (a missing file here) is not even looked at."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "stdengine.cli.main", "serve", "-m", str(tmp_path / "missing.gguf")]
            + ["--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "INFER_LOG_FORMAT": "text"},
        )
    assert r.returncode == 2, r.stderr
    assert f"error: cannot listen on 127.0.0.1 port {port}: Address already in use" in r.stderr
    assert "hint: another process listens there" in r.stderr and "missing.gguf" not in r.stderr


def test_listening_is_announced_once_the_socket_listens(tmp_path: Path) -> None:
    """A client that connects as soon as the "listening on" line is emitted must get through, on a
    port the OS picked (port 0): the callback connects, with no retry, before anything else runs."""
    code = f"""
import os, signal, socket, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_server_toy import ToyEngine, Weights
from stdengine.adapter import SamplingParams
from stdengine.events import null_emitter
from stdengine.server.app import build_state, run_server
from stdengine.server.lifecycle import bind

state = build_state(ToyEngine(Weights(), 64, 0, True), parallel=1, defaults=SamplingParams(),
                    events=null_emitter(), model_ref="toy")

def listening(url):
    port = int(url.rsplit(":", 1)[1])
    try:
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
        print("connected", port, flush=True)
    except OSError as e:
        print("refused", port, e, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

run_server(state, bind("127.0.0.1", 0), on_listening=listening,
           on_stopped=lambda url, sig: print("stopped", url.rsplit(":", 1)[1], sig, flush=True))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")
    first, second = lines[0].split(), lines[1].split()
    assert first[0] == "connected", r.stdout
    assert int(first[1]) > 0  # the real port, not 0
    assert second == ["stopped", first[1], "SIGTERM"]


def test_shutdown_is_logged(tmp_path: Path) -> None:
    s = toy_server(tmp_path)
    assert s.stop() == 0
    names = [e["event"] for e in s.events()]
    assert names.index("run.start") < names.index("server.stop")
    (stop,) = s.events("server.stop")
    assert stop["url"] == s.url and stop["signal"] == "SIGTERM" and stop["level"] == "info"
    assert stop["summary"].startswith(f"stopped listening on {s.url} (SIGTERM)")
