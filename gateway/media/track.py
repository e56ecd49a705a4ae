"""The outbound speech track: pre-encoded packets, paced by the shared frame clock.

aiortc's sender awaits `recv()` in a loop and sends what it gets. Returning an
`av.Packet` with `pts` and `time_base` set makes it pack the payload as is, so
no encoding happens on this path: the track only waits for the next tick and
hands over the next frame from the playout buffer.

With DTX on, a track with nothing to say sends one silent packet every
`KEEPALIVE_FRAMES` frames instead of one every frame. Its RTP timestamps keep
counting every frame, so a receiver sees a gap of silence, which is what Opus
DTX is; the next utterance wakes the track at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from fractions import Fraction

import av
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from .frames import FRAME_S, frame_samples
from .pacer import Pacer
from .playout import Playout

KEEPALIVE_FRAMES = 20  # 400 ms, as libopus's own DTX


class SpeechTrack(MediaStreamTrack):
    """One session's outbound audio: a frame from its playout on each of its pacer's ticks."""

    kind = "audio"

    def __init__(self, playout: Playout, *, clock_rate: int = 48000, pacer: Pacer | None = None, dtx: bool = False) -> None:
        super().__init__()
        self.playout = playout
        self.pacer = pacer or Pacer()
        self.dtx = dtx
        self.set_clock_rate(clock_rate)
        self._pts = 0
        self._last: float | None = None
        self.on_departure: Callable[[float], None] | None = None  # (departure_time) after each frame
        playout.on_ready = self.pacer.wake

    def set_clock_rate(self, clock_rate: int) -> None:
        """Set once the codec is negotiated: 48000 for Opus, 8000 for G.711."""
        self.clock_rate = clock_rate
        self._time_base = Fraction(1, clock_rate)
        self._samples_per_frame = frame_samples(clock_rate)

    async def next_payload(self) -> tuple[bytes, int]:
        """The next frame's payload and its RTP time (in samples from the first frame), when due."""
        if self.readyState != "live":
            raise MediaStreamError
        idle = self.dtx and self.playout.idle
        now = await self.pacer.wait(KEEPALIVE_FRAMES if idle else 1)
        if self._last is not None:
            # Frames skipped while idle still count on the RTP clock.
            self._pts += self._samples_per_frame * max(1, round((now - self._last) / FRAME_S))
        self._last = now
        sent_at = time.perf_counter()  # the clock the session's timings use
        payload = self.playout.next_frame(sent_at)
        if self.on_departure is not None:
            self.on_departure(sent_at)
        return payload, self._pts

    async def recv(self) -> av.Packet:
        """For aiortc's own sender loop (`--rtp-sender aiortc`): the payload as a packet it packs as is."""
        payload, pts = await self.next_payload()
        packet = av.Packet(payload)
        packet.pts = pts
        packet.time_base = self._time_base
        return packet


IDLE_CHECK_S = 0.1


class SilentOutput:
    """The output of a session without an audio track (data channel only).

    Nobody listens, but utterances still play out in real time: frames leave
    the playout on the 20 ms clock and are dropped, so `audio.started`,
    `utterance.done` and `played_text` after a cancel mean what they mean for a
    listener, synthesis runs no faster than speech, and nothing is encoded.
    Between utterances it sleeps until one is ready.
    """

    def __init__(self, playout: Playout, *, pacer: Pacer | None = None) -> None:
        self.playout = playout
        self.pacer = pacer or Pacer()
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        playout.on_ready = self._on_ready

    def _on_ready(self) -> None:
        self._ready.set()
        self.pacer.wake()

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        try:
            while True:
                if self.playout.current is None:
                    self._ready.clear()
                    try:
                        # Woken when audio is ready; the timeout also notices an
                        # utterance queued with nothing to say, which must still end.
                        await asyncio.wait_for(self._ready.wait(), IDLE_CHECK_S)
                    except asyncio.TimeoutError:
                        pass
                    if self.playout.current is None:
                        continue
                    self.pacer = Pacer()  # a fresh clock: no catching up on the idle time
                await self.pacer.wait()
                self.playout.next_frame(time.perf_counter())
        except asyncio.CancelledError:
            pass
