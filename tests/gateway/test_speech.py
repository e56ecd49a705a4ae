"""Speech over real WebRTC: aiortc clients on loopback against `voxgate serve`."""

import asyncio

import numpy as np

from voxgate.engine import tone
from voxgate.rtc_client import TAIL_FRAMES, RtcClient
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
        await client.wait_tail(done)  # the jitter buffer still holds the tail
        pcm = client.audio.pcm(sent)
        heard_ms = audible_ms(pcm, client.audio.sample_rate)
        # Received sound spans what the server says it sent, less leading/trailing quiet.
        assert done["audio_ms"] * 0.75 < heard_ms <= done["audio_ms"] + 100
        assert word_error_rate(text, recognize(pcm, client.audio.sample_rate)) < 0.5


async def test_streamed_text_starts_speaking_before_text_end(piper_server):
    async with RtcClient(piper_server.url) as client:
        words = "Well, let me think about that for a moment before I answer your question properly.".split()
        for word in words:
            client.send({"type": "text.delta", "text": word + " ", "id": "st"})
            await asyncio.sleep(0.03)  # an LLM's token rate
        # text.end is held back until audio has started: a server that waited for
        # the end of the text before speaking never sends audio.started here.
        await client.wait_for("audio.started", id="st", timeout=10)
        assert not [e for _, e in client.event_log if e["type"] == "utterance.done"]
        client.send({"type": "text.end", "id": "st"})
        done = await client.wait_for("utterance.done", id="st", timeout=30)
        assert done["text"].split()[-1] == "properly."


async def test_tone_engine_audio_decodes_to_exactly_the_text_in_order(tone_server):
    async with RtcClient(tone_server.url) as client:
        texts = ["First utterance, queued.", "Second one: after the first!", "Third; ünïcödé too."]
        sent = client.send({"type": "speak", "text": texts[0], "id": "a"})
        client.send({"type": "speak", "text": texts[1], "id": "b"})
        client.send({"type": "speak", "text": texts[2], "id": "c"})
        for uid in "abc":
            done = await client.wait_for("utterance.done", id=uid, timeout=30)
        await client.wait_tail(done)
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
        started = await client.wait_for("audio.started", id="long")
        # Let a second of the utterance arrive, counted in frames rather than wall time:
        # 50 frames the server sent after audio.started.
        await client.wait_frames_after(started, 50)
        client.send({"type": "cancel"})
        interrupted = await client.wait_for("utterance.interrupted", id="long")
        dropped = await client.wait_for("utterance.interrupted", id="next")
        assert interrupted["reason"] == "cancel"
        # All 50 had left the server before the cancel (give or take the frame that
        # raced audio.started, and TAIL_FRAMES where aiortc's counter is missing).
        assert interrupted["played_ms"] >= (50 - TAIL_FRAMES) * 20, interrupted
        assert dropped["played_ms"] == 0 and dropped["played_text"] == ""
        # Every frame sent after the cancel is silence: the frame after the cancel
        # left silent (the first two may carry the decoder's fade-out).
        after = await client.wait_frames_after(interrupted, 12)
        loud = [i for i, p in enumerate(after[2:]) if np.abs(p).max() > 300]
        assert loud == [], f"audible frames {loud} were sent after the cancel"
        rate = client.audio.sample_rate
        heard = tone.decode(client.audio.pcm(sent), rate)
        assert heard and text.startswith(heard)
        # played_text is what went out on the wire: at most one symbol apart from what was decoded,
        # and played_ms is the same audio counted in frames (one tone symbol is 40 ms).
        assert text.startswith(interrupted["played_text"])
        assert abs(len(interrupted["played_text"]) - len(heard)) <= 1, (interrupted, heard)
        assert abs(interrupted["played_ms"] - len(heard.encode()) * tone.SYMBOL_S * 1000) <= 60, (interrupted, heard)
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
