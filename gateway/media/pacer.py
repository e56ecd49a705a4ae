"""Frame timing for outbound audio: one clock for every track, absolute deadlines.

`FrameClock` ticks every 5 ms on an absolute schedule on the monotonic clock,
and only while some track is waiting. Each track's `Pacer` takes every fourth
tick of its own phase, so a frame leaves every 20 ms exactly, and the tracks'
work is spread over four phases instead of bunched on one tick. One timer
serves all tracks: with a timer per track, every session cost the event loop a
wake-up of its own per frame.

Deadlines never accumulate drift: tick j is due at anchor + j * 5 ms. If the
event loop stalls past a few frames, the clock re-anchors at the present
instead of firing a catch-up burst, which a receiver's jitter buffer would
have to absorb; a track that itself falls behind skips ahead the same way.

Between utterances the frames are silence, so their timing is free: when a
new utterance's first audio is ready, `wake()` sends it at once and the track
continues on the tick nearest a frame later. One frame leaves early; nothing
is sent twice or bunched.
"""

from __future__ import annotations

import asyncio
import math
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from .frames import FRAME_S

PHASES = 4  # ticks per frame
STALL_FRAMES = 3  # behind by more than this: re-anchor instead of bursting
LATE_S = 0.005  # a frame leaving later than this after its deadline counts as late
INTERVALS_KEPT = 3000  # recent inter-departure intervals each pacer keeps for jitter figures (a minute)


class MonotonicClock:
    """The time source: the monotonic clock and the event loop's timers.

    Tests pass one of their own, so schedules can be checked tick by tick
    without depending on how busy the machine is.
    """

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, delay: float, interrupt: asyncio.Future) -> None:
        """Return after `delay` seconds, or as soon as `interrupt` is resolved."""
        timer = asyncio.get_running_loop().call_later(delay, _resolve, interrupt)
        try:
            await interrupt
        finally:
            timer.cancel()


