"""The engine worker process through its client: streams, cancel, crash recovery, backpressure."""

import asyncio
import os
import signal
import time

import numpy as np
import pytest

from voxgate.engine import tone
from voxgate.engine.base import SynthesisOptions
from voxgate.engine.runtime.client import STREAM_WINDOW, EngineClient, EngineConfig
from voxgate.engine.errors import EngineCrashed, EngineStreamError


async def collect(stream):
    return [chunk async for chunk in stream]


async def spoken(client, text: str) -> str:
    """What a fresh stream of `client` says for `text` (the tone engine's decoding)."""
    stream = client.stream()
    stream.push_text(text)
    stream.end_input()
    pcm = np.concatenate([c.pcm for c in await collect(stream)])
    return tone.decode(pcm, tone.SAMPLE_RATE)


async def test_tone_stream_roundtrips_text_exactly_in_order(tone_client):
    text = "Hello there, this is the tone engine. It speaks every byte; even ünïcode!"
    stream = tone_client.stream()
    for piece in text.split(" "):
        stream.push_text(piece + " ")
    stream.end_input()
    chunks = await collect(stream)
    assert [c.unit_index for c in chunks] == sorted(c.unit_index for c in chunks)
    pcm = np.concatenate([c.pcm for c in chunks])
    assert tone.decode(pcm, tone.SAMPLE_RATE).strip() == text


async def test_many_concurrent_streams_each_get_their_own_text(tone_client):
    texts = [f"Stream number {i} says {'abc' * i}. Then it ends." for i in range(1, 13)]
    streams = [tone_client.stream() for _ in texts]
    for stream, text in zip(streams, texts):
        stream.push_text(text)
        stream.end_input()
    results = await asyncio.gather(*(collect(s) for s in streams))
    for text, chunks in zip(texts, results):
        pcm = np.concatenate([c.pcm for c in chunks])
        assert tone.decode(pcm, tone.SAMPLE_RATE).strip() == text


async def test_cancel_stops_the_stream_and_the_worker_serves_the_next(tone_client):
    stream = tone_client.stream()
    stream.push_text("One. " * 40)  # many units
    first = await stream.__anext__()
    assert len(first.pcm) > 0
    stream.cancel()
    rest = await collect(stream)
    assert rest == []
    assert tone_client.active_streams == 0
    assert await spoken(tone_client, "After cancel.") == "After cancel."


async def test_slow_consumer_does_not_grow_the_queue(tone_client):
    stream = tone_client.stream()
    text = "".join(f"Sentence number {i} is here. " for i in range(50))
    stream.push_text(text)
    stream.end_input()
    await asyncio.sleep(1.0)  # the tone engine could have made all 50 units by now, had it no credit limit
    assert stream._queue.qsize() <= STREAM_WINDOW
    chunks = await collect(stream)
    # Everything still arrives once read: every unit, in order, nothing lost.
    indices = [c.unit_index for c in chunks]
    assert indices == sorted(indices) and set(indices) == set(range(indices[-1] + 1))
    pcm = np.concatenate([c.pcm for c in chunks])
    assert tone.decode(pcm, tone.SAMPLE_RATE).strip() == text.strip()


async def test_unknown_voice_is_a_clear_stream_error(tone_client):
    stream = tone_client.stream(SynthesisOptions(voice="nobody"))
    stream.push_text("Hello.")
    stream.end_input()
    with pytest.raises(EngineStreamError, match="unknown voice"):
        await collect(stream)


async def test_a_killed_worker_ends_streams_with_an_error_and_restarts(tone_client):
    stream = tone_client.stream()
    stream.push_text("Before the crash. " * 30)
    await stream.__anext__()
    old_pid = tone_client.worker_pid
    os.kill(old_pid, signal.SIGKILL)
    with pytest.raises(EngineCrashed):
        await asyncio.wait_for(collect(stream), 10)
    for _ in range(200):
        if tone_client.ready:
            break
        await asyncio.sleep(0.05)
    assert tone_client.ready and tone_client.worker_pid != old_pid
    assert tone_client.restarts == 1
    assert await spoken(tone_client, "Back again.") == "Back again."


async def test_a_hung_worker_is_killed_within_its_bound_and_restarts():
    """A worker that hangs with its pipe open (SIGSTOP freezes it as a deadlock would: no EOF,
    no answer) is killed once a ping waits the bound, and restarts as a crashed one does."""
    bound = 1.0
    client = EngineClient(EngineConfig(engine="tone", parallel=2, ping_timeout=bound))
    await client.start()
    try:
        streams = [client.stream() for _ in range(2)]
        for stream in streams:
            stream.push_text("Before the hang. " * 30)
            await stream.__anext__()
        old_pid = client.worker_pid
        os.kill(old_pid, signal.SIGSTOP)
        hung_at = time.monotonic()
        for stream in streams:
            with pytest.raises(EngineCrashed):
                await asyncio.wait_for(collect(stream), 4 * bound)
        # Within the bound and one ping interval (a quarter of it), with room for a loaded machine.
        assert time.monotonic() - hung_at < 3 * bound
        assert client.hung_kills == 1 and client.restarts == 1
        for _ in range(200):
            if client.ready:
                break
            await asyncio.sleep(0.05)
        assert client.ready and client.worker_pid != old_pid
        assert await spoken(client, "Back again.") == "Back again."
        assert client.hung_kills == 1  # the new worker answers its pings
    finally:
        await client.close()


async def test_first_unit_goes_out_on_timeout_without_a_boundary():
    client = EngineClient(EngineConfig(engine="tone", parallel=1, first_unit_timeout=0.1))
    await client.start()
    try:
        stream = client.stream()
        stream.push_text("so what I was thinking is")  # no punctuation, no end
        chunk = await asyncio.wait_for(stream.__anext__(), 5)
        assert tone.decode(chunk.pcm, tone.SAMPLE_RATE) == "so what I was thinking "
        stream.cancel()
    finally:
        await client.close()


@pytest.mark.slow
async def test_piper_worker_streams_the_real_voice_and_a_new_stream_is_not_starved():
    # The watchdog at its shortest bound: a worker busy with long steps still answers every ping.
    client = EngineClient(EngineConfig(engine="piper", parallel=1, threads=1, ping_timeout=0.5))
    await client.start()
    try:
        assert client.info["sample_rate"] == 22050 and "joe" in client.info["voices"]
        order = []
        long = client.stream()
        long.push_text(" ".join(f"This is sentence number {i} of a long answer." for i in range(12)))
        long.end_input()

        async def read_long():
            async for chunk in long:
                order.append(("long", chunk.unit_index))
                await asyncio.sleep(0)

        reader = asyncio.ensure_future(read_long())
        while len(order) < 2:
            await asyncio.sleep(0.01)
        short = client.stream()
        short.push_text("Hi!")
        short.end_input()
        short_chunks = []
        async for chunk in short:
            order.append(("short", chunk.unit_index))
            short_chunks.append(chunk)
        assert all(c.sample_rate == 22050 for c in short_chunks)
        assert sum(c.duration for c in short_chunks) > 0.2
        assert [w.text for c in short_chunks for w in c.words] == ["Hi!"]
        await reader
        # The new stream's first chunk came before the long stream finished.
        assert order.index(("short", 0)) < len(order) - 1
        # Every unit of the long stream, in order (a unit streams as several chunks).
        long_units = [i for kind, i in order if kind == "long"]
        assert long_units == sorted(long_units) and set(long_units) == set(range(12))
        assert client.hung_kills == 0 and client.restarts == 0, client.slowest_ping_s
    finally:
        await client.close()
