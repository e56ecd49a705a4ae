"""Any gateway answers about any session: a session made on A, reached through B.

Two real `voxgate serve` processes share a real Redis (conftest.py). B holds
nothing; every request about A's session goes through B's directory lookup and
proxy, and must get what A itself would answer, to the right key only.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import aiohttp
import pytest

from voxgate.engine import tone
from voxgate.rtc_client import OfferRefused, RtcClient
from voxgate.gateway.sessions.registry import TokenSigner

from .conftest import KEY, OTHER_KEY, TOKEN_SECRET, TTL_S

AUTH = {"Authorization": f"Bearer {KEY}"}
OTHER = {"Authorization": f"Bearer {OTHER_KEY}"}


async def make_session(http: aiohttp.ClientSession, gateway) -> dict:
    """A session made on `gateway` itself. The hop header turns placement off
    (tests/fleet/test_placement.py covers that): without it, A may place the
    session on B when B publishes more headroom, and these tests need it on A."""
    async with http.post(gateway.url + "/v1/sessions", headers={**AUTH, "X-Voxgate-Hop": "1"}) as resp:
        assert resp.status == 201, await resp.text()
        return await resp.json()


async def answer(http: aiohttp.ClientSession, method: str, url: str, **kwargs) -> tuple[int, dict]:
    async with http.request(method, url, **kwargs) as resp:
        return resp.status, await resp.json()


async def next_event(ws: aiohttp.ClientWebSocketResponse, kind: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        msg = await asyncio.wait_for(ws.receive(), max(0.01, deadline - time.monotonic()))
        assert msg.type == aiohttp.WSMsgType.TEXT, f"WebSocket ended ({msg.type}) before {kind}"
        event = json.loads(msg.data)
        if event["type"] == kind:
            return event


async def test_session_made_on_a_is_reached_through_b(fleet, redis_server):
    a, b = fleet
    async with aiohttp.ClientSession() as http:
        made = await make_session(http, a)
        sid, token = made["session_id"], made["client_token"]
        # The directory names A, with a hash of the key and never the key itself.
        raw = redis_server.client().get("voxgate:session:" + sid)
        record = json.loads(raw)
        assert record["gw"] == a.url and record["owner"] and KEY not in raw
        assert 0 < redis_server.client().pttl("voxgate:session:" + sid) <= TTL_S * 1000

        status, state = await answer(http, "GET", f"{b.url}/v1/sessions/{sid}", headers=AUTH)
        assert (status, state["session_id"]) == (200, sid)

        # A joining offer through B: A answers with its own ICE candidates, and media flows from A.
        listener = RtcClient(b.url, session_id=sid, token=token)
        try:
            await listener.connect()
            assert listener.session_id == sid
            # Trickle ICE through B reaches A's peer and A's policy (10/8 is not an allowed network).
            refused = {"candidate": "candidate:1 1 udp 2130706431 10.0.0.5 40000 typ host", "sdpMid": "0", "token": token}
            status, body = await answer(http, "POST", f"{b.url}/v1/sessions/{sid}/candidates", json=refused)
            assert (status, body["error"]["code"]) == (403, "candidate_refused")
            status, body = await answer(http, "POST", f"{b.url}/v1/sessions/{sid}/candidates", json={"candidate": None})
            assert (status, body["error"]["code"]) == (401, "token_required")
            # Another session's token is refused by A through B, as A refuses it itself.
            other_token = (await make_session(http, a))["client_token"]
            for gateway in (a, b):
                status, body = await answer(http, "POST", f"{gateway.url}/v1/sessions/{sid}/candidates", json={**refused, "token": other_token})
                assert (status, body["error"]["code"]) == (403, "token_mismatch"), gateway.url
            # The session's ICE servers through B: A knows the session, B alone would not.
            status, body = await answer(http, "GET", f"{b.url}/v1/ice-servers", params={"token": token})
            assert (status, body) == (200, {"ice_servers": []})

            # The backend WebSocket through B, both ways, frame by frame.
            async with http.ws_connect(f"{b.url}/v1/sessions/{sid}/ws", headers=AUTH) as ws:
                ready = await next_event(ws, "session.ready")
                assert (ready["session_id"], ready["role"]) == (sid, "writer")
                await ws.send_str(json.dumps({"type": "speak", "text": "through b", "id": "u1"}))
                started = await next_event(ws, "audio.started")
                assert started["id"] == "u1"
                await next_event(ws, "utterance.done")
                await listener.wait_tail(await listener.wait_for("utterance.done", id="u1"))
                assert tone.decode(listener.audio.pcm(), listener.audio.sample_rate) == "through b"
                status, state = await answer(http, "GET", f"{b.url}/v1/sessions/{sid}", headers=AUTH)
                assert state["connected"]["webrtc"] == {"state": "connected"} and state["writer"] is not None

                # Another key gets through B exactly what it gets from A: nothing.
                for gateway in (a, b):
                    for method in ("GET", "DELETE"):
                        status, body = await answer(http, method, f"{gateway.url}/v1/sessions/{sid}", headers=OTHER)
                        assert (status, body["error"]["code"]) == (404, "unknown_session"), (gateway.url, method)
                    with pytest.raises(aiohttp.WSServerHandshakeError) as refused_ws:
                        await http.ws_connect(f"{gateway.url}/v1/sessions/{sid}/ws", headers=OTHER)
                    assert refused_ws.value.status == 404
                    status, body = await answer(http, "GET", f"{gateway.url}/v1/sessions/{sid}")
                    assert (status, body["error"]["code"]) == (401, "unauthorized")

                # DELETE through B ends the session on A: the WebSocket hears it, the record goes.
                status, body = await answer(http, "DELETE", f"{b.url}/v1/sessions/{sid}", headers=AUTH)
                assert (status, body) == (200, {"session_id": sid, "closed": True})
                closed = await next_event(ws, "session.closed")
                assert closed["type"] == "session.closed"
        finally:
            await listener.close()
        # Deleted, not left to expire: from here the record could only outlive its TTL.
        redis_server.client().pexpire("voxgate:session:" + sid, 60_000)
        await wait_until(lambda: redis_server.client().get("voxgate:session:" + sid) is None, "the record deleted")
        status, body = await answer(http, "GET", f"{b.url}/v1/sessions/{sid}", headers=AUTH)
        assert (status, body["error"]["code"]) == (404, "unknown_session")


async def test_unknown_ids_get_404_never_another_gateway(fleet):
    a, b = fleet
    unknown = "f" * 32
    token = TokenSigner(TOKEN_SECRET, 60).issue(unknown)
    async with aiohttp.ClientSession() as http:
        status, body = await answer(http, "GET", f"{b.url}/v1/sessions/{unknown}", headers=AUTH)
        assert (status, body["error"]["code"]) == (404, "unknown_session")
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(f"{b.url}/v1/sessions/{unknown}/ws", headers=AUTH)
        assert refused.value.status == 404
        listener = RtcClient(b.url, token=token)
        try:
            with pytest.raises(OfferRefused) as offer:
                await listener.connect()
            assert (offer.value.status, offer.value.body["error"]["code"]) == (404, "unknown_session")
        finally:
            await listener.close()
        # A request that was proxied once is answered where it lands, never sent on:
        # A's own session asked of B with the hop header gets B's local answer.
        made = await make_session(http, a)
        hop = {**AUTH, "X-Voxgate-Hop": "1"}
        status, body = await answer(http, "GET", f"{b.url}/v1/sessions/{made['session_id']}", headers=hop)
        assert (status, body["error"]["code"]) == (404, "unknown_session")
        status, _ = await answer(http, "DELETE", f"{a.url}/v1/sessions/{made['session_id']}", headers=AUTH)
        assert status == 200


def test_redis_url_needs_an_advertise_url():
    proc = subprocess.run(
        [sys.executable, "-m", "voxgate.cli", "serve", "--redis-url", "redis://127.0.0.1:1/0"],
        capture_output=True, text=True, timeout=60, env={k: v for k, v in os.environ.items() if not k.startswith("VOXGATE_")},
    )
    assert proc.returncode == 2 and "--advertise-url" in proc.stderr, proc.stderr


def test_standalone_gateway_does_not_import_redis():
    code = (
        "import sys; from voxgate.config import Settings; from voxgate.signaling.server import create_app; "
        "create_app(Settings(engine='tone')); print(sorted(m for m in sys.modules if m == 'redis' or m.endswith('.fleet')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "[]"


async def wait_until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout} s")
        await asyncio.sleep(0.05)  # polls state in another process; ends as soon as it holds
