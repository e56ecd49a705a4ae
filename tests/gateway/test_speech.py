"""Speech over real WebRTC: aiortc clients on loopback against `voxgate serve`."""

import asyncio

import numpy as np

from voxgate.engine import tone
from voxgate.rtc_client import RtcClient
from tests.speech import recognize, word_error_rate


def audible_ms(pcm: np.ndarray, rate: int, threshold: float = 300.0) -> float:
    n = rate // 50
    frames = len(pcm) // n
    if frames == 0:
        return 0.0
    rms = np.sqrt(np.mean(pcm[: frames * n].reshape(frames, n).astype(np.float64) ** 2, axis=1))
    voiced = np.nonzero(rms > threshold)[0]
    return 0.0 if len(voiced) == 0 else (voiced[-1] - voiced[0] + 1) * 20.0


async def test_speak_plays_the_real_voice_for_its_full_duration(piper_server):
    async with RtcClient(piper_server.url) as client:
        assert client.ready["codec"] == "opus" and client.ready["sample_rate"] == 48000
        text = "The quick brown fox jumps over the lazy dog near the river bank."
        sent = client.send({"type": "speak", "text": text, "id": "s1"})
        started = await client.wait_for("audio.started", id="s1")
        assert started["ttfa_ms"] > 0
        done = await client.wait_for("utterance.done", id="s1", timeout=30)
        await asyncio.sleep(0.4)  # the jitter buffer still holds the tail
        pcm = client.audio.pcm(sent)
        heard_ms = audible_ms(pcm, client.audio.sample_rate)
        # Received sound spans what the server says it sent, less leading/trailing quiet.
        assert done["audio_ms"] * 0.75 < heard_ms <= done["audio_ms"] + 100
        assert word_error_rate(text, recognize(pcm, client.audio.sample_rate)) < 0.5


async def test_streamed_text_starts_speaking_before_text_end(piper_server):
    async with RtcClient(piper_server.url) as client:
        words = "Well, let me think about that for a moment before I answer your question properly.".split()
        for word in words[:3]:
            client.send({"type": "text.delta", "text": word + " ", "id": "st"})
            await asyncio.sleep(0.05)
        started = await client.wait_for("audio.started", id="st", timeout=10)
        for word in words[3:]:
            client.send({"type": "text.delta", "text": word + " ", "id": "st"})
            await asyncio.sleep(0.03)
        end_sent = client.send({"type": "text.end", "id": "st"})
        started_at = next(t for t, e in client.event_log if e is started)
        assert started_at < end_sent
        done = await client.wait_for("utterance.done", id="st", timeout=30)
        assert done["text"].split()[-1] == "properly."


async def test_tone_engine_audio_decodes_to_exactly_the_text_in_order(tone_server):
    async with RtcClient(tone_server.url) as client:
        texts = ["First utterance, queued.", "Second one: after the first!", "Third; ünïcödé too."]
        sent = client.send({"type": "speak", "text": texts[0], "id": "a"})
        client.send({"type": "speak", "text": texts[1], "id": "b"})
        client.send({"type": "speak", "text": texts[2], "id": "c"})
        for uid in "abc":
            await client.wait_for("utterance.done", id=uid, timeout=30)
        await asyncio.sleep(0.4)
        decoded = tone.decode(client.audio.pcm(sent), client.audio.sample_rate)
        assert decoded == "".join(texts)
        kinds = [(e["type"], e.get("id")) for _, e in client.event_log if e["type"] in ("audio.started", "utterance.done")]
        assert kinds == [("audio.started", "a"), ("utterance.done", "a"), ("audio.started", "b"),
                         ("utterance.done", "b"), ("audio.started", "c"), ("utterance.done", "c")]


async def test_cancel_silences_the_wire_and_reports_what_was_heard(tone_server):
    async with RtcClient(tone_server.url) as client:
        text = "This long utterance is cut off part of the way through, so not all of it is heard. " * 3
        sent = client.send({"type": "speak", "text": text, "id": "long"})
        client.send({"type": "speak", "text": "Queued behind it.", "id": "next"})
        await client.wait_for("audio.started", id="long")
        await asyncio.sleep(1.0)
        cancel_at = client.send({"type": "cancel"})
        interrupted = await client.wait_for("utterance.interrupted", id="long")
        dropped = await client.wait_for("utterance.interrupted", id="next")
        assert interrupted["reason"] == "cancel"
        assert 800 <= interrupted["played_ms"] <= 3000, interrupted
        assert dropped["played_ms"] == 0 and dropped["played_text"] == ""
        await asyncio.sleep(0.6)
        rate = client.audio.sample_rate
        # Nothing audible arrives once the jitter buffer has drained (~80 ms plus transit).
        late = [p for t, p in client.audio.frames if t > cancel_at + 0.25 and np.abs(p).max() > 300]
        assert late == [], f"{len(late)} audible frames arrived after the cancel"
        heard = tone.decode(client.audio.pcm(sent), rate)
        assert text.startswith(heard)
        # played_text is what went out on the wire: at most one symbol apart from what was decoded.
        assert text.startswith(interrupted["played_text"])
        assert abs(len(interrupted["played_text"]) - len(heard)) <= 1, (interrupted, heard)
        # The session goes on.
        client.send({"type": "speak", "text": "Still here.", "id": "after"})
        await client.wait_for("utterance.done", id="after")


async def test_deltas_for_an_interrupted_utterance_are_refused_not_spoken_later(tone_server):
    async with RtcClient(tone_server.url) as client:
        client.send({"type": "text.delta", "text": "An answer that the user interrupts, and ", "id": "turn1"})
        await client.wait_for("audio.started", id="turn1")
        client.send({"type": "cancel"})
        await client.wait_for("utterance.interrupted", id="turn1")
        client.send({"type": "text.delta", "text": "more tokens from the old turn.", "id": "turn1"})
        error = await client.wait_for("error")
        assert error["code"] == "utterance_interrupted" and error["id"] == "turn1"
