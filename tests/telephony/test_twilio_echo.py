"""The Twilio path against the bot's own echo: a phone on speaker sends the bot's voice back.

The stand-in phone plays what it receives at 20 ms a frame, and its line sends
that back 200 ms later at -10 dB, continuously, as Twilio streams a call (μ-law,
8 kHz), with an espeak-ng caller mixed in when the test says so. The bot is
the real voice.
"""

from __future__ import annotations

import numpy as np
import soxr

from tests import listening_corpus as corpus
from voxgate.client import VoxgateSession

from twilio_standin import SpeakerPhone, TwilioStandIn

ECHO_DB = -10.0
DELAY_FRAMES = 10  # 200 ms


async def test_a_speakerphone_echo_does_not_interrupt_and_the_caller_still_does(piper_server):
    backend = VoxgateSession(piper_server.url)
    await backend.open()
    phone = TwilioStandIn(piper_server.url)
    await phone.connect()
    line = None
    try:
        await phone.start({"session_id": backend.session_id, "token": backend.client_token})
        await backend.wait_for("call.started")
        line = SpeakerPhone(phone, echo_db=ECHO_DB, delay_frames=DELAY_FRAMES)
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

