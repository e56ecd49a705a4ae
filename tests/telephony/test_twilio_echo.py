"""The Twilio path against the bot's own echo: a phone on speaker sends the bot's voice back.

The stand-in phone plays what it receives at 20 ms a frame, and its line sends
that back 200 ms later at -10 dB, continuously, as Twilio streams a call (μ-law,
8 kHz), with an espeak-ng caller mixed in when the test says so. The bot is
the real voice.
"""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
import soxr

from tests import listening_corpus as corpus
from voxgate.client import VoxgateSession
from voxgate.gateway.encoder import ulaw_decode, ulaw_encode

from twilio_standin import FRAME_S, TwilioStandIn

ECHO_DB = -10.0
DELAY_FRAMES = 10  # 200 ms


class SpeakerPhone:
    """The stand-in's line: the phone's loudspeaker heard back by its microphone, plus a caller."""

    def __init__(self, phone: TwilioStandIn) -> None:
        self.phone = phone
        self.played = 0  # received media frames played so far
        self.line: list[np.ndarray] = [np.zeros(160, np.int16)] * DELAY_FRAMES
        self.caller: np.ndarray | None = None
        self.caller_at: float | None = None
        self._clears = 0
        self.task = asyncio.ensure_future(self._run())

    def say(self, pcm8k: np.ndarray) -> None:
        self.caller = pcm8k
        self.caller_at = None

    async def _run(self) -> None:
        t0 = time.monotonic()
        tick = 0
        pos = 0
        while True:
            await asyncio.sleep(max(0.0, t0 + tick * FRAME_S - time.monotonic()))
            tick += 1
            media = self.phone.received.media
            clears = self.phone.received.clears
            if len(clears) > self._clears:  # what a clear dropped is never played
                self._clears = len(clears)
                self.played = max(self.played, sum(1 for t, _ in media if t < clears[-1]))
            if self.played < len(media):
                heard = ulaw_decode(media[self.played][1]).astype(np.float64)
                self.played += 1
            else:
                heard = np.zeros(160)
            self.line.append(heard)
            mix = self.line.pop(0) * 10 ** (ECHO_DB / 20)
            if self.caller is not None:
                if self.caller_at is None:
                    self.caller_at = time.perf_counter()
                    pos = 0
                piece = self.caller[pos : pos + 160]
                mix[: len(piece)] += piece
                pos += 160
                if pos >= len(self.caller):
                    self.caller = None
            payload = ulaw_encode(np.clip(mix, -32768, 32767).astype(np.int16))
            await self.phone.send({"event": "media", "streamSid": self.phone.stream_sid,
                                   "media": {"track": "inbound", "chunk": str(tick), "timestamp": str(tick * 20),
                                             "payload": base64.b64encode(payload).decode("ascii")}})


async def test_a_speakerphone_echo_does_not_interrupt_and_the_caller_still_does(piper_server):
    backend = VoxgateSession(piper_server.url)
    await backend.open()
    phone = TwilioStandIn(piper_server.url)
    await phone.connect()
    line = None
    try:
        await phone.start({"session_id": backend.session_id, "token": backend.client_token})
        await backend.wait_for("call.started")
        line = SpeakerPhone(phone)
        outcome = await backend.say(corpus.BOT_REPLIES[1])
        assert not outcome.interrupted and not phone.received.clears, "the bot's own echo interrupted it"
        # The same line, a caller over the echo of the next reply, two seconds into it.
        before = len(phone.received.media)
        uid = await backend.say(corpus.BOT_REPLIES[2], wait=False)
        await phone.wait(lambda: len(phone.received.media) >= before + 100)
        clip = soxr.resample(corpus.espeak("Sorry, can I stop you there for a second?", "en-029+f2").astype(np.float32),
                             corpus.RATE, 8000).astype(np.int16)
        line.say(clip)
        interrupted = await backend.wait_for("utterance.interrupted", id=uid, timeout=20)
        assert interrupted["reason"] == "barge_in"
        await phone.wait(lambda: phone.received.clears)
        assert line.caller_at is not None
        latency = phone.received.clears[0] - (line.caller_at + corpus.onset_s(clip, 8000))
        assert 0 < latency < 1.5, latency
    finally:
        if line is not None:
            line.task.cancel()
        await phone.close()
        await backend.close()

