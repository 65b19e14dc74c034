"""Every engine that can load in CI is served by `infer serve` and checked through the real OpenAI
client: the reference engine and llama.cpp (llama-cpp-python), on SmolLM2-135M-Instruct.

Prompts and answers are kept short: these check the plumbing (shapes, streaming, greedy
agreement between streamed and whole answers, tokenize, context errors), not the engines' speed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parent.parent


class RealServer:
    """`infer serve` itself (the console script's module), with a real engine and model."""

    def __init__(self, engine: str, model: Path, tmp: Path, *extra: str) -> None:
        self.log = tmp / f"serve-{engine}.log"
        self.err = open(self.log, "w", encoding="utf-8")  # noqa: SIM115
        cmd = [
            sys.executable,
            "-m",
            "stdengine.cli.main",
            "serve",
            "-e",
            engine,
            "-m",
            str(model),
            "--port",
            "0",
            "-c",
            "256",
            "-np",
            "2",
            "--log-format",
            "json",
            *extra,  # e.g. a larger -c: the last of a repeated flag wins
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.err, cwd=ROOT)
        self.url = ""
        deadline = time.monotonic() + 120
        while not self.url:
            for line in self.log.read_text(encoding="utf-8").splitlines():
                ev = json.loads(line) if line.startswith("{") else {}
                if ev.get("event") == "run.start" and ev.get("url"):
                    self.url = ev["url"]
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"infer serve -e {engine} did not start:\n{self.log.read_text()}")
            time.sleep(0.05)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.err.close()
        return self.proc.returncode


def engine_ready(engine: str, model: Path) -> str | None:
    """Why the engine cannot be served here yet, or None. Only a missing or unfinished engine is a
    reason to skip; a server that fails with a loadable engine is a failure."""
    from stdengine import registry
    from stdengine.events import null_emitter
    from stdengine.options import Options

    try:
        cls = registry.engine_class(engine)
    except Exception as e:
        return f"engine '{engine}' is not installed or does not import: {e}"
    ok, why = cls.availability()
    if not ok:
        return f"engine '{engine}' cannot load here: {why}"
    try:
        cls.load(Options(engine=engine, model=str(model), ctx_size=256), null_emitter()).close()
    except Exception as e:
        return f"engine '{engine}' does not load the model yet: {type(e).__name__}: {e}"
    return None


@pytest.fixture(scope="module", params=["reference", "llamacpp"])
def served(
    request: pytest.FixtureRequest, smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, RealServer]]:
    engine = request.param
    why = engine_ready(engine, smollm2_path)
    if why is not None:
        pytest.skip(why)
    server = RealServer(engine, smollm2_path, tmp_path_factory.mktemp(f"serve-{engine}"))
    yield engine, server
    assert server.stop() == 0


@pytest.mark.models
def test_real_engine_served(served: tuple[str, RealServer], smollm2_path: Path) -> None:
    engine, server = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    assert model == str(smollm2_path)
    messages: Any = [{"role": "user", "content": "What is the capital of France?"}]

    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    text = whole.choices[0].message.content
    assert whole.id.startswith("chatcmpl-") and text and whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage is not None and 0 < whole.usage.completion_tokens <= 8
    assert whole.to_dict()["timings"]["predicted_n"] == whole.usage.completion_tokens

    # greedy: the streamed answer is the same text, chunk by chunk, ending with usage
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )

    done = client.completions.create(model=model, prompt="The sky is", max_tokens=4, temperature=0)
    assert done.id.startswith("cmpl-") and done.choices[0].text and done.usage is not None

    with httpx.Client(base_url=server.url, timeout=60) as http:
        tokens = http.post("/tokenize", json={"content": "Hello world"}).json()["tokens"]
        assert (
            tokens
            and http.post("/detokenize", json={"tokens": tokens}).json()["content"].strip() == "Hello world"
        )
        # over the 256-token context: a clear 400 with the numbers, and the server goes on
        r = http.post("/v1/completions", json={"prompt": "word " * 400, "max_tokens": 1})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (
            err["type"] == "exceed_context_size_error"
            and err["n_ctx"] == 256
            and err["n_prompt_tokens"] > 256
        )
        assert http.get("/health").json() == {"status": "ok"}
        assert "stdengine:tokens_predicted_total" in http.get("/metrics").text
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == text  # the context was left clean for the next request


QUESTIONS = ["What is the capital of France?", "Write a short poem about rain.", "List three uses of copper."]


@pytest.mark.models
def test_reference_answers_repeat_exactly(smollm2_path: Path, tmp_path: Path) -> None:
    """The reference engine's determinism contract, through the server: a greedy 64-token answer is
    the same text asked again (the prompt cache reuses the prefix), streamed, and after other
    questions in between, for several questions. ignore_eos keeps every answer 64 tokens long,
    however short the model's own answer would be."""
    server = RealServer("reference", smollm2_path, tmp_path)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id

        def ask(question: str, stream: bool = False) -> str:
            kw: Any = dict(
                model=model,
                messages=[{"role": "user", "content": question}],
                max_tokens=64,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            if stream:
                return "".join(
                    c.choices[0].delta.content or ""
                    for c in client.chat.completions.create(**kw, stream=True)
                    if c.choices
                )
            return client.chat.completions.create(**kw).choices[0].message.content or ""

        first = {q: ask(q) for q in QUESTIONS}
        assert all(len(a.split()) >= 20 for a in first.values()), first  # long answers
        for q in QUESTIONS:
            assert ask(q) == first[q], q
            assert ask(q, stream=True) == first[q], q
    finally:
        assert server.stop() == 0
