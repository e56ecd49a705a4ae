"""The server process's heap: what start-up made is frozen, young collections are kept short, and the
gateway picks when full collections run.

A full garbage collection stops the whole process, and every speaking session's
frames wait behind it. It walks every object the live sessions hold, most of
them aiortc's, so its length grows with the session count. At 80 sessions one
took 35-151 ms, and CPython's own schedule started one once or twice a
minute, whatever the sessions were doing (`voxgate_gc_pause_seconds`,
docs/scaling.md).

Young collections (generations 0 and 1) stay automatic, but come more often
(`YoungCollections`). Each walks every young object that is still alive, and
CPython starts one after 700 more container objects were made than freed
(2000 from Python 3.13). Objects of the sessions' steady churn that die in an
older generation count as freed, so the young generation grows far past that
between collections (a probe, not committed, counted up to 18,000 live young
objects at 220 conversations: coroutines and futures awaiting the next frame,
word timings, RTCP reports). With `--media-priority realtime` on 2 cores
(Python 3.11), the longest young collection of a capacity-benchmark window
reached the 5-7.5 ms bucket at 200-240 conversations (7.5-10 ms at 280) with
CPython's 700, enough to push a tick's frames past 5 ms late, and mostly stayed
under 3 ms with 200 and generation 1 every 5th (3-5 ms at 280 in one run;
docs/scaling.md).

Young collections free most cyclic garbage. What they
leave is long-lived cyclic garbage, chiefly the peer connections of sessions
that closed. So `FullCollections` runs a full collection after
`FULL_AFTER_CLOSED` sessions have closed, as soon as the last open session
closes, and at the latest every `--full-gc-interval-s` seconds. Two of those
can still fall while others speak, but far less often. The memory held back
is the cyclic garbage of that many closed sessions, or of that interval.

Where the Python's collector ignores a generation-2 threshold (3.14's
incremental collector), CPython keeps its own schedule and `FullCollections`
does nothing. Young collections were measured on Python 3.11 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys

log = logging.getLogger("voxgate.heap")

FULL_AFTER_CLOSED = 64  # sessions closed since the last full collection: collect now
NEVER = 1 << 30  # a generation-2 threshold CPython never reaches: it starts no full collection itself
MIDDLE_EVERY = 5  # a generation-1 collection every this many young ones (CPython: 10)
# From 3.14 the collector is incremental, and the second threshold means something else: left alone there.
MIDDLE_IS_RATIO = sys.version_info < (3, 14)


def _swap_thresholds(first: int, values: tuple[int, ...]) -> tuple[int, ...] | None:
    """Set the collection thresholds of generations `first`, first + 1, ... to `values`, keeping the
    others. Returns what they were, or None, having changed nothing, where this Python ignores them."""
    before = gc.get_threshold()
    upto = first + len(values)
    gc.set_threshold(*before[:first], *values, *before[upto:])
    if gc.get_threshold()[first:upto] != values:
        gc.set_threshold(*before)
        return None
    return before[first:upto]


def settle() -> None:
    """Put what start-up made (modules, the app, the engine client) out of the collector's reach,
    so that a full collection walks only what sessions made since. At 40 speaking sessions a
    full collection of the whole heap took 77 ms."""
    gc.collect()
    gc.freeze()


class YoungCollections:
    """Young collections after `threshold` new container objects instead of CPython's default, so each is short.

    Owns generations 0 and 1 of the thresholds; `FullCollections` owns generation 2's. Generation 1
    comes every `MIDDLE_EVERY`th young collection rather than every 10th, so it too walks fewer
    objects (chosen by measurement: docs/benchmarks.md). An object that survives one generation-1
    collection moves to generation 2, and with collections this frequent that happens within a
    second or so of its birth rather than several: a cycle it ends in then waits for the next full
    collection. What that holds back between full collections was not measured.
    """

    def __init__(self, threshold: int) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            # 0 would turn automatic collection off for the whole process.
            raise ValueError(f"a young-collection threshold must be a positive count, not {threshold!r}")
        self.threshold = threshold
        self._saved: tuple[int, ...] | None = None  # CPython's young thresholds, while this holds them

    def start(self) -> bool:
        """Set the young thresholds (process-wide, until stop()); False where this Python ignores them."""
        if self._saved is not None:
            return True
        wanted = (self.threshold, MIDDLE_EVERY) if MIDDLE_IS_RATIO else (self.threshold,)
        self._saved = _swap_thresholds(0, wanted)
        if self._saved is None:
            log.info("this Python's collector sizes young collections itself; --gc-young-threshold has no effect")
            return False
        return True

    def stop(self) -> None:
        """Give CPython's young thresholds back, leaving generation 2's as it is."""
        if self._saved is not None:
            _swap_thresholds(0, self._saved)
            self._saved = None


class FullCollections:
    """Runs full collections when sessions close or the interval passes, not when CPython's heuristic fires."""

    def __init__(self, interval_s: float, after_closed: int = FULL_AFTER_CLOSED) -> None:
        self.interval_s = interval_s
        self.after_closed = after_closed
        self.closed = 0  # sessions closed since the last full collection
        self.collections = 0
        self.collected = asyncio.Event()  # set after each full collection this runs, until the next is due
        self._due = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._full_threshold: int | None = None  # CPython's generation-2 threshold, while this holds it

    def start(self) -> bool:
        """Take full collections over from CPython (process-wide, until stop()); False where it cannot."""
        if self._task is not None:
            return True
        saved = _swap_thresholds(2, (NEVER,))
        if saved is None:
            log.info("this Python's collector schedules full collections itself; --full-gc-interval-s has no effect")
            return False
        (self._full_threshold,) = saved
        self._task = asyncio.ensure_future(self._run())
        self._task.add_done_callback(self._ended)
        return True

    async def stop(self) -> None:
        """Give full collections back to CPython."""
        task, self._task = self._task, None
        try:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        finally:
            self._give_back()

    def _ended(self, task: asyncio.Task) -> None:
        # Should the loop ever fail, full collections must not stay off for good. A task
        # that stop() ended is no longer ours: stop() gave the thresholds back.
        if task is not self._task:
            return
        self._task = None
        if not task.cancelled() and task.exception() is not None:
            log.error("full collections go back to CPython's schedule after an error", exc_info=task.exception())
        self._give_back()

    def _give_back(self) -> None:
        # Generation 2's threshold only: the young ones may have changed since (YoungCollections).
        if self._full_threshold is not None:
            _swap_thresholds(2, (self._full_threshold,))
            self._full_threshold = None

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
            self.collected.clear()
            self.closed = 0
            gc.collect()
            self.collections += 1
            self.collected.set()
