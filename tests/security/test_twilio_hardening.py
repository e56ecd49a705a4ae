"""Finding 12: the Twilio WebSocket checks signatures, times out, rate-limits, and logs safely.

Before: no `X-Twilio-Signature` check, no timeout before `start`, no rate
limit, a full traceback in the log for each malformed frame, and a
`streamSid` with a newline forged a line of the plain-text log.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time

import aiohttp
import pytest

from sec_helpers import log_text

PATH = "/v1/telephony/twilio"


def twilio_signature(auth_token: str, url: str) -> str:
    """How Twilio signs a request without POST parameters: base64(HMAC-SHA1(token, full URL))."""
    return base64.b64encode(hmac.new(auth_token.encode(), url.encode(), hashlib.sha1).digest()).decode()


def ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + PATH


async def receive_event(ws, wanted: str, timeout: float = 20) -> dict:
    while True:
        msg = await ws.receive(timeout=timeout)
        if msg.type != aiohttp.WSMsgType.TEXT:
            raise AssertionError(f"connection ended before {wanted}: {msg}")
        event = json.loads(msg.data)
        if event.get("event") == "error" and event.get("code") == wanted:
            return event


async def test_signature_is_required_when_an_auth_token_is_set(server_factory):
    server = server_factory("tone", ["--twilio-auth-token", "twilio-secret"])
    async with aiohttp.ClientSession() as http:
        for headers in ({}, {"X-Twilio-Signature": "AAAA"}, {"X-Twilio-Signature": twilio_signature("other", ws_url(server))}):
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(ws_url(server), headers=headers)
            assert refused.value.status == 403
        good = {"X-Twilio-Signature": twilio_signature("twilio-secret", ws_url(server))}
        async with http.ws_connect(ws_url(server), headers=good) as ws:
            await ws.send_str(json.dumps({"event": "connected"}))
            assert not ws.closed


async def test_a_stream_without_start_is_closed(server_factory):
    server = server_factory("tone", ["--telephony-start-timeout-s", "1"])
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
        await ws.send_str(json.dumps({"event": "connected"}))
        await receive_event(ws, "start_timeout")
        msg = await ws.receive(timeout=20)
        assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING)


async def test_a_flood_of_frames_is_rate_limited(tone_server):
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(tone_server)) as ws:
        for _ in range(600):
            await ws.send_str('{"event": "connected"}')
        await receive_event(ws, "rate_limited")


MALFORMED = [
    {"event": "mark", "mark": []},
    {"event": "dtmf", "dtmf": "5"},
    {"event": "start", "start": {"streamSid": "MZ1", "mediaFormat": "mulaw"}},
    {"event": "start", "start": {"streamSid": "MZ1", "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": "abc"}}},
    {"event": "start", "start": {"streamSid": "MZ1", "tracks": "inbound"}},
    {"event": "start", "start": {"streamSid": "MZ1", "callSid": ["CA1"]}},
]


async def test_malformed_frames_get_errors_without_tracebacks(server_factory):
    server = server_factory("tone")
    async with aiohttp.ClientSession() as http:
        for frame in MALFORMED:
            async with http.ws_connect(ws_url(server)) as ws:
                await ws.send_str(json.dumps(frame))
                event = json.loads((await ws.receive(timeout=20)).data)
                assert event["event"] == "error" and event["code"] != "internal", (frame, event)
        async with http.ws_connect(ws_url(server)) as ws:
            await ws.send_str("[" * 60000)  # deeper than the JSON parser's recursion limit, under the frame limit
            assert json.loads((await ws.receive(timeout=20)).data)["code"] == "invalid_json"
    log = log_text(server)
    assert "Traceback" not in log, log[-3000:]


async def test_a_stream_sid_cannot_forge_a_log_line(server_factory):
    server = server_factory("tone")
    forged = "MZ1\n2026-01-01 00:00:00,000 INFO voxgate.admin: FORGED login ok"
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(server)) as ws:
        await ws.send_str(json.dumps({"event": "start", "start": {"streamSid": forged, "callSid": "CA1"}}))
        event = json.loads((await ws.receive(timeout=20)).data)
        assert event["event"] == "error" and event["code"] == "invalid_message"
    log = log_text(server)
    assert not any(line.startswith("2026-01-01") for line in log.splitlines()), log[-2000:]


# Issue 39, findings 6, 7 and 10: oversized media, the log, replayed and re-hosted signatures.

def _start(n: int) -> str:
    return json.dumps({"event": "start", "start": {"streamSid": f"MZ{n}", "callSid": f"CA{n}"}})


def _signed(server, call: str, secret: str = "twilio-secret", url: str | None = None) -> tuple[str, dict]:
    target = f"{ws_url(server)}?call={call}"
    return target, {"X-Twilio-Signature": twilio_signature(secret, url or target)}


async def test_oversized_media_frames_are_refused(tone_server):
    big = base64.b64encode(bytes(36 * 1024)).decode()  # 48 KiB of base64, as in the attack
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(tone_server)) as ws:
        await ws.send_str(_start(1))
        await ws.send_str(json.dumps({"event": "media", "media": {"track": "inbound", "payload": big}}))
        await receive_event(ws, "frame_too_large")
        # Twilio's own 160-byte frames still go through: the next error is the probe's, not theirs.
        ok = base64.b64encode(bytes(160)).decode()
        await ws.send_str(json.dumps({"event": "media", "media": {"track": "inbound", "payload": ok}}))
        await ws.send_str(json.dumps({"event": "dtmf", "dtmf": {}}))
        event = json.loads((await ws.receive(timeout=20)).data)
        assert event["code"] == "invalid_message", event


async def test_a_signature_opens_one_stream_and_forwarded_hosts_need_a_trusted_proxy(server_factory):
    server = server_factory("tone", ["--twilio-auth-token", "twilio-secret"])
    async with aiohttp.ClientSession() as http:
        url, headers = _signed(server, "CA1")
        async with http.ws_connect(url, headers=headers) as ws:
            await ws.send_str(json.dumps({"event": "connected"}))
        with pytest.raises(aiohttp.WSServerHandshakeError) as replayed:
            await http.ws_connect(url, headers=headers)
        assert replayed.value.status == 403
        url, headers = _signed(server, "CA2")  # the next call's URL is signed anew
        async with http.ws_connect(url, headers=headers):
            pass
        # A signature Twilio made for another host does not pass here by naming that host.
        elsewhere = "wss://evil.example/v1/telephony/twilio?call=CA3"
        url, headers = _signed(server, "CA3", url=elsewhere)
        forwarded = {**headers, "X-Forwarded-Host": "evil.example", "X-Forwarded-Proto": "https"}
        with pytest.raises(aiohttp.WSServerHandshakeError) as rehosted:
            await http.ws_connect(url, headers=forwarded)
        assert rehosted.value.status == 403
    proxied = server_factory("tone", ["--twilio-auth-token", "twilio-secret", "--trusted-proxy", "127.0.0.0/8"])
    async with aiohttp.ClientSession() as http:
        url, headers = _signed(proxied, "CA3", url=elsewhere)
        async with http.ws_connect(url, headers={**headers, "X-Forwarded-Host": "evil.example",
                                                 "X-Forwarded-Proto": "https"}):
            pass
        # From here on the attack of finding 7: anyone's junk, on a server that needs signatures.
        started = time.monotonic()
        for _ in range(200):
            with pytest.raises(aiohttp.WSServerHandshakeError):
                await http.ws_connect(ws_url(proxied), headers={"X-Twilio-Signature": "forged"})
        elapsed = time.monotonic() - started
    lines = [line for line in log_text(proxied).splitlines() if "invalid_signature" in line]
    # One line a second at most (and one more for the second the flood began in), not one each.
    assert 1 <= len(lines) <= elapsed + 2, (len(lines), elapsed)


async def test_client_errors_are_logged_at_a_bounded_rate(tone_server):
    before = sum("unknown_event" in line for line in log_text(tone_server).splitlines())
    started = time.monotonic()

    async def junk(http) -> None:
        async with http.ws_connect(ws_url(tone_server)) as ws:
            for _ in range(50):
                await ws.send_str('{"event": "x\\u001b[2J"}')
            for _ in range(50):
                event = json.loads((await ws.receive(timeout=20)).data)
                assert event["code"] == "unknown_event", event

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(junk(http) for _ in range(20)))  # 1,000 errors, every one answered
    elapsed = time.monotonic() - started
    lines = sum("unknown_event" in line for line in log_text(tone_server).splitlines()) - before
    assert lines <= elapsed + 2, (lines, elapsed)
