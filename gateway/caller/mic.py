"""The peer's microphone, read for barge-in and for backends: RTP straight to 16 kHz mono.

aiortc would decode every inbound Opus packet to 48 kHz stereo in a thread of
its own and hand each frame back to the event loop, after which the VAD needs
16 kHz mono anyway. Here the receiver's packets are taken as they arrive, on
the event loop, and libopus decodes them straight to 16 kHz mono: a third of
the samples of one channel instead of two, and no thread hop per frame.
Nothing at all is decoded while nobody listens: the session's VAD off and no
backend taking the caller's audio (caller_audio.py).

The browser is asked for DTX (`usedtx=1` in the answer), so a silent
microphone sends a packet every 400 ms instead of every 20 ms; the gaps in
RTP time reach the VAD as silence without being decoded.

Browsers also put the level of each packet's audio in its RTP header (RFC
6464, `ssrc-audio-level`, which aiortc negotiates). A packet quieter than
`QUIET_DBOV` that the sender does not flag as voice is silence for barge-in
whatever the VAD's noise floor, so it reaches the VAD as silence (its length
read from its header) without being decoded: the energy gate, before the
decoder. The level is the peer's own word about its own microphone, so a peer
that misstates it can only mute its own barge-in. While a backend takes the
caller's audio, every packet is decoded, quiet or not. A quiet microphone without DTX then costs the packet's
arrival and nothing more. Packets without the level are decoded as before.

This reads aiortc's receiver one step below its public API: the RTP packet
handler of `RTCRtpReceiver`, which the DTLS transport calls for each packet.
aiortc's own decoding of this track is not used at all, so nothing queues up
there either.

One step further down, each microphone datagram is taken as aioice hands it
over (`Connection.data_received`), SRTP-unprotected with the DTLS transport's
session and read here, in the same call: aiortc would queue it on an
asyncio.Queue, wake its receive task, read the clock through `datetime` and
parse the whole packet into objects first, which was most of a microphone's
cost per packet. Everything else (DTLS, the data channel, RTCP) still goes to
aiortc's queue. Where this aiortc or aioice lacks what that reads, packets
take aiortc's path as before, and the log says so. Every private name these
paths read is in rtc_internals.py.

What a peer may make the microphone do is bounded before anything is decoded
(issue 53). Only the SSRCs its session admits reach SRTP at all (ssrcs.py,
--max-ssrcs), and the microphone is one of them: the one the offer names first,
or else the first heard; packets from the others are not read. Then at most --mic-max-packets-per-s packets a second are read
(a token bucket, MEDIA_BURST_MS's worth of burst), and at most real time plus
`MEDIA_MARGIN` of RTP time, with `MEDIA_BURST_MS` of burst: a packet costs the
RTP time it moves the stream on, its own length and the jump ahead of it
(which becomes frames of silence, up to MAX_GAP_FRAMES). A packet past either
is dropped unread and counted (`voxgate_mic_dropped_total`): a peer sending
faster than it speaks gets real time, and costs about what a real microphone does.
What is left, taking and dropping each datagram, is charged to the session's tenant, and
late-frame admission closes the session when that is what made frames late (mic_charge.py).
"""

from __future__ import annotations

import logging
import math
import struct
import time
from typing import Callable, NamedTuple

import numpy as np

from ..media import opus, rtc_internals
from ..media.clock import CaptureClock, SessionClock
from ..media.encoder import alaw_decode, ulaw_decode
from ..media.frames import FRAME_MS
from ..media.resample import Upsampler2x
from ..media.ssrcs import SsrcLimit
from .vad import VAD_RATE
from ...config import Settings

log = logging.getLogger(__name__)

