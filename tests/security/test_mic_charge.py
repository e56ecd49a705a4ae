"""Issue 53, theme: a caller whose own datagrams make frames late is the one closed (gateway/load/mic_charge.py).

The microphone's bounds drop a flood before decrypting or decoding it, but taking each datagram
off the socket and dropping it still costs the event loop. That cost is charged to the session's
tenant, and when late-frame admission blames that tenant, the session is closed (its UDP socket
with it), while another key's session keeps speaking.

Real aiortc peers on loopback: the attacker floods its own session with its own SRTP
(tests/security/rtp_flood.py). The late frames, and the rest of a 30 s flood's charge, are set
where admission's tick would (bench/bench_listening_flood.py runs the flood for real).
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from voxgate.gateway.media import opus
from voxgate.rtc_client import RtcClient
from tests.conftest import in_process_gateway
from tests.security.rtp_flood import RtpFlood, silent_caller

from sec_helpers import http_json

PACKETS = 1500


async def made(url: str, key: str) -> dict:
    status, body, _ = await http_json("POST", url + "/v1/sessions", headers={"X-API-Key": key})
    assert status == 201, body
    return body


async def test_a_caller_flooding_its_own_session_is_charged_for_it_and_closed_when_frames_are_late(caplog):
    payload = opus.Encoder(48000, 32000, 5, False, 0, False).encode(np.zeros(960, dtype=np.int16))[0]
    async with in_process_gateway(api_key=["attacker", "victim"]) as (app, url):
        gw = app["gateway"]
        blame = gw.admission.blame
        a, v = await made(url, "attacker"), await made(url, "victim")
        attacker = await silent_caller(url, session_id=a["session_id"], token=a["client_token"])
        victim = RtcClient(url, mic=True, session_id=v["session_id"], token=v["client_token"])
        try:
            await victim.connect()
            charges = gw.peers[a["session_id"]].charge, gw.peers[v["session_id"]].charge
            before = [c.charged_s for c in charges]
            flood = RtpFlood(attacker)
            for _ in range(PACKETS // 50):  # 20 ms packets from its own SSRC, far past real time, and new SSRCs
                flood.packets(40, payload)
                flood.ssrc_flood(10, payload)
                await asyncio.sleep(0.005)
            dropped = gw.peers[a["session_id"]].mic.dropped
            await asyncio.sleep(0.2)  # what the socket buffer held
            spent = [c.charged_s - b for c, b in zip(charges, before)]
            # Only the flooder's tenant is charged for the flood (the victim's microphone sends
            # 50 packets a second meanwhile); datagrams the bounds dropped are charged too.
            assert dropped >= PACKETS // 4
            assert blame.load("key:attacker") > 0 and spent[0] > 4 * spent[1], spent
            assert spent[0] / flood.sent > 0.2e-6, (spent, flood.sent)

            # Frames went late, and the attacker's tenant is to blame: a 30 s flood's charge (its
            # datagrams are 0.6 of the 8 s of CPU the process spent).
            caplog.set_level(logging.INFO, logger="voxgate.gateway.load.mic_charge")
            closed = gw.sessions[a["session_id"]]
            blame.charge("key:attacker", 6.0)
            blame.tick(1.0, 8.0, late=True)
            assert blame.culprit == "key:attacker"
            event = await attacker.wait_for("error", timeout=5)
            assert event["code"] == "late_frames"
            await asyncio.wait_for(closed.closed_event.wait(), 5)
            assert gw.peers.get(a["session_id"]) is None or gw.peers[a["session_id"]].pc.connectionState == "closed"
            lines = [r for r in caplog.records if r.name == "voxgate.gateway.load.mic_charge"]
            assert len(lines) == 1 and lines[0].exc_info is None and "closing it" in lines[0].getMessage()

            # The other key's session is up and speaks.
            assert not gw.sessions[v["session_id"]].closed
            since = time.perf_counter()
            victim.send({"type": "speak", "text": "Still here.", "id": "s"})
            await victim.wait_for("utterance.done", id="s", timeout=15)
            assert victim.audio.count_since(since) >= 10
        finally:
            await attacker.close()
            await victim.close()
