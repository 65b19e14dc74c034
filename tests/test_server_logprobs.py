"""Log-probabilities through `infer serve` (the reference engine on SmolLM2): chat `logprobs` /
`top_logprobs`, completions `logprobs` with `echo` and token-id prompts, and the `openai` engine's
score() through the server. The expected values are numpy's log_softmax of the logits the same
engine's decode() gives in this process."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from test_server_engines import RealServer

from stdengine.events import null_emitter
from stdengine.options import Options

TOL = 1e-4
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine(smollm2_path: Path) -> Iterator[Any]:
    from stdengine.reference.adapter import ReferenceEngine

    e = ReferenceEngine.load(
        Options(engine="reference", model=str(smollm2_path), ctx_size=256), null_emitter()
    )
    yield e
    e.close()


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    s = RealServer("reference", smollm2_path, tmp_path_factory.mktemp("serve-logprobs"))
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def http(server: RealServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def expected_rows(engine: Any, ids: list[int]) -> np.ndarray:
    """log_softmax of every row of decode(ids, all_logits=True), from an empty context."""
    engine.reset()
    rows = log_softmax(engine.decode(ids, all_logits=True))
    engine.reset()
    return rows


def assert_top(entries: list[dict[str, Any]], row: np.ndarray) -> None:
    """The served top entries are the row's most likely ids, most likely first, at its values."""
    ids = [e["id"] for e in entries]
    assert np.allclose([e["logprob"] for e in entries], row[ids], atol=TOL)
    assert np.allclose(sorted(row, reverse=True)[: len(ids)], [e["logprob"] for e in entries], atol=TOL)
    for e in entries:
        assert bytes(e["bytes"]).decode("utf-8", errors="replace") == e["token"]


def chat_body(**kw: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
        **kw,
    }


def test_chat_logprobs_are_the_models_distribution(http: httpx.Client, engine: Any) -> None:
    r = http.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"] == 4
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    # the prompt as the server renders it, then each generated token appended
    text = engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = engine.tokenize(text, add_special=False, parse_special=True)
    generated = [e["id"] for e in content]
    rows = expected_rows(engine, ids + generated)[len(ids) - 1 :]
    for e, row in zip(content, rows, strict=False):
        assert abs(e["logprob"] - row[e["id"]]) < TOL
        assert e["id"] == int(np.argmax(row))  # temperature 0: the most likely token
        assert len(e["top_logprobs"]) == 5
        assert_top(e["top_logprobs"], row)


def test_chat_streamed_logprobs_equal_the_whole_answer(http: httpx.Client) -> None:
    whole = http.post("/v1/chat/completions", json=chat_body()).json()["choices"][0]["logprobs"]["content"]
    streamed: list[dict[str, Any]] = []
    with http.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed += (choice["logprobs"] or {}).get("content", [])
    assert [e["id"] for e in streamed] == [e["id"] for e in whole]
    for a, b in zip(streamed, whole, strict=True):
        assert a["token"] == b["token"] and abs(a["logprob"] - b["logprob"]) < TOL
        assert [t["id"] for t in a["top_logprobs"]] == [t["id"] for t in b["top_logprobs"]]


def test_echo_of_token_ids_scores_the_prompt(http: httpx.Client, engine: Any) -> None:
    ids = engine.tokenize(PROMPT)
    rows = expected_rows(engine, ids)
    for prompt in (ids, [ids]):  # lm-evaluation-harness sends [[ids]]
        body = {"prompt": prompt, "echo": True, "logprobs": 5, "max_tokens": 1, "temperature": 0}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        n = len(ids)
        assert len(lp["tokens"]) == n + 1  # the prompt's tokens, then the generated one
        assert choice["text"].startswith(PROMPT) and choice["text"] == "".join(lp["tokens"])
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        expected = [rows[t - 1][ids[t]] for t in range(1, n)] + [rows[n - 1][lp["content"][n]["id"]]]
        assert np.allclose(lp["token_logprobs"][1:], expected, atol=TOL)
        for t in range(1, n + 1):
            assert_top(lp["content"][t]["top_logprobs"], rows[t - 1])
            top = lp["top_logprobs"][t]  # OpenAI's {text: logprob}
            assert set(top) == {e["token"] for e in lp["content"][t]["top_logprobs"]}
        offsets = lp["text_offset"]
        assert offsets == [sum(len(tok) for tok in lp["tokens"][:i]) for i in range(n + 1)]
    # max_tokens 0: only the scored prompt
    body = {"prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 0}
    r = http.post("/v1/completions", json=body).json()
    assert r["choices"][0]["text"] == PROMPT and r["choices"][0]["finish_reason"] == "length"
    assert len(r["choices"][0]["logprobs"]["tokens"]) == len(ids)
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}


