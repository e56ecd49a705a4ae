"""The Twilio Media Streams bridge against a `voxgate serve` process.

A stand-in plays Twilio's side over a real WebSocket (Twilio itself is not
reachable from here). The bot speaks with the tone engine, so what the phone
receives decodes back to the exact text; the caller's barge-in is real speech
from the Piper voice, μ-law encoded, sent as media.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
import pytest
import soxr

from voxgate.client import VoxgateSession
from voxgate.engine import tone

from twilio_standin import FRAME_S, TwilioStandIn
from tests.speech import the_voice

BOT_TEXT = "Thanks for calling. Your order ships on Monday and arrives by Thursday."


async def _call(server_url: str, **custom) -> tuple[VoxgateSession, TwilioStandIn]:
    backend = VoxgateSession(server_url)
    await backend.open()
    phone = TwilioStandIn(server_url)
    await phone.connect()
    await phone.start({"session_id": backend.session_id, "token": backend.client_token, **custom})
    await backend.wait_for("call.started")
    return backend, phone


async def test_media_marks_and_pacing(tone_server):
    backend, phone = await _call(tone_server.url, customer="42")
    try:
        outcome = await backend.say(BOT_TEXT)
        assert not outcome.interrupted
        end_mark = f"{outcome.id}:{outcome.played_ms}:end"
        await phone.wait(lambda: any(m.name == end_mark and m.echoed == "played" for m in phone.received.marks))
        r = phone.received
        # Only Twilio's outbound events, as JSON text frames, for our stream.
        assert r.non_text_frames == 0
        assert {m["event"] for _, m in r.messages} <= {"media", "mark"}
        assert all(m["streamSid"] == phone.stream_sid for _, m in r.messages)
        assert all(len(payload) == 160 for _, payload in r.media)
        # The phone hears exactly the text.
        assert tone.decode(phone.pcm(), 8000) == BOT_TEXT
        assert len(r.media) * 20 == outcome.played_ms

        # Real-time pacing: never more than one frame ahead of the wall clock.
        # Two frames of slack absorb loopback delivery jitter of the first frame.
        t0 = r.media[0][0]
        lead = max(i + 1 - ((t - t0) / FRAME_S + 1) for i, (t, _) in enumerate(r.media))
        span = (r.media[-1][0] - t0) / ((len(r.media) - 1) * FRAME_S)
        print(f"\ntwilio pacing: {len(r.media)} frames in {(r.media[-1][0] - t0) * 1000:.0f} ms, "
              f"max lead {lead:.2f} frames, {span:.3f}x real time")
        assert lead <= 1 + 2
        # ... and not slower than real time either (a pacer at 30 ms a frame gives 1.5x).
        assert 0.9 <= span <= 1.25, span

        # Each mark says how much of the utterance went out before it, exactly.
        assert r.marks, "no marks sent"
        for mark in r.marks:
            uid, ms = mark.name.split(":")[:2]
            assert uid == outcome.id
            assert mark.frames_before * 20 == int(ms), mark
        assert r.marks[-1].name == end_mark
        assert all(m.echoed == "played" for m in r.marks)
        # Engine chunk boundaries are marked too, between the every-200 ms marks: the
        # tone engine's first unit ("Thanks for calling. ") ends at 40 ms per byte.
        first_unit_ms = len(BOT_TEXT[: BOT_TEXT.index(". ") + 2].encode()) * 40
        assert any(abs(int(m.name.split(":")[1]) - first_unit_ms) <= 20 for m in r.marks), (first_unit_ms, [m.name for m in r.marks])

        # The server knows what was played from the echoed marks.
        state = await backend.state()
        tel = state["connected"]["telephony"]
        assert state["codec"] == "pcmu"
        assert tel["call_sid"] == phone.call_sid and tel["stream_sid"] == phone.stream_sid
        assert tel["frames_sent"] == len(r.media)
        assert tel["marks_sent"] == len(r.marks) and tel["marks_played"] == len(r.marks)
        assert tel["played"] == {"id": outcome.id, "ms": outcome.played_ms, "end": True}
        started = next(e for e in backend.history if e["type"] == "call.started")
        assert started["custom_parameters"] == {"session_id": backend.session_id, "customer": "42"}

        # DTMF reaches the backend; the call ends with `stop` and takes the session with it.
        await phone.send({"event": "dtmf", "streamSid": phone.stream_sid, "dtmf": {"track": "inbound_track", "digit": "7"}})
        assert (await backend.wait_for("call.dtmf"))["digit"] == "7"
        await phone.stop()
        await backend.wait_for("session.closed")
    finally:
        await phone.close()
        await backend.close()


@pytest.fixture(scope="module")
def caller_speech() -> np.ndarray:
    """A caller's words at 8 kHz, from the Piper voice, in this process."""
    from voxgate.engine.base import SynthesisOptions

    chunks = list(the_voice().synthesize("Wait, stop please. I have a question about my order.", SynthesisOptions()))
    rate = chunks[0].sample_rate
    pcm = np.concatenate([c.pcm for c in chunks]).astype(np.int16)
    return soxr.resample(pcm, rate, 8000).astype(np.int16)


