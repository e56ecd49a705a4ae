"""The pool's replica, spoken to directly (raw HTTP) and through RemoteEngineClient: real Ray Serve."""

from __future__ import annotations

import json

import aiohttp
import aiohttp.web
import numpy as np
import pytest

from voxgate.engine import tone
from voxgate.engine.base import SynthesisOptions
from voxgate.engine.runtime.codec import FRAME_HEAD, MAX_PCM_BYTES, FrameError, frame_sizes, pack_frame, parse_header
from voxgate.engine.cluster.pool_protocol import (
    INFO_PATH, MAX_REPLICAS_LISTED, STREAM_PATH, PoolProtocolError, StreamRequest, parse_replicas,
)
from voxgate.engine.errors import EngineCrashed
from voxgate.engine.cluster.remote import RemoteEngineClient
from tests.conftest import free_port


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


async def speak_exactly(client: RemoteEngineClient, text: str) -> None:
    stream = client.stream(SynthesisOptions())
    stream.push_text(text)
    stream.end_input()
    chunks = [chunk async for chunk in stream]
    assert tone.decode(np.concatenate([c.pcm for c in chunks]), chunks[0].sample_rate) == text


async def test_streams_go_straight_to_the_replica_that_listens_itself(remote, pool):
    """Serve's direct ingress (on in start_local): the pool lists its replica's own
    address, and the gateway's requests skip the proxy."""
    (replica,) = remote.pool.replicas
    assert replica.rstrip("/") != pool.url.rstrip("/")
    async with aiohttp.ClientSession() as http:
        async with http.get(replica + INFO_PATH) as resp:
            assert (await resp.json())["pid"] == remote.info["pid"]  # the replica itself answers there
    before = pool.stats()["requests"]
    await speak_exactly(remote, "Straight to the replica.")
    assert remote.requests_by_route == {"direct": 1, "proxy": 0}
    assert pool.stats()["requests"] == before + 1


async def test_a_replica_that_cannot_be_reached_falls_back_to_the_proxy(pool):
    client = RemoteEngineClient(pool.url)
    await client.start()
    try:
        (live,) = client.pool.replicas
        gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there: a replica that moved or died
        client.pool.replicas = [gone]
        before = pool.stats()["requests"]
        await speak_exactly(client, "Through the proxy instead.")
        assert client.requests_by_route == {"direct": 0, "proxy": 1}
        assert pool.stats()["requests"] == before + 1  # synthesized once, through the proxy
        assert client.pool.replicas == []
        # A replica that failed stays out for a while, even when the next listing names it.
        client.pool.drop(live, "unreachable in this test")
        await client.pool.refresh_replicas()
        assert client.pool.replicas == []
        client.pool._failed.clear()
        await client.pool.refresh_replicas()
        assert client.pool.replicas == [live]
    finally:
        await client.close()


