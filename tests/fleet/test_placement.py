"""Placement across a fleet (issue 41): two real `voxgate serve` processes and a real Redis, one
gateway full. Every session asked of the full one is made on the other, its URLs point there,
and it speaks to a real WebRTC listener; an offer the full one refuses names the other.

The full gateway is made full deterministically: `--synthesis-budget 0.1` is less than one
conversation at the default --talk-share of 0.4, so its admission refuses every new session.
The fleet has its own Redis, so the session-scoped gateways of the other fleet tests are not
candidates.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import aiohttp
import pytest

from voxgate.engine import tone
from voxgate.rtc_client import OfferRefused, RtcClient

from .conftest import FleetGateway, RedisServer
from .test_routing import AUTH, next_event


def _wait_up(gateway: FleetGateway, timeout: float = 90.0) -> None:
    """Until the gateway answers /readyz with its engine loaded (a full one answers 503)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gateway.proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {gateway.proc.returncode}; log:\n{open(gateway.log_path).read()[-3000:]}")
        try:
            with urllib.request.urlopen(gateway.url + "/readyz", timeout=1) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read())
        except OSError:
            body = {}
        if body.get("engine"):
            return
        time.sleep(0.2)  # another process starting up
    raise RuntimeError(f"gateway not up after {timeout} s")


@pytest.fixture(scope="module")
def full_and_roomy():
    redis = RedisServer()
    full = FleetGateway("full", redis.url, ["--synthesis-budget", "0.1"])
    roomy = FleetGateway("roomy", redis.url)
    try:
        for gateway in (full, roomy):
            _wait_up(gateway)
        yield redis, full, roomy
    finally:
        for gateway in (full, roomy):
            gateway.stop()
        redis.stop()


async def _metric(http: aiohttp.ClientSession, gateway, name: str) -> float:
    async with http.get(gateway.url + "/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _wait_metric(http, gateway, name: str, value: float, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while await _metric(http, gateway, name) != value:
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} never {value} on {gateway.url}")
        await asyncio.sleep(0.1)  # another process's state, published through Redis each second


async def _speaks(http: aiohttp.ClientSession, made: dict, text: str) -> None:
    """A listener at the answer's offer URL and a backend at its ws_url: the listener hears `text`."""
    base = made["offer_url"][: -len("/v1/offer")]
    listener = RtcClient(base, session_id=made["session_id"], token=made["client_token"])
    try:
        await listener.connect()
        async with http.ws_connect(made["ws_url"], headers=AUTH) as ws:
            await next_event(ws, "session.ready")
            await ws.send_str(json.dumps({"type": "speak", "text": text, "id": "u1"}))
            await next_event(ws, "utterance.done", timeout=20.0)
        await listener.wait_tail(await listener.wait_for("utterance.done", id="u1"))
        assert tone.decode(listener.audio.pcm(), listener.audio.sample_rate) == text
    finally:
        await listener.close()


async def test_every_new_session_lands_on_the_gateway_with_room_and_speaks(full_and_roomy):
    redis, full, roomy = full_and_roomy
    # A load written by someone with Redis access but not the fleet's secret, for a
    # gateway that is not in the fleet, with all the headroom there is: never placed on.
    redis.client().hset("voxgate:load", "http://127.0.0.1:9", json.dumps(
        {"exp": f"{time.time() + 3600:.3f}", "budget": "100000.000", "demand": "0.000", "sessions": "0", "sig": "0" * 64}))
    async with aiohttp.ClientSession() as http:
        await _wait_metric(http, full, "voxgate_fleet_gateways_with_room", 1.0)
        # The full gateway refuses on its own: admission, not placement, is what it runs out of.
        async with http.get(full.url + "/readyz") as resp:
            assert resp.status == 503 and (await resp.json())["reason"] == "synthesis"

        made = []
        for _ in range(3):
            async with http.post(full.url + "/v1/sessions", headers=AUTH) as resp:
                assert resp.status == 201, await resp.text()
                made.append(await resp.json())
        for m in made:
            sid = m["session_id"]
            assert m["session_url"] == f"{roomy.url}/v1/sessions/{sid}"
            assert m["offer_url"] == f"{roomy.url}/v1/offer"
            assert m["ws_url"] == "ws" + roomy.url[4:] + f"/v1/sessions/{sid}/ws"
            assert json.loads(redis.client().get("voxgate:session:" + sid))["gw"] == roomy.url
        await asyncio.gather(*(_speaks(http, m, f"placed {i}") for i, m in enumerate(made)))
        assert await _metric(http, full, 'voxgate_fleet_placed_total{outcome="placed"}') == 3.0

        # The gateway with room keeps its own sessions.
        async with http.post(roomy.url + "/v1/sessions", headers=AUTH) as resp:
            assert resp.status == 201
            assert (await resp.json())["session_url"].startswith(roomy.url + "/")

        # An offer the full gateway refuses names the one with room.
        client = RtcClient(full.url)
        try:
            with pytest.raises(OfferRefused) as refused:
                await client.connect()
        finally:
            await client.close()
        error = refused.value.body["error"]
        assert (refused.value.status, error["code"], error["reason"]) == (503, "at_capacity", "synthesis")
        assert error["gateway"] == roomy.url

        # Without a valid key nothing is placed: the full gateway's own 401.
        async with http.post(full.url + "/v1/sessions", headers={"Authorization": "Bearer nope"}) as resp:
            assert resp.status == 401


def test_a_published_load_is_used_only_when_signed_and_in_range():
    from voxgate.gateway.fleet.directory_records import GatewayLoad, RecordSigner

    from .conftest import TOKEN_SECRET

    signer, url = RecordSigner(TOKEN_SECRET), "http://10.0.0.2:8080"
    good = GatewayLoad(12.5, 3.25, 7, time.time() + 3)
    assert GatewayLoad.decode(url, good.encode(url, signer), signer) == GatewayLoad(12.5, 3.25, 7, round(good.expires_at, 3))
    assert GatewayLoad.decode(url, GatewayLoad(float("inf"), 0.0, 0, 1.0).encode(url, signer), signer).budget == float("inf")
    assert GatewayLoad.decode("http://10.0.0.3:8080", good.encode(url, signer), signer) is None  # another gateway's
    assert GatewayLoad.decode(url, good.encode(url, RecordSigner("another secret")), signer) is None

    def signed(**fields) -> str:
        data = {"exp": f"{time.time() + 3:.3f}", "budget": "1.000", "demand": "0.000", "sessions": "0", **fields}
        data["sig"] = signer.sign("load", url, data["exp"], data["budget"], data["demand"], data["sessions"])
        return json.dumps(data)

    assert GatewayLoad.decode(url, signed(), signer) is not None
    for hostile in (dict(budget="nan"), dict(budget="-1"), dict(budget="1e9"), dict(demand="-0.5"), dict(demand="inf"),
                    dict(sessions="-1"), dict(sessions="1.5"), dict(exp="nan"), dict(budget="1" * 40)):
        assert GatewayLoad.decode(url, signed(**hostile), signer) is None, hostile
    for raw in (None, "", "[]", "{", '{"exp": 1}', "x" * 2000):
        assert GatewayLoad.decode(url, raw, signer) is None
