"""TwilioOutput (gateway/phone/twilio_output.py): μ-law media in order, marks, one clear per interruption.

The output is driven directly here: its session is a stand-in holding a real
Playout (the output needs only the session's playout and its departure hook),
and `send` collects the messages Twilio would get. The pacer is the real one
(20 ms frames), so each test runs for well under a second of speech.
tests/telephony/test_twilio.py runs the same output inside `voxgate serve`
against a Twilio stand-in over a WebSocket.
"""

from __future__ import annotations

import asyncio
import base64

from voxgate.gateway.media.playout import Playout, UtterancePlay
from voxgate.gateway.phone.twilio_output import MARK_EVERY_FRAMES, TwilioOutput

SILENCE = b"\xff" * 160


class StandInSession:
    """The session's speech output, as TwilioOutput sees it: a playout, and where departures go."""

    def __init__(self) -> None:
        self.playout = Playout(SILENCE)
        self.departures: list[float] = []

    def on_departure(self, now: float) -> None:
        self.departures.append(now)


class Wire:
    """What Twilio would receive, with a way to wait for a message."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self._changed = asyncio.Event()

    async def send(self, message: dict) -> None:
        self.messages.append(message)
        self._changed.set()

    async def wait(self, predicate, timeout: float = 10.0) -> dict:
        async def until() -> dict:
            while True:
                found = [m for m in self.messages if predicate(m)]
                if found:
                    return found[-1]
                self._changed.clear()
                await self._changed.wait()

        return await asyncio.wait_for(until(), timeout)

    def of(self, event: str) -> list[dict]:
        return [m for m in self.messages if m["event"] == event]

    def marks(self) -> list[str]:
        return [m["mark"]["name"] for m in self.of("mark")]


def start(frames: list[bytes], chunk_ends: set[int] = frozenset()) -> tuple[TwilioOutput, StandInSession, Wire, UtterancePlay]:
    session, wire = StandInSession(), Wire()
    output = TwilioOutput(session, stream_sid="MZ1", send=wire.send)
    play = UtterancePlay(id="u", chunk_ends=set(chunk_ends))
    session.playout.add(play)
    session.playout.push(play, frames)
    session.playout.finish(play)
    session.playout.on_done = lambda p: output.on_event({"type": "utterance.done", "id": p.id, "audio_ms": p.played_ms})
    output.start()
    return output, session, wire, play


async def test_frames_go_out_in_order_with_marks_at_chunk_ends_every_200_ms_and_at_the_end():
    frames = [bytes([i]) * 160 for i in range(23)]
    output, session, wire, _ = start(frames, chunk_ends={3})
    try:
        await wire.wait(lambda m: m["event"] == "mark" and m["mark"]["name"].endswith(":end"))
    finally:
        await output.stop()
    media = [base64.b64decode(m["media"]["payload"]) for m in wire.of("media")]
    assert media == frames  # silence between utterances is not sent at all
    assert all(m["streamSid"] == "MZ1" for m in wire.messages)
    assert MARK_EVERY_FRAMES == 10
    assert wire.marks() == ["u:60", "u:200", "u:400", "u:460:end"]
    # Each mark follows the frame it marks.
    order = [m["event"] if m["event"] != "mark" else m["mark"]["name"] for m in wire.messages]
    assert order.index("u:60") == 3 and order.index("u:200") == 11  # after 3 frames; after 10 (and the first mark)
    assert output.frames_sent == 23 and output.marks_sent == 4
    assert len(session.departures) >= 23


async def test_echoed_marks_say_what_was_played():
    output, _, wire, _ = start([b"\x01" * 160] * 12)
    try:
        await wire.wait(lambda m: m["event"] == "mark" and m["mark"]["name"].endswith(":end"))
    finally:
        await output.stop()
    output.on_mark("u:200")
    assert output.played == {"id": "u", "ms": 200, "end": False} and output.marks_played == 1
    output.on_mark("u:240:end")
    assert output.played == {"id": "u", "ms": 240, "end": True}
    output.on_mark("not-ours:x")  # logged, not fatal; what was played stays
    assert output.played["ms"] == 240


async def test_an_interruption_sends_one_clear_and_pending_marks_echo_as_cleared():
    output, session, wire, _ = start([b"\x02" * 160] * 40)
    try:
        await wire.wait(lambda m: m["event"] == "mark")  # u:200 is out, not yet echoed
        session.playout.clear()
        # One interrupt reports each dropped utterance; they share one clear.
        output.on_event({"type": "utterance.interrupted", "id": "u"})
        output.on_event({"type": "utterance.interrupted", "id": "v"})
        await wire.wait(lambda m: m["event"] == "clear")
        await asyncio.sleep(0.1)  # five more ticks: nothing stale follows the clear
    finally:
        await output.stop()
    assert len(wire.of("clear")) == 1 and output.clears == 1
    events = [m["event"] for m in wire.messages]
    assert "media" not in events[events.index("clear"):]
    # Twilio echoes pending marks at once after a clear: they were cleared, not played.
    for name in wire.marks():
        output.on_mark(name)
    assert output.marks_cleared == len(wire.marks()) and output.marks_played == 0 and output.played is None


async def test_an_utterance_dropped_with_its_writer_clears_nothing_at_the_phone():
    output, _, wire, _ = start([b"\x02" * 160] * 12)
    try:
        # A queued utterance whose backend went away before any of it played (session_queue.writer_gone).
        output.on_event({"type": "utterance.interrupted", "id": "later", "reason": "writer_gone", "played_ms": 0})
        await wire.wait(lambda m: m["event"] == "mark" and m["mark"]["name"].endswith(":end"))
    finally:
        await output.stop()
    assert wire.of("clear") == [] and output.clears == 0


async def test_a_closed_connection_ends_the_output_quietly():
    session = StandInSession()

    async def broken(message: dict) -> None:
        raise ConnectionError("gone")

    output = TwilioOutput(session, stream_sid="MZ2", send=broken)
    play = UtterancePlay(id="u")
    session.playout.add(play)
    session.playout.push(play, [b"\x03" * 160] * 3)
    output.start()
    await asyncio.wait_for(output._task, 5)
    assert output._task.exception() is None and output.frames_sent == 0
