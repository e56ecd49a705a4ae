"""The session's clock, and where the caller's audio falls on it.

Every time a session reports (`at_ms` on speech.started, speech.stopped,
audio.started and utterance.interrupted; the capture time of each frame of the
caller's audio; a transcript's `start_ms` and `end_ms`) is in milliseconds
since the session was made, on the process's monotonic clock. A backend can
then line up what the caller said with what the bot was saying at that moment.

The gateway cannot read the caller's clock, only its media clock (RTP
timestamps, or a count of samples for a phone call) and when each packet
arrived. `CaptureClock` places the media clock on the session's by the packet
that came fastest: that one is taken to have left the moment its last sample
was captured, and every other packet keeps its distance from it in media
time. Network jitter and late bursts then change nothing, and a capture time
is never later than the packet's arrival. So that a caller's clock that runs
slower than ours does not drift away, the placement creeps later by at most
`CREEP` until a packet pulls it back.
"""

from __future__ import annotations

import time

# How fast the placement may creep later, in ms per ms: 500 ppm, above the skew of any
# working sound card or phone network clock (those stay within about 100 ppm).
CREEP = 0.0005


class SessionClock:
    """Milliseconds since the session was made (time.perf_counter, CLOCK_MONOTONIC on Linux)."""

    def __init__(self, origin: float | None = None) -> None:
        self.origin = time.perf_counter() if origin is None else origin

    def ms(self, at: float | None = None) -> float:
        """The session time of `at` (a perf_counter value; now when None)."""
        return ((time.perf_counter() if at is None else at) - self.origin) * 1000.0

    def at_ms(self, at: float | None = None) -> int:
        """The same, as the whole milliseconds events carry."""
        return int(self.ms(at))


class CaptureClock:
    """Places a sender's media clock (`rate` ticks a second, wrapping at `wrap`) on a SessionClock."""

    def __init__(self, clock: SessionClock, rate: int, wrap: int = 1 << 32) -> None:
        self.clock = clock
        self.rate = rate
        self.wrap = wrap
        self._last_tick: int | None = None  # the last media tick seen, as sent (wrapped)
        self._unwrapped = 0  # the same, unwrapped
        self._offset: float | None = None  # session ms minus media ms, from the fastest packet
        self._placed_at = 0.0  # session ms when _offset was last set

    def end_ms(self, end_tick: int, now_ms: float | None = None) -> float:
        """When the media up to `end_tick` (the tick after a packet's last sample) was captured,
        in session ms, given that the packet arrived at `now_ms` (now when None)."""
        now = self.clock.ms() if now_ms is None else now_ms
        if self._last_tick is None:
            self._unwrapped = end_tick
        else:
            step = (end_tick - self._last_tick) % self.wrap
            if step >= self.wrap // 2:
                step -= self.wrap  # older than the last packet: reordered
            self._unwrapped += step
        self._last_tick = end_tick
        media_ms = self._unwrapped * 1000.0 / self.rate
        seen = now - media_ms
        if self._offset is None:
            self._offset = seen
        else:
            self._offset = min(self._offset + CREEP * max(0.0, now - self._placed_at), seen)
        self._placed_at = now
        return self._offset + media_ms
