"""A real gateway (`voxgate serve --engine-url`) on the real pool, heard by a real aiortc client over loopback."""

from __future__ import annotations

import asyncio

from voxgate.engine import tone
from voxgate.rtc_client import RtcClient


async def test_speech_from_the_pool_decodes_to_exactly_the_text(pool_gateway):
    async with RtcClient(pool_gateway.url) as client:
        texts = ["First from the pool.", "Second, queued behind it!"]
        sent = client.send({"type": "speak", "text": texts[0], "id": "a"})
        client.send({"type": "speak", "text": texts[1], "id": "b"})
        for uid in "ab":
            done = await client.wait_for("utterance.done", id=uid, timeout=30)
        await client.wait_tail(done)
        assert tone.decode(client.audio.pcm(sent), client.audio.sample_rate) == "".join(texts)


async def test_cancel_at_the_gateway_stops_the_replica(pool_gateway, pool):
    async with RtcClient(pool_gateway.url) as client:
        before = pool.stats()
        long = "A long answer that the listener interrupts before it ends. " * 20
        client.send({"type": "text.delta", "text": long, "id": "c"})
        await client.wait_for("audio.started", id="c")
        client.send({"type": "cancel"})
        await client.wait_for_any(("utterance.done", "utterance.interrupted"), timeout=10)
        after = await pool.wait_stats(lambda s: s["streams"] == 0)
        # 20 sentences were sent; the replica stopped within a few of them.
        assert after["steps"] - before["steps"] < 20


async def test_a_replica_killed_mid_speech(pool_gateway, pool):
    """A stream whose replica dies ends with engine_crashed, as with a local worker; the peers
    stay connected, and once Serve has replaced the replica the next utterance plays.

    The tone engine is instant, so a replica may already have sent a stream's whole answer
    (the gateway reads it at the listener's pace) when it is killed; more text on the same
    stream then reaches the pool after the kill. Where Serve's proxy already routes that to
    the new replica, the stream plays on to its end, which is as good for the listener.
    """
    async with RtcClient(pool_gateway.url) as a, RtcClient(pool_gateway.url) as b:
        # About 5 s of tone, not 17: a stream the replica sent whole plays out before its utterance.done.
        long = "A long utterance that is still playing when the replica dies. " * 2
        more = "More words sent after it died."
        a.send({"type": "text.delta", "text": long, "id": "a1"})
        b.send({"type": "text.delta", "text": long, "id": "b1"})
        await a.wait_for("audio.started", id="a1")
        await b.wait_for("audio.started", id="b1")
        killed = pool.kill_replica()
        for client, uid in ((a, "a1"), (b, "b1")):
            client.send({"type": "text.delta", "text": more, "id": uid})
            client.send({"type": "text.end", "id": uid})
        for client, uid in ((a, "a1"), (b, "b1")):
            event = await client._next(lambda e: e["type"] == "error" or (e["type"] == "utterance.done" and e.get("id") == uid), 60, uid)
            if event["type"] == "error":
                assert event["code"] == "engine_crashed" and "restart" in event["message"], event
        for attempt in range(300):
            uid = f"a2-{attempt}"
            sent = a.send({"type": "speak", "text": "Back after the crash.", "id": uid})
            event = await a._next(lambda e: e.get("id") == uid and e["type"] in ("utterance.done", "error"), 60, uid)
            if event["type"] == "utterance.done":
                break
            assert event["code"] in ("engine_crashed", "engine_unavailable"), event
            await asyncio.sleep(0.1)  # Serve is still starting the new replica
        assert event["text"] == "Back after the crash."
        await a.wait_tail(event)
        # Whatever of a1 was already buffered plays out (how much depends on how long Serve
        # took to replace the replica), then the new utterance, whole: the listener hears a
        # clean prefix of a1 and nothing of it after the new utterance.
        heard = tone.decode(a.audio.pcm(), a.audio.sample_rate)
        assert heard.endswith("Back after the crash.")
        assert tone.decode(a.audio.pcm(sent), a.audio.sample_rate).endswith("Back after the crash.")
        before = heard[: -len("Back after the crash.")].rstrip()
        assert before and (long + more).startswith(before), before
        assert a.pc.connectionState == "connected" and b.pc.connectionState == "connected"
        assert pool.replica_actors() and killed not in pool.replica_actors()
        assert pool_gateway.proc.poll() is None
