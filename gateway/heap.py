"""The server process's heap: what start-up made is frozen, and the gateway picks when full collections run.

A full garbage collection stops the whole process, and every speaking session's
frames wait behind it. It walks every object the live sessions hold, most of
them aiortc's, so its length grows with the session count. At 80 sessions one
took 35-51 ms, and CPython's own schedule started one once or twice a minute,
in the middle of speech (`voxgate_gc_pause_seconds`, docs/scaling.md).

Young collections (generations 0 and 1) stay automatic. They walk only new
objects, take about a millisecond, and free most cyclic garbage. What they
leave is long-lived cyclic garbage, chiefly the peer connections of sessions
that closed. So `FullCollections` runs a full collection after
`FULL_AFTER_CLOSED` sessions have closed, as soon as the last open session
closes, and at the latest every `--full-gc-interval-s` seconds. The memory
bound is the garbage of that many closed sessions, or of that interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging

log = logging.getLogger("voxgate.heap")

FULL_AFTER_CLOSED = 64  # sessions closed since the last full collection: collect now
NEVER = 1 << 30  # a generation-2 threshold CPython never reaches: it starts no full collection itself


def settle() -> None:
    """Put what start-up made (modules, the app, the engine client) out of the collector's reach,
    so that a full collection walks only what sessions made since. At 40 speaking sessions a
    full collection of the whole heap took 77 ms."""
    gc.collect()
    gc.freeze()


class FullCollections:
    """Runs full collections when sessions close or the interval passes, not when CPython's heuristic fires."""

    def __init__(self, interval_s: float, after_closed: int = FULL_AFTER_CLOSED) -> None:
        self.interval_s = interval_s
        self.after_closed = after_closed
        self.closed = 0  # sessions closed since the last full collection
        self.collections = 0
        self.collected = asyncio.Event()  # set after each full collection this runs
        self._due = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._thresholds: tuple[int, int, int] | None = None

    def start(self) -> None:
        """Take full collections over from CPython (process-wide, until stop())."""
        if self._task is not None:
            return
        self._thresholds = gc.get_threshold()
        young, middle, _ = self._thresholds
        gc.set_threshold(young, middle, NEVER)
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Give full collections back to CPython."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)

    def session_closed(self, still_open: int) -> None:
        """A session closed; `still_open` sessions remain. With none left, a collection costs nobody."""
        self.closed += 1
        if self.closed >= self.after_closed or still_open == 0:
            self._due.set()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._due.wait(), self.interval_s)
            self._due.clear()
            self.closed = 0
            gc.collect()
            self.collections += 1
            self.collected.set()
