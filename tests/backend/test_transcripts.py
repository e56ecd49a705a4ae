"""What the caller said, as text (`--stt pocketsphinx`): a real aiortc client speaks espeak-ng turns.

The backend's WebSocket gets one `speech.transcript` per turn, after its
`speech.stopped`, spanning the turn on the session's clock. The recognizer
loses nothing on the way: its WER over the turns heard through the live path
(Opus over WebRTC, the gateway's decoder, the VAD's cut) is within 0.05 of the
same recognizer run offline on the exact samples the client's microphone sent.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import soxr

from voxgate.client import VoxgateSession
from voxgate.gateway.stt_pocketsphinx import Pocketsphinx
from voxgate.rtc_client import MicTrack, RtcClient

from tests.conftest import in_process_gateway
from tests.listening_corpus import onset_s
from tests.transcripts import CLEAR_TURNS, corpus_wer, turn_audio


class RecordingMic(MicTrack):
    """The client's microphone, keeping every sample it handed to aiortc."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list = []

    async def recv(self):
        frame = await super().recv()
        self.sent.append(frame.to_ndarray().reshape(-1).copy())
        return frame


async def test_webrtc_caller_turns_reach_the_backend_as_transcripts_as_good_as_offline():
    async with in_process_gateway(stt="pocketsphinx") as (app, url):
        backend = VoxgateSession(url)
        await backend.open()
        origin = time.perf_counter() - backend.ready["at_ms"] / 1000.0
        client = RtcClient(url, mic=True, session_id=backend.session_id, token=backend.client_token)
        client.mic = RecordingMic()
        live, offline, spans = [], [], []
        try:
            await client.connect()
            recognizer = Pocketsphinx()
            for phrase, voice in CLEAR_TURNS:
                clip = turn_audio(phrase, voice, 48000)
                first = len(client.mic.sent)
                client.mic.play(clip)
                began = time.perf_counter()  # within a frame of the clip's first sample
                stopped = await backend.wait_for("speech.stopped", timeout=30)
                event = await backend.wait_for("speech.transcript", timeout=30)
                assert event["final"] is True and event["start_ms"] < event["end_ms"] <= stopped["at_ms"] + 20
                live.append(event["text"])
                while client.mic.busy:
                    await asyncio.sleep(0.05)
                # Offline: the same recognizer on exactly what the microphone sent for this turn.
                sent = np.concatenate(client.mic.sent[first:])[: len(clip)]
                offline.append(await asyncio.to_thread(recognizer.recognize, soxr.resample(sent, 48000, 16000)))
                speech_from = (began - origin) * 1000 + (0.3 + onset_s(clip[int(0.3 * 48000):])) * 1000
                spans.append((event["start_ms"], event["end_ms"], speech_from))
        finally:
            await client.close()
            await backend.close()
    phrases = [p for p, _ in CLEAR_TURNS]
    wer_live, wer_offline = corpus_wer(phrases, live), corpus_wer(phrases, offline)
    print(f"\npocketsphinx WER over {len(CLEAR_TURNS)} espeak-ng turns: live path {wer_live:.3f}, offline on the sent audio "
          f"{wer_offline:.3f}\n  live:    {live}\n  offline: {offline}")
    # Each transcript spans its turn's speech on the session's clock.
    for start_ms, end_ms, speech_from in spans:
        assert start_ms <= speech_from + 60 < end_ms, (start_ms, speech_from, end_ms)
    assert abs(wer_live - wer_offline) <= 0.05
