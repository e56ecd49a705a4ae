"""Frame timing for outbound audio: an absolute schedule on the monotonic clock.

Each frame is due exactly one frame after the previous one's deadline, so
sleeping never accumulates drift. If the event loop stalls past a few frames,
the schedule is re-anchored at the present instead of firing a catch-up
burst, which a receiver's jitter buffer would have to absorb.

Between utterances the frames are silence, so their timing is free: when a
new utterance's first audio is ready, `wake()` sends it at once and the
schedule continues from there, instead of the audio waiting up to a frame
for the next tick. One frame leaves early; nothing is sent twice or bunched.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field

FRAME_S = 0.020


@dataclass
class PacerStats:
    frames: int = 0
    late_frames: int = 0  # sent more than `late_s` after their deadline
    stalls: int = 0  # re-anchored after the loop fell behind
    wakes: int = 0  # re-anchored early for an utterance's first frame
    # Recent inter-departure intervals in seconds, for jitter figures.
    intervals: deque = field(default_factory=lambda: deque(maxlen=3000))

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


class MonotonicClock:
    """The pacer's time source: the monotonic clock and the event loop's timers.

    Tests pass a clock of their own, so the schedule can be checked frame by
    frame without depending on how busy the machine is.
    """

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, delay: float, woken: asyncio.Future) -> None:
        """Return after `delay` seconds, or as soon as `woken` is resolved."""
        timer = asyncio.get_running_loop().call_later(delay, _resolve, woken)
        try:
            await woken
        finally:
            timer.cancel()


class Pacer:
    """Says when each outbound frame leaves: every `frame_s` on an absolute schedule."""

    def __init__(
        self,
        frame_s: float = FRAME_S,
        stall_frames: int = 3,
        late_s: float = 0.005,
        clock: MonotonicClock | None = None,
    ) -> None:
        self.frame_s = frame_s
        self.stall_s = stall_frames * frame_s
        self.late_s = late_s
        self.clock = clock or MonotonicClock()
        self.stats = PacerStats()
        self._deadline: float | None = None
        self._last_departure: float | None = None
        self._sleeper: asyncio.Future | None = None
        self._woken = False
        self.on_frame = None  # optional callable(interval_s, late_s) for metrics

    def wake(self) -> None:
        """Send the next frame now rather than at its tick (only while idle between utterances)."""
        self._woken = True
        if self._sleeper is not None and not self._sleeper.done():
            self._sleeper.set_result(None)

    async def wait(self) -> float:
        """Sleep until the next frame is due; returns the departure time."""
        now = self.clock.now()
        if self._deadline is None:
            self._deadline = now
        delay = self._deadline - now
        woken = False
        if delay > 0 and not self._woken:
            self._sleeper = asyncio.get_running_loop().create_future()
            try:
                await self.clock.sleep(delay, self._sleeper)
            finally:
                self._sleeper = None
            now = self.clock.now()
        if self._woken:
            self._woken = False
            if delay > 0:
                woken = True
                self._deadline = now
                self.stats.wakes += 1
        lateness = now - self._deadline
        if lateness > self.stall_s:
            self.stats.stalls += 1
            self._deadline = now
            lateness = 0.0
        elif lateness > self.late_s:
            self.stats.late_frames += 1
        self.stats.frames += 1
        if self._last_departure is not None and not woken:
            interval = now - self._last_departure
            self.stats.intervals.append(interval)
            if self.on_frame is not None:
                self.on_frame(interval, lateness)
        self._last_departure = now
        self._deadline += self.frame_s
        return now


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