class FakeServer:
    """A plain aiohttp server on loopback standing in for what a listing may name: a
    port another program holds, a replica that dies after answering, a broken pool."""

    def __init__(self, routes) -> None:
        self.app = aiohttp.web.Application()
        self.app.add_routes(routes)
        self.hits = 0

    async def __aenter__(self) -> str:
        self.runner = aiohttp.web.AppRunner(self.app)
        await self.runner.setup()
        port = free_port()
        await aiohttp.web.TCPSite(self.runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


async def test_a_listed_port_that_answers_as_no_replica_does_goes_through_the_proxy(pool):
    async def busy(request):
        return aiohttp.web.Response(status=503, text="not a replica")

    client = RemoteEngineClient(pool.url)
    await client.start()
    try:
        async with FakeServer([aiohttp.web.post(STREAM_PATH, busy)]) as other:
            client.pool.replicas = [other]
            await speak_exactly(client, "Placed by the proxy.")
        assert client.requests_by_route == {"direct": 0, "proxy": 1} and other in client.pool._failed
    finally:
        await client.close()


async def test_a_replica_that_fails_after_answering_is_not_asked_again_through_the_proxy(pool):
    """Once a replica has the request, it may have synthesized: a cut response ends
    the stream (EngineCrashed) instead of running the text a second time."""
    async def cut(request):
        resp = aiohttp.web.StreamResponse()
        await resp.prepare(request)
        await resp.write(FRAME_HEAD.pack(10, 0))  # half a frame, then the connection goes
        raise ConnectionResetError

    client = RemoteEngineClient(pool.url)
    await client.start()
    try:
        before = pool.stats()["requests"]
        async with FakeServer([aiohttp.web.post(STREAM_PATH, cut)]) as dying:
            client.pool.replicas = [dying]
            stream = client.stream(SynthesisOptions())
            stream.push_text("Said once at most.")
            stream.end_input()
            with pytest.raises(EngineCrashed):
                [chunk async for chunk in stream]
        assert client.requests_by_route == {"direct": 1, "proxy": 0}
        assert pool.stats()["requests"] == before
    finally:
        await client.close()


async def test_a_broken_listing_neither_stops_the_gateway_nor_its_refresher(pool):
    """Deeply nested or oversized JSON at /v1/replicas (a pool gone wrong): the
    gateway starts, lists nothing, and reads the next listing again."""
    answers = {"body": "[" * 100_000 + "]" * 100_000}

    async def info(request):
        return aiohttp.web.json_response({"engine": "tone", "voices": ["tone"]})

    async def replicas(request):
        return aiohttp.web.Response(text=answers["body"], content_type="application/json")

    async with FakeServer([aiohttp.web.get(INFO_PATH, info), aiohttp.web.get("/v1/replicas", replicas)]) as broken:
        client = RemoteEngineClient(broken)
        await client.start()
        try:
            assert client.pool.replicas == [] and client.ready
            answers["body"] = json.dumps({"replicas": [{"url": "http://127.0.0.1:1"}] * 50_000})  # over the size cap
            await client.pool.refresh_replicas()
            assert client.pool.replicas == []
            answers["body"] = json.dumps({"replicas": [{"url": "http://127.0.0.1:1"}]})
            await client.pool.refresh_replicas()
            assert client.pool.replicas == ["http://127.0.0.1:1"]
            assert client._refresher is not None and not client._refresher.done()
        finally:
            await client.close()


async def test_a_gateway_told_not_to_goes_through_the_proxy(pool):
    client = RemoteEngineClient(pool.url, direct=False)
    await client.start()
    try:
        await speak_exactly(client, "Proxy only.")
        assert client.pool.replicas == [] and client.requests_by_route == {"direct": 0, "proxy": 1}
    finally:
        await client.close()


async def test_the_grpc_ingress_streams_the_same_frames(pool):
    """Serve's gRPC proxy with the hand-written servicer (engine/cluster/pool.py): raw bytes
    in and out, the same request body and frames as over HTTP."""
    import grpc

    from voxgate.engine.cluster.pool import APP_NAME, GRPC_SERVICE

    metadata = (("application", APP_NAME),)
    async with grpc.aio.insecure_channel(pool.grpc_address) as channel:
        stream = channel.unary_stream(f"/{GRPC_SERVICE}/Stream")
        text = "Over gRPC."
        frames = [bytes(m) async for m in stream(StreamRequest({}, [[0, text]]).encode(), metadata=metadata)]
        parsed = [split_frame(f) for f in frames]
        assert [h["kind"] for h, _ in parsed][-1] == "end"
        pcm = np.concatenate([np.frombuffer(p, dtype=np.int16) for h, p in parsed if h["kind"] == "chunk"])
        assert tone.decode(pcm, parsed[0][0]["sample_rate"]) == text
        refused = [split_frame(bytes(m)) async for m in stream(b"not json", metadata=metadata)]
        assert [h["kind"] for h, _ in refused] == ["error"] and "JSON" in refused[0][0]["message"]
        stats = await channel.unary_unary(f"/{GRPC_SERVICE}/Stats")(b"", metadata=metadata)
        assert json.loads(stats)["requests"] >= 1


def split_frame(frame: bytes) -> tuple[dict, bytes]:
    n_head, n_pcm = frame_sizes(frame[:FRAME_HEAD.size])
    assert len(frame) == FRAME_HEAD.size + n_head + n_pcm
    return parse_header(frame[FRAME_HEAD.size:FRAME_HEAD.size + n_head]), frame[FRAME_HEAD.size + n_head:]


def test_a_replica_listing_yields_only_plain_numeric_http_addresses():
    listing = {"replicas": [
        {"url": "http://10.0.0.7:30000"}, {"url": "http://[::1]:30001/"}, {"url": "http://10.0.0.7:30000/"},
        {"url": "http://evil.example:30000"}, {"url": "https://10.0.0.8:30000"}, {"url": "http://u:p@10.0.0.9:1"},
        {"url": "http://10.0.0.9"}, {"url": "http://10.0.0.9:99999"}, {"url": "file:///etc/passwd"},
        {"url": "http://10.0.0.9:1/?q=1"}, {"url": 7}, "http://10.0.0.9:2", None, {"url": "http://1.2.3.4:5" + "0" * 300},
    ]}
    assert parse_replicas(listing) == ["http://10.0.0.7:30000", "http://[::1]:30001"]
    many = {"replicas": [{"url": f"http://10.0.{i // 250}.{i % 250}:1"} for i in range(MAX_REPLICAS_LISTED * 4)]}
    assert len(parse_replicas(many)) == MAX_REPLICAS_LISTED
    for bad in (None, [], {"replicas": "x"}, {"nope": []}):
        with pytest.raises(PoolProtocolError):
            parse_replicas(bad)


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
    # The gateway holds 0.2 s back from its listener (the most it may say, proto.MAX_HELD_S).
    stream = remote.stream(SynthesisOptions(), start_in_s=4.0, held_s=0.2)
    stream.push_text("First sentence heard now.")  # one unit: no clause boundary inside
    stream.flush()
    first = await stream.__anext__()
    seen = await pool.wait_stats(lambda s: s["last_start_in_s"] is not None and s["streams"] == 0)
    # The first request carried the stream's start deadline (4 s, less the time to send it).
    assert 3.0 < seen["last_start_in_s"] <= 4.0 and seen["last_playing"] is False
    # A later unit carries how long the listener's audio lasts: the first chunk's duration, at most,
    # less what the gateway holds back.
    stream.push_text("Second sentence.")
    stream.end_input()
    rest = [chunk async for chunk in stream]
    assert rest and rest[-1].unit_end
    seen = pool.stats()
    assert seen["last_playing"] is True
    assert 2.5 < seen["last_start_in_s"] <= first.duration + 3.8


async def test_a_stream_queued_behind_another_is_needed_when_that_ones_audio_runs_out(remote, pool):
    """The gateway opens an utterance queued behind another with `after`: its
    requests carry the earlier stream's deadline (4 s here), not 0, so the
    replica does not rank it as a listener waiting now: behind a stream still
    open (nothing sent yet), and behind one that has ended (all its audio
    received, as when an LLM's next sentence arrives)."""
    first = remote.stream(SynthesisOptions(), start_in_s=4.0)
    first_audio_s = 0.0  # what the first stream's listener hears before the queued one
    try:
        for text in ("Queued behind the first.", "And behind the first once it has ended."):
            before = pool.stats()
            queued = remote.stream(SynthesisOptions(), after=first)
            queued.push_text(text)
            queued.end_input()
            assert [chunk async for chunk in queued]
            seen = await pool.wait_stats(lambda s: s["requests"] > before["requests"] and s["streams"] == 0)
            assert 3.0 + first_audio_s < seen["last_start_in_s"] <= 4.0 + first_audio_s
            assert seen["last_playing"] is False
            if first_audio_s == 0.0:  # for the second round, the first stream says its text and ends
                first.push_text("The first says something.")
                first.end_input()
                first_audio_s = sum(chunk.duration for chunk in [chunk async for chunk in first])
                assert first_audio_s > 0 and first.sid not in remote._transports
    finally:
        first.cancel()


async def test_a_stream_behind_a_cancelled_one_is_needed_at_once(remote, pool):
    first = remote.stream(SynthesisOptions(), start_in_s=4.0)
    queued = remote.stream(SynthesisOptions(), after=first)
    first.cancel()
    before = pool.stats()
    queued.push_text("Needed now.")
    queued.end_input()
    assert [chunk async for chunk in queued]
    seen = await pool.wait_stats(lambda s: s["requests"] > before["requests"] and s["streams"] == 0)
    assert seen["last_start_in_s"] < 1.0


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
    with pytest.raises(FrameError):
        frame_sizes(FRAME_HEAD.pack(10, MAX_PCM_BYTES + 2))
    with pytest.raises(FrameError):
        parse_header(b'{"kind": "exec"}')
