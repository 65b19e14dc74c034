"""A small, fast engine for the server tests, the helpers that start `infer serve` with it in a
subprocess, and unit tests of the server's slot pool and request parsing.

The toy engine's "model" is a fixed list of words: one token per character for the prompt (ids
are code points, so tokenize/detokenize round-trip), one word per generated token. With temp 0
the words follow from the prompt; with temp > 0 they are drawn from a random generator seeded by
`seed`, so a seed makes the output reproducible. Engine arguments: `-E delay_ms=N` sleeps N ms per
generated token (to hold a slot while a test looks), `-E clone=0` makes new_context() return None
(one context for all slots). A prompt containing `[[crash]]` raises a plain RuntimeError after two
tokens, to check that no engine failure can take the server down.

Run as a script, this file is `infer` with the toy engine registered:
    python tests/test_server_toy.py serve -e toy -m toy --port 0
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stdengine.adapter import (
    DoneEvent,
    Engine,
    EngineInfo,
    FinishReason,
    GenerateRequest,
    GenerationEvent,
    SamplingParams,
    Timings,
    TokenEvent,
    Usage,
    now_ms,
)
from stdengine.errors import ContextOverflow, InvalidRequest
from stdengine.generation import StopMatcher

ROOT = Path(__file__).resolve().parent.parent
WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
]
DEFAULT_LENGTH = 12  # tokens generated when n_predict is -1, then an end-of-generation "token"


class Weights:
    """What new_context() shares: made once by load()."""

    def __init__(self) -> None:
        self.words = list(WORDS)


class ToyEngine(Engine):
    name = "toy"
    description = "test engine: words for tokens, optional delay"
    capabilities = frozenset({"stream", "tokenize", "chat_template", "seed"})
    option_map = {
        "ctx_size": "prompt limit",
        "seed": "random.Random",
        "temp": "0 = words follow the prompt",
        "top_k": "accepted",
        "top_p": "accepted",
        "n_predict": "generation limit",
        "stop": "StopMatcher",
    }
    needs_model_file = False

    def __init__(self, weights: Weights, n_ctx: int, delay_ms: float, clone: bool) -> None:
        self.weights = weights
        self._n_ctx = n_ctx
        self.delay_ms = delay_ms
        self.clone = clone
        self.busy = threading.Lock()  # one generation per context: a second one at once is a server bug

    @classmethod
    def load(cls, options: Any, events: Any) -> ToyEngine:
        args = options.engine_args
        engine = cls(
            Weights(), options.ctx_size or 256, float(args.get("delay_ms", 0)), args.get("clone", "1") != "0"
        )
        events.info("model.loaded", path=options.model, architecture="toy", n_params=len(WORDS), load_ms=0.0)
        return engine

    def new_context(self) -> ToyEngine | None:
        return ToyEngine(self.weights, self._n_ctx, self.delay_ms, self.clone) if self.clone else None

    def info(self) -> EngineInfo:
        return EngineInfo(
            name="toy", version="1", model={"n_vocab": 0x110000, "words": len(self.weights.words)}
        )

    def n_ctx(self) -> int:
        return self._n_ctx

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return ([1] if add_special else []) + [ord(c) for c in text]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return "".join(chr(t) for t in tokens if t != 1)

    def decode(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        return np.zeros(len(WORDS), dtype=np.float32)

    def reset(self) -> None:
        pass

    def has_chat_template(self) -> bool:
        return True

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
        if not self.busy.acquire(blocking=False):
            raise RuntimeError("two generations at once on one toy context")
        try:
            yield from self._generate(request)
        finally:
            self.busy.release()

    def _generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
        s = request.sampling
        text = self.apply_chat_template(request.messages) if request.messages is not None else request.prompt
        if not text:
            raise InvalidRequest("the prompt is empty")
        prompt = self.tokenize(text)
        if len(prompt) + 1 > self._n_ctx:
            raise ContextOverflow(
                f"the prompt needs {len(prompt) + 1} tokens but the context holds {self._n_ctx}",
                n_prompt_tokens=len(prompt) + 1,
                n_ctx=self._n_ctx,
            )
        t0 = now_ms()
        if s.temp > 0:
            rng = random.Random(s.seed if s.seed >= 0 else None)
            pick = lambda i: rng.randrange(len(self.weights.words))  # noqa: E731
        else:
            start = sum(prompt) % len(WORDS)
            pick = lambda i: (start + i) % len(WORDS)  # noqa: E731
        limit = s.n_predict if s.n_predict >= 0 else DEFAULT_LENGTH
        stops = StopMatcher(s.stop)
        finish: FinishReason = "length" if s.n_predict >= 0 else "stop"
        matched = None
        t1 = now_ms()
        n = 0
        while n < limit:
            if self.delay_ms:
                time.sleep(self.delay_ms / 1e3)
            if "[[crash]]" in text and n == 2:
                raise RuntimeError("the toy engine crashed on purpose")
            piece = self.weights.words[pick(n)] + " "
            n += 1
            out, matched = stops.feed(piece)
            yield TokenEvent(n, out)
            if matched is not None:
                finish = "stop"
                break
        if matched is None and (tail := stops.flush()):
            yield TokenEvent(-1, tail)
        if n >= limit and s.n_predict < 0:
            finish = "stop"
        yield DoneEvent(
            finish_reason=finish,
            stop=matched,
            usage=Usage(len(prompt), n),
            timings=Timings(
                prompt_n=len(prompt), prompt_ms=t1 - t0, predicted_n=n, predicted_ms=max(now_ms() - t1, 1e-3)
            ),
        )


class ToyEmbedEngine(ToyEngine):
    """The toy engine plus embeddings: a text's vector is its character histogram over a-z."""

    name = "toy-embed"
    capabilities = ToyEngine.capabilities | {"embeddings"}

    def embed(self, texts: list[str]) -> list[list[float]]:
        return [[float(t.count(chr(c))) for c in range(ord("a"), ord("z") + 1)] for t in texts]


