"""Slots: the engine contexts that serve requests at once, the bounded queue in front of them, and
the bridge between an engine's blocking `generate()` (run in a worker thread) and the asyncio
server.

An engine instance has one context (KV cache, sampler), so one request at a time may use it. With
`-np N` the server asks the engine for N-1 more contexts on the same loaded weights
(`Engine.new_context()`); an engine that cannot make one is served on its single context and
requests take turns. A request that finds every slot busy waits in a queue of bounded length; one
more is refused with 503 at once, so a flood of clients cannot pile up unbounded work.

With continuous batching (a Scheduler, stdengine.batching) the generations run on the scheduler's
thread instead, all of them together; a slot's worker thread then only scores an echoed prompt
first, when asked, and hands the generation over.

Everything here except `Generation._run` and the scheduler's calls (and `Courier.post`, which they
make) runs on the event loop thread, so the pool needs no lock.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from stdengine.adapter import Engine, GenerateRequest
from stdengine.batching import Calls, Scheduler
from stdengine.errors import ServerBusy
from stdengine.local_engine import LocalEngine

T = TypeVar("T")

END = object()  # put on a generation's queue after its last item
GONE = object()  # put on a watched generation's queue when its client disconnects


class ClientGone(Exception):
    """The client closed the connection while its request was waiting or running."""


class Courier:
    """Carries calls from worker threads to one event loop, with one wake-up of the loop for all
    the calls posted before it runs.

    Each wake-up (call_soon_threadsafe) writes to the loop's self-pipe and makes the loop thread
    runnable; on 2 cores that thread then takes a core from the engine's compute threads. With
    continuous batching the scheduler posts the N sequences' events of a step together, in one
    wake-up and one loop iteration, in the order posted."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._calls: Calls = []

    def post(self, fn: Callable[[Any], object], arg: Any) -> None:
        """Run fn(arg) on the loop soon (from any thread)."""
        self.post_all([(fn, arg)])

    def post_all(self, calls: Calls) -> None:
        """Run each fn(arg) on the loop soon, in order (from any thread)."""
        with self._lock:
            first = not self._calls
            self._calls.extend(calls)
            if not first:
                return  # the first of these calls has a wake-up on its way
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _deliver(self) -> None:  # on the loop
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, arg in calls:
            fn(arg)


