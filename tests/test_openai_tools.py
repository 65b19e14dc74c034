"""`infer serve -e openai` passes tools to the upstream server and gives its calls back: the
upstream (a stand-in that answers as OpenAI does, streaming `tool_calls` deltas) gets the request's
tools, tool_choice, parallel_tool_calls and messages as the client sent them, and the client gets
the upstream's calls, whole and streamed, under `auto` too (which needs no grammar here)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]

# the upstream's answer: two calls, the first one's arguments in two pieces, the second without any
CALL_DELTAS = [
    [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}],
    [{"index": 0, "function": {"arguments": '{"city": '}}],
    [{"index": 0, "function": {"arguments": '"Paris"}'}}],
    [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": ""}}],
]


class OpenAILike(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def reply(self, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.reply({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "x"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/chat/completions":
            self.send_response(404)
            self.end_headers()
            return
        self.server.bodies.append(body)  # type: ignore[attr-defined]
        if body.get("tools") and body.get("tool_choice") != "none":
            deltas = [{"tool_calls": d} for d in CALL_DELTAS]
            finish = "tool_calls"
        else:
            deltas = [{"content": "Sunny."}]
            finish = "stop"
        chunks = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
        chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for c in chunks:
            self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), OpenAILike)
    httpd.bodies = []  # type: ignore[attr-defined]
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", httpd.bodies  # type: ignore[attr-defined]
    httpd.shutdown()


@pytest.fixture(scope="module")
def client(upstream):
    from fastapi.testclient import TestClient

    from stdengine.adapter import SamplingParams
    from stdengine.engines.openai import OpenAIEngine
    from stdengine.events import null_emitter
    from stdengine.options import Options
    from stdengine.server.app import build_state, close_state, create_app

    engine = OpenAIEngine.load(Options(engine="openai", url=upstream[0]), null_emitter())
    assert "tool_calls" in engine.capabilities
    state = build_state(engine, parallel=1, defaults=SamplingParams(), events=null_emitter(), model_ref="m")
    with TestClient(create_app(state)) as c:
        yield c
    close_state(state)


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "12:00"},
]

EXPECTED = [("get_weather", {"city": "Paris"}), ("get_time", {})]


def calls_of(message: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]


@pytest.mark.parametrize(
    "choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_tools_go_upstream_and_calls_come_back(client, upstream, choice):
    body = {
        "model": "m",
        "messages": CONVERSATION,
        "tools": TOOLS,
        "tool_choice": choice,
        "parallel_tool_calls": True,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    sent = upstream[1][-1]
    assert sent["tools"] == TOOLS and sent["tool_choice"] == choice and sent["parallel_tool_calls"] is True
    assert sent["messages"] == CONVERSATION  # as the client sent them: calls and results included
    assert "response_format" not in sent  # the upstream constrains its answer itself
    choice0 = r.json()["choices"][0]
    assert choice0["finish_reason"] == "tool_calls"
    assert calls_of(choice0["message"]) == EXPECTED
    assert all(c["id"].startswith("call_") for c in choice0["message"]["tool_calls"])


def test_streamed_calls_join_to_the_whole_answer(client):
    body = {"model": "m", "messages": CONVERSATION[:1], "tools": TOOLS, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in map(json.loads, lines):
        for ch in chunk["choices"]:
            for d in ch["delta"].get("tool_calls") or []:
                c = calls.setdefault(d["index"], {"name": "", "arguments": ""})
                c["name"] += d.get("function", {}).get("name") or ""
                c["arguments"] += d.get("function", {}).get("arguments") or ""
            finish = ch.get("finish_reason") or finish
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == EXPECTED
    assert finish == "tool_calls"


def test_a_text_answer_stays_text(client):
    body = {"model": "m", "messages": CONVERSATION[:1], "tools": TOOLS, "tool_choice": "none"}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] == "Sunny." and not message.get("tool_calls")


def test_calls_as_text_reads_back_as_our_format():
    """The engine's text for the deltas is the JSON array stdengine.server.tools parses."""
    from stdengine.engines.openai import CallsAsText

    c = CallsAsText()
    text = "".join(c.feed(d) for d in CALL_DELTAS) + c.end()
    assert json.loads(text) == [{"name": n, "arguments": a} for n, a in EXPECTED]
    assert CallsAsText().end() == ""
