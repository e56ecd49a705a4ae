"""A writer's open utterance ends with its writer (gateway/sessions/session_queue.py's `writer_gone`).

Real peers on the tone engine: an aiortc listener hears the session, backends
write through `voxgate.client` on the session WebSocket. A backend that leaves
an utterance open and goes away must not hold the session: what it had started
to say ends with what it has, what nothing of was heard is dropped, the events
say which, and what is queued behind it plays.
"""

from __future__ import annotations

import asyncio

import pytest

from voxgate.client import VoxgateSession
from voxgate.engine import tone
from voxgate.rtc_client import RtcClient


async def test_a_backend_gone_mid_reply_ends_it_with_what_it_has_and_the_next_backend_speaks(tone_server):
    async with RtcClient(tone_server.url) as listener:
        first = VoxgateSession(tone_server.url, session_id=listener.session_id)
        await first.open()
        await first.send({"type": "text.delta", "id": "x", "text": "Hello there, "})
        started = await listener.wait_for("audio.started", id="x")
        await first.close()  # gone without text.end, as a backend killed mid-reply
        ended = await listener.wait_for("utterance.ended", id="x", timeout=10)
        done = await listener.wait_for("utterance.done", id="x", timeout=10)
        assert ended["reason"] == "writer_gone"
        assert done["text"].strip() == "Hello there,"
        async with VoxgateSession(tone_server.url, session_id=listener.session_id) as second:
            assert second.ready["role"] == "writer"
            outcome = await asyncio.wait_for(second.say("Next."), 10)
            assert not outcome.interrupted
            await listener.wait_tail(await listener.wait_for("utterance.done", id=outcome.id))
        heard = tone.decode(listener.audio.pcm(listener.arrival(started) - 0.5), listener.audio.sample_rate)
        assert heard.replace(" ", "") == "Hellothere,Next.", heard


async def test_a_backend_gone_before_its_reply_was_heard_drops_it_and_what_plays_goes_on(tone_server):
    async with RtcClient(tone_server.url) as listener:
        first = VoxgateSession(tone_server.url, session_id=listener.session_id)
        await first.open()
        await first.send({"type": "speak", "id": "p", "text": "Playing now, fully."})
        await first.send({"type": "text.delta", "id": "x", "text": "Never heard, "})
        await listener.wait_for("audio.started", id="p")
        await first.close()
        dropped = await listener.wait_for("utterance.interrupted", id="x", timeout=10)
        assert (dropped["reason"], dropped["played_ms"], dropped["played_text"]) == ("writer_gone", 0, "")
        # What its writer had ended plays to its end.
        done = await listener.wait_for("utterance.done", id="p", timeout=10)
        assert done["text"] == "Playing now, fully."
        async with VoxgateSession(tone_server.url, session_id=listener.session_id) as second:
            outcome = await asyncio.wait_for(second.say("Next."), 10)
            await listener.wait_tail(await listener.wait_for("utterance.done", id=outcome.id))
            state = await second.state()
        assert state["utterances"]["queued"] == 0
        heard = tone.decode(listener.audio.pcm(), listener.audio.sample_rate)
        assert "Never" not in heard and heard.replace(" ", "").endswith("fully.Next."), heard


async def test_a_data_channel_closed_mid_reply_ends_its_utterance(tone_server):
    async with RtcClient(tone_server.url) as listener:
        async with VoxgateSession(tone_server.url, session_id=listener.session_id, role="watcher") as backend:
            listener.send({"type": "text.delta", "id": "x", "text": "From the page, "})
            await backend.wait_for("audio.started", id="x")
            listener._channel.close()  # the page's channel goes; its media stays
            ended = await backend.wait_for("utterance.ended", id="x", timeout=10)
            await backend.wait_for("utterance.done", id="x", timeout=10)
            assert ended["reason"] == "writer_gone"
            state = await backend.state()
            assert state["utterances"]["queued"] == 0


async def test_the_queue_alone_feeds_the_engine_and_reports_what_a_cancel_stopped():
    """`UtteranceQueue` without a Session or an output: text reaches the engine streams in order, the
    feeder is woken per utterance, and an interrupt cancels every stream, says what the listener heard
    of each, and has the output start afresh (timed from the cancel only when audio was dropped)."""
    from dataclasses import dataclass

    from tests.gateway.test_session import Events, FakeEngine, Samples
    from voxgate.gateway.media.clock import SessionClock
    from voxgate.gateway.errors import GatewayError
    from voxgate.gateway.media.playout import Playout
    from voxgate.gateway.sessions.session_queue import UtteranceQueue

    @dataclass
    class Options:
        voice: str | None = None
        rate: float = 1.0
        max_utterance_chars: int = 100
        max_queued_utterances: int = 3

    engine, events, samples, playout = FakeEngine(), Events(), Samples(), Playout(b"\x00")
    woken: list[int] = []
    restarts: list[float | None] = []
    queue = UtteranceQueue(engine, options=Options(), playout=playout, clock=SessionClock(), metrics=samples,  # type: ignore[arg-type]
                           emit=events, wire_rate=lambda: 48000, on_queued=lambda: woken.append(1),
                           on_cancelled=restarts.append)
    queue.speak("peer", "a", "one two")
    queue.append("peer", "b", "three ")
    queue.append("peer", None, "four")  # the peer's open utterance
    with pytest.raises(GatewayError) as refused:
        queue.append("backend", "b", "theirs")
    assert refused.value.code == "id_in_use"
    for _ in range(5):
        await asyncio.sleep(0)  # the text pump: a slice a turn
    first, second = engine.streams
    assert first.texts == ["one two"] and first.ended and second.texts == ["three ", "four"] and not second.ended
    assert second.after is first and first.held_s > 0  # the output's lag, at the wire's rate
    assert [e["id"] for e in events.of("utterance.queued")] == ["a", "b"] and len(woken) == 2
    assert queue.next_to_feed() is queue.utterances[0]
    queue.interrupt("cancel")
    assert first.cancelled and second.cancelled and queue.utterances == [] and not playout.queue
    assert [(e["id"], e["played_ms"], e["played_text"]) for e in events.of("utterance.interrupted")] == [
        ("a", 0, ""), ("b", 0, "")]
    assert len(restarts) == 1 and restarts[0] is not None  # queued audio was dropped: cancel-to-silence runs
    queue.end("peer", "b")  # ending an interrupted utterance does nothing
    queue.interrupt("cancel")  # nothing queued
    assert restarts[1] is None and queue.stats == {"utterances": 2, "interrupted": 2}
