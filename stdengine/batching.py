"""Steps several contexts of one model together: the scheduler under `infer serve -np N`.

Each context runs its own generate() in its own thread, as without batching; what changes is
where its tokens are evaluated. A context in batch mode (`LocalEngine.batcher` set) hands every
evaluation to the Batcher that the contexts share, which gathers what each active context wants
evaluated and makes one `_evaluate_batch` call per step: an engine with the `batch_decode`
capability evaluates the step in shared forward passes (the weights read once for all the
contexts), any other gets LocalEngine's default, a loop of `_evaluate` calls (same results).

A step starts as soon as every active context (one inside generate()) has submitted, or when the
oldest submission has waited WAIT_S: a context that is still sampling, sending its token or
scoring log-probabilities when the others are ready joins the next step instead of holding them
up. A prompt is submitted in chunks of CHUNK tokens, one chunk a step, so a long prompt delays the
other contexts' next token by at most the evaluation of CHUNK tokens per context that is reading a
prompt in that step (spec/server.md, "Continuous batching").

There is no scheduler thread: the first submission of a step makes its context's thread the
step's leader, which waits (on its own condition variable) until every active context has
submitted or its wait runs out, then evaluates the step; the others wait for their results.
Nobody else is woken on a submission: on a 2-core machine N threads woken per submission (N^2 per
step) cost as much as a step's forward pass. Only one step runs at a time.

A step lists its contexts in the order they were attached, whoever leads it: the engine may run
the step on its first context's resources (the reference engine: that context's thread pool), and
a step on another pool than the last one's wakes that pool's sleeping workers while the last
one's are still spinning for their next job.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stdengine.local_engine import LocalEngine

CHUNK = 64  # prompt tokens per context per step
WAIT_S = 0.005  # the longest a step waits for an active context that has not submitted yet


@dataclass
class BatchStats:
    """What the steps so far looked like (the server's /metrics)."""

    steps: int = 0
    rows: int = 0  # contexts evaluated, summed over steps (rows / steps = the mean batch size)
    tokens: int = 0  # tokens evaluated, summed over steps
    max_rows: int = 0
    seconds: float = 0.0  # the steps' evaluations, summed


class Batcher:
    def __init__(self, chunk: int = CHUNK, wait_s: float = WAIT_S) -> None:
        if chunk < 1:
            raise ValueError("a batcher's chunk must be at least one token")
        self.chunk = chunk
        self.wait_s = wait_s
        self.stats = BatchStats()
        self._lock = threading.Lock()
        self._due = threading.Condition(self._lock)  # the leader waits here for its step's moment
        self._done = threading.Condition(self._lock)  # the others wait here for their results
        self._active: set[int] = set()  # id() of the contexts inside generate()
        self._pending: dict[int, tuple[LocalEngine, list[int]]] = {}  # submitted, not yet taken
        self._results: dict[int, BaseException | None] = {}  # evaluated: None, or the error
        self._leader: int | None = None  # the pending submission whose thread runs the next step
        self._oldest = 0.0  # when the oldest pending submission came
        self._stepping = False
        self._rank: dict[int, int] = {}  # id() of each attached context: the order steps list them in

    def attach(self, ctx: LocalEngine) -> None:
        """Put a context in batch mode: its evaluations go through this batcher from now on."""
        ctx.batcher = self
        self._rank.setdefault(id(ctx), len(self._rank))

    # --- called from the contexts' threads ------------------------------------------------
    def join(self, ctx: LocalEngine) -> None:
        """The context starts a generation: steps wait (boundedly) for its submissions."""
        with self._lock:
            self._active.add(id(ctx))

    def leave(self, ctx: LocalEngine) -> None:
        """The context's generation ended: steps stop waiting for it."""
        with self._lock:
            self._active.discard(id(ctx))
            self._due.notify()  # the pending ones may now be all that the next step waits for

    def evaluate(self, ctx: LocalEngine, tokens: list[int]) -> None:
        """What ctx._evaluate(tokens) does, in shared steps (a prompt one chunk at a time)."""
        for start in range(0, len(tokens), self.chunk):
            self._submit(ctx, tokens[start : start + self.chunk])

    def _submit(self, ctx: LocalEngine, tokens: list[int]) -> None:
        key = id(ctx)
        with self._lock:
            if not self._pending:
                self._oldest = time.monotonic()
            self._pending[key] = (ctx, tokens)
            if self._leader is None:
                self._leader = key
            elif self._ready():
                self._due.notify()  # the leader's wait is over
            while key not in self._results:
                if self._leader != key:
                    self._done.wait()
                    continue
                wait = self._oldest + self.wait_s - time.monotonic()
                if self._stepping:
                    self._due.wait()  # the step before ours is running
                elif self._ready() or wait <= 0:
                    self._step()  # returns with the lock held again, our result in
                else:
                    self._due.wait(wait)
            error = self._results.pop(key)
        if error is not None:
            raise error

    def _ready(self) -> bool:
        """Every active context has submitted: waiting longer gains nothing."""
        return self._active <= self._pending.keys()

    def _step(self) -> None:
        """Evaluate everything pending as one step. Called by the leader with the lock held;
        releases it while the engine works, so that other contexts can submit for the next step
        (the first of them its leader)."""
        items = sorted(self._pending.values(), key=lambda item: self._rank.get(id(item[0]), len(self._rank)))
        self._pending.clear()
        self._leader = None
        self._stepping = True
        self._lock.release()
        t0 = time.monotonic()
        try:
            results = _run(items)
        finally:
            self._lock.acquire()
            self._stepping = False
        self.stats.seconds += time.monotonic() - t0
        self.stats.steps += 1
        self.stats.rows += len(items)
        self.stats.tokens += sum(len(t) for _, t in items)
        self.stats.max_rows = max(self.stats.max_rows, len(items))
        self._results.update(results)
        if self._pending:
            self._oldest = time.monotonic()  # what came during the step waits from now
        self._done.notify_all()
        self._due.notify()  # the next step's leader, if it came during this one


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