RTP_CLOCK = {"opus": 48000, "pcmu": 8000, "pcma": 8000}
# How much later than the sound a decoded sample comes out, in ms: Opus's look-ahead in a
# browser's encoder (312 samples at 48 kHz, libopus's VoIP and audio applications), or the upsampler's.
DECODE_DELAY_MS = {"opus": 6.5, "pcmu": Upsampler2x.DELAY_S * 1000.0, "pcma": Upsampler2x.DELAY_S * 1000.0}
MAX_GAP_FRAMES = 50  # a longer silence than 1 s tells the VAD nothing more
# RTP time a microphone may move on faster than real time, as a share of it, and in a burst (ms): a
# network (or a client's loop) that held packets back delivers them late and at once, and five
# seconds of them are still heard. What a flood gets is the rate: the burst is spent once. It holds
# the dearest single packet (a 1 s jump, then 120 ms of Opus), so that one is always heard in the end.
MEDIA_MARGIN = 0.25
MEDIA_BURST_MS = 5000.0
# RFC 6464 levels are -dBov: 127 is silence. Nobody barges in quieter than -55 dBov
# (speech into a headset or laptop microphone sits around -15 to -40).
QUIET_DBOV = 55
# 0 dBov on the VAD's scale (20 log10 of the int16 RMS): a level L in the header is FULL_SCALE_DB - L.
FULL_SCALE_DB = 20 * math.log10(32767)


MAX_SRTP_BYTES = rtc_internals.MAX_SRTP_BYTES


class RtpFields(NamedTuple):
    payload_type: int
    timestamp: int
    payload: bytes
    extension: tuple[int, bytes] | None  # (profile, the extension block's data)


def parse_rtp(data: bytes) -> RtpFields | None:
    """What the microphone reads from a plain RTP packet (RFC 3550), or None where
    aiortc's `RtpPacket.parse` would refuse it."""
    if len(data) < 12 or data[0] >> 6 != 2:
        return None
    first = data[0]
    pos = 12 + 4 * (first & 0x0F)  # past the CSRCs
    extension = None
    if first & 0x10:
        if len(data) < pos + 4:
            return None
        profile, words = struct.unpack_from("!HH", data, pos)
        end = pos + 4 + 4 * words
        if len(data) < end:
            return None
        extension = (profile, data[pos + 4 : end])
        pos = end
    end = len(data)
    if first & 0x20:  # padding: its length is the last byte
        padding = data[-1]
        if padding == 0 or padding > end - pos:
            return None
        end -= padding
    if pos > end:
        return None
    return RtpFields(data[1] & 0x7F, int.from_bytes(data[4:8], "big"), data[pos:end], extension)


def level_reader(extensions_map) -> Callable[[int, bytes], tuple[bool, int] | None]:
    """Reads a packet's RFC 6464 audio level from its header-extension block: (voice, -dBov) or None.

    aiortc's `HeaderExtensionsMap.get` unpacks every element into a new object for
    each packet; this walks the block for the one element the microphone reads,
    under the id negotiated for it, which aiortc's map holds (read on every packet,
    as the map is configured only once the connection is up). It refuses what
    aiortc refuses about the block's layout and the level's own length; other
    elements' contents are not read. Where this aiortc keeps the ids elsewhere,
    its own `get` reads the level.
    """
    ids = rtc_internals.extension_ids(extensions_map)
    if ids is None:
        log.warning("this aiortc keeps its header-extension ids elsewhere: each packet's audio level is read by aiortc's map")
        return lambda profile, block: extensions_map.get(profile, block).audio_level

    def read(profile: int, block: bytes) -> tuple[bool, int] | None:
        wanted = ids.audio_level
        level = None
        pos, end = 0, len(block)
        if profile == 0xBEDE:  # one-byte elements: id in the high nibble, length - 1 in the low
            while pos < end:
                head = block[pos]
                pos += 1
                if head == 0:
                    continue  # padding
                length = (head & 0x0F) + 1
                if pos + length > end:
                    raise ValueError("RTP one-byte header extension value is truncated")
                if head >> 4 == wanted:
                    level = _level(block, pos, length)
                pos += length
        elif profile == 0x1000:  # two-byte elements: id byte, length byte
            while pos < end:
                if block[pos] == 0:
                    pos += 1
                    continue
                if pos + 2 > end:
                    raise ValueError("RTP two-byte header extension is truncated")
                element, length = block[pos], block[pos + 1]
                pos += 2
                if pos + length > end:
                    raise ValueError("RTP two-byte header extension value is truncated")
                if element == wanted:
                    level = _level(block, pos, length)
                pos += length
        return level  # the last one, as aiortc

    return read


def _level(block: bytes, pos: int, length: int) -> tuple[bool, int]:
    if length != 1:
        raise ValueError("an audio level is one byte")
    value = block[pos]
    return (value & 0x80 == 0x80, value & 0x7F)


