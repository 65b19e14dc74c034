"""Contexts that step together (stdengine.batching, issue 21): answers equal the solo answers, a
long prompt goes in chunks, one context's error stays its own, a cancelled generation leaves at
once, and `infer serve -np N` with a scheduler answers concurrent requests as it answers them one
by one.

The engine's own batched forward pass (`batch_decode`) is tested bit for bit in the reference
engine's tests; here the scheduler runs whatever `_evaluate_batch` the engine has (LocalEngine's
loop for the stand-in engine), and the answers are compared with the same engine's solo answers."""

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
from stdengine.batching import Scheduler
from stdengine.errors import InvalidRequest
from stdengine.events import Emitter
from stdengine.local_engine import LocalEngine
from stdengine.options import Options

# --- the scheduler on a stand-in engine (no model) ----------------------------------------------

BAD = 99  # a token Scripted's _evaluate refuses, before evaluating anything


class Gate:
    """Holds a step inside an evaluation until opened, so that the jobs submitted meanwhile all
    join the next step."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def hold(self) -> None:
        self.entered.set()
        assert self.opened.wait(30)


class Scripted(LocalEngine):
    """Generates the pieces of a script in order (token i is the text script[i]), no model; token
    len(script) is its end-of-generation token, which min_tokens and ignore_eos mask. Its
    evaluations go to a shared log, tagged; the first one waits at the gate, if it has one."""

    name = "scripted"

    def __init__(
        self,
        script: list[str],
        log: list[tuple[int, list[int]]] | None = None,
        tag: int = 0,
        gate: Gate | None = None,
    ) -> None:
        self.script = script
        self.log = log if log is not None else []
        self.tag = tag
        self.gate = gate
        self.tokens = []
        self.n_vocab = 100
        self.events = Emitter(log_format="json", stream=io.StringIO())
        self.logits = np.zeros(self.n_vocab, dtype=np.float32)

    def _evaluate(self, tokens: list[int]) -> None:
        if self.gate is not None:
            gate, self.gate = self.gate, None
            gate.hold()
        if BAD in tokens:
            raise InvalidRequest(f"bad token in context {self.tag}")
        self.log.append((self.tag, list(tokens)))
        self.tokens.extend(tokens)

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


class Jobs:
    """Submits generations to a scheduler and keeps what each emitted (its events, or its error)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.out: list[list[Any]] = []
        self.ended: list[threading.Event] = []

    def submit(self, ctx: LocalEngine, req: GenerateRequest, cancelled: threading.Event | None = None) -> int:
        i = len(self.out)
        self.out.append([])
        self.ended.append(threading.Event())
        self.scheduler.submit(ctx, req, self.out[i].append, lambda _: self.ended[i].set(), cancelled)
        return i

    def wait(self) -> list[list[Any]]:
        assert all(e.wait(60) for e in self.ended)
        return self.out


def tokens_req(prompt: list[int], n: int) -> GenerateRequest:
    return GenerateRequest(prompt_tokens=prompt, sampling=SamplingParams(temp=0, n_predict=n))


def text(events: list[Any]) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenEvent))


SCRIPT = ["a", "b", "c", "d"]


def started(gate: Gate, *contexts: Scripted) -> tuple[Scheduler, Jobs]:
    """A scheduler over the contexts, its first step held at the gate by a blocker job on the
    last context (a one-token prompt, one token generated)."""
    scheduler = Scheduler(contexts, chunk=4)
    jobs = Jobs(scheduler)
    jobs.submit(contexts[-1], tokens_req([0], 1))
    assert gate.entered.wait(30)
    return scheduler, jobs


def test_prompts_go_in_chunks_and_steps_gather_the_contexts() -> None:
    log: list[tuple[int, list[int]]] = []
    gate = Gate()
    a, b, blocker = Scripted(SCRIPT, log, 0), Scripted(SCRIPT, log, 1), Scripted(SCRIPT, log, 2, gate)
    scheduler, jobs = started(gate, a, b, blocker)
    try:
        jobs.submit(a, tokens_req(list(range(10)), 3))
        jobs.submit(b, tokens_req([7, 8], 3))
        gate.opened.set()
        out = jobs.wait()
    finally:
        scheduler.close()
    assert [text(o) for o in out] == ["a", "abc", "abc"]
    assert all(isinstance(o[-1], DoneEvent) for o in out)
    # a's prompt in chunks of 4, then the tokens it generated but the last (which ends it)
    assert a.tokens == [*range(10), 0, 1] and b.tokens == [7, 8, 0, 1]
    assert [t for tag, t in log if tag == 0] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0], [1]]
    # step 1: the blocker alone; from step 2 on a and b step together, in the scheduler's order
    assert log == [
        (2, [0]),
        (0, [0, 1, 2, 3]),
        (1, [7, 8]),
        (0, [4, 5, 6, 7]),
        (1, [0]),
        (0, [8, 9]),
        (1, [1]),
        (0, [0]),
        (0, [1]),
    ]
    s = scheduler.stats
    assert (s.steps, s.rows, s.tokens, s.max_rows) == (6, 9, 17, 2)