# --- starting `infer serve` with the toy engine -------------------------------------------------


class Server:
    """`infer serve` in a subprocess, on a port the OS picked (--port 0), logging JSON to a file."""

    def __init__(self, args: list[str], tmp: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = tmp / f"serve-{os.getpid()}-{time.monotonic_ns()}.log"
        self.err = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115
        cmd = [sys.executable, str(Path(__file__)), "serve", "--port", "0", "--log-format", "json", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=self.err, cwd=ROOT, env={**os.environ, **(env or {})}
        )
        self.url = self._wait_listening()

    def _wait_listening(self, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ev in self.events():
                if ev.get("event") == "run.start" and ev.get("url"):
                    return str(ev["url"])
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"infer serve exited with {self.proc.returncode}:\n{self.log_path.read_text()}"
                )
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"infer serve did not start:\n{self.log_path.read_text()}")

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(encoding="utf-8").splitlines():
            if line.startswith("{"):
                ev = json.loads(line)
                if name is None or ev.get("event") == name:
                    out.append(ev)
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.err.close()
        return self.proc.returncode


def toy_server(tmp: Path, *args: str, env: dict[str, str] | None = None) -> Server:
    return Server(["-e", "toy", "-m", "toy", *args], tmp, env=env)


# --- unit tests of the pieces the server is made of -----------------------------------------------


def test_toy_engine_is_deterministic_and_round_trips() -> None:
    engine = ToyEngine(Weights(), 64, 0, True)
    assert engine.detokenize(engine.tokenize("héllo")) == "héllo"
    req = GenerateRequest(prompt="hi", sampling=SamplingParams(temp=0))
    a, b = list(engine.generate(req)), list(engine.generate(req))
    assert a[:-1] == b[:-1] and len(a) == DEFAULT_LENGTH + 1
    assert isinstance(a[-1], DoneEvent) and a[-1].usage.completion_tokens == DEFAULT_LENGTH


def test_slot_pool_queues_then_refuses() -> None:
    from stdengine.server.slots import ServerBusy, SlotPool

    async def scenario() -> None:
        a, b = ToyEngine(Weights(), 8, 0, True), ToyEngine(Weights(), 8, 0, True)
        pool = SlotPool([a, b], queue_size=1)
        first, second = await pool.acquire(), await pool.acquire()
        assert {id(first), id(second)} == {id(a), id(b)} and pool.busy == 2
        waiter = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0)
        assert pool.waiting == 1
        with pytest.raises(ServerBusy, match="queue size 1"):
            await pool.acquire()
        pool.release(first)  # goes to the waiter, not the free list
        assert await waiter is first and pool.busy == 2 and pool.waiting == 0
        # a waiter that gives up leaves the queue and loses no slot
        gone = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        assert pool.waiting == 0
        pool.release(second)
        pool.release(first)
        assert pool.busy == 0
        pool.close()

    asyncio.run(scenario())


