"""audio.words: each chunk's words with their times on the session clock, the clock
audio.started's at_ms is on, over real WebRTC with the real voice; session.update turns them off."""

from voxgate.rtc_client import RtcClient

TEXT = "Captions follow the voice word by word. Each word arrives with the audio it starts in."


async def test_words_come_on_the_session_clock_and_can_be_turned_off(piper_server):
    async with RtcClient(piper_server.url) as client:
        client.send({"type": "speak", "text": TEXT, "id": "w1"})
        started = await client.wait_for("audio.started", id="w1")
        done = await client.wait_for("utterance.done", id="w1", timeout=30)
        events = [e for _, e in client.event_log if e["type"] == "audio.words" and e.get("id") == "w1"]
        assert len(events) >= 2  # per chunk, not once at the end
        words = [w for e in events for w in e["words"]]
        assert [w["word"] for w in words] == TEXT.split()
        assert words[0]["start_ms"] >= started["at_ms"]
        assert all(a["start_ms"] < a["end_ms"] <= b["start_ms"] + 0.2 for a, b in zip(words, words[1:]))
        # The last word ends where the utterance's audio does, on the same clock (frames are 20 ms): with the
        # voice's leading silence cut (gateway/media/feeder.py), the words moved back with it.
        assert abs(words[-1]["end_ms"] - (started["at_ms"] + done["audio_ms"])) <= 40, (words[-1], started, done)
        # A listener never gets a word before the audio it is in has started.
        first_words_at = next(t for t, e in client.event_log if e["type"] == "audio.words")
        started_at = next(t for t, e in client.event_log if e["type"] == "audio.started")
        assert first_words_at >= started_at

        client.send({"type": "session.update", "words": "no"})
        assert (await client.wait_for("error"))["code"] == "invalid_field"
        client.send({"type": "session.update", "words": False})
        updated = await client.wait_for("session.updated")
        assert updated["words"] is False
        client.send({"type": "speak", "text": "No captions now.", "id": "w2"})
        await client.wait_for("utterance.done", id="w2", timeout=30)
        assert not [e for _, e in client.event_log if e["type"] == "audio.words" and e.get("id") == "w2"]
