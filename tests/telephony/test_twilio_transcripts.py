"""What the caller said on a phone call, as text (`--stt pocketsphinx`): a Twilio media stream speaks espeak-ng turns.

The same check as tests/backend/test_transcripts.py over the telephony path:
the caller's μ-law at 8 kHz, through the gateway's Twilio stream, its decoder
and the VAD's cut, gives one `speech.transcript` per turn whose WER is within
0.05 of the same recognizer run offline on exactly the μ-law the phone sent
for that turn. The turn's span is matched frame for frame (the backend also
takes the caller's audio, whose frames are the phone's, in order, on the
session clock): pocketsphinx's wideband model hears 8 kHz speech poorly and
its errors on it swing with a cut's few tens of ms, so the same span on both
sides measures what the path loses, not where a cut fell. Even so it is
chaotic there: offline raised to 16 kHz with soxr (here) scores 0.484 against
0.516 live, with the gateway's own half-band filter 0.355; the WebRTC test's
wideband turns are the firm check, this one that the phone path gives
transcripts and loses no frames on the way.
"""

from __future__ import annotations

import asyncio

import numpy as np
import soxr

from voxgate.client import VoxgateSession
from voxgate.gateway.media.encoder import ulaw_decode
from voxgate.gateway.caller.stt_pocketsphinx import decode

from tests.conftest import in_process_gateway
from tests.transcripts import CLEAR_TURNS, corpus_wer, turn_audio
from twilio_standin import TwilioStandIn


async def _collect(backend: VoxgateSession, into: list) -> None:
    async for frame in backend.caller_frames():
        into.append(frame)


async def test_twilio_caller_turns_reach_the_backend_as_transcripts_as_good_as_offline():
    frames: list = []
    async with in_process_gateway(stt="pocketsphinx") as (app, url):
        backend = VoxgateSession(url, caller_audio=True, caller_audio_buffer=5000)
        await backend.open()
        reader = asyncio.ensure_future(_collect(backend, frames))
        phone = TwilioStandIn(url)
        transcripts = []
        try:
            await phone.connect()
            await phone.start({"session_id": backend.session_id, "token": backend.client_token})
            await backend.wait_for("call.started")
            for phrase, voice in CLEAR_TURNS:
                await phone.send_audio(turn_audio(phrase, voice, 8000))  # real time
                stopped = await backend.wait_for("speech.stopped", timeout=30)
                event = await backend.wait_for("speech.transcript", timeout=30)
                assert event["final"] is True and event["start_ms"] < event["end_ms"] <= stopped["at_ms"] + 20
                transcripts.append(event)
        finally:
            reader.cancel()
            await phone.close()
            await backend.close()
    errors = [e for e in backend.history if e.get("type") == "error"]
    assert not errors, errors
    # The gateway's caller frames are the phone's media frames, one for one, in order.
    assert [f.seq for f in frames] == list(range(frames[0].seq, frames[0].seq + len(frames)))
    assert len(phone.sent_media) - 3 <= len(frames) <= len(phone.sent_media)  # the last may be in flight at the end
    live, offline = [], []
    for event in transcripts:
        live.append(event["text"])
        # Offline: the same recognizer on exactly the μ-law the phone sent in the turn's span.
        span = [m for (_, m), f in zip(phone.sent_media, frames) if event["start_ms"] <= f.capture_ms + 10 < event["end_ms"]]
        sent = np.concatenate([ulaw_decode(m) for m in span])
        offline.append(decode(soxr.resample(sent, 8000, 16000)))
    phrases = [p for p, _ in CLEAR_TURNS]
    wer_live, wer_offline = corpus_wer(phrases, live), corpus_wer(phrases, offline)
    print(f"\npocketsphinx WER over {len(CLEAR_TURNS)} espeak-ng turns by phone (μ-law 8 kHz): live path {wer_live:.3f}, "
          f"offline on the sent audio {wer_offline:.3f}\n  live:    {live}\n  offline: {offline}")
    assert abs(wer_live - wer_offline) <= 0.05
