"""Contexts that step together (stdengine.batching, issue 21): answers equal the solo answers, a
long prompt goes in chunks, one context's error stays its own, and `infer serve -np N` with a
batcher answers concurrent requests as it answers them one by one.

The engine's own batched forward pass (`batch_decode`) is tested bit for bit in the reference
engine's tests; here the batcher runs whatever `_evaluate_batch` the engine has (LocalEngine's
loop until then), and the answers are compared with the same engine's solo answers."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from stdengine.adapter import DoneEvent, GenerateRequest, SamplingParams, TokenEvent
from stdengine.batching import Batcher
from stdengine.errors import InvalidRequest
from stdengine.events import Emitter
from stdengine.local_engine import LocalEngine
from stdengine.options import Options

# --- the batcher on a stand-in engine (no model) ------------------------------------------------


class Recorder(LocalEngine):
    """Only what the batcher touches: tokens, and an _evaluate that records its calls (and refuses
    a negative token, before evaluating anything)."""

    name = "recorder"

    def __init__(self, log: list[tuple[int, list[int]]], tag: int) -> None:
        self.tokens = []
        self.log = log
        self.tag = tag

    def _evaluate(self, tokens: list[int]) -> None:
        if any(t < 0 for t in tokens):
            raise InvalidRequest(f"bad token in context {self.tag}")
        self.log.append((self.tag, list(tokens)))
        self.tokens.extend(tokens)

    # abstract methods of Engine, unused here
    @classmethod
    def load(cls, options: Any, events: Any) -> Any:
        raise NotImplementedError

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        raise NotImplementedError

    def detokenize(self, tokens: Any) -> str:
        raise NotImplementedError

    def decode(self, tokens: Any, all_logits: bool = False) -> Any:
        raise NotImplementedError

    def n_ctx(self) -> int:
        return 1 << 20

    def reset(self) -> None:
        self.tokens = []

    def info(self) -> Any:
        raise NotImplementedError


def run_threads(targets: list[Any]) -> list[BaseException | None]:
    errors: list[BaseException | None] = [None] * len(targets)

    def wrap(i: int) -> None:
        try:
            targets[i]()
        except BaseException as e:
            errors[i] = e

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return errors


def test_prompts_go_in_chunks_and_steps_gather_the_contexts() -> None:
    log: list[tuple[int, list[int]]] = []
    batcher = Batcher(chunk=4, wait_s=10.0)  # a step waits for every active context
    a, b = Recorder(log, 0), Recorder(log, 1)
    for c in (a, b):
        batcher.attach(c)
        batcher.join(c)

    def work(c: Recorder, prompt: list[int]) -> None:
        batcher.evaluate(c, prompt)
        for t in range(3):
            batcher.evaluate(c, [100 + t])
        batcher.leave(c)

    assert run_threads([lambda: work(a, list(range(10))), lambda: work(b, [7, 8])]) == [None, None]
    assert a.tokens == [*range(10), 100, 101, 102] and b.tokens == [7, 8, 100, 101, 102]
    # a's prompt in chunks of 4; each step holds both contexts while both are active
    assert [t for tag, t in log if tag == 0] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [100], [101], [102]]
    s = batcher.stats
    assert s.tokens == 13 + 5 and s.rows == 6 + 4 and s.max_rows == 2
    # b ran out of work after 4 steps; then a stepped alone (it stopped waiting for b at leave)
    assert s.steps == 6


def test_a_step_lists_its_contexts_in_the_order_they_were_attached() -> None:
    """Whoever submits first, a step hands the engine its contexts in attach order: the reference
    engine runs a step on its first context's thread pool, and a step on another pool than the last
    one's wakes that pool's sleeping workers (-np 8 over HTTP gave about 14% fewer tokens/s)."""
    log: list[tuple[int, list[int]]] = []
    batcher = Batcher(wait_s=10.0)  # a step waits for every active context
    ctxs = [Recorder(log, i) for i in range(3)]
    for c in ctxs:
        batcher.attach(c)
        batcher.join(c)

    def work(c: Recorder, delay: float) -> None:
        time.sleep(delay)
        batcher.evaluate(c, [c.tag])
        batcher.leave(c)

    # submitted in the order 2, 0, 1
    assert (
        run_threads([lambda c=c, d=d: work(c, d) for c, d in zip(ctxs, (0.1, 0.2, 0.0), strict=True)])
        == [None] * 3
    )
    assert batcher.stats.steps == 1
    assert [tag for tag, _ in log] == [0, 1, 2]


def test_one_contexts_error_is_its_own() -> None:
    log: list[tuple[int, list[int]]] = []
    batcher = Batcher(wait_s=10.0)
    ctxs = [Recorder(log, i) for i in range(3)]
    for c in ctxs:
        batcher.attach(c)
        batcher.join(c)

    def work(c: Recorder, tokens: list[int]) -> None:
        try:
            batcher.evaluate(c, tokens)
        finally:
            batcher.leave(c)

    errors = run_threads(
        [lambda c=c, t=t: work(c, t) for c, t in zip(ctxs, ([1, 2], [3, -1], [5]), strict=True)]
    )
    assert errors[0] is None and errors[2] is None
    assert isinstance(errors[1], InvalidRequest) and "context 1" in str(errors[1])
    assert ctxs[0].tokens == [1, 2] and ctxs[1].tokens == [] and ctxs[2].tokens == [5]


def test_a_step_does_not_wait_for_a_context_that_never_submits() -> None:
    """A joined context whose thread is busy elsewhere holds a step up for wait_s at most."""
    log: list[tuple[int, list[int]]] = []
    batcher = Batcher(wait_s=0.01)
    a, idle = Recorder(log, 0), Recorder(log, 1)
    batcher.join(a)
    batcher.join(idle)
    batcher.evaluate(a, [1, 2, 3])
    batcher.evaluate(a, [4])
    assert a.tokens == [1, 2, 3, 4] and batcher.stats.steps == 2


class Scripted(Recorder):
    """Generates the pieces of a script in order (token i is the text script[i]), no model; token
    len(script) is its end-of-generation token, which min_tokens and ignore_eos mask."""

    name = "scripted"

    def __init__(self, script: list[str]) -> None:
        super().__init__([], 0)
        self.script = script
        self.n_vocab = len(script) + 1
        self.events = Emitter(log_format="json", stream=io.StringIO())
        self.logits = np.zeros(self.n_vocab, dtype=np.float32)

    def _keep_prefix(self, n: int) -> int:
        self.tokens = self.tokens[:n]
        return n

    def _logits_buffer(self) -> Any:
        return self.logits

    def _is_eog(self, token: int) -> bool:
        return token == len(self.script)

    def _sample_tokens(self, s: SamplingParams) -> Iterator[int]:
        yield from range(len(self.script))
        while True:
            yield len(self.script)

    def _text_stream(self) -> Any:
        script = self.script

        class Pieces:
            def push(self, token: int) -> str:
                return script[token]

            def flush(self) -> str:
                return ""

        return Pieces()


def test_a_stop_string_across_the_min_tokens_boundary_ends_the_answer() -> None:
    """min_tokens=2: the stop "<end>" begins in token 2's text and ends in token 3's, so it is
    found (and cut); the same stop wholly inside the first two tokens is plain text."""
    script = ["Hi <end> x", " <e", "nd> more", " tail"]
    stop = SamplingParams(temp=0, n_predict=10, stop=["<end>"])

    def run(min_tokens: int) -> tuple[str, str, int]:
        req = GenerateRequest(prompt_tokens=[0], sampling=stop, min_tokens=min_tokens)
        events = list(Scripted(script).generate(req))
        done = events[-1]
        assert isinstance(done, DoneEvent)
        text = "".join(e.text for e in events if isinstance(e, TokenEvent))
        return text, done.finish_reason, done.usage.completion_tokens

    assert run(0) == ("Hi ", "stop", 1)
    assert run(2) == ("Hi <end> x ", "stop", 3)  # " <e" held back: it began the stop
    assert run(3) == ("Hi <end> x <end> more tail", "stop", 4)  # both inside: the script's end


# --- real models: batched answers equal solo answers --------------------------------------------

PROMPTS = [
    "Name three colours.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Count from one to five.",
]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def contexts(request: pytest.FixtureRequest, smollm2_path: Any, gemma3_path: Any) -> Iterator[list[Any]]:
    from stdengine import registry

    cls = registry.engine_class("reference")
    path = smollm2_path if request.param == "smollm2" else gemma3_path
    engine = cls.load(
        Options(model=str(path), ctx_size=512, threads=2), Emitter(log_format="json", stream=io.StringIO())
    )
    ctxs = [engine] + [engine.new_context() for _ in range(len(PROMPTS) - 1)]
    yield ctxs
    for c in ctxs[1:]:
        c.close()
    engine.close()


def requests(long: str) -> list[GenerateRequest]:
    """Greedy and seeded requests, one with a prompt of several chunks."""
    out = []
    for i, p in enumerate(PROMPTS):
        sampling = (
            SamplingParams(temp=0, n_predict=24)
            if i % 2 == 0
            else SamplingParams(temp=0.8, seed=7 + i, n_predict=24)
        )
        out.append(GenerateRequest(messages=[{"role": "user", "content": p}], sampling=sampling))
    out[2].messages = [{"role": "user", "content": long}]
    return out


def answer(ctx: Any, req: GenerateRequest) -> tuple[list[int], str, str]:
    events = list(ctx.generate(req))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    toks = [e.id for e in events if isinstance(e, TokenEvent) and e.id >= 0]
    return toks, "".join(e.text for e in events if isinstance(e, TokenEvent)), done.finish_reason


LONG = "Summarize this list: " + ", ".join(f"item {i} is {'red' if i % 3 else 'blue'}" for i in range(40))


def test_concurrent_batched_answers_equal_solo_answers(contexts: list[Any]) -> None:
    reqs = requests(LONG)
    for c in contexts:
        c.reset()
    solo = [answer(contexts[0], r) for r in reqs]  # one context, one request at a time
    batcher = Batcher()
    for c in contexts:
        c.reset()
        batcher.attach(c)
    try:
        results: list[Any] = [None] * len(reqs)

        def run(i: int) -> None:
            results[i] = answer(contexts[i], reqs[i])

        assert run_threads([lambda i=i: run(i) for i in range(len(reqs))]) == [None] * len(reqs)
        assert results == solo
        s = batcher.stats
        assert s.max_rows >= 2 and s.rows > s.steps  # the contexts did share steps
        assert len(contexts[0].tokenize(LONG)) > batcher.chunk  # the long prompt took several steps
    finally:
        for c in contexts:
            c.batcher = None


def test_eog_ids_are_found_once_per_model(contexts: list[Any]) -> None:
    """The scan of the vocabulary for end-of-generation ids (min_tokens, ignore_eos) is shared
    by the contexts of one loaded model."""
    ids = contexts[0]._eog_ids()
    assert len(ids) > 0 and all(c._eog_ids() is ids for c in contexts[1:])


def test_generators_driven_from_one_thread_and_a_closed_one(contexts: list[Any]) -> None:
    """Two generations interleaved by one thread cannot both submit at once: each step waits its
    bound, then goes alone; the answers are still the solo ones. Closing a generator mid-way
    leaves the batcher (the next steps do not wait for it)."""
    reqs = requests(LONG)[:2]
    for c in contexts:
        c.reset()
    solo = [answer(contexts[0], r) for r in reqs]
    batcher = Batcher(wait_s=0.001)
    for c in contexts[:3]:
        c.reset()
        batcher.attach(c)
    try:
        gens = [contexts[i].generate(reqs[i]) for i in range(2)]
        events: list[list[Any]] = [[], []]
        live = [True, True]
        while any(live):
            for i in range(2):
                if live[i]:
                    ev = next(gens[i], None)
                    live[i] = ev is not None
                    if ev is not None:
                        events[i].append(ev)
        got = [
            (
                [e.id for e in evs if isinstance(e, TokenEvent) and e.id >= 0],
                "".join(e.text for e in evs if isinstance(e, TokenEvent)),
                evs[-1].finish_reason,
            )
            for evs in events
        ]
        assert got == solo
        g = contexts[2].generate(reqs[0])
        next(g)
        g.close()
        assert not batcher._active
    finally:
        for c in contexts:
            c.batcher = None


# --- infer serve with a batcher -------------------------------------------------------------------


def test_served_concurrent_answers_equal_solo_answers(smollm2_path: Any) -> None:
    """-np 4 with the slots stepping together (forced on, whatever the engine declares): four
    concurrent requests, chat and text, greedy and seeded, streamed and whole, get what each gets
    alone; /metrics counts the batched steps and the latencies."""
    httpx = pytest.importorskip("httpx")
    from stdengine import registry
    from stdengine.server.app import build_state, close_state, create_app

    events = Emitter(log_format="json", stream=io.StringIO())
    engine = registry.engine_class("reference").load(
        Options(model=str(smollm2_path), ctx_size=512, threads=2), events
    )
    state = build_state(
        engine, parallel=4, defaults=SamplingParams(), events=events, model_ref="m", batching=True
    )
    assert state.batcher is not None and state.slots.total == 4
    bodies: list[tuple[str, dict[str, Any]]] = [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 20, "temperature": 0},
        ),
        ("/v1/completions", {"prompt": "The sea is", "max_tokens": 20, "temperature": 0.9, "seed": 3}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": LONG}],
                "max_tokens": 20,
                "temperature": 0,
                "stream": True,
            },
        ),
        (
            "/v1/completions",
            {"prompt": "One, two,", "max_tokens": 20, "temperature": 0, "ignore_eos": True, "stream": True},
        ),
    ]

    def text_of(r: Any, stream: bool) -> str:
        assert r.status_code == 200, r.text
        if not stream:
            choice = r.json()["choices"][0]
            return str(choice.get("text") or choice["message"]["content"])
        out = []
        for line in r.text.splitlines():
            if line.startswith("data: {"):
                import json

                for c in json.loads(line[6:])["choices"]:
                    out.append(c.get("text") or c.get("delta", {}).get("content") or "")
        return "".join(out)

    async def scenario() -> tuple[list[str], list[str], str]:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:

            async def one(path: str, body: dict[str, Any]) -> str:
                return text_of(await client.post(path, json=body), bool(body.get("stream")))

            solo = [await one(p, b) for p, b in bodies]
            together = await asyncio.gather(*(one(p, b) for p, b in bodies))
            metrics = (await client.get("/metrics")).text
        return solo, list(together), metrics

    try:
        solo, together, metrics = asyncio.run(scenario())
    finally:
        close_state(state)
    assert together == solo and all(solo)
    values = {
        line.split()[0].removeprefix("stdengine:"): float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("stdengine:")
    }
    assert values["n_decode_total"] == state.batcher.stats.steps > 0
    assert values["batch_size_max"] >= 2 and values["n_busy_slots_per_decode"] > 1
    assert values["time_to_first_token_seconds_count"] == 8 and values["queue_seconds_count"] == 8
    assert values["inter_token_latency_seconds_count"] > 0
    assert values["batch_step_seconds_count"] == values["n_decode_total"]
    assert values["batch_step_seconds_sum"] > 0


@pytest.mark.parametrize("flags", [[], ["--no-batching"]], ids=["batched", "no-batching"])
def test_served_disconnect_frees_its_sequence(smollm2_path: Any, tmp_path: Any, flags: list[str]) -> None:
    """`infer serve -np 2` on the reference engine (batched when it declares batch_decode, unless
    --no-batching): a streaming client that leaves frees its sequence at the next token, and the
    next requests are answered as they are alone."""
    httpx = pytest.importorskip("httpx")
    from test_server_toy import Server

    args = ["-e", "reference", "-m", str(smollm2_path), "-np", "2", "-c", "512", "-t", "2", *flags]
    s = Server(args, tmp_path)
    try:
        with httpx.Client(base_url=s.url, timeout=120) as http:
            body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                while not next(lines).startswith("data: {"):
                    pass
            deadline = time.monotonic() + 60
            while "stdengine:requests_processing 0" not in http.get("/metrics").text:
                assert time.monotonic() < deadline, "the left request still holds its slot"
                time.sleep(0.05)
            short = {"prompt": "The sea is", "max_tokens": 12, "temperature": 0}
            alone = http.post("/v1/completions", json=short).json()["choices"][0]["text"]
            results: list[Any] = []
            threads = [
                threading.Thread(target=lambda: results.append(http.post("/v1/completions", json=short)))
                for _ in range(2)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert [r.json()["choices"][0]["text"] for r in results] == [alone, alone]
            batched = "batch_decode" in http.get("/props").json()["capabilities"] and not flags
            assert ("stdengine:batch_size_max " in http.get("/metrics").text) == batched
    finally:
        assert s.stop() == 0
    done = [e["status"] for e in s.events("request.done") if e["route"] == "/v1/completions"]
    assert sorted(done) == [200, 200, 200, 499]
