"""Finding 11: trickle ICE needs the session's token; NAT64, 6to4 and Teredo are refused.

Before, `POST /v1/sessions/{id}/candidates` needed no token even with
`--require-token` (a third party added candidates to another user's peer),
and NAT64 `64:ff9b::/96` counted as a global address.
"""

from __future__ import annotations

import pytest

from voxgate.gateway.webrtc.ice import IcePolicy
from voxgate.rtc_client import RtcClient

from sec_helpers import http_json

# Loopback: the test servers allow their own --ice-host network, and nothing leaves this machine.
GOOD = "candidate:1 1 udp 2122260223 127.0.0.1 50000 typ host"


def cand(address: str) -> str:
    return f"candidate:1 1 udp 2122260223 {address} 50000 typ host"


@pytest.mark.parametrize("address", ["64:ff9b::a00:1", "64:ff9b:1::a00:1", "2002:a00:1::1", "2001:0:4136:e378:8000:63bf:3fff:fdd2", "::ffff:10.0.0.1"])
def test_translated_prefixes_are_not_public(address):
    assert IcePolicy().allows(address) is False
    assert IcePolicy().allows("2606:4700::1111") is True  # an ordinary global IPv6 address


async def test_candidates_need_the_sessions_token(tone_server):
    url = tone_server.url
    async with RtcClient(url) as a, RtcClient(url):  # a second live session beside a's
        path = f"{url}/v1/sessions/{a.session_id}/candidates"
        status, body, _ = await http_json("POST", path, body={"candidate": GOOD, "sdpMid": "0", "sdpMLineIndex": 0})
        assert (status, body["error"]["code"]) == (401, "token_required")
        # b's token is for b's session.
        status, made_b, _ = await http_json("POST", url + "/v1/sessions")
        status, body, _ = await http_json("POST", path, body={"candidate": GOOD, "sdpMid": "0", "token": made_b["client_token"]})
        assert (status, body["error"]["code"]) == (403, "token_mismatch")


async def test_with_the_token_candidates_are_checked_by_network(tone_server):
    from aiortc import RTCConfiguration, RTCPeerConnection

    from voxgate.gateway.webrtc.ice import restrict_host_addresses

    restrict_host_addresses(["127.0.0.1"])
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.createDataChannel("control")
    await pc.setLocalDescription(await pc.createOffer())
    status, answer, _ = await http_json("POST", tone_server.url + "/v1/offer", body={"sdp": pc.localDescription.sdp, "type": "offer"})
    await pc.close()
    assert status == 200 and answer["token"]
    path = f"{tone_server.url}/v1/sessions/{answer['session_id']}/candidates"
    auth = {"Authorization": f"Bearer {answer['token']}"}
    status, body, _ = await http_json("POST", path, body={"candidate": GOOD, "sdpMid": "0", "sdpMLineIndex": 0}, headers=auth)
    assert status == 200 and body == {"ok": True}
    status, body, _ = await http_json("POST", path, body={"candidate": cand("64:ff9b::a00:1"), "sdpMid": "0", "sdpMLineIndex": 0}, headers=auth)
    assert (status, body["error"]["code"]) == (403, "candidate_refused")
    # An empty candidate is how a browser says its candidates are all there, as null is.
    status, body, _ = await http_json("POST", path, body={"candidate": "", "sdpMid": "0", "sdpMLineIndex": 0}, headers=auth)
    assert status == 200 and body == {"ok": True}, (status, body)
