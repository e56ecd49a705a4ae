"""Finding 6: offers that never connect cannot hold the server's session slots.

Before, an offer whose ICE never completed held its slot for the 300 s idle
timeout, `--api-key` did not protect `/v1/offer`, and with `--max-sessions 3`
three anonymous offers with their candidates stripped made a keyed
`POST /v1/sessions` get 503. Now: a deadline to reach "connected"
(`--connect-timeout-s`), a limit per client address, and a separate budget
for sessions made without a key or token.
"""

from __future__ import annotations

import json

import aiohttp
from aiortc import RTCConfiguration, RTCPeerConnection

from voxgate.gateway.webrtc.ice import restrict_host_addresses

from sec_helpers import http_json


async def stripped_offer(url: str, headers: dict | None = None) -> tuple[int, dict]:
    """An anonymous offer with every candidate removed; the answer is never applied,
    so the server's side of ICE can never complete."""
    restrict_host_addresses(["127.0.0.1"])
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="recvonly")
    pc.createDataChannel("control")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = "\r\n".join(l for l in pc.localDescription.sdp.splitlines() if not l.startswith("a=candidate")) + "\r\n"
    await pc.close()
    status, body, _ = await http_json("POST", url + "/v1/offer", body={"sdp": sdp, "type": "offer"}, headers=headers)
    return status, body


async def test_anonymous_offers_cannot_take_the_slots_keyed_backends_need(server_factory):
    server = server_factory("tone", ["--max-sessions", "3", "--api-key", "k"])
    results = [await stripped_offer(server.url) for _ in range(3)]
    statuses = [s for s, _ in results]
    assert statuses[0] == 200 and 503 in statuses, results
    status, body, _ = await http_json("POST", server.url + "/v1/sessions", headers={"X-API-Key": "k"})
    assert status == 201, body


async def test_an_offer_that_never_connects_gives_its_slot_back(server_factory):
    server = server_factory("tone", ["--connect-timeout-s", "1.5"])
    status, body = await stripped_offer(server.url)
    assert status == 200
    sid = body["session_id"]
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{server.url.replace('http', 'ws')}/v1/sessions/{sid}/ws?role=watcher") as ws:
            while True:
                event = json.loads((await ws.receive(timeout=30)).data)
                if event["type"] == "session.closed":
                    break
    assert "no connection" in event["reason"], event
    status, _, _ = await http_json("GET", f"{server.url}/v1/sessions/{sid}")
    assert status == 404


async def test_one_client_address_has_a_limit(server_factory):
    # The clients come through a "proxy" on loopback that names them in X-Forwarded-For.
    server = server_factory("tone", ["--max-sessions-per-address", "2", "--trusted-proxy", "127.0.0.0/8"])
    one = {"X-Forwarded-For": "198.51.100.7"}
    results = [await stripped_offer(server.url, one) for _ in range(3)]
    assert [s for s, _ in results[:2]] == [200, 200]
    status, body = results[2]
    assert (status, body["error"]["code"]) == (429, "address_limit")
    # Another client is not held back by the first; a forged hop before the proxy's changes nothing.
    assert (await stripped_offer(server.url, {"X-Forwarded-For": "198.51.100.8"}))[0] == 200
    status, body = await stripped_offer(server.url, {"X-Forwarded-For": "203.0.113.1, 198.51.100.7"})
    assert (status, body["error"]["code"]) == (429, "address_limit")
