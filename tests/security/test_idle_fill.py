"""Issue 53, finding 3: admission cannot be filled by sessions that do nothing.

Before, a session counted its full --talk-share against the speech budget from the moment it was
made: offers that never finish ICE (from a few addresses, within the per-address cap) or sessions one
key made ahead and never joined filled the budget, and every other key's POST /v1/sessions got 503
until they timed out. Now a session not joined yet counts --unjoined-share of it, and only for
--unjoined-hold-s; anonymous offers leave --key-reserve of the budget to keys; and one key's unjoined
sessions may take at most --made-ahead-share of the budget.

The budget is fixed (--synthesis-budget 4 at --talk-share 0.4: ten quiet sessions fill it) so the
tests know where it lies; bench/bench_idle_fill.py runs the attacks at full size.
"""

from __future__ import annotations

from aiortc import RTCConfiguration, RTCPeerConnection

from tests.conftest import in_process_gateway
from voxgate.gateway.webrtc.ice import restrict_host_addresses
from voxgate.rtc_client import RtcClient

from sec_helpers import http_json

KEYS = {"api_key": ["attacker", "victim"], "synthesis_budget": 4.0, "talk_share": 0.4}


async def stripped_sdp() -> str:
    """An offer with every candidate removed: the server's side of ICE can never complete."""
    restrict_host_addresses(["127.0.0.1"])
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="recvonly")
    pc.createDataChannel("control")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = "\r\n".join(line for line in pc.localDescription.sdp.splitlines() if not line.startswith("a=candidate")) + "\r\n"
    await pc.close()
    return sdp


async def make_and_use(url: str, key: str) -> None:
    """POST /v1/sessions with `key`, join it over WebRTC and hear it start speaking."""
    status, made, _ = await http_json("POST", url + "/v1/sessions", headers={"X-API-Key": key})
    assert status == 201, made
    peer = RtcClient(url, session_id=made["session_id"], token=made["client_token"])
    await peer.connect()
    try:
        peer.send({"type": "speak", "text": "Hello there.", "id": "u1"})
        await peer.wait_for("audio.started", id="u1")
    finally:
        await peer.close()


async def test_offers_that_never_connect_leave_keys_their_room():
    async with in_process_gateway(**KEYS, trusted_proxy=["127.0.0.0/8"], max_sessions_per_address=10) as (app, url):
        sdp = await stripped_sdp()
        statuses = []
        for i in range(30):  # three addresses, each within its cap of 10
            status, _, _ = await http_json("POST", url + "/v1/offer", body={"sdp": sdp, "type": "offer"},
                                           headers={"X-Forwarded-For": f"198.51.100.{i % 3 + 1}"})
            statuses.append(status)
        # Anonymous offers stop short of the budget's key reserve: 3 of 4, at 0.2 each (not 0.4).
        assert statuses.count(200) >= 10 and 503 in statuses, statuses
        await make_and_use(url, "victim")


async def test_one_key_cannot_book_the_budget_ahead():
    async with in_process_gateway(**KEYS) as (app, url):
        statuses = []
        for _ in range(29):  # under --max-sessions-per-key's 50
            status, body, _ = await http_json("POST", url + "/v1/sessions", headers={"X-API-Key": "attacker"})
            statuses.append((status, (body.get("error") or {}).get("code")))
            if status != 201:
                break
        # Half the budget (2 of 4) at 0.4 each: five sessions made ahead, then the key's own limit.
        assert statuses.count((201, None)) == 5 and statuses[-1] == (429, "key_limit"), statuses
        await make_and_use(url, "victim")


async def test_an_unjoined_session_counts_for_a_short_time_then_is_admitted_again_when_joined():
    async with in_process_gateway(**KEYS, unjoined_hold_s=1.0) as (app, url):
        gw = app["gateway"]
        status, made, _ = await http_json("POST", url + "/v1/sessions", headers={"X-API-Key": "victim"})
        assert status == 201
        session = gw.sessions[made["session_id"]]
        now = gw.admission.clock()
        assert gw.admission.unjoined_weight(session, now) == 0.4 * 0.5
        assert gw.admission.unjoined_weight(session, now + 1.0) == 0.0
        # Past its hold it counts nothing, so joining it is admitted again: a full node refuses the join.
        session.created_at -= 1.0
        gw.settings.synthesis_budget = 0.1
        status, body, _ = await http_json("POST", url + "/v1/offer", body={
            "sdp": await stripped_sdp(), "type": "offer", "session_id": made["session_id"], "token": made["client_token"]})
        assert (status, body["error"]["code"]) == (503, "at_capacity"), body
