"""The openai engine against real OpenAI-compatible servers started on loopback: llama-cpp-python's
own server (streaming, stop strings, tokenize, API keys, a server killed mid-stream), and a small
stand-in for llama-server that answers with the shapes llama-server documents (anchors §3: the
`Server: llama.cpp` header, /tokenize, /props, exceed_context_size_error, `error:` stream events).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from stdengine.adapter import DoneEvent, GenerateRequest, SamplingParams, TokenEvent
from stdengine.errors import (
    ContextOverflow,
    EngineFailure,
    EngineUnavailable,
    InvalidRequest,
    UnsupportedOption,
    UsageError,
)
from stdengine.events import Emitter
from stdengine.options import Options

pytest.importorskip("llama_cpp")
pytest.importorskip(
    "sse_starlette", reason="llama-cpp-python's server needs pip install 'llama-cpp-python[server]'"
)
pytest.importorskip("starlette_context")
pytest.importorskip("pydantic_settings")

from stdengine.engines.openai import OpenAIEngine, wait_until_ready  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--n_ctx", "512", "--n_threads", "2", *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, timeout_s=120)
    except Exception:
        proc.kill()
        raise
    return proc, url


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server(smollm2_path: Path) -> Iterator[str]:
    proc, url = start_server(smollm2_path)
    yield url
    stop_server(proc)


def load(url: str, **kw: Any) -> OpenAIEngine:
    return OpenAIEngine.load(Options(engine="openai", url=url, **kw), Emitter(verbosity=0))


@pytest.fixture(scope="module")
def engine(server: str) -> Iterator[OpenAIEngine]:
    e = load(server)
    yield e
    e.close()


def run(engine: Any, request: GenerateRequest) -> tuple[list[TokenEvent], str, DoneEvent]:
    events, done = [], None
    for ev in engine.generate(request):
        if isinstance(ev, TokenEvent):
            events.append(ev)
        else:
            done = ev
    assert done is not None
    return events, "".join(e.text for e in events), done


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temp=0.0, n_predict=n, **kw)


# --- llama-cpp-python's server ------------------------------------------------------------------
def test_load_probes_the_server(engine, smollm2_path):
    assert engine.dialect == "llama-cpp-python"
    assert engine.model == str(smollm2_path)  # the first id of /v1/models
    assert "tokenize" in engine.capabilities and "tokenize" not in OpenAIEngine.capabilities
    assert "logits" not in engine.capabilities
    # the server applies its template without showing it: nothing here can render it
    assert "chat_template" not in engine.capabilities
    assert engine.info().backend == "remote"


def test_tokenize_matches_llama_cpp(engine, smollm2_path):
    from llama_cpp import Llama

    vocab = Llama(str(smollm2_path), vocab_only=True, verbose=False)
    for text in ["Hello world", "café 😀", "<|im_start|>user\nHi<|im_end|>"]:
        for add_special in (True, False):
            expected = vocab.tokenize(text.encode(), add_bos=add_special, special=True)
            assert engine.tokenize(text, add_special=add_special) == expected
        assert (
            engine.detokenize(engine.tokenize(text, add_special=False)) == vocab.detokenize(expected).decode()
        )
    with pytest.raises(InvalidRequest, match="always parses special tokens"):
        engine.tokenize("x", parse_special=False)


def test_streamed_completion_matches_llama_cpp_in_process(engine, smollm2_path):
    from stdengine.engines.llamacpp import LlamaCppEngine

    local = LlamaCppEngine.load(
        Options(model=str(smollm2_path), threads=2, ctx_size=512), Emitter(verbosity=0)
    )
    request = GenerateRequest(prompt="Once upon a time", sampling=greedy(12))
    expected = run(local, request)[1]
    local.close()
    events, text, done = run(engine, request)
    assert text == expected
    assert len(events) > 1  # streamed, not one piece
    assert done.finish_reason == "length" and done.usage.completion_tokens == 12


def test_chat_streams_under_the_servers_template(engine):
    request = GenerateRequest(messages=[{"role": "user", "content": "Say hello."}], sampling=greedy(8))
    events, text, done = run(engine, request)
    assert text.strip() and len(events) > 1
    assert done.finish_reason in ("stop", "length")


def test_stop_string_ends_generation_before_it(engine):
    full = run(engine, GenerateRequest(prompt="Once upon a time", sampling=greedy(16)))[1]
    stop = full[8:11]
    _, text, done = run(engine, GenerateRequest(prompt="Once upon a time", sampling=greedy(16, stop=[stop])))
    assert text == full[: full.find(stop)]
    assert (done.finish_reason, done.stop) == ("stop", stop)


def test_llama_fields_are_refused_where_the_server_takes_none(server):
    with pytest.raises(UnsupportedOption, match="top_k"):
        load(server, top_k=5, engine_args={"dialect": "openai"})
    with pytest.raises(UnsupportedOption, match="repeat_last_n"):  # a server setting in llama-cpp-python
        load(server, repeat_last_n=32)
    load(server, top_k=5, min_p=0.1).close()  # llama-cpp-python takes these


def test_bad_engine_args_and_urls(server):
    with pytest.raises(UsageError, match="no engine argument"):
        load(server, engine_args={"colour": "blue"})
    with pytest.raises(UsageError, match="needs the server's URL"):
        OpenAIEngine.load(Options(engine="openai"), Emitter(verbosity=0))
    with pytest.raises(InvalidRequest, match="cannot return logits"):
        OpenAIEngine.decode(None, [1])  # type: ignore[arg-type]


def test_connection_refused_is_engine_unavailable():
    with pytest.raises(EngineUnavailable, match="cannot reach the server"):
        load(f"http://127.0.0.1:{free_port()}")


def test_api_key(smollm2_path, monkeypatch):
    proc, url = start_server(smollm2_path, "--api_key", "s3cret")
    try:
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        with pytest.raises(EngineUnavailable, match="401") as e:
            load(url, api_key="wrong")
        assert "Invalid API key" in e.value.message  # the server's own words
        assert "--api-key" in (e.value.hint or "")
        with pytest.raises(EngineUnavailable, match="401"):
            load(url)
        ok = load(url, api_key="s3cret")
        assert run(ok, GenerateRequest(prompt="Hi", sampling=greedy(2)))[2].usage.completion_tokens == 2
        monkeypatch.setenv("OPENAI_API_KEY", "s3cret")
        load(url).close()
    finally:
        stop_server(proc)


def test_server_killed_mid_stream(smollm2_path):
    proc, url = start_server(smollm2_path)
    try:
        engine = load(url)
        stream = engine.generate(GenerateRequest(prompt="Once upon a time", sampling=greedy(400)))
        assert isinstance(next(stream), TokenEvent)
        proc.kill()
        proc.wait()
        with pytest.raises((EngineFailure, EngineUnavailable)) as e:
            list(stream)
        assert "broke in the middle of the stream" in e.value.message or "ended the stream" in e.value.message
        with pytest.raises(EngineUnavailable, match="cannot reach"):
            list(engine.generate(GenerateRequest(prompt="Hi", sampling=greedy(2))))
    finally:
        if proc.poll() is None:
            proc.kill()


# --- a stand-in for llama-server --------------------------------------------------------------
class LlamaServerLike(BaseHTTPRequestHandler):
    """Answers as llama-server does (anchors §3); the prompt picks the behaviour."""

    def log_message(self, *args: Any) -> None:
        pass

    def reply(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Server", "llama.cpp")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def stream(self, events: list[str]) -> None:
        self.send_response(200)
        self.send_header("Server", "llama.cpp")
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # no length: the body ends when the connection closes
        for event in events:
            self.wfile.write(event.encode())
        self.close_connection = True

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self.reply(
                200,
                {"object": "list", "data": [{"id": "fake.gguf", "object": "model", "owned_by": "llamacpp"}]},
            )
        elif self.path == "/props":
            self.reply(200, {"default_generation_settings": {"n_ctx": 128}, "build_info": "b4747-fake"})
        else:
            self.reply(404, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)  # type: ignore[attr-defined]
        if self.path == "/tokenize":
            self.reply(
                200, {"tokens": ([1] if body["add_special"] else []) + [ord(c) for c in body["content"]]}
            )
            return
        prompt = body.get("prompt", "")
        chunk = 'data: {"choices":[{"text":"%s","index":0,"finish_reason":%s}]}\n\n'
        if prompt == "long":
            self.reply(400, {"error": {"code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": 300,
                                       "n_ctx": 128, "message": "request (300 tokens) exceeds the available "
                                       "context size (128 tokens), try increasing it"}})  # fmt: skip
        elif prompt == "garbage":
            self.stream([chunk % ("Hel", "null"), "data: {not json\n\n"])
        elif prompt == "fails":
            self.stream(
                [
                    chunk % ("Hel", "null"),
                    'error: {"code":500,"message":"out of memory","type":"server_error"}\n\n',
                ]
            )
        elif prompt == "cut":
            self.stream([chunk % ("Hel", "null")])
        else:
            last = ('data: {"choices":[{"text":"","index":0,"finish_reason":"length"}],"usage":{"prompt_tokens":3,'
                    '"completion_tokens":2},"timings":{"prompt_n":3,"prompt_ms":1.5,"predicted_n":2,"predicted_ms":4.0}}\n\n')  # fmt: skip
            self.stream([chunk % ("Hel", "null"), chunk % ("lo", "null"), last, "data: [DONE]\n\n"])


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), LlamaServerLike)
    httpd.bodies = []  # type: ignore[attr-defined]
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", httpd.bodies  # type: ignore[attr-defined]
    httpd.shutdown()


def test_llama_server_dialect_fields_tokenize_and_timings(fake):
    url, bodies = fake
    engine = load(url, top_k=7, repeat_last_n=32)
    assert engine.dialect == "llama.cpp" and "tokenize" in engine.capabilities
    assert "chat_template" in engine.capabilities  # llama-server shows it (/apply-template)
    assert engine.n_ctx() == 128 and engine.info().build == "b4747-fake"
    assert engine.tokenize("ab") == [1, 97, 98] and engine.tokenize("ab", add_special=False) == [97, 98]
    _, text, done = run(
        engine,
        GenerateRequest(prompt="hi", sampling=SamplingParams(top_k=7, repeat_last_n=32, n_predict=2, seed=5)),
    )
    assert text == "Hello" and done.finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (3, 2)
    assert (done.timings.prompt_n, done.timings.prompt_ms, done.timings.predicted_ms) == (3, 1.5, 4.0)
    sent = bodies[-1]
    assert (sent["top_k"], sent["repeat_last_n"], sent["max_tokens"], sent["seed"]) == (7, 32, 2, 5)
    assert "stop" not in sent  # stop strings are matched here, on the stream


def test_llama_server_errors_keep_its_message(fake):
    engine = load(fake[0])
    with pytest.raises(ContextOverflow, match="exceeds the available context size") as e:
        run(engine, GenerateRequest(prompt="long"))
    assert e.value.details == {"n_prompt_tokens": 300, "n_ctx": 128}
    with pytest.raises(EngineFailure, match="malformed stream event"):
        run(engine, GenerateRequest(prompt="garbage"))
    with pytest.raises(EngineFailure, match="out of memory"):
        run(engine, GenerateRequest(prompt="fails"))
    with pytest.raises(EngineFailure, match="ended the stream before its end"):
        run(engine, GenerateRequest(prompt="cut"))
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        run(engine, GenerateRequest(prompt=""))
    assert run(engine, GenerateRequest(prompt="hi"))[1] == "Hello"  # and the next request is served


def test_model_from_args_or_m(fake):
    assert load(fake[0], model="fake.gguf").model == "fake.gguf"
    assert load(fake[0], engine_args={"model": "fake.gguf"}).model == "fake.gguf"
    from stdengine.errors import ModelNotFound

    with pytest.raises(ModelNotFound, match="does not serve 'other'"):
        load(fake[0], model="other")


def test_cli_run_against_the_server(server):
    env = {**os.environ, "INFER_URL": server}
    r = subprocess.run([sys.executable, "-m", "stdengine.cli.main", "run", "-e", "openai", "--raw", "-p",
                        "Once upon a time", "-n", "4", "--temp", "0", "--json"],
                       capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["usage"]["completion_tokens"] == 4


# --- capabilities per instance, and infer serve -e openai forwarding /tokenize -------------------
def test_the_instance_says_tokenize_the_class_stays_as_declared(fake, server):
    declared = OpenAIEngine.capabilities
    with_tokenizer = [load(fake[0]), load(server)]  # llama-server's /tokenize, llama-cpp-python's /extras
    assert all("tokenize" in e.capabilities for e in with_tokenizer)
    assert OpenAIEngine.capabilities == declared == frozenset({"stream", "chat_template"})
    for e in with_tokenizer:
        e.close()


def _upstream_ids(url: str, text: str) -> list[int]:
    """The upstream's own ids for text, asked directly on its own route."""
    import httpx

    root = url.removesuffix("/v1")
    r = httpx.post(root + "/tokenize", json={"content": text, "add_special": True})
    if r.status_code == 404:  # llama-cpp-python
        r = httpx.post(root + "/extras/tokenize", json={"input": text})
    r.raise_for_status()
    return [int(t) for t in r.json()["tokens"]]


