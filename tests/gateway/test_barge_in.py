"""Barge-in by voice: the client's microphone talks over the server's speech."""

import numpy as np
import pytest

from voxgate.engine import tone
from voxgate.rtc_client import TAIL_FRAMES, RtcClient
from tests.speech import synthesize_48k

LONG = "I am going to keep talking for quite a while now, so that there is plenty of time for you to interrupt me. " * 2


@pytest.fixture(scope="module")
def user_speech() -> np.ndarray:
    # Real speech, made by the engine itself, as the listener's voice.
    return synthesize_48k("Wait, stop, I have a question about that.")


async def test_speech_on_the_mic_interrupts_with_reason_barge_in(tone_server, user_speech):
    # The bot speaks with the tone engine, so what reached the listener decodes
    # exactly; the listener's voice on the mic is real speech.
    async with RtcClient(tone_server.url, mic=True) as client:
        sent = client.send({"type": "speak", "text": LONG, "id": "talk"})
        started = await client.wait_for("audio.started", id="talk", timeout=20)
        await client.wait_frames_after(started, 50)  # a second of it has arrived
        client.mic.play(user_speech)
        await client.wait_for("speech.started", timeout=10)
        interrupted = await client.wait_for("utterance.interrupted", id="talk", timeout=5)
        assert interrupted["reason"] == "barge_in"
        assert interrupted["played_ms"] >= (50 - TAIL_FRAMES) * 20
        await client.wait_tail(interrupted)
        heard = tone.decode(client.audio.pcm(sent), client.audio.sample_rate)
        assert heard and LONG.startswith(heard)
        # played_text is what the listener heard, within one symbol.
        assert LONG.startswith(interrupted["played_text"])
        assert abs(len(interrupted["played_text"]) - len(heard)) <= 1, (interrupted["played_text"], heard)
        await client.wait_for("speech.stopped", timeout=10)


@pytest.mark.parametrize("kind", ["silence", "steady noise"])
async def test_silence_or_steady_noise_does_not_interrupt(tone_server, kind):
    async with RtcClient(tone_server.url, mic=True) as client:
        if kind == "steady noise":
            rng = np.random.default_rng(1)
            client.mic.play((rng.standard_normal(48000 * 6) * 1500).astype(np.int16))
        client.send({"type": "speak", "text": "Nothing should stop this short sentence from being spoken in full.", "id": "x"})
        done = await client.wait_for("utterance.done", id="x", timeout=20)
        assert done["audio_ms"] > 1000
        assert not [e for _, e in client.event_log if e["type"] in ("utterance.interrupted", "speech.started")]


async def test_vad_off_ignores_the_mic_and_keeps_talking(piper_server, user_speech):
    async with RtcClient(piper_server.url, mic=True) as client:
        client.send({"type": "session.update", "vad": {"enabled": False}})
        updated = await client.wait_for("session.updated")
        assert updated["vad"]["enabled"] is False
        client.send({"type": "speak", "text": "Keep going no matter what you hear from the other side.", "id": "k"})
        started = await client.wait_for("audio.started", id="k", timeout=20)
        client.mic.play(user_speech)
        done = await client.wait_for("utterance.done", id="k", timeout=20)
        # The user's speech was on the mic for most of the utterance (it is about as long).
        assert client.arrival(done) - client.arrival(started) > 1.0
        assert not [e for _, e in client.event_log if e["type"] in ("utterance.interrupted", "speech.started")]
