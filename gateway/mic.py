"""The peer's microphone, read for barge-in: RTP straight to 16 kHz mono for the VAD.

aiortc would decode every inbound Opus packet to 48 kHz stereo in a thread of
its own and hand each frame back to the event loop, after which the VAD needs
16 kHz mono anyway. Here the receiver's packets are taken as they arrive, on
the event loop, and libopus decodes them straight to 16 kHz mono: a third of
the samples of one channel instead of two, and no thread hop per frame.
Nothing at all is decoded while the session's VAD is off.

The browser is asked for DTX (`usedtx=1` in the answer), so a silent
microphone sends a packet every 400 ms instead of every 20 ms; the gaps in
RTP time reach the VAD as silence without being decoded.

Browsers also put the level of each packet's audio in its RTP header (RFC
6464, `ssrc-audio-level`, which aiortc negotiates). A packet quieter than
`QUIET_DBOV` that the sender does not flag as voice is silence for barge-in
whatever the VAD's noise floor, so it reaches the VAD as silence (its length
read from its header) without being decoded: the energy gate, before the
decoder. The level is the peer's own word about its own microphone, so a peer
that misstates it can only mute its own barge-in. A quiet microphone without DTX then costs the packet's
arrival and nothing more. Packets without the level are decoded as before.

This reads aiortc's receiver one step below its public API: the RTP packet
handler of `RTCRtpReceiver`, which the DTLS transport calls for each packet.
aiortc's own decoding of this track is not used at all, so nothing queues up
there either.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import numpy as np

from . import opus
from .encoder import alaw_decode, ulaw_decode
from .frames import FRAME_MS
from .resample import StreamResampler
from .vad import VAD_RATE

log = logging.getLogger(__name__)

RTP_CLOCK = {"opus": 48000, "pcmu": 8000, "pcma": 8000}
MAX_GAP_FRAMES = 50  # a longer silence than 1 s tells the VAD nothing more
# RFC 6464 levels are -dBov: 127 is silence. Nobody barges in quieter than -55 dBov
# (speech into a headset or laptop microphone sits around -15 to -40).
QUIET_DBOV = 55
# 0 dBov on the VAD's scale (20 log10 of the int16 RMS): a level L in the header is FULL_SCALE_DB - L.
FULL_SCALE_DB = 20 * math.log10(32767)


class Microphone:
    """Decodes one peer's microphone packets for `on_audio` (16 kHz mono int16).

    `on_gap(frames, level_db)` hears about frames that never came (DTX, loss;
    level None) or were quiet by their own level, so the VAD counts them as
    silence; `wanted()` says whether anyone listens at all.
    """

    def __init__(
        self,
        codec: str,
        payload_type: int,
        on_audio: Callable[[np.ndarray], None],
        on_gap: Callable[..., None],
        wanted: Callable[[], bool],
    ) -> None:
        self.codec = codec
        self.payload_type = payload_type
        self.on_audio = on_audio
        self.on_gap = on_gap
        self.wanted = wanted
        self.frame_ticks = RTP_CLOCK[codec] * FRAME_MS // 1000
        self.packets = 0
        self.decoded = 0
        self.gated = 0  # quiet by the packet's own level: silence, not decoded
        self._next_ts: int | None = None  # RTP time the next packet should carry
        if codec == "opus":
            self._decoder: opus.Decoder | None = opus.Decoder(VAD_RATE)
            self._resampler: StreamResampler | None = None
        else:
            self._decoder = None
            self._law = ulaw_decode if codec == "pcmu" else alaw_decode
            self._resampler = StreamResampler(8000, VAD_RATE)

    def attach(self, receiver) -> None:
        """Take the receiver's RTP packets from now on."""
        receiver._handle_rtp_packet = self._on_rtp

    def _ticks(self, payload: bytes) -> int:
        """The packet's length on the RTP clock, without decoding it."""
        if self._decoder is not None:
            return opus.packet_samples(payload, RTP_CLOCK["opus"])
        return len(payload)  # G.711: one byte a sample at 8 kHz

    async def _on_rtp(self, packet, arrival_time_ms: int = 0) -> None:
        if packet.payload_type != self.payload_type or not packet.payload:
            return  # comfort noise, DTMF events, padding
        self.packets += 1
        if not self.wanted():
            self._next_ts = None
            return
        ts = packet.timestamp
        if self._next_ts is not None:
            ahead = (ts - self._next_ts) & 0xFFFFFFFF
            if ahead >= 0x80000000:
                return  # a duplicate, or older than what was already heard: too late for the VAD
            if ahead >= self.frame_ticks:
                self.on_gap(min(ahead // self.frame_ticks, MAX_GAP_FRAMES))
        level = packet.extensions.audio_level  # (the sender's voice flag, -dBov) or None
        if level is not None and not level[0] and level[1] >= QUIET_DBOV:
            try:
                ticks = self._ticks(packet.payload)
            except (opus.OpusError, ValueError):
                return
            self.gated += 1
            self._next_ts = (ts + ticks) & 0xFFFFFFFF
            self.on_gap(max(1, round(ticks / self.frame_ticks)), FULL_SCALE_DB - level[1])
            return
        try:
            if self._decoder is not None:
                pcm = self._decoder.decode(packet.payload)
                ticks = len(pcm) * RTP_CLOCK["opus"] // VAD_RATE  # 20, 40 or 60 ms a packet
            else:
                assert self._resampler is not None
                pcm = self._resampler.process(self._law(packet.payload))
                ticks = self._ticks(packet.payload)
        except (opus.OpusError, ValueError) as exc:
            log.debug("microphone packet not decoded: %s", exc)
            return
        self.decoded += 1
        self._next_ts = (ts + ticks) & 0xFFFFFFFF  # the next packet follows this one's last sample
        self.on_audio(pcm)
