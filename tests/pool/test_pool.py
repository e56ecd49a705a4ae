"""The pool's replica, spoken to directly (raw HTTP) and through RemoteEngineClient: real Ray Serve."""

from __future__ import annotations

import aiohttp
import numpy as np
import pytest

from voxgate.engine import tone
from voxgate.engine.base import SynthesisOptions
from voxgate.engine.pool_protocol import (
    FRAME_HEAD, MAX_PCM_BYTES, STREAM_PATH, PoolProtocolError, StreamRequest, frame_sizes, pack_frame, parse_header,
)
from voxgate.engine.remote import RemoteEngineClient


@pytest.fixture
async def remote(pool):
    client = RemoteEngineClient(pool.url)
    await client.start()
    yield client
    await client.close()


async def read_frame(resp: aiohttp.ClientResponse) -> tuple[dict, bytes]:
    n_head, n_pcm = frame_sizes(await resp.content.readexactly(FRAME_HEAD.size))
    header = parse_header(await resp.content.readexactly(n_head))
    return header, await resp.content.readexactly(n_pcm)


async def test_remote_stream_decodes_to_exactly_the_text(remote):
    stream = remote.stream(SynthesisOptions())
    text = "Hello from the pool. A second unit, ünïcödé too."
    stream.push_text(text)
    stream.end_input()
    chunks = [chunk async for chunk in stream]
    assert [c.unit_index for c in chunks] == sorted(c.unit_index for c in chunks)
    assert "".join(c.text for c in chunks) == text
    assert tone.decode(np.concatenate([c.pcm for c in chunks]), chunks[0].sample_rate) == text
    assert remote.active_streams == 0 and remote.info["engine"] == "tone"


async def test_closing_the_response_stops_the_replica_work(pool):
    """The gateway closes the stream after one frame: the replica's scheduler drops the
    stream (its generator was closed) long before its 8 units were synthesized.

    Each unit is 64 pieces (a word, then a second of silence: one step each), so a
    replica that went on after the close would run 512 steps; the tone engine makes
    a short unit in a millisecond, and 8 of them could all be done before the close
    reaches the replica."""
    before = pool.stats()
    pieces = [["speech", "a", 1.0] if j % 2 == 0 else ["pause", 1000] for j in range(64)]
    units = [[i, pieces] for i in range(8)]
    body = StreamRequest({}, units).encode()
    async with aiohttp.ClientSession() as http:
        resp = await http.post(pool.url + STREAM_PATH.lstrip("/"), data=body)
        header, pcm = await read_frame(resp)
        assert header["kind"] == "chunk" and header["unit_index"] == 0 and len(pcm) > 0
        resp.close()  # what RemoteTransport does on cancel
    after = await pool.wait_stats(lambda s: s["requests"] > before["requests"] and s["streams"] == 0)
    # The work stops with the close, not after 8 units of 64 steps.
    assert after["steps"] - before["steps"] < len(units) * len(pieces) // 4


async def test_the_playout_deadline_travels_with_each_request(remote, pool):
    stream = remote.stream(SynthesisOptions(), start_in_s=4.0)
    stream.push_text("First sentence heard now.")  # one unit: no clause boundary inside
    stream.flush()
    first = await stream.__anext__()
    seen = await pool.wait_stats(lambda s: s["last_start_in_s"] is not None and s["streams"] == 0)
    # The first request carried the stream's start deadline (4 s, less the time to send it).
    assert 3.0 < seen["last_start_in_s"] <= 4.0 and seen["last_playing"] is False
    # A later unit carries how long the listener's audio lasts: the first chunk's duration, at most.
    stream.push_text("Second sentence.")
    stream.end_input()
    rest = [chunk async for chunk in stream]
    assert rest and rest[-1].unit_end
    seen = pool.stats()
    assert seen["last_playing"] is True
    assert 3.0 < seen["last_start_in_s"] <= first.duration + 4.0


async def test_bad_requests_are_refused_with_a_reason(pool):
    async with aiohttp.ClientSession() as http:
        for body in (b"not json", b'{"units": []}', StreamRequest({"colour": "red"}, [[0, "x"]]).encode(),
                     StreamRequest({}, [[0, "x" * 5000]]).encode()):
            async with http.post(pool.url + STREAM_PATH.lstrip("/"), data=body) as resp:
                assert resp.status == 400, body[:40]
                assert (await resp.json())["error"] == "bad_request"


def test_frames_over_the_caps_are_refused_before_reading_them():
    frame = pack_frame({"kind": "chunk"}, np.zeros(4, dtype=np.int16))
    assert frame_sizes(frame[: FRAME_HEAD.size]) == (len(b'{"kind":"chunk"}'), 8)
    with pytest.raises(PoolProtocolError):
        frame_sizes(FRAME_HEAD.pack(10, MAX_PCM_BYTES + 2))
    with pytest.raises(PoolProtocolError):
        parse_header(b'{"kind": "exec"}')