async def test_barge_in_by_caller_sends_clear(tone_server, caller_speech):
    backend, phone = await _call(tone_server.url)
    try:
        uid = await backend.say(BOT_TEXT * 3, wait=False)
        await phone.wait(lambda: len(phone.received.media) >= 25)  # half a second is playing
        # Twilio streams the caller's line all through the call, silence too: the echo canceller
        # learns from it that this phone sends no echo back (gateway/caller/echo.py).
        await phone.send_audio(np.zeros(8000, np.int16))
        sent_at: list[float] = []
        talker = asyncio.ensure_future(phone.send_audio(caller_speech, on_first=lambda: sent_at.append(time.perf_counter())))
        interrupted = await backend.wait_for("utterance.interrupted", id=uid)
        await phone.wait(lambda: phone.received.clears)
        clear_at = phone.received.clears[0]
        # Count from the caller's first voiced frame, not from the synthesized leading silence.
        frames = caller_speech[: len(caller_speech) // 160 * 160].reshape(-1, 160).astype(np.float64)
        first_voiced = int(np.argmax(np.sqrt((frames**2).mean(axis=1)) > 500))
        latency_ms = (clear_at - sent_at[0] - first_voiced * FRAME_S) * 1000
        print(f"\ntwilio barge-in: clear {latency_ms:.0f} ms after the caller started talking (VAD needs 200 ms of speech)")
        assert interrupted["reason"] == "barge_in"
        assert latency_ms < 5000  # sanity only; VAD needs ~200 ms of speech by design
        clear_msg = next(m for t, m in phone.received.messages if m["event"] == "clear")
        assert clear_msg == {"event": "clear", "streamSid": phone.stream_sid}
        # What was sent before the clear is what the session says was heard:
        # played_ms in frames, and played_text within one symbol of the decoded audio.
        before = len([t for t, _ in phone.received.media if t < clear_at])
        assert interrupted["played_ms"] == before * 20
        heard = tone.decode(phone.pcm(), 8000)
        assert heard and (BOT_TEXT * 3).startswith(heard)
        assert (BOT_TEXT * 3).startswith(interrupted["played_text"])
        assert abs(len(interrupted["played_text"]) - len(heard)) <= 1, (interrupted["played_text"], heard)
        talker.cancel()
        # Nothing of the interrupted utterance follows the clear: everything the
        # phone receives after it, up to the next utterance's end, is that utterance.
        next_text = "Go ahead."
        outcome = await backend.say(next_text)
        await phone.wait(lambda: any(m.name == f"{outcome.id}:{outcome.played_ms}:end" for m in phone.received.marks))
        assert tone.decode(phone.pcm(since=clear_at), 8000) == next_text
        state = await backend.state()
        assert state["connected"]["telephony"]["clears"] == 1
        # Marks pending at the clear came back as cleared, not as played.
        played = state["connected"]["telephony"]["played"]
        assert played is None or played["ms"] <= interrupted["played_ms"]
    finally:
        await phone.close()
        await backend.close()


async def test_call_without_session_gets_one(tone_server):
    phone = TwilioStandIn(tone_server.url, stream_sid="MZnew0001", call_sid="CAnew0001")
    await phone.connect()
    try:
        await phone.start({"voice": "tone"})
        async with aiohttp.ClientSession() as http:
            for _ in range(50):
                async with http.get(tone_server.url + "/v1/sessions", params={"call_sid": "CAnew0001"}) as resp:
                    sessions = (await resp.json())["sessions"]
                if sessions:
                    break
                await asyncio.sleep(0.05)
        assert len(sessions) == 1 and sessions[0]["codec"] == "pcmu"
        async with VoxgateSession(tone_server.url, session_id=sessions[0]["session_id"]) as backend:
            outcome = await backend.say("Hi caller.")
            await phone.wait(lambda: any(m.name.endswith(":end") for m in phone.received.marks))
            assert tone.decode(phone.pcm(), 8000) == "Hi caller."
            assert outcome.played_ms == len(phone.received.media) * 20
    finally:
        await phone.close()


async def test_bad_frames_are_refused_not_fatal(tone_server):
    phone = TwilioStandIn(tone_server.url, stream_sid="MZbad0001")
    await phone.connect()
    try:
        assert phone.ws is not None
        await phone.send({"event": "media", "streamSid": "MZbad0001", "media": {"payload": "AAAA"}})
        await phone.ws.send_bytes(b"\x00\x01binary")
        await phone.ws.send_str("not json")
        await phone.send({"event": "bogus"})
        await phone.wait(lambda: len(phone.received.errors) >= 4)
        codes = [e["code"] for e in phone.received.errors]
        assert codes == ["not_started", "binary_frame", "invalid_json", "unknown_event"]
        # Still alive: the call starts and works.
        async with VoxgateSession(tone_server.url) as backend:
            await phone.start({"session_id": backend.session_id, "token": backend.client_token})
            await backend.wait_for("call.started")
            await phone.send({"event": "media", "streamSid": "MZbad0001", "media": {"track": "inbound", "payload": "%%%"}})
            await phone.wait(lambda: len(phone.received.errors) >= 5)
            assert phone.received.errors[-1]["code"] == "invalid_payload"
            await backend.say("ok")
            await phone.wait(lambda: any(m.name.endswith(":end") for m in phone.received.marks))
            assert tone.decode(phone.pcm(), 8000) == "ok"
    finally:
        await phone.close()


async def test_join_needs_a_valid_token(tone_server):
    async with VoxgateSession(tone_server.url) as backend:
        phone = TwilioStandIn(tone_server.url, stream_sid="MZtok0001")
        await phone.connect()
        try:
            await phone.start({"session_id": backend.session_id, "token": backend.client_token[:-3] + "AAA"})
            await phone.wait(lambda: phone.received.errors)
            assert phone.received.errors[0]["code"] == "invalid_token"
            await phone.wait(lambda: phone.ws.closed)
        finally:
            await phone.close()
        state = await backend.state()
        assert state["connected"]["telephony"] is None and state["codec"] is None
