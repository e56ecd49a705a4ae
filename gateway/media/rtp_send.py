"""The speech track's RTP packets, built and sent here instead of by aiortc's sender loop.

aiortc's `RTCRtpSender._run_rtp` handles any track: for each frame it awaits
`recv()`, converts the packet's time base with fractions, builds an `RtpPacket`
and a `HeaderExtensions` object, fills the extensions through a map,
serializes, reads the NTP clock twice through `datetime`, and hands the bytes
down through three coroutine layers. For one pre-encoded 20 ms payload that
was most of the event loop's cost per frame. Here the RTP header is made once
per sender as a template (the same bytes aiortc would write: version, payload
type, SSRC, the header extensions it negotiated: the mid, and abs-send-time
where negotiated, which aiortc does not do for audio), and each frame only
writes its sequence number, timestamp, marker and send time into it before
SRTP and the socket: `direct_wire` protects it and hands it to the nominated
pair's socket in one call, where aiortc and aioice pass it down four
coroutines.

This replaces one private method of the sender (`_run_rtp`) and keeps the
state aiortc's RTCP loop reads for its sender reports (packet and octet
counts, the last RTP and NTP timestamps), the way `mic.py` reads the receiver
one step below its public API; every private name it reads is in
rtc_internals.py. `install` checks that state exists; where it does not (an
aiortc release that renamed it), aiortc's own loop runs, and the track's
`recv()` serves it as before, with a warning. `--rtp-sender aiortc` chooses
that loop on purpose.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
from typing import TYPE_CHECKING

from aiortc.mediastreams import MediaStreamError

from . import rtc_internals
from .rtc_internals import HeaderExtensions, direct_wire, random_sequence_number

if TYPE_CHECKING:
    from .track import SpeechTrack

log = logging.getLogger(__name__)

NTP_EPOCH_OFFSET = 2208988800  # seconds from 1900 (NTP) to 1970 (Unix)
_FIXED = struct.Struct("!BBHLL")
_SEQ_TS = struct.Struct("!HL")
_ABS_PROBE = 0x123456
__all__ = ["RtpSender", "PacketWriter", "direct_wire", "header_template", "install", "ntp_now", "supported"]


def ntp_now() -> int:
    """The NTP time as aiortc's clock.current_ntp_time() computes it, without datetime objects."""
    return int((time.time() + NTP_EPOCH_OFFSET) * (1 << 32))


def supported(sender) -> bool:
    return rtc_internals.sender_supported(sender)


def install(sender, track: SpeechTrack) -> bool:
    """Send `track`'s payloads with `RtpSender` when `sender` starts; False: aiortc's loop stays."""
    if not supported(sender):
        log.warning("this aiortc's RTCRtpSender lacks the state the direct RTP sender keeps; using aiortc's loop")
        return False

    def run(codec):
        sender.voxgate_rtp = RtpSender(sender, track, codec)  # kept for its counters
        return sender.voxgate_rtp.run()

    # RTCRtpSender.send() starts this with the codec.
    rtc_internals.replace_rtp_loop(sender, run)
    return True


def header_template(extensions_map, mid: str | None) -> tuple[int, bytes, int | None]:
    """The header-extension block aiortc writes for this sender, and where the send time sits in it.

    Returns (profile, value, offset of the 3 abs-send-time bytes in value or None).
    """
    profile, with_zero = extensions_map.set(HeaderExtensions(mid=mid, abs_send_time=0))
    _, with_probe = extensions_map.set(HeaderExtensions(mid=mid, abs_send_time=_ABS_PROBE))
    # The field is where the two differ (a peer's mid may contain the probe's bytes).
    differ = [i for i, (a, b) in enumerate(zip(with_zero, with_probe)) if a != b]
    offset = differ[0] if differ else None  # None: no abs-send-time negotiated (aiortc's audio)
    if offset is not None and (len(with_zero) != len(with_probe) or differ[-1] - offset > 2):
        raise ValueError("unexpected abs-send-time header extension layout")
    return profile, with_zero, offset


