"""In-band FEC until the listener shows a clean line: the Opus signal, from RTCP.

libopus told the signal is music codes speech with CELT alone; told it is
voice, it codes it with SILK or hybrid (SILK below 8 kHz, CELT above). CELT
alone costs about a third as much per frame here, with the same pocketsphinx
WER (bench/bench_opus_quality.py), but only SILK carries in-band FEC: a copy of
each frame at low bitrate inside the next packet (LBRR), which rebuilds a lost
packet when the next one arrives in time.

So with `--opus-signal auto` (the default, with `--opus-fec` on; without FEC,
auto is music throughout) a session codes its speech as voice, with FEC, from
its first packet: nothing is known about the line yet, and a browser's first
receiver report comes seconds in, after the first losses. It turns to music
after CLEAN_REPORTS reports in a row show less than LOSS_ON, and back to voice
from the first report of LOSS_ON or more until HOLD_S after the last such
report. libopus switches modes between two frames without a click; each switch
applies from the next frame encoded.

FEC is only as good as what libopus puts in the packets: it codes LBRR only
with a nonzero expected loss (`--opus-loss-pct`) and a bitrate that covers it
(gateway/media/opus.py `has_lbrr`; measured in chromium by bench/bench_network.py).

Receiver reports reach an aiortc sender through its private
`_handle_rtcp_packet`; `watch_reports` wraps it (through rtc_internals.py). If
an aiortc upgrade renames it, `watch_reports` says so and the session keeps
voice (FEC) throughout.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

from . import rtc_internals
from .rtc_internals import RtcpRrPacket, RtcpSrPacket

log = logging.getLogger(__name__)

# One receiver report's fraction lost (RFC 3550: lost / expected since the
# sender's previous report, an 8-bit count of 256ths, so 1 % means 3/256 or
# more) from which the listener gets FEC. Reports come every 0.5-1.5 s from
# aiortc and every few seconds from browsers.
LOSS_ON = 0.01
# Reports in a row under LOSS_ON after which a line counts as clean (FEC off): a few
# seconds from aiortc, about ten from chromium, which reports every 2.5-7.5 s.
CLEAN_REPORTS = 2
# How long FEC stays on after the last report of loss: loss comes in bursts, and
# each switch costs a few frames of the new mode's warm-up.
HOLD_S = 30.0


class SignalPolicy:
    """The signal a session's Opus encoder codes speech as, from the listener's loss reports."""

    def __init__(self) -> None:
        self.signal = "voice"  # FEC before the first loss: nothing is known about the line yet
        self._voice_until = -math.inf
        self._clean = 0  # reports in a row under LOSS_ON
        self._pinned = False

    def pin_voice(self) -> None:
        """No reports can be watched: FEC throughout, whatever comes."""
        self.signal, self._pinned = "voice", True

    def report(self, fraction_lost: float, now: float) -> str:
        """One receiver report's fraction lost (0..1) at time `now`; returns the signal to use."""
        if self._pinned:
            return self.signal
        if fraction_lost >= LOSS_ON:
            self._voice_until, self._clean = now + HOLD_S, 0
        else:
            self._clean += 1
        self.signal = "voice" if now < self._voice_until or self._clean < CLEAN_REPORTS else "music"
        return self.signal


def watch_reports(sender, on_fraction_lost: Callable[[float], None]) -> bool:
    """Call on_fraction_lost(fraction) for each receiver report about `sender`'s
    stream, after aiortc has read it. False when aiortc offers no place to watch."""
    def watch(packet) -> None:
        if isinstance(packet, (RtcpRrPacket, RtcpSrPacket)):
            ssrc = rtc_internals.sender_ssrc(sender)
            for report in packet.reports:
                if report.ssrc == ssrc:
                    try:
                        on_fraction_lost(report.fraction_lost / 256.0)
                    except Exception:  # aiortc's receive loop ends the transport on an error: never from here
                        log.exception("a loss report could not be applied")

    if not rtc_internals.watch_rtcp(sender, watch):
        log.warning("aiortc's RTCRtpSender has no _handle_rtcp_packet or _ssrc: Opus keeps in-band FEC (signal voice) throughout")
        return False
    return True
