"""The conversation loop over WebRTC (`--stt whisper`): partials while the caller speaks, then the final.

A real aiortc client's microphone says one question in real time; the backend
on the session WebSocket sees `speech.started`, partial transcripts
(`final: false`), and one final transcript, the end of the turn, decided by the
gateway's rule (gateway/caller/endpoint.py) well before the longest silence. The
session's `turn` settings are checked like every other field.
"""

from __future__ import annotations

import time

import numpy as np

from voxgate.client import VoxgateSession
from voxgate.rtc_client import RtcClient

from tests.backend.test_transcripts import RecordingMic
from tests.conftest import in_process_gateway
from tests.listening_corpus import espeak
from tests.speech import word_error_rate

PHRASE = "What time does the store open tomorrow?"


async def test_a_caller_turn_gives_partials_then_one_final_as_the_turn_ends():
    clip = np.concatenate([np.zeros(9600, np.int16), espeak(PHRASE, "en-us", 48000), np.zeros(48000 * 2, np.int16)])
    async with in_process_gateway(stt="whisper", stt_partial_ms=500) as (_, url):
        backend = VoxgateSession(url)
        await backend.open()
        client = RtcClient(url, mic=True, session_id=backend.session_id, token=backend.client_token)
        client.mic = RecordingMic()
        try:
            await backend.send({"type": "session.update", "turn": {"min_silence_ms": 50}})
            assert (await backend.wait_for("error"))["code"] == "invalid_field"
            await backend.send({"type": "session.update", "turn": {"max_silence_ms": 2000, "min_silence_ms": 300}})
            updated = await backend.wait_for("session.updated")
            assert updated["turn"] == {"min_silence_ms": 300, "max_silence_ms": 2000, "partial_ms": 500}
            await client.connect()
            client.mic.play(clip)
            seen = []
            async for event in backend.events():
                if event["type"] in ("speech.started", "speech.transcript", "speech.stopped"):
                    seen.append((time.perf_counter(), event))
                if event["type"] == "speech.transcript" and event["final"]:
                    break
        finally:
            await client.close()
            await backend.close()
    kinds = [e["type"] if e["type"] != "speech.transcript" else ("final" if e["final"] else "partial") for _, e in seen]
    assert kinds[0] == "speech.started" and kinds[-1] == "final" and kinds.count("final") == 1, kinds
    assert "partial" in kinds, kinds
    final = seen[-1][1]
    assert word_error_rate(PHRASE, final["text"]) <= 0.25, final
    # The turn's end came from the rule (300 ms of silence), not the longest silence (2 s): from speech.started
    # (about 200 ms into the speech) it spans the speech and about 100 ms more, where 2 s would give 1.8 s more.
    started_ms = seen[0][1]["at_ms"]
    speech_ms = len(espeak(PHRASE, "en-us", 48000)) / 48
    assert final["end_ms"] - started_ms < speech_ms + 1000, (final, started_ms, speech_ms)
