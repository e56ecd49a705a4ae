"""Issue 53, finding 4: a WebRTC microphone bounded at real time plus a margin, in packets and in RTP time.

Before the fix, 4,000 packets a second of 20 ms Opus were each decoded (99 %
CPU), and tiny packets each a second ahead in RTP time made 50 frames of
silence each for the VAD. Here the packets reach the microphone as aiortc's
receiver would hand them over, on a clock the test moves: a flood gets about
real time through, dropped packets are never decoded, and a real microphone,
even one a network held back for a while, loses nothing.
"""

from __future__ import annotations

import numpy as np
from aiortc.rtp import RtpPacket

from voxgate.gateway.media import opus
from voxgate.gateway.caller.mic import MEDIA_BURST_MS, MEDIA_MARGIN, Microphone

PT = 111
SSRC = 53


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Receiver:
    async def _handle_rtp_packet(self, packet, arrival_time_ms: int) -> None:  # pragma: no cover - replaced
        raise AssertionError("replaced by the microphone's")


class Heard:
    def __init__(self) -> None:
        self.frames = 0  # decoded and silent frames the VAD would get
        self.drops: dict[str, int] = {}

    def audio(self, pcm: np.ndarray, capture_ms: float) -> None:
        self.frames += len(pcm) // 320

    def gap(self, frames: int, level_db: float | None = None) -> None:
        self.frames += frames

    def drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1


def microphone(clock: Clock, heard: Heard) -> tuple[Microphone, object]:
    mic = Microphone("opus", PT, heard.audio, heard.gap, lambda: True, on_drop=heard.drop, now=clock, ssrc=SSRC)
    receiver = Receiver()
    mic.attach(receiver)
    return mic, receiver._handle_rtp_packet


def packet(payload: bytes, seq: int, ts: int) -> RtpPacket:
    p = RtpPacket(payload_type=PT, sequence_number=seq & 0xFFFF, timestamp=ts & 0xFFFFFFFF, ssrc=SSRC)
    p.payload = payload
    return p


PAYLOAD = opus.Encoder(48000, 32000, 5, False, 0, False).encode(np.full(960, 3000, dtype=np.int16))[0]


def allowed_frames(seconds: float) -> int:
    """Frames of RTP time the microphone may take in `seconds`: its burst, then real time plus the margin."""
    return int((MEDIA_BURST_MS + seconds * 1000.0 * (1 + MEDIA_MARGIN)) / 20) + 1


async def test_a_packet_flood_gets_real_time_through_and_the_rest_is_not_decoded():
    clock, heard = Clock(), Heard()
    mic, handle = microphone(clock, heard)
    for i in range(8000):  # 4,000 packets a second of 20 ms Opus, for 2 s
        clock.t += 1 / 4000
        await handle(packet(PAYLOAD, i, 960 * i), 0)
    assert mic.decoded <= allowed_frames(2.0) and heard.frames <= allowed_frames(2.0)
    assert mic.decoded >= 2.0 * 50  # real time at least
    assert sum(heard.drops.values()) == 8000 - mic.decoded and set(heard.drops) <= {"packet_rate", "media_rate"}


async def test_packets_jumping_ahead_in_rtp_time_make_no_more_silence_than_real_time():
    clock, heard = Clock(), Heard()
    mic, handle = microphone(clock, heard)
    for i in range(4000):  # 2,000 a second, each a second ahead of the last, for 2 s
        clock.t += 1 / 2000
        await handle(packet(PAYLOAD, i, 48000 * i), 0)
    assert heard.frames <= allowed_frames(2.0)
    assert heard.drops.get("media_rate", 0) + heard.drops.get("packet_rate", 0) >= 4000 - 10


async def test_a_real_microphone_held_back_by_the_network_loses_nothing():
    clock, heard = Clock(), Heard()
    mic, handle = microphone(clock, heard)
    seq = 0
    for second in range(10):
        if second == 4:  # the network holds 2.5 s of packets, then delivers them at once
            clock.t += 2.5
            for _ in range(125):
                await handle(packet(PAYLOAD, seq, 960 * seq), 0)
                seq += 1
            continue
        for _ in range(50):
            clock.t += 0.02
            await handle(packet(PAYLOAD, seq, 960 * seq), 0)
            seq += 1
    # A DTX silence: a packet every 400 ms, the gaps heard as silence.
    for _ in range(20):
        clock.t += 0.4
        seq += 20
        await handle(packet(PAYLOAD, seq, 960 * seq), 0)
    assert heard.drops == {} and mic.decoded == 575 + 20 and heard.frames == 595 + 20 + 19 * 19