class PacketWriter:
    """One sender's RTP packets from a header template: the bytes aiortc's serialize() writes
    for a one-payload frame (marker set), with the header extensions it negotiated."""

    def __init__(self, *, payload_type: int, ssrc: int, extensions_map, mid: str | None) -> None:
        profile, value, abs_at = header_template(extensions_map, mid)
        header = bytearray(_FIXED.pack(0x80 | (0x10 if value else 0), 0x80 | payload_type, 0, 0, ssrc))
        if value:
            header += struct.pack("!HH", profile, len(value) >> 2) + value
        # Past the fixed header and the extension block's own header.
        self._abs_at = None if abs_at is None else len(header) - len(value) + abs_at
        self._header = header

    def packet(self, payload: bytes, sequence: int, rtp_time: int, ntp: int) -> bytes:
        header = self._header
        _SEQ_TS.pack_into(header, 2, sequence, rtp_time)
        if self._abs_at is not None:
            at = self._abs_at
            header[at : at + 3] = ((ntp >> 14) & 0x00FFFFFF).to_bytes(3, "big")
        return bytes(header) + payload


class RtpSender:
    """One speech track's packets out: the writer, the counters aiortc's RTCP reads, SRTP and the socket."""

    def __init__(self, sender, track: SpeechTrack, codec) -> None:
        self.sender = sender
        self.track = track
        self.codec = codec
        self.sequence = random_sequence_number()  # the lower half, as aiortc: an early wrap breaks SRTP
        self.timestamp_origin = int.from_bytes(os.urandom(4), "big")
        self.packets = 0
        self.octets = 0
        self.direct_packets = 0  # of those, sent by direct_wire rather than aiortc's _send_rtp

    def _writer(self) -> PacketWriter:
        extensions_map, mid = rtc_internals.sender_header(self.sender)
        return PacketWriter(
            payload_type=self.codec.payloadType, ssrc=rtc_internals.sender_ssrc(self.sender),
            extensions_map=extensions_map, mid=mid,
        )

    async def run(self) -> None:
        """Until the track ends or the transport closes. Unlike aiortc's loop it does not follow
        replaceTrack, setTransport or the sender being disabled after it starts: the gateway
        never renegotiates a session, and aiortc has no ICE restart."""
        sender, track = self.sender, self.track
        rtc_internals.sender_started(sender)
        send = rtc_internals.aiortc_send_rtp(sender.transport)  # SRTP protect, then the ICE pair's socket
        direct = direct_wire(sender.transport)
        if direct is None:
            log.warning("this aiortc's DTLS transport or aioice's connection lacks what the direct RTP path reads; "
                        "speech packets take aiortc's _send_rtp")
            direct = _never
        record_sent = rtc_internals.record_sent  # what aiortc's RTCP loop puts in its sender reports
        try:
            # Inside the try: a peer's odd offer (a mid too long for a header extension)
            # ends this track's sending, not aiortc's connect task.
            packet = self._writer().packet
            while True:
                payload, pts = await track.next_payload()
                rtp_time = (self.timestamp_origin + pts) & 0xFFFFFFFF
                ntp = ntp_now()
                data = packet(payload, self.sequence, rtp_time, ntp)
                if direct(data):
                    self.direct_packets += 1
                else:
                    await send(data)
                self.packets += 1
                self.octets += len(payload)
                self.sequence = (self.sequence + 1) & 0xFFFF
                record_sent(sender, ntp, rtp_time, self.packets, self.octets)
        except (asyncio.CancelledError, ConnectionError, MediaStreamError):
            pass
        except Exception:
            log.exception("the speech track's RTP sender failed; this session sends no audio")
        finally:
            track.stop()
            rtc_internals.sender_exited(sender)


def _never(data: bytes) -> bool:
    return False
