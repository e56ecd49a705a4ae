"""Admission by measured headroom (issue 41): past the node's speech budget every way in refuses
a new session or request with 503 at_capacity and Retry-After, /readyz turns 503 a margin before,
and sessions speaking now count whole while quiet ones count at --talk-share.

The budget is fixed here (--synthesis-budget) so that the tests know where it lies; the measured
one is checked on the real voice at the end, and in bench/bench_admission.py under load.
"""

from __future__ import annotations

import json
import re
import time

import aiohttp

from tests.conftest import in_process_gateway
from voxgate.rtc_client import RtcClient

SDP = "v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\n"  # never parsed: the refusal comes first


async def _json(resp: aiohttp.ClientResponse) -> dict:
    return json.loads(await resp.text())


async def _rejected(http: aiohttp.ClientSession, url: str, reason: str) -> float:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    match = re.search(r'^voxgate_sessions_rejected_total\{reason="%s"\} (\S+)$' % reason, text, flags=re.M)
    return float(match.group(1)) if match else 0.0


async def test_past_the_budget_every_way_in_is_refused_and_readyz_turns_first():
    async with in_process_gateway(synthesis_budget=2.0, talk_share=1.0, ready_margin=0.25, unjoined_share=1.0) as (app, url):
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/readyz") as resp:
                body = await _json(resp)
                assert resp.status == 200 and body["budget_rtf"] == 2.0, body
            made = []
            async with http.post(url + "/v1/sessions") as resp:
                assert resp.status == 201
                made.append((await _json(resp))["session_id"])
            # One more fits (1 + 1 <= 2), but not within the margin (2 > 2 x 0.75): readiness goes first.
            async with http.get(url + "/readyz") as resp:
                body = await _json(resp)
                assert resp.status == 503 and body["reason"] == "synthesis" and body["demand_rtf"] == 1.0, body
            async with http.post(url + "/v1/sessions") as resp:
                assert resp.status == 201
                made.append((await _json(resp))["session_id"])

            # Full: each way in is refused, at once, and says why.
            t0 = time.perf_counter()
            async with http.post(url + "/v1/sessions") as resp:
                refused_in = time.perf_counter() - t0
                error = (await _json(resp))["error"]
                assert resp.status == 503 and resp.headers["Retry-After"] == "5", error
                assert error["code"] == "at_capacity" and error["reason"] == "synthesis", error
            assert refused_in < 0.5, refused_in
            async with http.post(url + "/v1/offer", json={"sdp": SDP, "type": "offer"}) as resp:
                error = (await _json(resp))["error"]
                assert (resp.status, error["code"], error["reason"]) == (503, "at_capacity", "synthesis"), error
                assert resp.headers["Retry-After"]
            async with http.post(url + "/v1/tts", json={"text": "Hello there."}) as resp:
                error = (await _json(resp))["error"]
                assert (resp.status, error["code"], error["reason"]) == (503, "at_capacity", "synthesis"), error
                assert resp.headers["Retry-After"]
            async with http.ws_connect(url.replace("http", "ws") + "/v1/telephony/twilio") as phone:
                await phone.send_json({"event": "connected", "protocol": "Call", "version": "1.0.0"})
                await phone.send_json({"event": "start", "sequenceNumber": "1", "streamSid": "MZfull0001", "start": {
                    "streamSid": "MZfull0001", "callSid": "CAfull0001", "tracks": ["inbound"], "customParameters": {},
                    "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}})
                message = await phone.receive_json(timeout=10)
                assert message["event"] == "error" and message["code"] == "unavailable", message
            assert await _rejected(http, url, "synthesis") == 4
            assert len(app["gateway"].sessions) == 2

            # A session that ends gives its share back.
            async with http.delete(url + f"/v1/sessions/{made.pop()}") as resp:
                assert resp.status == 200
            async with http.post(url + "/v1/sessions") as resp:
                assert resp.status == 201
                made.append((await _json(resp))["session_id"])
            for sid in made:
                async with http.delete(url + f"/v1/sessions/{sid}") as resp:
                    assert resp.status == 200
            async with http.get(url + "/readyz") as resp:
                assert resp.status == 200, await resp.text()


async def test_a_session_speaking_now_counts_whole_and_a_quiet_one_at_the_talk_share():
    async with in_process_gateway(synthesis_budget=2.0, talk_share=0.5, unjoined_share=1.0) as (app, url):
        gw = app["gateway"]
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/sessions") as resp:
                made = await _json(resp)
            peer = RtcClient(url, session_id=made["session_id"], token=made["client_token"])
            await peer.connect()
            try:
                for _ in range(2):
                    async with http.post(url + "/v1/sessions") as resp:
                        assert resp.status == 201  # 3 quiet sessions: 1.5 of 2
                assert gw.admission.expected() == (0.0, 1.5)
                # 0.5 more would fit while the first one is quiet, but not while it speaks: it counts 1
                # then (the tone engine speaks 40 ms a character: 6 s).
                peer.send({"type": "speak", "text": "a" * 150, "id": "long"})
                await peer.wait_for("audio.started", id="long")
                assert gw.admission.expected() == (1.0, 2.0)
                async with http.post(url + "/v1/sessions") as resp:
                    error = (await _json(resp))["error"]
                    assert (resp.status, error["reason"]) == (503, "synthesis"), error
                peer.send({"type": "cancel"})
                await peer.wait_for("utterance.interrupted", id="long")
                async with http.post(url + "/v1/sessions") as resp:
                    assert resp.status == 201, await resp.text()
            finally:
                await peer.close()


async def test_the_budget_is_measured_on_the_real_voice(piper_server):
    async with aiohttp.ClientSession() as http:
        async with http.get(piper_server.url + "/readyz") as resp:
            body = await _json(resp)
        async with http.get(piper_server.url + "/metrics") as resp:
            text = await resp.text()
    engine = float(re.search(r'^voxgate_synthesis_cost\{part="engine"\} (\S+)$', text, flags=re.M).group(1))
    # The voice's synthesis, measured by the worker at start: some hundredths of a core per audio second.
    assert 0.005 < engine < 0.5, engine
    # On 2 cores: tens of seconds of audio per second, not the tone engine's hundreds.
    assert 2 < body["budget_rtf"] < 200, body