def test_a_step_lists_its_contexts_in_the_scheduler_order() -> None:
    """Whoever is submitted first, a step hands the engine its contexts in the order the scheduler
    was given them: the reference engine runs a step on its first context's thread pool, and a step
    on another pool than the last one's wakes that pool's sleeping workers (-np 8 over HTTP gave
    about 14% fewer tokens/s)."""
    log: list[tuple[int, list[int]]] = []
    gate = Gate()
    ctxs = [Scripted(SCRIPT, log, i) for i in range(3)] + [Scripted(SCRIPT, log, 3, gate)]
    scheduler, jobs = started(gate, *ctxs)
    try:
        for i in (2, 0, 1):
            jobs.submit(ctxs[i], tokens_req([i], 1))
        gate.opened.set()
        jobs.wait()
    finally:
        scheduler.close()
    assert log == [(3, [0]), (0, [0]), (1, [1]), (2, [2])]
    assert scheduler.stats.steps == 2


def test_one_contexts_error_is_its_own() -> None:
    """In a shared step, the context whose tokens the engine refuses gets the error (raised in its
    generation, which ends with it); the others are evaluated as if alone."""
    log: list[tuple[int, list[int]]] = []
    gate = Gate()
    ctxs = [Scripted(SCRIPT, log, i) for i in range(3)] + [Scripted(SCRIPT, log, 3, gate)]
    scheduler, jobs = started(gate, *ctxs)
    try:
        for c, prompt in zip(ctxs, ([1, 2], [3, BAD], [5]), strict=False):
            jobs.submit(c, tokens_req(prompt, 2))
        gate.opened.set()
        out = jobs.wait()
    finally:
        scheduler.close()
    assert [text(o) for o in out] == ["a", "ab", "", "ab"]
    assert isinstance(out[2][0], InvalidRequest) and "context 1" in str(out[2][0]) and len(out[2]) == 1
    assert ctxs[0].tokens == [1, 2, 0] and ctxs[1].tokens == [] and ctxs[2].tokens == [5, 0]


def test_a_cancelled_generation_leaves_before_the_next_step() -> None:
    """Cancelled while it runs, a generation is closed before the next step (its done comes, no
    DoneEvent); cancelled before it starts, it does no work at all; an invalid request ends with
    its error."""
    log: list[tuple[int, list[int]]] = []
    a, b = Scripted(SCRIPT, log, 0), Scripted(SCRIPT, log, 1)
    scheduler = Scheduler([a, b])
    jobs = Jobs(scheduler)
    stop = threading.Event()

    def emit(event: Any) -> None:
        got.append(event)
        stop.set()  # after the first token

    got: list[Any] = []
    ended = threading.Event()
    try:
        scheduler.submit(a, tokens_req([1, 2], 4), emit, lambda _: ended.set(), stop)
        assert ended.wait(30)
        early = threading.Event()
        early.set()
        jobs.submit(b, tokens_req([3], 4), early)
        jobs.submit(b, tokens_req([], 4))
        out = jobs.wait()
    finally:
        scheduler.close()
    assert [type(e) for e in got] == [TokenEvent] and got[0].text == "a"
    assert [t for tag, t in log if tag == 0] == [[1, 2], [0]]  # the step of its token ran, no more
    assert out[0] == [] and isinstance(out[1][0], InvalidRequest) and len(out[1]) == 1
    assert not [t for tag, t in log if tag == 1]


def test_closing_the_scheduler_ends_the_running_generations() -> None:
    """close() stops the loop after the step that runs; a generation still running is closed
    (its done comes, with no DoneEvent), and later submissions are refused."""
    gate = Gate()
    ctx = Scripted(SCRIPT, gate=gate)
    scheduler = Scheduler([ctx])
    jobs = Jobs(scheduler)
    jobs.submit(ctx, tokens_req([1, 2], 3))
    assert gate.entered.wait(30)
    closer = threading.Thread(target=scheduler.close)
    closer.start()
    gate.opened.set()
    closer.join(30)
    assert not closer.is_alive()
    (out,) = jobs.wait()  # done came
    # (the loop may have resumed it once more before it saw close())
    assert all(isinstance(e, TokenEvent) for e in out) and len(out) < 3 and ctx.tokens[:2] == [1, 2]
    with pytest.raises(RuntimeError, match="closed"):
        scheduler.submit(ctx, tokens_req([1], 2), print, print)


