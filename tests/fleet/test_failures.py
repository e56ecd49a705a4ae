"""A gateway dies, Redis restarts: the directory heals, nobody crashes.

A gateway killed with SIGKILL cannot delete its records: they expire after the
TTL, and until then the others answer 502 `owner_unreachable`; a backend
connected through another gateway sees its WebSocket close at once. Redis
restarted empty: gateways keep serving their own sessions, answer 503
`directory_unavailable` for the others', and rebuild the records on their next
refresh.
"""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp

from .conftest import TTL_S
from .test_routing import AUTH, answer, make_session, next_event, wait_until


async def directory_up(http: aiohttp.ClientSession, gateway) -> float:
    async with http.get(gateway.url + "/metrics") as resp:
        text = await resp.text()
    return float(re.search(r"^voxgate_directory_up (\S+)$", text, re.M).group(1))


async def wait_status(http, url: str, wanted: int, what: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status, body = await answer(http, "GET", url, headers=AUTH)
        if status == wanted:
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: still {status} {body} after {timeout} s")
        await asyncio.sleep(0.1)  # polls the other processes; ends as soon as they answer


async def test_killed_gateway_records_expire_and_its_websockets_close(doomed, fleet, redis_server):
    _, b = fleet
    redis = redis_server.client()
    async with aiohttp.ClientSession() as http:
        sid = (await make_session(http, doomed))["session_id"]
        key = "voxgate:session:" + sid
        # Killed after a refresh, so that it is the refreshed record that must expire.
        first = redis.get(key)
        await wait_until(lambda: redis.get(key) != first, "the record refreshed")
        async with http.ws_connect(f"{b.url}/v1/sessions/{sid}/ws", headers=AUTH) as ws:
            await next_event(ws, "session.ready")
            doomed.kill()
            # The backend connected through B hears its session's gateway go.
            msg = await asyncio.wait_for(ws.receive(), 10.0)
            assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), msg
            assert ws.close_code == 1001
        # Until the record expires, B knows the holder and says it does not answer.
        if redis.pttl(key) > 500:
            status, body = await answer(http, "GET", f"{b.url}/v1/sessions/{sid}", headers=AUTH)
            assert (status, body["error"]["code"]) == (502, "owner_unreachable")
        await wait_until(lambda: redis.get(key) is None, "the dead gateway's record expired", timeout=TTL_S + 5)
        status, body = await answer(http, "GET", f"{b.url}/v1/sessions/{sid}", headers=AUTH)
        assert (status, body["error"]["code"]) == (404, "unknown_session")


async def test_redis_restart_rebuilds_the_directory(fleet, redis_server):
    a, b = fleet
    async with aiohttp.ClientSession() as http:
        before = (await make_session(http, a))["session_id"]
        redis_server.stop()
        try:
            # B cannot know where A's session is, and says so; A still serves it.
            status, body = await answer(http, "GET", f"{b.url}/v1/sessions/{before}", headers=AUTH)
            assert (status, body["error"]["code"]) == (503, "directory_unavailable")
            status, _ = await answer(http, "GET", f"{a.url}/v1/sessions/{before}", headers=AUTH)
            assert status == 200
            await wait_until_async(lambda: directory_up(http, a), 0.0, "A's voxgate_directory_up 0")
            # A session made during the outage works on A and is recorded later.
            during = (await make_session(http, a))["session_id"]
        finally:
            redis_server.start()  # empty: no persistence
        for sid in (before, during):
            body = await wait_status(http, f"{b.url}/v1/sessions/{sid}", 200, "record rebuilt by A's refresh", TTL_S + 5)
            assert body["session_id"] == sid
        # B reads Redis again at once (lookups), but marks it up only at its own next refresh.
        for gateway in (a, b):
            await wait_until_async(lambda: directory_up(http, gateway), 1.0, "voxgate_directory_up 1 again", TTL_S + 5)
        assert a.proc.poll() is None and b.proc.poll() is None
        for sid in (before, during):
            status, _ = await answer(http, "DELETE", f"{b.url}/v1/sessions/{sid}", headers=AUTH)
            assert status == 200


async def wait_until_async(read, wanted: float, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while await read() != wanted:
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout} s")
        await asyncio.sleep(0.1)