@pytest.mark.parametrize("upstream", ["fake", "server"])
def test_infer_serve_forwards_tokenize_to_the_upstream(upstream, request, tmp_path):
    """`infer serve -e openai --url UPSTREAM` answers POST /tokenize with the upstream's ids (the
    served openai instance says `tokenize`, and the server reads the instance)."""
    import httpx

    url = request.getfixturevalue(upstream)
    url = url[0] if isinstance(url, tuple) else url
    port = free_port()
    cmd = [sys.executable, "-m", "stdengine.cli.main", "serve", "-e", "openai", "--url", url,
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:  # a file, not a pipe: a full pipe would block the server
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=out)
    try:
        served = f"http://127.0.0.1:{port}"
        try:
            wait_until_ready(served, timeout_s=60)
        except EngineUnavailable:
            pytest.fail(f"infer serve -e openai did not start: {log.read_text()[-2000:]}")
        text = "Hello world, once upon a time"
        r = httpx.post(served + "/tokenize", json={"content": text, "add_special": True})
        assert r.status_code == 200, r.text
        ids = [t["id"] if isinstance(t, dict) else t for t in r.json()["tokens"]]
        assert ids == _upstream_ids(url, text)
        if upstream == "server":  # the stand-in has no /detokenize
            back = httpx.post(served + "/detokenize", json={"tokens": ids})
            assert back.status_code == 200, back.text
            assert text in back.json()["content"]
    finally:
        stop_server(proc)  # type: ignore[arg-type]


def test_an_answer_that_is_not_json_is_an_engine_failure(fake):
    engine = load(fake[0])  # the stand-in answers /detokenize with an event stream
    with pytest.raises(EngineFailure, match="not JSON"):
        engine.detokenize([1, 97])
    engine.close()
