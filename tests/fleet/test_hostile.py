"""Requests through the proxy that a careless proxy would get wrong: a WebSocket
route asked without an upgrade, a record in Redis that is not one of ours, an
answer that arrives in pieces. Real gateways and Redis (conftest.py)."""

from __future__ import annotations

import asyncio
import json
from unittest import mock

import aiohttp
import pytest

from voxgate.signaling.fleet_proxy import read_capped

from .test_routing import AUTH, make_session, next_event, wait_until


async def test_a_plain_get_of_the_websocket_route_takes_no_role(fleet):
    a, b = fleet
    async with aiohttp.ClientSession() as http:
        sid = (await make_session(http, a))["session_id"]
        # Not an upgrade: B must not open a socket to A for it (that socket would
        # hold the session's writer role while the caller gets its error).
        async with http.get(f"{b.url}/v1/sessions/{sid}/ws", headers=AUTH) as resp:
            assert resp.status == 400
        async with http.ws_connect(f"{b.url}/v1/sessions/{sid}/ws", headers=AUTH) as ws:
            ready = await next_event(ws, "session.ready")
            assert ready["role"] == "writer"
        async with http.delete(f"{a.url}/v1/sessions/{sid}", headers=AUTH) as resp:
            assert resp.status == 200


async def test_an_unreadable_record_does_not_stop_the_refresh_of_the_others(fleet, redis_server):
    a, _ = fleet
    r = redis_server.client()
    async with aiohttp.ClientSession() as http:
        first = (await make_session(http, a))["session_id"]
        second = (await make_session(http, a))["session_id"]
        r.set("voxgate:session:" + first, "not json {")
        r.delete("voxgate:session:" + second)
        # The next refresh rewrites both: the unreadable one as A's record again,
        # the missing one as after a Redis restart.
        await wait_until(lambda: r.get("voxgate:session:" + second) is not None, "the missing record rewritten")
        await wait_until(lambda: (r.get("voxgate:session:" + first) or "").startswith("{"), "the unreadable record rewritten")
        assert json.loads(r.get("voxgate:session:" + first))["gw"] == a.url
        for sid in (first, second):
            async with http.delete(f"{a.url}/v1/sessions/{sid}", headers=AUTH) as resp:
                assert resp.status == 200


async def test_an_answer_in_pieces_is_read_whole_and_capped():
    # aiohttp's reader needs a transport protocol to pause and resume; nothing here reads a socket.
    protocol = mock.Mock(_reading_paused=False)
    loop = asyncio.get_running_loop()
    content = aiohttp.StreamReader(protocol, 2**16, loop=loop)

    async def arrive() -> None:
        for piece in (b'{"sdp": "' + b"v" * 1400, b"w" * 1400 + b'"}'):
            content.feed_data(piece)
            await asyncio.sleep(0)  # the next segment comes later: one read() sees only this one
        content.feed_eof()

    feeder = asyncio.ensure_future(arrive())
    body = await read_capped(content, 1 << 20)
    await feeder
    assert json.loads(body)["sdp"] == "v" * 1400 + "w" * 1400

    big = aiohttp.StreamReader(protocol, 2**16, loop=loop)
    big.feed_data(b"x" * 101)
    big.feed_eof()
    with pytest.raises(aiohttp.ClientPayloadError):
        await read_capped(big, 100)