def test_courier_delivers_in_order_with_one_wakeup_per_burst() -> None:
    from stdengine.server.slots import Courier

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        courier = Courier(loop)
        got: list[Any] = []
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counted(*args: Any) -> Any:
            nonlocal wakeups
            wakeups += 1
            return real(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]

        def burst(start: int) -> None:  # from worker threads, as the slots post their tokens
            for i in range(start, start + 50):
                courier.post(got.append, i)

        threads = [threading.Thread(target=burst, args=(k * 50,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        await asyncio.sleep(0.05)
        assert sorted(got) == list(range(200))
        for k in range(4):  # each thread's calls in the order it posted them
            assert [x for x in got if k * 50 <= x < (k + 1) * 50] == list(range(k * 50, (k + 1) * 50))
        assert wakeups == 1  # the loop did not run while the threads posted: one wake-up for all
        courier.post(got.append, "late")  # a post after a delivery wakes the loop again
        await asyncio.sleep(0.05)
        assert got[-1] == "late" and wakeups == 2

    asyncio.run(scenario())


def test_text_frames_equal_the_whole_chunks_encoding() -> None:
    from stdengine.server import api
    from stdengine.server.completion import TextFrames, _sse

    for kind in ("chat", "text"):
        for usage in (False, True):
            reply = api.Reply(kind, 'mo"del', "fp", include_usage=usage)  # type: ignore[arg-type]
            frame = TextFrames(reply)
            for text in ("a", ' "quoted" \\ back', "line\nbreak\t", "héllo ✓ 🙂", "\x00\x1f", "</script>"):
                assert frame(text) == _sse(reply.chunk(text)), (kind, usage, text)


def test_request_parsing_is_strict() -> None:
    from stdengine.errors import InvalidRequest as Bad
    from stdengine.server import api

    with pytest.raises(Bad, match="Unrecognized request argument supplied: typical_p"):
        api.parse(api.ChatRequest, {"messages": [{"role": "user", "content": "x"}], "typical_p": 0.5})
    with pytest.raises(Bad, match="temperature"):
        api.parse(api.ChatRequest, {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"})
    req = api.parse(
        api.ChatRequest,
        {
            "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]}],
            "stop": "x",
            "max_completion_tokens": 5,
        },
    )
    assert api.chat_messages(req) == [{"role": "system", "content": "a"}]


def test_capabilities_are_the_loaded_instances() -> None:
    """The server asks the loaded engine instance what it can do, never its class: an instance
    that can tokenize (as the openai engine's can when its upstream server has a tokenizer) serves
    /tokenize although its class does not declare it, and one that cannot gets 501 although its
    class declares it."""
    from starlette.testclient import TestClient

    from stdengine.events import null_emitter
    from stdengine.server.app import build_state, close_state, create_app

    class Undeclared(ToyEngine):
        capabilities = ToyEngine.capabilities - {"tokenize"}

    can, cannot = Undeclared(Weights(), 64, 0, True), ToyEngine(Weights(), 64, 0, True)
    can.capabilities = ToyEngine.capabilities  # type: ignore[misc]
    cannot.capabilities = Undeclared.capabilities  # type: ignore[misc]
    for engine, status in ((can, 200), (cannot, 501)):
        state = build_state(
            engine, parallel=1, defaults=SamplingParams(), events=null_emitter(), model_ref="toy"
        )
        try:
            with TestClient(create_app(state)) as http:
                r = http.post("/tokenize", json={"content": "hé"})
                assert r.status_code == status, r.text
                if status == 200:
                    assert r.json() == {"tokens": [ord("h"), ord("é")]}
                    assert http.post("/detokenize", json={"tokens": [104, 233]}).json() == {"content": "hé"}
                else:
                    assert r.json()["error"]["type"] == "not_supported_error"
                shown = set(http.get("/props").json()["capabilities"])
                assert ("tokenize" in shown) == (status == 200)
        finally:
            close_state(state)


if __name__ == "__main__":
    from stdengine import registry
    from stdengine.cli.main import main

    registry.register("toy", ToyEngine)
    registry.register("toy-embed", ToyEmbedEngine)
    main()
