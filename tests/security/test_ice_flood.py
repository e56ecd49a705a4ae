"""Issue 39, finding 1: a connected peer's STUN and candidate floods are bounded.

A peer knows its own session's ICE password, so it can sign binding requests
from as many source addresses as it likes (spoofed, or here: one loopback
socket each). Before the fix aioice learned every one as a peer-reflexive
candidate, scanned and re-sorted that list on each check, and sent up to 7
checks of its own to every source. These tests send the flood with real
sockets at a real gateway and a real aiortc peer, and check the caps: the
remote-candidate set stays at `MAX_REMOTE_CANDIDATES`, each unverified source
gets at most `MAX_CHECKS_PER_SOURCE` checks, and the session still speaks.
The load figures (late frames of other sessions, /healthz) are in
bench/bench_stun_flood.py.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import sys
import time

from aioice import stun

from tests.conftest import in_process_gateway
from voxgate.gateway.webrtc.ice import MAX_CHECKS_PER_SOURCE, MAX_REMOTE_CANDIDATES, remote_candidate_count
from voxgate.rtc_client import RtcClient

from sec_helpers import http_json

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))

# A check as the peer would send it, signed with the session's own ICE password: the benchmark's attacker's.
from bench_stun_flood import binding_request  # noqa: E402 - bench/ is on the path only now

SOURCES = 150  # far past the cap; each a socket of its own, so each is a new source address


def gateway_ports(gateway_sdp: str) -> set[tuple[str, int]]:
    return {(m.group(1), int(m.group(2))) for m in re.finditer(r"a=candidate:\S+ \d+ udp \d+ (\S+) (\d+) typ host", gateway_sdp)}


def received_requests(sock: socket.socket) -> int:
    """How many STUN binding requests (the gateway's checks) have reached this socket."""
    count = 0
    while True:
        try:
            data = sock.recv(2048)
        except BlockingIOError:
            return count
        try:
            if stun.parse_message(data).message_class == stun.Class.REQUEST:
                count += 1
        except ValueError:
            pass


async def test_a_signed_stun_flood_from_many_sources_is_capped_and_amplifies_nothing():
    async with in_process_gateway() as (app, url):
        async with RtcClient(url) as client:
            peer = app["gateway"].peers[client.session_id]
            gateway_sdp = peer.pc.localDescription.sdp
            request = binding_request(gateway_sdp, client.pc.localDescription.sdp)
            targets = gateway_ports(gateway_sdp)
            sockets = []
            try:
                for _ in range(SOURCES):
                    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                    sock.bind(("127.0.0.1", 0))
                    sock.setblocking(False)
                    sockets.append(sock)
                for sock in sockets:
                    for target in targets:
                        sock.sendto(request, target)
                flood_at = time.monotonic()
                for _ in range(3):  # pings answered after the datagrams: they were read by then
                    client.send({"type": "ping", "t": 1})
                    await client.wait_for("pong", timeout=5)
                assert remote_candidate_count(peer.pc) <= MAX_REMOTE_CANDIDATES
                guard = peer.ice_guards[0]
                assert guard.dropped["candidate_limit"] >= SOURCES - MAX_REMOTE_CANDIDATES

                # aioice retransmits a check at 0, 0.5, 1.5, 3.5 s...: past 3.5 s an unguarded
                # gateway has sent 4 to each source it learned.
                await asyncio.sleep(max(0.0, flood_at + 4.5 - time.monotonic()))
                checks = [received_requests(sock) for sock in sockets]
            finally:
                for sock in sockets:
                    sock.close()
            assert max(checks) <= MAX_CHECKS_PER_SOURCE, sorted(checks)[-5:]
            assert sum(checks) <= MAX_REMOTE_CANDIDATES * MAX_CHECKS_PER_SOURCE
            assert sum(1 for c in checks if c) >= 1  # sources inside the cap were checked at all

            client.send({"type": "speak", "text": "Still here.", "id": "s"})
            await client.wait_for("utterance.done", id="s", timeout=30)


async def test_trickled_candidates_past_the_cap_are_refused_in_plain_words():
    """A browser trickles its candidates after the offer (no end-of-candidates in it), as here."""
    from aiortc import RTCConfiguration, RTCPeerConnection

    async with in_process_gateway() as (app, url):
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        try:
            pc.addTransceiver("audio", direction="recvonly")
            pc.createDataChannel("control")
            await pc.setLocalDescription(await pc.createOffer())
            sdp = "".join(line for line in pc.localDescription.sdp.splitlines(keepends=True)
                          if not line.startswith("a=end-of-candidates"))
            status, answer, _ = await http_json("POST", url + "/v1/offer", body={"sdp": sdp, "type": "offer"})
            assert status == 200, answer
            sid, token = answer["session_id"], answer["token"]
            peer = app["gateway"].peers[sid]
            statuses = []
            for port in range(40000, 40000 + MAX_REMOTE_CANDIDATES + 10):
                status, body, _ = await http_json(
                    "POST", f"{url}/v1/sessions/{sid}/candidates",
                    body={"candidate": f"candidate:1 1 udp 2130706431 127.0.0.1 {port} typ host", "sdpMid": "0",
                          "sdpMLineIndex": 0, "token": token},
                )
                statuses.append((status, body))
            refused = [b for s, b in statuses if s == 409]
            assert refused and all(b["error"]["code"] == "too_many_candidates" for b in refused), statuses[-1]
            assert [s for s, _ in statuses[: len(statuses) - len(refused)]] == [200] * (len(statuses) - len(refused))
            assert remote_candidate_count(peer.pc) == MAX_REMOTE_CANDIDATES
        finally:
            await pc.close()
