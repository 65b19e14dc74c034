"""Steps several contexts of one model together: the scheduler under `infer serve -np N`.

One thread per model (the Scheduler's) drives the generations of all its contexts. Each runs as
`LocalEngine.generation()`, a generator that yields its events and an `Evaluate` wherever it
needs tokens evaluated. A step of the loop resumes every generation that is not waiting for an
evaluation until it asks for one (sampling, stop strings and log-probabilities run then, on the
scheduler's thread), hands its events to the request's `emit`, and then evaluates what all of
them asked for in one `_evaluate_batch` call: an engine with the `batch_decode` capability in
shared forward passes (the weights read once for all the contexts), any other with LocalEngine's
default, a loop of `_evaluate` calls (same results).

Why one thread: with a thread per context, every step handed the GIL and the cores from one
thread to the next eight times over (2-core machine, 8 sequences: about a tenth of the run passed
between steps). Here the Python between two steps runs in one thread, straight through, and what
it hands to the requests (their events, their end) goes out in one `deliver` call just before
the step, so that the server's event loop is woken once a step (spec/server.md, "From the
generating threads to the event loop").

A request submitted while a step runs joins the next one. A prompt goes in chunks of CHUNK
tokens, one chunk a step, so a long prompt delays the other contexts' next token by at most the
evaluation of CHUNK tokens per context that is reading a prompt in that step (spec/server.md,
"Continuous batching"). A cancelled generation is closed before the next step.

A step lists its contexts in the order the scheduler was given them: the engine may run the step
on its first context's resources (the reference engine: that context's thread pool), and a step
on another pool than the last one's wakes that pool's sleeping workers while the last one's are
still spinning for their next job.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from stdengine.adapter import GenerateRequest
from stdengine.errors import EngineFailure
from stdengine.local_engine import Evaluate, GenerationStep, LocalEngine

CHUNK = 64  # prompt tokens per context per step


@dataclass
class BatchStats:
    """What the steps so far looked like (the server's /metrics)."""

    steps: int = 0
    rows: int = 0  # contexts evaluated, summed over steps (rows / steps = the mean batch size)
    tokens: int = 0  # tokens evaluated, summed over steps
    max_rows: int = 0
    seconds: float = 0.0  # the steps' evaluations, summed


Calls = list[tuple[Callable[[Any], object], Any]]  # (fn, arg): fn(arg), in order


@dataclass
class Job:
    """One request's generation on one context, as the scheduler runs it."""

    ctx: LocalEngine
    steps: Generator[GenerationStep, None, None]  # ctx.generation(request)
    emit: Callable[[Any], object]  # each event, or the exception that ended the generation
    done: Callable[[Any], object]  # called once (with None), after the last emit
    cancelled: threading.Event
    rank: int
    todo: list[int] = field(default_factory=list)  # the tokens of its Evaluate not yet evaluated
    ended: bool = False


class Scheduler:
    """contexts: those it may be given, in the order its steps list them. deliver(calls): runs
    the calls (to the jobs' emit and done) in order, wherever their receiver lives (the server: on
    its event loop); by default at once, on the scheduler's thread."""

    def __init__(
        self,
        contexts: Sequence[LocalEngine],
        chunk: int = CHUNK,
        deliver: Callable[[Calls], object] | None = None,
    ) -> None:
        if chunk < 1:
            raise ValueError("a scheduler's chunk must be at least one token")
        self.chunk = chunk
        self._deliver = deliver or _call_all
        self._outbox: Calls = []
        self.stats = BatchStats()
        self._rank = {id(c): i for i, c in enumerate(contexts)}  # the order steps list them in
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._new: list[Job] = []  # submitted, not yet taken in
        self._running: list[Job] = []  # the scheduler thread's own
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="infer-scheduler", daemon=True)
        self._thread.start()

    def submit(
        self,
        ctx: LocalEngine,
        request: GenerateRequest,
        emit: Callable[[Any], object],
        done: Callable[[Any], object],
        cancelled: threading.Event | None = None,
    ) -> None:
        """Run request on ctx from the next step on (from any thread): emit(event) for each of
        its events, or emit(error) for the exception that ends it, then done(None), all through
        `deliver`. Setting `cancelled` stops it before the next step. ctx must be free for the
        scheduler alone until done is called."""
        job = Job(
            ctx,
            ctx.generation(request),
            emit,
            done,
            cancelled or threading.Event(),
            self._rank.get(id(ctx), len(self._rank)),
        )
        with self._lock:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            self._new.append(job)
            self._wake.notify()

    def close(self) -> None:
        """Stop the loop (generations still running are closed) and wait for it."""
        with self._lock:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    # --- the scheduler's thread ------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while self._next_step():
                pass
        except BaseException as e:  # a bug here must not leave the requests waiting forever
            with self._lock:
                self._closed = True  # later submissions are refused
            failure = EngineFailure(f"the scheduler stopped: {type(e).__name__}: {e}")
            for job in self._running:
                if not job.ended:
                    self._outbox.append((job.emit, failure))
                    self._end(job, close=True)
            raise
        finally:
            with self._lock:
                new, self._new = self._new, []
            for job in new:
                self._end(job, close=True)
            self._flush()

    def _next_step(self) -> bool:
        """Take in the new jobs, resume the running ones, run a step; False once closed."""
        self._flush()  # what the last step's errors ended
        with self._lock:
            while not (self._new or self._running or self._closed):
                self._wake.wait()
            if self._new:
                self._running = sorted(self._running + self._new, key=lambda j: j.rank)
                self._new.clear()
            closed = self._closed
        for job in self._running:
            if closed or job.cancelled.is_set():
                self._end(job, close=True)
            elif not job.todo:
                self._resume(job, None)
        self._running = [job for job in self._running if not job.ended]
        self._flush()
        if self._running:
            self._step(self._running)
            self._running = [job for job in self._running if not job.ended]  # an error may end one
        return not closed

    def _resume(self, job: Job, error: BaseException | None) -> None:
        """Run job's generation (error thrown into it) until it asks for an evaluation or ends."""
        try:
            item: GenerationStep = next(job.steps) if error is None else job.steps.throw(error)
            while not isinstance(item, Evaluate):
                self._outbox.append((job.emit, item))
                if job.cancelled.is_set():
                    self._end(job, close=True)
                    return
                item = next(job.steps)
            job.todo = item.tokens
        except StopIteration:
            self._end(job)
        except BaseException as e:  # handed to the request, which answers with it
            self._outbox.append((job.emit, e))
            self._end(job)

    def _end(self, job: Job, close: bool = False) -> None:
        if close:
            try:
                job.steps.close()  # stop the generation where it is
            except Exception as e:
                self._outbox.append((job.emit, e))
        job.ended = True
        self._outbox.append((job.done, None))

    def _flush(self) -> None:
        if self._outbox:
            calls, self._outbox = self._outbox, []
            self._deliver(calls)

    def _step(self, running: list[Job]) -> None:
        """Evaluate the next chunk of every job's Evaluate in one step; an error goes back into
        its own job's generation."""
        items = [(job.ctx, job.todo[: self.chunk]) for job in running]
        t0 = time.monotonic()
        errors = _run(items)
        s = self.stats
        s.seconds += time.monotonic() - t0
        s.steps += 1
        s.rows += len(items)
        s.tokens += sum(len(t) for _, t in items)
        s.max_rows = max(s.max_rows, len(items))
        for job, (ctx, chunk) in zip(running, items, strict=True):
            error = errors[id(ctx)]
            if error is None:
                job.todo = job.todo[len(chunk) :]
            else:
                job.todo = []
                self._resume(job, error)


def _call_all(calls: Calls) -> None:
    for fn, arg in calls:
        fn(arg)


def _run(items: list[tuple[LocalEngine, list[int]]]) -> dict[int, BaseException | None]:
    """One _evaluate_batch call; when it fails, the contexts it did not evaluate are evaluated
    alone, so that an error (a full context, a bad token) is only its own context's."""
    before = [len(ctx.tokens) for ctx, _ in items]
    try:
        items[0][0]._evaluate_batch(items)
        return {id(ctx): None for ctx, _ in items}
    except BaseException as e:
        if len(items) == 1:
            return {id(items[0][0]): e}
    out: dict[int, BaseException | None] = {}
    for (ctx, tokens), n in zip(items, before, strict=True):
        if len(ctx.tokens) == n + len(tokens):  # evaluated before the failure (the default loop)
            out[id(ctx)] = None
            continue
        try:
            ctx._evaluate_batch([(ctx, tokens)])
            out[id(ctx)] = None
        except BaseException as e:
            out[id(ctx)] = e
    return out
