"""Server lifecycle and access: graceful drain on SIGTERM, Origin checks, capacity."""

import asyncio
import signal

import aiohttp

from voxgate.rtc_client import RtcClient


async def test_sigterm_drains_then_exits(server_factory):
    server = server_factory("tone", ["--drain-timeout-s", "15"])
    async with RtcClient(server.url) as client:
        text = "This utterance is allowed to finish while the server drains. " * 2
        client.send({"type": "speak", "text": text, "id": "d"})
        await client.wait_for("audio.started", id="d")
        server.proc.send_signal(signal.SIGTERM)
        async with aiohttp.ClientSession() as http:
            # The signal is handled asynchronously: poll until readiness drops.
            for _ in range(200):
                async with http.get(server.url + "/readyz") as resp:
                    status, body = resp.status, await resp.json()
                if status == 503:
                    break
                await asyncio.sleep(0.02)
            assert status == 503 and body["accepting"] is False
            async with http.post(server.url + "/v1/offer", json={"sdp": "v=0\r\nm=audio 9 RTP/AVP 0\r\n", "type": "offer"}) as resp:
                assert resp.status == 503 and (await resp.json())["error"]["code"] == "draining"
        done = await client.wait_for("utterance.done", id="d", timeout=20)
        assert done["text"].strip() == text.strip()
        closed = await client.wait_for("session.closed", timeout=10)
        assert closed["reason"] == "server shutting down"
    assert await asyncio.get_running_loop().run_in_executor(None, server.proc.wait, 20) == 0


async def test_origin_checks(server_factory):
    server = server_factory("tone", ["--cors-origin", "https://app.example"])
    offer = {"sdp": "v=0\r\n", "type": "offer"}
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/v1/offer", json=offer, headers={"Origin": "https://evil.example"}) as resp:
            assert resp.status == 403 and (await resp.json())["error"]["code"] == "origin_not_allowed"
        # The bundled page's own origin, and a configured one, get through to validation.
        async with http.post(server.url + "/v1/offer", json=offer, headers={"Origin": server.url}) as resp:
            assert resp.status == 400
        async with http.post(server.url + "/v1/offer", json=offer, headers={"Origin": "https://app.example"}) as resp:
            assert resp.status == 400
            assert resp.headers["Access-Control-Allow-Origin"] == "https://app.example"
        preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
        async with http.options(server.url + "/v1/offer", headers=preflight) as resp:
            assert resp.status == 204 and "POST" in resp.headers["Access-Control-Allow-Methods"]


async def test_past_capacity_new_sessions_are_refused_cleanly(server_factory):
    server = server_factory("tone", ["--max-sessions", "2"])
    async with RtcClient(server.url) as a, RtcClient(server.url) as b:
        third = RtcClient(server.url)
        try:
            await third.connect()
            raise AssertionError("a third session was accepted")
        except RuntimeError as exc:
            assert "503" in str(exc) and "at_capacity" in str(exc)
        finally:
            await third.close()
        async with aiohttp.ClientSession() as http:
            async with http.post(server.url + "/v1/offer", json={"sdp": "v=0\r\n", "type": "offer"}) as resp:
                # The refusal says when to try again: the one error mapping carries its headers.
                assert resp.status == 503 and resp.headers.get("Retry-After") == "5"
                assert (await resp.json())["error"]["code"] == "at_capacity"
        for client, uid in ((a, "a"), (b, "b")):
            client.send({"type": "speak", "text": "The first two keep working.", "id": uid})
        await a.wait_for("utterance.done", id="a")
        await b.wait_for("utterance.done", id="b")


async def test_ice_servers_default_empty_and_turn_credentials_are_short_lived(server_factory, tone_server):
    async with aiohttp.ClientSession() as http:
        async with http.get(tone_server.url + "/v1/ice-servers") as resp:
            assert (await resp.json()) == {"ice_servers": []}
    server = server_factory("tone", ["--ice-server", "turn:turn.example.com:3478", "--turn-secret", "s3cret", "--turn-ttl-s", "600"])
    # TURN credentials are issued only against a session's client token, bound to that session.
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/v1/sessions") as resp:
            made = await resp.json()
        async with http.get(server.url + "/v1/ice-servers", params={"token": made["client_token"]}) as resp:
            body = await resp.json()
    [entry] = body["ice_servers"]
    expiry, user = entry["username"].split(":")
    assert user == made["session_id"] and entry["urls"] == ["turn:turn.example.com:3478"] and body["ttl"] == 600
    import base64
    import hashlib
    import hmac
    import time

    assert 0 < int(expiry) - time.time() <= 600
    expected = base64.b64encode(hmac.new(b"s3cret", entry["username"].encode(), hashlib.sha1).digest()).decode()
    assert entry["credential"] == expected
