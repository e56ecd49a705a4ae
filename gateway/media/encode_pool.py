"""Where resampling and Opus run: on the event loop (the default), or on threads.

`--encode-threads 0`, the default, encodes on the event loop, as its lowest
priority. Jobs wait in one queue, an utterance's first audio first, and one
callback runs them only in a turn of the loop where no other callback waits:
the sends that a frame-clock tick releases, packets read, messages. Once it
starts it runs jobs for up to `LOOP_BUDGET_S`, and a job is a slice of at
most 0.1 s (`feeder.py`), about 5 frames of work, so whatever becomes due
meanwhile waits behind the budget and one slice at most. Encoding gives way
for at most `MAX_YIELD_S` at a stretch (until the first turn after it), so a
loop that is never idle still encodes. An utterance's first slice gives way
too, so on a busy loop first audio can wait up to that long: letting it go
ahead of a tick's sends was tried, and late frames were no better for it in
two pairs of runs at 40 sessions. A
first version without the giving way, a fixed budget per turn, put a
millisecond of encoding ahead of a tick's sends in each of the two or three
turns between the tick and the socket, and frames went late.

`--encode-threads N` (or `auto`: one per core beyond the event loop's, at
least one) encodes on N threads shared by every session. libopus releases the
GIL while it encodes, so encoding runs beside the loop. A thread wakes the
loop only when no wake-up is already pending, and the loop then takes every
result that is ready, so the cost is per batch, not per slice. An utterance's
first audio jumps the queue there too.

Why the loop is the default: at 40 sessions on 2 cores, in alternating runs of
`bench/bench_capacity.py` (docs/benchmarks.md), encoding on the loop cost less CPU
per session and sent fewer late frames than one thread, with continuous
speech and in conversations alike. The thread and the loop hand the GIL to
each other around every libopus call and every send, and each hand-off wakes
the other core. Threads remain for one process that must use more cores than
one loop can drive.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ...config import MAX_ENCODE_THREADS
from . import loop_internals, priority

FIRST = 0  # priority of an utterance's first slice
LATER = 1
MAX_THREADS = MAX_ENCODE_THREADS
LOOP_BUDGET_S = 0.001  # encoding on the loop: at most this long per turn, then one more job
MAX_YIELD_S = 0.005  # encoding on the loop gives way to other callbacks for at most this long


@dataclass
class _LoopJobs:
    """One event loop's encoding jobs, while the pool has no threads."""

    heap: list = field(default_factory=list)  # (priority, order, future, fn, args)
    yielding_since: float | None = None  # when encoding began to give way to other callbacks


def default_threads() -> int:
    """One per core beyond the event loop's, and at least one.

    The cores this process may run on (a cpuset or taskset), not the machine's:
    with --media-priority realtime these threads may take every core they are given."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def parse_threads(value: str) -> int:
    """`--encode-threads`: "auto" or a count from 0 (on the event loop) to MAX_THREADS."""
    if value.strip().lower() == "auto":
        return default_threads()
    try:
        threads = int(value)
    except ValueError:
        threads = -1
    if not 0 <= threads <= MAX_THREADS:
        raise ValueError(
            f"--encode-threads {value!r}: give auto, 0 (encode on the event loop) or a thread count up to {MAX_THREADS}"
        )
    return threads


def _run(fn: Callable[..., Any], args: tuple) -> tuple[Any, BaseException | None]:
    """fn(*args) as (result, None) or (None, the exception), for the awaiting coroutine."""
    try:
        return fn(*args), None
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        return None, exc


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled meanwhile: nobody waits for it
        return
    if error is None:
        future.set_result(result)
    elif isinstance(error, StopIteration):  # a future refuses it (TypeError): it would end the caller's coroutine
        future.set_exception(RuntimeError(f"an encoding job raised {error!r}"))
    else:
        future.set_exception(error)


class EncodePool:
    def __init__(self, threads: int = 0) -> None:
        self.threads = threads
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._lock = threading.Lock()
        # Results waiting for their event loop, and the loops already asked to take them.
        self._done: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, Any, BaseException | None]]] = {}
        self._wake_pending: set[asyncio.AbstractEventLoop] = set()
        # Without threads: each loop's waiting jobs; a loop is here while its drain is scheduled.
        self._here: dict[asyncio.AbstractEventLoop, _LoopJobs] = {}
        self._workers: list[threading.Thread] = []

    def configure(self, threads: int) -> None:
        """Set the thread count (0: on the event loop) before the first job."""
        if self._workers:
            raise RuntimeError("the encode pool's threads have started; configure it before the first job")
        self.threads = threads

    def submit(self, fn: Callable[..., Any], *args: Any, priority: int = LATER) -> asyncio.Future:
        """Run fn(*args) on a pool thread, or, when the pool has no threads, on the loop in
        turns where no other callback waits (up to MAX_YIELD_S later);
        the result arrives on the calling event loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if self.threads == 0:
            if loop not in self._here:
                for closed in [other for other in self._here if other.is_closed()]:
                    del self._here[closed]  # closed with jobs queued: nobody waits for them
                self._here[loop] = _LoopJobs()
                loop.call_soon(self._drain, loop)
            heapq.heappush(self._here[loop].heap, (priority, next(self._order), future, fn, args))
            return future
        if not self._workers:
            for i in range(self.threads):
                worker = threading.Thread(target=self._work, name=f"encode-{i}", daemon=True)
                worker.start()
                self._workers.append(worker)
        self._jobs.put((priority, next(self._order), future, fn, args))
        return future

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the loop's jobs while nothing else waits, for up to LOOP_BUDGET_S, then go round."""
        jobs = self._here[loop]
        now = time.perf_counter()
        # A loop that cannot say (uvloop) never waits: encoding there runs on its budget alone.
        if loop_internals.callbacks_waiting(loop):
            if jobs.yielding_since is None:
                jobs.yielding_since = now
            if now - jobs.yielding_since < MAX_YIELD_S:
                loop.call_soon(self._drain, loop)
                return
        jobs.yielding_since = None
        until = now + LOOP_BUDGET_S
        try:
            ran = False
            while jobs.heap:
                if ran and time.perf_counter() >= until:
                    break
                _, _, future, fn, args = heapq.heappop(jobs.heap)
                if future.cancelled():
                    continue  # its session was interrupted meanwhile
                ran = True
                _settle(future, *_run(fn, args))
        finally:
            # Whatever happened, the loop's other jobs still run (or its entry goes).
            if jobs.heap:
                loop.call_soon(self._drain, loop)
            else:
                del self._here[loop]

    def _work(self) -> None:
        priority.enter_media_thread()  # the event loop's priority: these threads hold the GIL it waits for
        while True:
            _, _, future, fn, args = self._jobs.get()
            if future.cancelled():
                continue  # its session was interrupted meanwhile
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # handed to the awaiting coroutine: a thread has nobody else to tell
                result, error = None, exc
            loop = future.get_loop()
            with self._lock:
                self._done.setdefault(loop, []).append((future, result, error))
                if loop in self._wake_pending:
                    continue
                self._wake_pending.add(loop)
            try:
                loop.call_soon_threadsafe(self._deliver, loop)
            except RuntimeError:  # that loop has closed: nobody waits for these any more
                with self._lock:
                    self._done.pop(loop, None)
                    self._wake_pending.discard(loop)

    def _deliver(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            done = self._done.pop(loop, [])
            self._wake_pending.discard(loop)
        for future, result, error in done:
            _settle(future, result, error)


# One pool for the process: the cores are shared by every session.
encode_pool = EncodePool()
