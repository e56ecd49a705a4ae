"""Encoding threads shared by every session, handing results back in batches.

Resampling and Opus run off the event loop (libopus releases the GIL), on one
thread per core beyond the one the event loop needs. Waking the event loop
from a thread costs a system call and a loop iteration; with a wake-up per
encoded slice that was a tenth of the media path's CPU. Here a thread wakes
the loop only when no wake-up is already pending, and the loop then takes
every result that is ready, so the cost is per batch, not per slice.

An utterance's first audio jumps the queue: its encoding is on the path to
first audio, the others are up to a second ahead of their playout.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import threading
from typing import Any, Callable

from . import priority

FIRST = 0  # priority of an utterance's first slice
LATER = 1


class EncodePool:
    def __init__(self, threads: int | None = None) -> None:
        # The cores this process may run on (a cpuset or taskset), not the machine's: with
        # --media-priority realtime these threads may take every core they are given.
        self.threads = threads or max(1, len(os.sched_getaffinity(0)) - 1)
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._lock = threading.Lock()
        # Results waiting for their event loop, and the loops already asked to take them.
        self._done: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, Any, BaseException | None]]] = {}
        self._wake_pending: set[asyncio.AbstractEventLoop] = set()
        self._workers: list[threading.Thread] = []
        self.batches = 0
        self.jobs = 0

    def submit(self, fn: Callable[..., Any], *args: Any, priority: int = LATER) -> asyncio.Future:
        """Run fn(*args) on a pool thread; the result arrives on the calling event loop."""
        loop = asyncio.get_running_loop()
        if not self._workers:
            for i in range(self.threads):
                worker = threading.Thread(target=self._work, name=f"encode-{i}", daemon=True)
                worker.start()
                self._workers.append(worker)
        future = loop.create_future()
        self._jobs.put((priority, next(self._order), future, fn, args))
        return future

    def _work(self) -> None:
        priority.enter_media_thread()  # the event loop's priority: these threads hold the GIL it waits for
        while True:
            _, _, future, fn, args = self._jobs.get()
            if future.cancelled():
                continue  # its session was interrupted meanwhile
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # handed to the awaiting coroutine
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
        self.batches += 1
        self.jobs += len(done)
        for future, result, error in done:
            if future.cancelled():
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)


# One pool for the process: the cores are shared by every session.
encode_pool = EncodePool()
