"""Issue 39, findings 2, 3 and 8: the directory is not trusted blindly, and lookups cost
nothing before authentication. Real gateways and a real Redis (conftest.py).

Whoever can write to Redis plays the attacker here: they point a session's record at a
server of their own (a plain aiohttp app in this process that records what reaches it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time

import aiohttp
from aiohttp import web

from voxgate.gateway.fleet.directory import KEY_PREFIX
from voxgate.gateway.fleet.directory_records import RecordSigner, SessionRecord, key_id

from .conftest import KEY, TOKEN_SECRET, TTL_S
from .test_routing import AUTH, OTHER, answer, make_session, wait_until


@contextlib.asynccontextmanager
async def attacker_server():
    """An HTTP server that answers everything 200 and keeps every request's headers."""
    seen: list[dict] = []

    async def anything(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.json_response({"session_id": "stolen"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    finally:
        await runner.cleanup()


def record_is_holders(r, sid: str, holder) -> bool:
    raw = r.get(KEY_PREFIX + sid)
    if raw is None:
        return False
    record, why = SessionRecord.decode(sid, raw, RecordSigner(TOKEN_SECRET))
    return why == "ok" and record.gateway == holder.url


async def test_a_forged_record_is_refused_and_repaired_by_its_holder(fleet, redis_server):
    a, b = fleet
    r = redis_server.client()
    async with aiohttp.ClientSession() as http, attacker_server() as (evil, seen):
        sid = (await make_session(http, a))["session_id"]
        # What someone with Redis access but not the fleet's secret can write: a record of the old
        # shape, and one with a made-up signature.
        for forged in ({"gw": evil, "owner": key_id(KEY), "exp": time.time() + 60},
                       {"gw": evil, "owner": key_id(KEY), "exp": f"{time.time() + 60:.3f}", "sig": "0" * 64}):
            r.set(KEY_PREFIX + sid, json.dumps(forged), px=60_000)
            status, body = await answer(http, "GET", f"{b.url}/v1/sessions/{sid}", headers=AUTH)
            assert (status, body["error"]["code"]) == (503, "record_refused"), body
            assert seen == []  # the key went nowhere
            # A, which holds the session, rewrites its own record at its next refresh.
            await wait_until(lambda: record_is_holders(r, sid, a), "the forged record repaired by its holder", TTL_S * 3)
            status, body = await answer(http, "GET", f"{b.url}/v1/sessions/{sid}", headers=AUTH)
            assert status == 200 and body["session_id"] == sid
        assert seen == []
        status, _ = await answer(http, "DELETE", f"{a.url}/v1/sessions/{sid}", headers=AUTH)
        assert status == 200


async def test_a_signed_record_naming_no_gateway_of_the_fleet_is_not_followed(fleet, redis_server):
    _, b = fleet
    r = redis_server.client()
    sid = "unlisted-" + secrets.token_hex(8)
    async with aiohttp.ClientSession() as http, attacker_server() as (evil, seen):
        record = SessionRecord(sid, evil, key_id(KEY), time.time() + 60)
        r.set(KEY_PREFIX + sid, record.encode(RecordSigner(TOKEN_SECRET)), px=60_000)
        status, body = await answer(http, "GET", f"{b.url}/v1/sessions/{sid}", headers=AUTH)
        assert (status, body["error"]["code"]) == (503, "owner_unknown"), body
        assert seen == []
    r.delete(KEY_PREFIX + sid)


async def test_a_deeply_nested_record_is_a_json_error(fleet, redis_server):
    _, b = fleet
    r = redis_server.client()
    sid = "nested-" + secrets.token_hex(8)
    r.set(KEY_PREFIX + sid, "[" * 200_000 + "]" * 200_000, px=60_000)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{b.url}/v1/sessions/{sid}", headers=AUTH) as resp:
            assert resp.status == 503 and resp.content_type == "application/json", await resp.text()
            assert (await resp.json())["error"]["code"] == "record_refused"
    r.delete(KEY_PREFIX + sid)
    assert "Traceback" not in open(b.log_path).read()


async def test_another_keys_session_costs_no_hop_and_the_key_stays_here(fleet):
    a, b = fleet
    async with aiohttp.ClientSession() as http:
        sid = (await make_session(http, a))["session_id"]
        before = await _proxied_gets(http, b)
        status, body = await answer(http, "GET", f"{b.url}/v1/sessions/{sid}", headers=OTHER)
        assert (status, body["error"]["code"]) == (404, "unknown_session")
        # B answered from the record's owner; the other key was never sent to A.
        assert await _proxied_gets(http, b) == before
        status, _ = await answer(http, "GET", f"{b.url}/v1/sessions/{sid}", headers=AUTH)
        assert status == 200 and await _proxied_gets(http, b) == before + 1
        status, _ = await answer(http, "DELETE", f"{a.url}/v1/sessions/{sid}", headers=AUTH)
        assert status == 200


async def _proxied_gets(http: aiohttp.ClientSession, gateway) -> float:
    async with http.get(gateway.url + "/metrics") as resp:
        text = await resp.text()
    wanted = 'voxgate_fleet_proxied_total{outcome="proxied",route="get"}'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(wanted))


async def test_an_absolute_request_line_is_proxied_by_its_path(fleet):
    a, b = fleet
    async with aiohttp.ClientSession() as http:
        sid = (await make_session(http, a))["session_id"]
    reader, writer = await asyncio.open_connection("127.0.0.1", b.port)
    # Absolute form (RFC 9112 3.2.2), naming a host the Host allow-list lets through: the target
    # must still be the holder's URL and the path, never the line.
    writer.write((f"GET http://127.0.0.1:1/v1/sessions/{sid} HTTP/1.1\r\nHost: 127.0.0.1:{b.port}\r\n"
                  f"Authorization: Bearer {KEY}\r\nConnection: close\r\n\r\n").encode())
    data = await asyncio.wait_for(reader.read(), 20)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"200", data[:300]
    assert json.loads(body)["session_id"] == sid
    async with aiohttp.ClientSession() as http:
        status, _ = await answer(http, "DELETE", f"{a.url}/v1/sessions/{sid}", headers=AUTH)
        assert status == 200


@contextlib.contextmanager
def _commands_naming(r, words: set[str]):
    """Every command Redis runs while the block runs that names one of `words` (MONITOR in a
    thread). Counting all GETs would also count the gateways' own refreshes, whose script
    reads the records it rewrites every few seconds."""
    import threading

    seen: list[str] = []
    end = "voxgate-test-end-" + secrets.token_hex(4)
    ready = threading.Event()

    def watch() -> None:
        with r.monitor() as m:
            ready.set()
            for info in m.listen():
                command = info["command"]
                if end in command:
                    return
                if any(w in command for w in words):
                    seen.append(command)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield seen
    finally:
        r.echo(end)
        thread.join(10)


async def test_lookup_floods_cost_redis_nothing_before_authentication_and_owned_sessions_keep_working(fleet, redis_server):
    a, b = fleet
    r = redis_server.client()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        made = await make_session(http, a)
        sid = made["session_id"]

        ids = [secrets.token_hex(16) for _ in range(400)]

        async def unauthenticated(sid: str, n: int) -> int:
            async with http.post(f"{b.url}/v1/sessions/{sid}/candidates",
                                 json={"candidate": "candidate:1 1 udp 1 127.0.0.1 9 typ host", "token": f"x.{n}"}) as resp:
                await resp.read()
                return resp.status

        with _commands_naming(r, set(ids)) as lookups:
            statuses = await asyncio.gather(*(unauthenticated(sid, n) for n, sid in enumerate(ids)))
        assert set(statuses) == {401}, sorted(set(statuses))
        assert lookups == []  # not one lookup reached Redis

        # 400 authenticated lookups at once (a key holder's own flood) wait for the lookup pool
        # instead of failing, while a backend's requests about its session on A go through B.
        async def keyed() -> int:
            async with http.get(f"{b.url}/v1/sessions/{secrets.token_hex(16)}", headers=AUTH) as resp:
                await resp.read()
                return resp.status

        async def owned() -> list[int]:
            out = []
            for _ in range(10):
                async with http.get(f"{b.url}/v1/sessions/{sid}", headers=AUTH) as resp:
                    await resp.read()
                    out.append(resp.status)
            return out

        flood, mine = await asyncio.gather(asyncio.gather(*(keyed() for _ in range(400))), owned())
        assert set(flood) == {404}, sorted(set(flood))
        assert mine == [200] * 10
        async with http.get(b.url + "/metrics") as resp:
            assert "voxgate_directory_up 1.0" in await resp.text()
        status, _ = await answer(http, "DELETE", f"{a.url}/v1/sessions/{sid}", headers=AUTH)
        assert status == 200


def test_a_fleet_needs_the_shared_token_secret():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("VOXGATE_")}
    proc = subprocess.run(
        [sys.executable, "-m", "voxgate.cli", "serve", "--redis-url", "redis://127.0.0.1:1/0",
         "--advertise-url", "http://127.0.0.1:8080"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "--token-secret" in proc.stderr, proc.stderr