def _resolve(future: asyncio.Future | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


class FrameClock:
    """Ticks every `frame_s / phases` seconds while any pacer waits for one."""

    def __init__(
        self, *, frame_s: float = FRAME_S, phases: int = PHASES, time_source: MonotonicClock | None = None
    ) -> None:
        self.frame_s = frame_s
        self.phases = phases
        self.slot_s = frame_s / phases
        self.time = time_source or MonotonicClock()
        self.stall_s = STALL_FRAMES * frame_s
        self.stalls = 0
        self.ticks = 0
        self._anchor: float | None = None
        self._next = 0  # index of the next tick to fire
        self._waiters: dict[int, list[asyncio.Future]] = {}
        self._ticker: asyncio.Task | None = None
        self._target: int | None = None  # the tick the ticker sleeps towards
        self._interrupt: asyncio.Future | None = None

    def deadline(self, tick: int) -> float:
        assert self._anchor is not None
        return self._anchor + tick * self.slot_s

    def upcoming(self) -> int:
        """The index of the first tick at or after now."""
        now = self.time.now()
        if self._anchor is None:
            self._anchor, self._next = now, 0
            return 0
        return max(self._next, math.ceil((now - self._anchor) / self.slot_s - 1e-9))

    def at(self, tick: int, future: asyncio.Future) -> None:
        """Resolve `future` with the tick's deadline when tick `tick` fires."""
        if self._anchor is None:
            self.upcoming()
        if tick < self._next:
            future.set_result(self.deadline(tick))  # already past: late
            return
        self._waiters.setdefault(tick, []).append(future)
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.ensure_future(self._run())
        elif self._target is not None and tick < self._target:
            _resolve(self._interrupt)  # a track starting on an earlier phase: wake the ticker sooner

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiters:
            # Never sleep towards ticks nobody waits for: the next tick to fire is
            # the first one waited for.
            tick = max(self._next, min(self._waiters))
            delay = self.deadline(tick) - self.time.now()
            if delay > 0:
                self._target, self._interrupt = tick, loop.create_future()
                try:
                    await self.time.sleep(delay, self._interrupt)
                finally:
                    self._target = self._interrupt = None
                if self.time.now() < self.deadline(tick):
                    continue  # interrupted for an earlier tick
            now = self.time.now()
            if now - self.deadline(tick) > self.stall_s:
                # The loop fell behind: this tick is due now, and the rest follow it.
                self.stalls += 1
                self._anchor = now - tick * self.slot_s
            due = self.deadline(tick)
            for t in [t for t in self._waiters if t <= tick]:
                for future in self._waiters.pop(t):
                    if not future.done():
                        future.set_result(due)
            self._next = tick + 1
            self.ticks += 1


_clocks: dict[asyncio.AbstractEventLoop, FrameClock] = {}


def shared_clock() -> FrameClock:
    """The one frame clock of the running event loop."""
    loop = asyncio.get_running_loop()
    clock = _clocks.get(loop)
    if clock is None:
        if len(_clocks) > 8:  # loops of finished test runs
            for old in [l for l in _clocks if l.is_closed()]:
                del _clocks[old]
        clock = _clocks[loop] = FrameClock()
    return clock


class IntervalRing:
    """The last `size` intervals, as plain doubles in one array.

    Not a deque of floats: a full garbage collection walks every item of a deque
    while the event loop waits, and 40 sessions' deques of 3,000 floats were the
    largest share of what it walked (a 5-19 ms pause, with every session's frames
    behind it).
    An array's items are not objects, so the collector skips them.
    """

    __slots__ = ("_values", "_size", "_count")

    def __init__(self, size: int = INTERVALS_KEPT) -> None:
        self._values = array("d", bytes(8 * size))
        self._size = size
        self._count = 0  # appended so far; the newest is at (count - 1) % size

    def append(self, value: float) -> None:
        self._values[self._count % self._size] = value
        self._count += 1

    def clear(self) -> None:
        self._count = 0

    def __len__(self) -> int:
        return min(self._count, self._size)

    def __iter__(self):
        """Oldest first."""
        start = self._count - len(self)
        return (self._values[i % self._size] for i in range(start, self._count))


@dataclass
class PacerStats:
    frames: int = 0
    late_frames: int = 0  # sent more than LATE_S after their deadline
    stalls: int = 0  # skipped ahead after falling behind
    wakes: int = 0  # sent early for an utterance's first frame
    keepalive_frames: int = 0  # covered by DTX keep-alives: one packet per `frames` of a wait
    # Recent inter-departure intervals in seconds, for jitter figures.
    intervals: IntervalRing = field(default_factory=IntervalRing)

    def jitter(self) -> dict:
        xs = list(self.intervals)
        if not xs:
            return {"count": 0}
        xs_ms = sorted(x * 1000 for x in xs)
        mean = sum(xs_ms) / len(xs_ms)
        var = sum((x - mean) ** 2 for x in xs_ms) / len(xs_ms)
        p99 = xs_ms[min(len(xs_ms) - 1, int(math.ceil(0.99 * len(xs_ms))) - 1)]
        return {
            "count": len(xs_ms),
            "mean_ms": mean,
            "stdev_ms": math.sqrt(var),
            "p99_ms": p99,
            "max_ms": xs_ms[-1],
        }


class Pacer:
    """Says when one track's frames leave: every frame on the frame clock's ticks of its phase."""

    def __init__(self, *, clock: FrameClock | None = None) -> None:
        self._clock = clock
        self.stats = PacerStats()
        self._tick: int | None = None  # the tick of the next departure
        self._last_departure: float | None = None
        self._sleeper: asyncio.Future | None = None
        self._woken = False
        self._clock_stalls = 0  # the clock's stall count at the last departure
        self.on_frame: Callable[[float, float], None] | None = None  # (interval_s, late_s), for metrics
        self.on_keepalive: Callable[[int], None] | None = None  # (frames covered), for metrics

    @property
    def clock(self) -> FrameClock:
        if self._clock is None:
            self._clock = shared_clock()
        return self._clock

    def wake(self) -> None:
        """Send the next frame now rather than at its tick (only while idle between utterances)."""
        self._woken = True
        if self._sleeper is not None and not self._sleeper.done():
            self._sleeper.set_result(None)

    async def wait(self, frames: int = 1) -> float:
        """Wait until the next frame is due, or `frames` frames from the last one
        (an idle track skipping frames); returns the departure time. A wake()
        ends the wait at once either way."""
        clock = self.clock
        frame_ticks = clock.phases
        if self._tick is None:
            self._tick = clock.upcoming()
        self._tick += (frames - 1) * frame_ticks
        deadline: float | None = None
        if not self._woken:
            self._sleeper = asyncio.get_running_loop().create_future()
            clock.at(self._tick, self._sleeper)
            try:
                deadline = await self._sleeper
            finally:
                self._sleeper = None
        now = clock.time.now()
        if self._woken or deadline is None:
            # Early, for an utterance's first frame: the schedule moves to the tick
            # nearest one frame from now, and this frame is not counted as jitter.
            self._woken = False
            self.stats.wakes += 1
            if frames > 1 and self._last_departure is not None:
                # Cut short in a DTX keep-alive's wait: the frames since the last one were covered too.
                self._keepalive(round((now - self._last_departure) / clock.frame_s) - 1)
            self._tick = clock.upcoming() + frame_ticks - 1
            self._depart(now, measured=False)
            return now
        lateness = now - deadline
        if frames > 1:
            # A DTX keep-alive between utterances: its timing is free and its interval
            # is many frames, so it is neither jitter nor late; it covers `frames`.
            behind = lateness > clock.stall_s
            self._tick = clock.upcoming() + frame_ticks - 1 if behind else self._tick + frame_ticks
            self._keepalive(frames)
            self._depart(now, measured=False)
            return now
        if lateness > clock.stall_s:
            # This track fell behind on its own: skip ahead rather than burst.
            self.stats.stalls += 1
            self._tick = clock.upcoming() + frame_ticks - 1
        elif clock.stalls != self._clock_stalls:
            # The whole loop fell behind and the clock re-anchored under this frame.
            self.stats.stalls += 1
            self._tick += frame_ticks
        else:
            if lateness > LATE_S:
                self.stats.late_frames += 1
            self._tick += frame_ticks
        self._depart(now, measured=True, lateness=max(0.0, lateness))
        return now

    def _keepalive(self, frames: int) -> None:
        if frames > 0:
            self.stats.keepalive_frames += frames
            if self.on_keepalive is not None:
                self.on_keepalive(frames)

    def _depart(self, now: float, measured: bool, lateness: float = 0.0) -> None:
        """A frame left at `now`; `measured`: its interval from the last one is pacer jitter."""
        self._clock_stalls = self.clock.stalls
        self.stats.frames += 1
        if self._last_departure is not None and measured:
            interval = now - self._last_departure
            self.stats.intervals.append(interval)
            if self.on_frame is not None:
                self.on_frame(interval, lateness)
        self._last_departure = now
