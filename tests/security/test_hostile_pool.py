"""Issue 39, finding 9: every field a gateway reads from an engine pool or replica is range-checked.

The pool here is a stand-in that speaks the pool protocol (engine/cluster/pool_protocol.py) over
real HTTP on loopback, as a compromised or broken replica would: it is the attacker, so it
is the one thing not real. The gateway's side is the real RemoteEngineClient.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from aiohttp import web

from voxgate.engine.base import SynthesisOptions
from voxgate.engine.errors import EngineCrashed, EngineUnavailable
from voxgate.engine.runtime.codec import pack_frame
from voxgate.engine.cluster.remote import RemoteEngineClient

GOOD_INFO = {"engine": "tone", "voices": ["tone"], "sample_rate": 16000, "supported_tags": []}
GOOD_CHUNK = {"kind": "chunk", "unit_index": 0, "sample_rate": 16000, "text": "Hi.", "words": [["Hi.", 0.0, 0.1]],
              "unit_end": True, "synth_s": 0.01, "synth_ago_s": 0.0}
BAD_CHUNKS = [
    ({"sample_rate": 10}, 20_000),  # 1,000 s of audio from 20 kB (4 MiB: 58 hours)
    ({"sample_rate": 5}, 320),  # crashed the feeder (a range() step of 0)
    ({"sample_rate": 16000}, 4 * 1024 * 1024 - 2),  # 131 s in one chunk
    ({"synth_s": math.nan}, 320),
    ({"synth_ago_s": -1e300}, 320),
    ({"words": [["Hi.", 0.0, math.inf]]}, 320),
    ({"words": [["Hi.", 0.5, 0.1]]}, 320),
    ({"unit_index": -1}, 320),
    ({"unit_end": "no"}, 320),
]


class StandInPool:
    def __init__(self) -> None:
        self.info: dict = dict(GOOD_INFO)
        self.load: dict = {"capacity": 4.0, "speaking": 0.0}
        self.chunk: tuple[dict, int] = (GOOD_CHUNK, 320)

    async def handle_info(self, request: web.Request) -> web.Response:
        return web.Response(text=json.dumps(self.info), content_type="application/json")

    async def handle_stats(self, request: web.Request) -> web.Response:
        return web.Response(text=json.dumps({"load": self.load}), content_type="application/json")

    async def handle_stream(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        header, n_pcm = self.chunk
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(pack_frame(header, np.zeros(n_pcm // 2, dtype=np.int16)))
        await resp.write(pack_frame({"kind": "end"}))
        await resp.write_eof()
        return resp


@pytest.fixture
async def stand_in():
    pool = StandInPool()
    app = web.Application()
    app.router.add_get("/v1/info", pool.handle_info)
    app.router.add_get("/v1/stats", pool.handle_stats)
    app.router.add_post("/v1/stream", pool.handle_stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    pool.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    yield pool
    await runner.cleanup()


async def _speak(client: RemoteEngineClient) -> list:
    stream = client.stream(SynthesisOptions())
    stream.push_text("Hi.")
    stream.end_input()
    return [chunk async for chunk in stream]


async def test_chunk_fields_out_of_range_end_the_stream(stand_in):
    client = RemoteEngineClient(stand_in.url, direct=False)
    await client.start()
    try:
        chunks = await _speak(client)  # the control: a chunk in range plays
        assert [c.sample_rate for c in chunks] == [16000] and len(chunks[0].pcm) == 160
        refused = []
        for change, n_pcm in BAD_CHUNKS:
            stand_in.chunk = ({**GOOD_CHUNK, **change}, n_pcm)
            try:
                await _speak(client)
            except EngineCrashed:
                refused.append(change)
        assert refused == [change for change, _ in BAD_CHUNKS]
    finally:
        await client.close()


@pytest.mark.parametrize("change", [{"sample_rate": 10}, {"voices": [{"a": 1}]}, {"synthesis_cost": 0.0},
                                    {"voices": ["x" * 10_000]}])
async def test_pool_info_out_of_range_is_refused_at_start(stand_in, change):
    stand_in.info = {**GOOD_INFO, **change}
    client = RemoteEngineClient(stand_in.url, direct=False)
    with pytest.raises(EngineUnavailable, match="out of range"):
        await client.start()
    await client.close()


async def test_a_replicas_load_out_of_range_is_left_out(stand_in):
    client = RemoteEngineClient(stand_in.url, direct=False)
    await client.start()
    try:
        assert client.pool_load().capacity == 4.0
        for load in ({"capacity": math.inf, "speaking": 0.0}, {"capacity": 1e300, "speaking": 0.0},
                     {"capacity": 4.0, "speaking": math.nan}, {"capacity": True, "speaking": 0.0}):
            stand_in.load = load
            client.pool.load_read = None
            await client.pool.refresh_load()
            assert client.pool_load() is None, load  # left out: admission falls back as with no report
    finally:
        await client.close()