class Allowance:
    """A token bucket: `rate` a second, holding at most `burst`, read on `now` (seconds)."""

    def __init__(self, rate: float, burst: float, now: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self.left = burst
        self.now = now
        self._at = now()

    def take(self, amount: float = 1.0) -> bool:
        """Spend `amount` if that much is left; False, spending nothing, if not."""
        now = self.now()
        self.left = min(self.burst, self.left + (now - self._at) * self.rate)
        self._at = now
        if amount > self.left:
            return False
        self.left -= amount
        return True


class Microphone:
    """Decodes one peer's microphone packets for `on_audio(pcm, capture_ms)` (16 kHz mono int16,
    and when its first sample was captured, on `clock`: see clock.py).

    `on_gap(frames, level_db)` hears about frames that never came (DTX, loss;
    level None) or were quiet by their own level, so the VAD counts them as
    silence; `wanted()` says whether anyone listens at all, and `whole()`
    whether every packet must be decoded, quiet ones too (a backend takes the audio).
    `on_drop(reason)` hears of each packet dropped by a bound: `packet_rate`, `media_rate`
    (and `ssrc`, from `ssrcs`, the session's: see ssrcs.py). `timed` wraps the datagram
    handler to charge its CPU time, dropped datagrams' too (mic_charge.py).
    """

    def __init__(
        self,
        codec: str,
        payload_type: int,
        on_audio: Callable[[np.ndarray, float], None],
        on_gap: Callable[..., None],
        wanted: Callable[[], bool],
        *,
        whole: Callable[[], bool] = lambda: False,
        clock: SessionClock | None = None,
        max_packets_per_s: float = Settings.mic_max_packets_per_s,
        ssrcs: SsrcLimit | None = None,
        on_drop: Callable[[str], None] = lambda reason: None,
        now: Callable[[], float] = time.monotonic,
        ssrc: int | None = None,
        timed: Callable[[Callable[[bytes, int], None]], Callable[[bytes, int], None]] | None = None,
    ) -> None:
        self.codec = codec
        self.payload_type = payload_type
        self.on_audio = on_audio
        self.on_gap = on_gap
        self.wanted = wanted
        self.whole = whole
        self.capture = CaptureClock(clock or SessionClock(), RTP_CLOCK[codec])
        self.frame_ticks = RTP_CLOCK[codec] * FRAME_MS // 1000
        self.packets = 0
        self.decoded = 0
        self.gated = 0  # quiet by the packet's own level: silence, not decoded
        self.direct = False  # datagrams taken from aioice, not packets from aiortc
        self.failures = 0
        self.dropped = 0  # packets past a bound, not read
        self.receiver: object = None  # the aiortc receiver attached to
        self.on_drop = on_drop
        self.ssrcs = ssrcs or SsrcLimit(Settings.max_ssrcs)
        self.timed = timed  # charges each datagram's CPU time to the session's tenant (mic_charge.py)
        # The microphone's own stream: the offer's first SSRC, else the first one heard.
        self.ssrc: int | None = ssrc
        # The same burst as RTP time's: a client that fell behind catches up with packets and RTP time alike.
        self._packet_rate = Allowance(max_packets_per_s, max_packets_per_s * MEDIA_BURST_MS / 1000.0, now)
        self._media_ms = Allowance(1000.0 * (1.0 + MEDIA_MARGIN), MEDIA_BURST_MS, now)
        self._next_ts: int | None = None  # RTP time the next packet should carry
        if codec == "opus":
            self._decoder: opus.Decoder | None = opus.Decoder(VAD_RATE)
            self._upsampler: Upsampler2x | None = None
        else:
            self._decoder = None
            self._law = ulaw_decode if codec == "pcmu" else alaw_decode
            self._upsampler = Upsampler2x()
        self._decode_delay_ms = DECODE_DELAY_MS[codec]

    def attach(self, receiver) -> None:
        """Take the receiver's RTP packets from now on: as datagrams where this aiortc allows,
        and from aiortc's packet handler for whatever still reaches it."""
        self.receiver = receiver
        rtc_internals.replace_rtp_handler(receiver, self._on_rtp)
        self.direct = self._take_datagrams(rtc_internals.receiver_dtls(receiver))

    def _take_datagrams(self, dtls) -> bool:
        extensions = rtc_internals.header_extensions_map(dtls)
        if extensions is None:
            log.warning("this aiortc's DTLS transport has no header-extension map: the microphone takes aiortc's path")
            return False
        read_level = level_reader(extensions)

        def on_rtp(plain: bytes) -> None:
            # Called from asyncio's datagram callback: nothing a peer sends may raise out of
            # here (the loop would log a traceback per datagram for every session to pay for).
            if not self._ours(int.from_bytes(plain[8:12], "big")):
                return
            if not self._packet_rate.take():
                self._drop("packet_rate")
                return
            fields = parse_rtp(plain)
            if fields is None:
                return
            try:
                level = read_level(*fields.extension) if fields.extension else None
            except (ValueError, IndexError, struct.error, UnicodeDecodeError):
                return  # a malformed header extension: aiortc's parse drops the packet too
            try:
                self._on_packet(fields.payload_type, fields.timestamp, fields.payload, level)
            except Exception:
                self.failures += 1
                if self.failures == 1:
                    log.exception("microphone packet handling failed (logged once per session)")

        if not rtc_internals.take_srtp_datagrams(dtls, on_rtp, self.ssrcs, self.timed):
            log.warning("this aiortc's transports lack what the direct microphone path reads; using aiortc's")
            return False
        return True

    def _ours(self, ssrc: int) -> bool:
        """Whether a packet is from the microphone's stream (the first heard is, when the offer named none)."""
        if self.ssrc is None:
            self.ssrc = ssrc
        elif ssrc != self.ssrc:
            self._drop("ssrc")
            return False
        return True

    def _drop(self, reason: str) -> None:
        self.dropped += 1
        self.on_drop(reason)

    def _ticks(self, payload: bytes) -> int:
        """The packet's length on the RTP clock, without decoding it."""
        if self._decoder is not None:
            return opus.packet_samples(payload, RTP_CLOCK["opus"])
        return len(payload)  # G.711: one byte a sample at 8 kHz

    async def _on_rtp(self, packet, arrival_time_ms: int = 0) -> None:
        """aiortc's path: a parsed `RtpPacket`."""
        if not self._ours(packet.ssrc):
            return
        if not self._packet_rate.take():
            self._drop("packet_rate")
            return
        self._on_packet(packet.payload_type, packet.timestamp, packet.payload, packet.extensions.audio_level)

    def _on_packet(self, payload_type: int, ts: int, payload: bytes, level: tuple[bool, int] | None) -> None:
        """One microphone packet; `level`: its RFC 6464 (voice flag, -dBov), if it carries one."""
        if payload_type != self.payload_type or not payload:
            return  # comfort noise, DTMF events, padding
        self.packets += 1
        if not self.wanted():
            self._next_ts = None
            return
        gap = 0
        if self._next_ts is not None:
            ahead = (ts - self._next_ts) & 0xFFFFFFFF
            if ahead >= 0x80000000:
                return  # a duplicate, or older than what was already heard: too late for the VAD
            gap = min(ahead // self.frame_ticks, MAX_GAP_FRAMES)
        try:
            ticks = self._ticks(payload)  # read from the packet's header, not decoded
        except (opus.OpusError, ValueError):
            return
        # What this packet moves the stream on: the silence it jumps over, then its own length.
        if not self._media_ms.take(gap * FRAME_MS + ticks * 1000.0 / self.capture.rate):
            self._drop("media_rate")
            return
        if gap:
            self.on_gap(gap)
        if level is not None and not level[0] and level[1] >= QUIET_DBOV and not self.whole():
            self.gated += 1
            self._next_ts = (ts + ticks) & 0xFFFFFFFF
            self.on_gap(max(1, round(ticks / self.frame_ticks)), FULL_SCALE_DB - level[1])
            return
        try:
            if self._decoder is not None:
                pcm = self._decoder.decode(payload)
                ticks = len(pcm) * RTP_CLOCK["opus"] // VAD_RATE  # 20, 40 or 60 ms a packet
            else:
                assert self._upsampler is not None
                pcm = self._upsampler.process(self._law(payload))
                ticks = self._ticks(payload)
        except (opus.OpusError, ValueError) as exc:
            log.debug("microphone packet not decoded: %s", exc)
            return
        self.decoded += 1
        self._next_ts = (ts + ticks) & 0xFFFFFFFF  # the next packet follows this one's last sample
        self.on_audio(pcm, self.capture.end_ms(self._next_ts) - len(pcm) * 1000.0 / VAD_RATE - self._decode_delay_ms)