def test_a_failing_scheduler_ends_its_generations_with_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Should the scheduler's loop itself fail, the running generations end with EngineFailure
    (a 500 for the server's clients, not a request that waits forever) and new ones are refused."""
    from stdengine.errors import EngineFailure

    ctx = Scripted(SCRIPT)
    scheduler = Scheduler([ctx])

    def broken(running: list[Any]) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(scheduler, "_step", broken)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the thread's traceback
    jobs = Jobs(scheduler)
    jobs.submit(ctx, tokens_req([1], 2))
    (out,) = jobs.wait()
    assert len(out) == 1 and isinstance(out[0], EngineFailure) and "a bug" in str(out[0])
    with pytest.raises(RuntimeError, match="closed"):
        scheduler.submit(ctx, tokens_req([1], 2), print, print)
    scheduler.close()


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


def answer_of(events: list[Any]) -> tuple[list[int], str, str]:
    done = events[-1]
    assert isinstance(done, DoneEvent), events[-1]
    toks = [e.id for e in events if isinstance(e, TokenEvent) and e.id >= 0]
    return toks, text(events), done.finish_reason


def test_concurrent_batched_answers_equal_solo_answers(contexts: list[Any]) -> None:
    reqs = requests(LONG)
    for c in contexts:
        c.reset()
    solo = [answer(contexts[0], r) for r in reqs]  # one context, one request at a time
    for c in contexts:
        c.reset()
    scheduler = Scheduler(contexts)
    try:
        jobs = Jobs(scheduler)
        for c, r in zip(contexts, reqs, strict=True):
            jobs.submit(c, r)
        assert [answer_of(o) for o in jobs.wait()] == solo
        s = scheduler.stats
        assert s.max_rows >= 2 and s.rows > s.steps  # the contexts did share steps
        assert len(contexts[0].tokenize(LONG)) > scheduler.chunk  # the long prompt took several steps
    finally:
        scheduler.close()


def test_eog_ids_are_found_once_per_model(contexts: list[Any]) -> None:
    """The scan of the vocabulary for end-of-generation ids (min_tokens, ignore_eos) is shared
    by the contexts of one loaded model."""
    ids = contexts[0]._eog_ids()
    assert len(ids) > 0 and all(c._eog_ids() is ids for c in contexts[1:])


def test_a_cancelled_generation_leaves_its_context_ready(contexts: list[Any]) -> None:
    """A generation cancelled after its first token is closed where it is; the next request on
    its context, beside another one, still gets its solo answer."""
    reqs = requests(LONG)[:2]
    for c in contexts:
        c.reset()
    solo = [answer(contexts[0], r) for r in reqs]
    scheduler = Scheduler(contexts[:2])
    try:
        stop = threading.Event()
        got: list[Any] = []
        ended = threading.Event()

        def emit(event: Any) -> None:
            got.append(event)
            stop.set()

        scheduler.submit(contexts[1], reqs[0], emit, lambda _: ended.set(), stop)
        assert ended.wait(60)
        assert len(got) == 1 and isinstance(got[0], TokenEvent) and got[0].id == solo[0][0][0]
        jobs = Jobs(scheduler)
        jobs.submit(contexts[0], reqs[0])
        jobs.submit(contexts[1], reqs[1])
        assert [answer_of(o) for o in jobs.wait()] == solo
    finally:
        scheduler.close()


# --- infer serve with a scheduler ----------------------------------------------------------------


def test_an_engine_that_overrides_generate_is_served_without_the_scheduler(smollm2_path: Any) -> None:
    """The scheduler drives generation(), so an engine whose generate() is its own (here: one
    that counts its answers) keeps a thread per slot: its generate() is what answers."""
    from stdengine import registry
    from stdengine.server.app import build_state, close_state

    base = registry.engine_class("reference")

    class Counting(base):  # type: ignore[misc, valid-type]
        def generate(self, request: GenerateRequest) -> Iterator[Any]:
            yield from super().generate(request)

    events = Emitter(log_format="json", stream=io.StringIO())
    engine = Counting.load(Options(model=str(smollm2_path), ctx_size=256, threads=2), events)
    state = build_state(
        engine, parallel=2, defaults=SamplingParams(), events=events, model_ref="m", batching=True
    )
    try:
        assert state.slots.total == 2 and state.slots.scheduler is None
    finally:
        close_state(state)


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
    assert state.slots.scheduler is not None and state.slots.total == 4
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
    assert values["n_decode_total"] == state.slots.scheduler.stats.steps > 0
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