class SlotPool:
    def __init__(self, contexts: list[Engine], queue_size: int, batching: bool = False) -> None:
        """batching: one Scheduler runs the contexts' generations together, when there are
        several and it can drive them all."""
        if not contexts:
            raise ValueError("a slot pool needs at least one context")
        self.contexts = contexts
        self.queue_size = queue_size
        self.scheduler: Scheduler | None = None
        # The scheduler drives LocalEngine.generation(): an engine that overrides generate() (its
        # events are not generation()'s) keeps one thread per slot, running its own generate().
        local = [
            c for c in contexts if isinstance(c, LocalEngine) and type(c).generate is LocalEngine.generate
        ]
        if batching and len(contexts) > 1 and len(local) == len(contexts):
            self.scheduler = Scheduler(local, deliver=self._deliver)
        self._free: list[Engine] = list(reversed(contexts))  # pop() hands out slot 0 first
        self._waiters: deque[asyncio.Future[Engine]] = deque()
        # One worker thread per slot: a generation holds its slot for as long as its thread runs
        # (with a scheduler, the thread only hands the generation over).
        self.executor = ThreadPoolExecutor(max_workers=len(contexts), thread_name_prefix="infer-slot")
        self._courier: Courier | None = None

    def _deliver(self, calls: Calls) -> None:  # on the scheduler's thread
        assert self._courier is not None  # made by the Generation that submitted the job
        self._courier.post_all(calls)

    def courier(self) -> Courier:
        """The workers' courier to the running loop (the one that serves this pool)."""
        loop = asyncio.get_running_loop()
        if self._courier is None or self._courier.loop is not loop:
            self._courier = Courier(loop)
        return self._courier

    @property
    def total(self) -> int:
        return len(self.contexts)

    @property
    def busy(self) -> int:
        return len(self.contexts) - len(self._free)

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    def slot_id(self, ctx: Engine) -> int:
        return next(i for i, c in enumerate(self.contexts) if c is ctx)

    async def acquire(self) -> Engine:
        """A free context, after waiting in the queue if need be; ServerBusy (503) when the queue
        is full."""
        if self._free and not self.waiting:
            return self._free.pop()
        if self.waiting >= self.queue_size:
            raise ServerBusy(
                f"the server is busy: all {self.total} slot(s) are in use and {self.waiting} request(s) "
                f"are already waiting (queue size {self.queue_size}); retry later"
            )
        fut: asyncio.Future[Engine] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            # The waiter gave up (its client left). If a context was handed over at the same
            # moment, pass it on instead of losing the slot.
            if fut.done() and not fut.cancelled():
                self.release(fut.result())
            raise
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def release(self, ctx: Engine) -> None:
        """Give a context back: to the longest-waiting request, else to the free list."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(ctx)
                return
        self._free.append(ctx)

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        if self.scheduler is not None:
            self.scheduler.close()


class DisconnectWatch:
    """Notices when the client closes the connection, so that a request waiting for a slot or
    for its next token stops at once instead of running to the end for nobody.

    Start it only after the request body has been read: it consumes the ASGI receive channel."""

    def __init__(self, receive: Any) -> None:
        self._task: asyncio.Future[None] = asyncio.ensure_future(self._wait(receive))

    @staticmethod
    async def _wait(receive: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    @property
    def gone(self) -> bool:
        return self._task.done() and not self._task.cancelled()

    def notify(self, queue: asyncio.Queue[Any]) -> None:
        """Put GONE on queue when the client disconnects: a reader of the queue then notices
        with no second waiter per item (guard's task and wait cost more than the item)."""

        def put(task: asyncio.Future[None]) -> None:
            if not task.cancelled():
                queue.put_nowait(GONE)

        self._task.add_done_callback(put)

    async def guard(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable`, or raise ClientGone if the client disconnects first."""
        task = asyncio.ensure_future(awaitable)
        both: set[asyncio.Future[Any]] = {task, self._task}
        try:
            done, _ = await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            raise ClientGone()
        finally:
            if not task.done():
                task.cancel()
                # let the cancelled awaitable run its cleanup (e.g. leave the slot queue)
                await asyncio.wait({task})

    def close(self) -> None:
        self._task.cancel()


class Generation:
    """One request's generate() on one slot's context, run in that slot's worker thread, or by
    the pool's scheduler.

    Each event (or the exception that ended generation) goes to the loop through an asyncio
    queue, then END, all by the pool's Courier. cancel() makes it stop at the next token: the
    engine's generator is closed there, and the slot is released just before END."""

    def __init__(
        self,
        pool: SlotPool,
        ctx: Engine,
        request: GenerateRequest,
        score: tuple[list[int], int] | None = None,
    ) -> None:
        self.pool = pool
        self.ctx = ctx
        self.request = request
        self.score = score  # an echo with logprobs: score these tokens (ids, top_n) first
        self.loop = asyncio.get_running_loop()
        self.courier = pool.courier()
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self._cancel = threading.Event()
        self.finished = False  # END was received

    def start(self) -> None:
        self.loop.run_in_executor(self.pool.executor, self._run)

    def cancel(self) -> None:
        self._cancel.set()

    async def next(self) -> Any:
        item = await self.queue.get()
        if item is END:
            self.finished = True
        return item

    async def finish(self) -> None:
        """Wait for the worker to leave (it releases the slot just before END), so that a client
        that sends its next request as soon as it has this answer finds the slot free."""
        while not self.finished:
            await self.next()

    def _events(self) -> Iterator[Any]:
        """The prompt's PromptLogprobs first when asked, then generate()'s events."""
        if self._cancel.is_set():  # the client left before the worker started: no work for nobody
            return
        if self.score is not None:
            yield self.ctx.score_prompt(*self.score)
        yield from self.ctx.generate(self.request)

    def _put(self, item: Any) -> None:
        self.courier.post(self.queue.put_nowait, item)

    def _end(self) -> None:
        self.courier.post(self._ended, None)

    def _ended(self, _: object) -> None:  # on the loop
        self.pool.release(self.ctx)  # before END: see finish()
        self.queue.put_nowait(END)

    def _run(self) -> None:  # in the worker thread
        scheduler = self.pool.scheduler
        if scheduler is not None and isinstance(self.ctx, LocalEngine):
            # the scheduler's calls to emit and done reach the loop through the courier
            try:
                if self.score is not None and not self._cancel.is_set():
                    self._put(self.ctx.score_prompt(*self.score))
                scheduler.submit(self.ctx, self.request, self.queue.put_nowait, self._ended, self._cancel)
            except BaseException as e:
                self._put(e)
                self._end()
            return
        events = None
        try:
            events = self._events()
            for ev in events:
                if self._cancel.is_set():
                    break
                self._put(ev)
        except BaseException as e:  # handed to the request handler, which answers with it
            self._put(e)
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                try:
                    close()  # stop the engine's generator where it is
                except Exception as e:
                    self._put(e)
            self._end()