def test_completion_logprobs_streamed_and_text_echo(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    chunks = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == whole["text"] and text.startswith(PROMPT)
    tokens, lps, offsets = [], [], []
    for c in chunks:
        lp = c["choices"][0]["logprobs"]
        if lp:
            tokens += lp["tokens"]
            lps += lp["token_logprobs"]
            offsets += lp["text_offset"]
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]
    assert lps[0] is None and np.allclose(lps[1:], whole["logprobs"]["token_logprobs"][1:], atol=TOL)


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("/v1/chat/completions", chat_body(top_logprobs=21), "top_logprobs"),
        ("/v1/chat/completions", chat_body(logprobs=False), "top_logprobs needs logprobs"),
        ("/v1/chat/completions", chat_body(top_logprobs=-1), "top_logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": True}, "logprobs"),
        ("/v1/completions", {"prompt": [1, 10**9], "echo": True, "logprobs": 1}, "outside the vocabulary"),
        ("/v1/completions", {"prompt": [1, -5], "max_tokens": 1}, "outside the vocabulary"),
        ("/v1/completions", {"prompt": [], "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_logprobs_requests_are_400(
    http: httpx.Client, route: str, body: dict[str, Any], field: str
) -> None:
    r = http.post(route, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and field in r.json()["error"]["message"]


def test_props_lists_the_capability(http: httpx.Client) -> None:
    assert "logprobs" in http.get("/props").json()["capabilities"]


def test_openai_engine_scores_through_the_server(server: RealServer, engine: Any) -> None:
    from stdengine.engines.openai import OpenAIEngine

    remote = OpenAIEngine.load(Options(engine="openai", url=server.url), null_emitter())
    try:
        assert "logprobs" in remote.capabilities
        ids = engine.tokenize(PROMPT)
        got, want = remote.score_prompt(ids, 5), engine.score_prompt(ids, 5)
        assert [t.id for t in got.tokens] == ids
        assert np.allclose(
            [t.logprob for t in got.tokens[1:]], [t.logprob for t in want.tokens[1:]], atol=TOL
        )
        assert len(got.top) == len(want.top) == len(ids)
        for a, b in zip(got.top, want.top, strict=True):
            assert [t.id for t in a] == [t.id for t in b]
            assert np.allclose([t.logprob for t in a], [t.logprob for t in b], atol=TOL)
        # and against numpy: row t is the distribution after ids[:t+1]
        rows = expected_rows(engine, ids)
        for t, row in enumerate(rows):
            assert got.top[t][0].id == int(np.argmax(row)) and abs(got.top[t][0].logprob - row.max()) < TOL
        # generation with logprobs through the server
        from stdengine.adapter import GenerateRequest, SamplingParams, TokenEvent

        request = GenerateRequest(prompt_tokens=ids, sampling=SamplingParams(temp=0, n_predict=2), logprobs=3)
        events = [ev for ev in remote.generate(request) if isinstance(ev, TokenEvent) and ev.token]
        assert [ev.id for ev in events][:1] == [got.top[-1][0].id]
        assert abs((events[0].logprob or 0) - got.top[-1][0].logprob) < TOL
        assert [t.id for t in events[0].top_logprobs or []] == [t.id for t in got.top[-1][:3]]
    finally:
        remote.close()


def test_local_score_equals_decode_rows(engine: Any) -> None:
    """Engine.score(): row t is log_softmax of decode()'s row t (also over several chunks)."""
    from stdengine import adapter

    ids = engine.tokenize(PROMPT * 3)
    rows = expected_rows(engine, ids)
    old, adapter.SCORE_CHUNK = adapter.SCORE_CHUNK, 4  # several chunks
    try:
        scored = engine.score(ids, 3)
    finally:
        adapter.SCORE_CHUNK = old
    assert len(scored) == len(ids)
    for top, row in zip(scored, rows, strict=True):
        want = np.argsort(-row, kind="stable")[:3]
        assert [t.id for t in top] == list(want)
        assert np.allclose([t.logprob for t in top], row[want], atol=1e-9)
