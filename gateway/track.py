"""The outbound speech track: pre-encoded packets, paced on the monotonic clock.

aiortc's sender awaits `recv()` in a loop and sends what it gets. Returning an
`av.Packet` with `pts` and `time_base` set makes it pack the payload as is, so
no encoding happens on this path: the track only waits for the next deadline
and hands over the next frame from the playout buffer.
"""

from __future__ import annotations

import time
from fractions import Fraction

import av
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from .pacer import Pacer
from .playout import Playout


class SpeechTrack(MediaStreamTrack):
    kind = "audio"

    def __init__(self, playout: Playout, clock_rate: int = 48000, pacer: Pacer | None = None) -> None:
        super().__init__()
        self.playout = playout
        self.clock_rate = clock_rate
        self.pacer = pacer or Pacer()
        self._time_base = Fraction(1, clock_rate)
        self._samples_per_frame = clock_rate // 50
        self._pts = 0
        self.on_departure = None  # callable(departure_time) after each frame
        playout.on_ready = self.pacer.wake

    def set_clock_rate(self, clock_rate: int) -> None:
        """Set once the codec is negotiated: 48000 for Opus, 8000 for G.711."""
        self.clock_rate = clock_rate
        self._time_base = Fraction(1, clock_rate)
        self._samples_per_frame = clock_rate // 50

    async def recv(self) -> av.Packet:
        if self.readyState != "live":
            raise MediaStreamError
        await self.pacer.wait()
        now = time.perf_counter()
        payload = self.playout.next_frame(now)
        packet = av.Packet(payload)
        packet.pts = self._pts
        packet.time_base = self._time_base
        self._pts += self._samples_per_frame
        if self.on_departure is not None:
            self.on_departure(now)
        return packet
