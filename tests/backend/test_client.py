"""voxgate.client: text pacing, streamed speech, interruption, events."""

from __future__ import annotations

import asyncio
import gc

import pytest

from voxgate.client import VoxgateError, VoxgateSession, coalesce
from voxgate.engine import tone

from backend_helpers import JoiningRtcClient


async def _tokens(pieces, gap_s):
    for piece in pieces:
        yield piece
        await asyncio.sleep(gap_s)


async def test_first_clause_goes_at_once_then_batches():
    first = ["Hello", " there", ","]
    rest = [f" word{i}" for i in range(30)]
    loop = asyncio.get_running_loop()
    start = loop.time()
    pieces = []
    async for piece in coalesce(_tokens(first + rest, 0.01), batch_s=0.1):
        pieces.append((loop.time() - start, piece))
    assert pieces[0][1] == "Hello there,"  # the first clause, not waiting for a batch
    assert "".join(p for _, p in pieces) == "".join(first + rest)
    assert len(pieces) < len(rest) / 2  # later tokens were coalesced
    print(f"\ncoalesce: {len(first + rest)} tokens -> {len(pieces)} messages; first after {pieces[0][0] * 1000:.0f} ms")


async def test_pending_text_is_sent_when_tokens_stall():
    async def stalled():
        yield "No clause boundary yet"
        await asyncio.sleep(0.5)
        yield " then more."

    got = []
    async for piece in coalesce(stalled(), batch_s=0.05):
        got.append(piece)
    # The first words did not wait for the stalled tokens.
    assert got == ["No clause boundary yet", " then more."]


async def test_say_stream_and_interruption(tone_server):
    async with JoiningRtcClient(tone_server.url, None, None) as listener:
        async with VoxgateSession(tone_server.url, session_id=listener.session_id) as session:
            events = session.events()
            outcome = await session.say_stream(["One, ", "two, ", "three."])
            assert not outcome.interrupted and outcome.text == "One, two, three."
            await listener.wait_tail(await listener.wait_for("utterance.done", id=outcome.id))
            assert tone.decode(listener.audio.pcm(), listener.audio.sample_rate) == "One, two, three."
            seen = []
            async for event in events:
                seen.append(event["type"])
                if event["type"] == "utterance.done":
                    break
            assert seen[:2] == ["utterance.queued", "utterance.started"] and "audio.started" in seen

            consumed = []

            async def endless():
                for i in range(1000):
                    consumed.append(i)
                    yield f"token{i} "
                    await asyncio.sleep(0.02)

            speaking = asyncio.ensure_future(session.say_stream(endless(), id="long"))
            started = await listener.wait_for("audio.started", id="long")
            await listener.audio.wait_frames(15, since=listener.arrival(started))  # some of it has played
            listener.send({"type": "cancel"})
            outcome = await asyncio.wait_for(speaking, 10)
            assert outcome.interrupted and outcome.reason == "cancel" and outcome.id == "long"
            assert outcome.played_ms > 0
            assert outcome.text.startswith(outcome.played_text.strip())
            assert len(consumed) < 1000  # it stopped reading the LLM


async def test_say_stream_whose_tokens_fail_ends_its_utterance_and_raises_the_sources_error(tone_server):
    """An LLM failing mid-reply: the source's own exception comes out of say_stream, the utterance
    is ended (what was sent plays), the next say() plays after it, and no future is left unretrieved."""
    loop = asyncio.get_running_loop()
    unhandled: list = []
    loop.set_exception_handler(lambda _, context: unhandled.append(context))

    class LLMDown(Exception):
        pass

    async def failing():
        yield "Part of a reply, "
        await asyncio.sleep(0.05)
        raise LLMDown("the LLM dropped the stream")

    async def converse() -> None:  # its session is garbage once it returns: a stray future would be reported
        async with JoiningRtcClient(tone_server.url, None, None) as listener:
            async with VoxgateSession(tone_server.url, session_id=listener.session_id) as session:
                with pytest.raises(LLMDown, match="dropped the stream"):
                    await session.say_stream(failing(), id="broken")
                outcome = await asyncio.wait_for(session.say("Next."), 10)
                assert not outcome.interrupted and outcome.text == "Next."
                first = next(e for e in session.history if e.get("id") == "broken" and e["type"] == "utterance.done")
                assert first["text"].strip() == "Part of a reply,"
                # Once more, with the session closed under a failed stream's future.
                with pytest.raises(LLMDown):
                    await session.say_stream(failing(), id="broken-2")

    try:
        await converse()
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert not [c for c in unhandled if "never retrieved" in str(c.get("message"))], unhandled


async def test_every_call_the_server_refuses_raises_its_error_at_once(tone_server):
    async with VoxgateSession(tone_server.url) as session:
        with pytest.raises(VoxgateError) as refused:
            await asyncio.wait_for(session.update(voice="nobody"), 5)
        assert refused.value.code == "unknown_voice" and "nobody" in refused.value.message
        updated = await asyncio.wait_for(session.update(rate=1.5), 5)
        assert updated["rate"] == 1.5
        async with VoxgateSession(tone_server.url, session_id=session.session_id, role="watcher") as watcher:
            for call in (watcher.say("Hi."), watcher.say_stream(["Hi."]), watcher.update(rate=1.0)):
                with pytest.raises(VoxgateError) as refused:
                    await asyncio.wait_for(call, 5)
                assert refused.value.code == "read_only"


async def test_a_long_calls_events_are_kept_within_bounds():
    """A backend on one call for hours: `history` and the events left for wait_for stay capped."""
    import json

    import aiohttp

    from voxgate import client

    class Message:
        type = aiohttp.WSMsgType.TEXT

        def __init__(self, i: int) -> None:
            self.data = json.dumps({"type": "audio.words", "id": "u", "n": i})

    class Socket:
        def __aiter__(self):
            return (Message(i) async for i in _tokens(range(3 * client.MAX_HISTORY), 0))

    session = VoxgateSession("http://127.0.0.1:1")
    session._ws = Socket()  # type: ignore[assignment]
    await session._read()
    assert len(session.history) <= client.MAX_HISTORY and session.history[-1]["n"] == 3 * client.MAX_HISTORY - 1
    assert session._queue.qsize() <= client.MAX_UNREAD + 1  # and the closing event
