"""The caller's audio from a phone call: Twilio's inbound μ-law to the session.

Twilio sends 8 kHz μ-law every 20 ms all through a call, silence included, so
the samples received are the call's media clock: each chunk is placed on the
session's clock by them (`CaptureClock`). It is decoded and upsampled to the
16 kHz the session's caller audio takes only while something listens (the VAD,
a backend taking the audio); otherwise it is counted and dropped.
"""

from __future__ import annotations

import time

from ..media.clock import CaptureClock
from ..media.encoder import ulaw_decode
from ..media.resample import Upsampler2x
from ..sessions.session import Session


class TwilioInput:
    """One call's inbound audio to its session (signaling/twilio_stream.py hands over the frames)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._capture = CaptureClock(session.clock, 8000, wrap=1 << 62)
        self._samples_in = 0
        self._upsampler: Upsampler2x | None = None  # while the session listens

    def feed(self, ulaw: bytes) -> None:
        """One media frame's μ-law bytes."""
        # Media flows all through a live call, quiet or not: it is not idle.
        self.session.last_activity = time.monotonic()
        if not ulaw:
            return
        self._samples_in += len(ulaw)
        if not self.session.caller.listening:
            self._upsampler = None
            return  # nothing is decoded while nobody listens: the VAD off, no backend taking the audio
        if self._upsampler is None:
            self._upsampler = Upsampler2x()
        pcm16k = self._upsampler.process(ulaw_decode(ulaw))
        end_ms = self._capture.end_ms(self._samples_in)
        self.session.caller.on_inbound_audio(pcm16k, end_ms - len(ulaw) / 8.0 - Upsampler2x.DELAY_S * 1000.0)
