"""The session API: keys, client tokens, joining from /v1/offer, the backend WebSocket.

Real `voxgate serve` processes on loopback, real aiortc listeners, the tone
engine so received audio decodes back to the exact text.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from voxgate.client import VoxgateError, VoxgateSession
from voxgate.engine import tone
from voxgate.gateway.sessions.registry import TokenSigner

from backend_helpers import JoiningRtcClient, OfferRefused

KEY = "test-key-1"
SECRET = "test-token-secret"


@pytest.fixture(scope="module")
def keyed_server(server_factory):
    return server_factory(
        "tone", ["--api-key", KEY, "--api-key", "other-key", "--token-secret", SECRET, "--require-token"]
    )


async def _json(resp: aiohttp.ClientResponse) -> dict:
    return await resp.json(content_type=None)


async def test_api_key_and_session_lifecycle(keyed_server):
    url = keyed_server.url
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/sessions") as resp:
            assert resp.status == 401 and (await _json(resp))["error"]["code"] == "unauthorized"
        async with http.post(url + "/v1/sessions", headers={"Authorization": "Bearer nope"}) as resp:
            assert resp.status == 401 and (await _json(resp))["error"]["code"] == "invalid_api_key"
        async with http.post(url + "/v1/sessions", headers={"X-API-Key": KEY}, data=b"{not json") as resp:
            assert resp.status == 400 and (await _json(resp))["error"]["code"] == "invalid_json"
        async with http.post(url + "/v1/sessions", headers={"X-API-Key": KEY}, json=[1]) as resp:
            error = (await _json(resp))["error"]
            # Says it once: what the body must be, and that an empty one is fine.
            assert (resp.status, error["code"]) == (400, "invalid_json") and error["message"].count("JSON object") == 1
            assert "empty" in error["message"], error
        async with http.post(url + "/v1/sessions", headers={"X-API-Key": KEY}, json={"voice": "nobody"}) as resp:
            assert resp.status == 400 and (await _json(resp))["error"]["code"] == "unknown_voice"
        async with http.post(url + "/v1/sessions", headers={"Authorization": f"Bearer {KEY}"}) as resp:
            assert resp.status == 201
            made = await _json(resp)
        sid = made["session_id"]
        host = url.split("://")[1]
        assert made["offer_url"] == f"{url}/v1/offer"
        assert made["ws_url"] == f"ws://{host}/v1/sessions/{sid}/ws"
        assert made["telephony_url"] == f"ws://{host}/v1/telephony/twilio"
        assert TokenSigner(SECRET, 300).verify(made["client_token"]) == sid
        async with http.get(url + f"/v1/sessions/{sid}") as resp:
            assert resp.status == 401
        headers = {"X-API-Key": KEY}
        async with http.get(url + f"/v1/sessions/{sid}", headers=headers) as resp:
            state = await _json(resp)
        assert state["made_ahead"] is True and state["codec"] is None
        assert state["connected"] == {"webrtc": None, "telephony": None}
        assert state["utterances"] == {"queued": 0, "playing": None, "ids": []}
        assert state["writer"] is None and state["watchers"] == []
        assert state["created_at"] <= state["last_activity"]
        # The WebSocket needs the key too.
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(url + f"/v1/sessions/{sid}/ws")
        assert refused.value.status == 401
        async with http.delete(url + f"/v1/sessions/{sid}", headers=headers) as resp:
            assert resp.status == 200
        async with http.get(url + f"/v1/sessions/{sid}", headers=headers) as resp:
            assert resp.status == 404 and (await _json(resp))["error"]["code"] == "unknown_session"


async def test_offer_tokens(keyed_server):
    url = keyed_server.url
    async with VoxgateSession(url, api_key=KEY) as backend, VoxgateSession(url, api_key=KEY) as other:
        signer = TokenSigner(SECRET, -10)  # the server's secret: forge an expired token
        cases = [
            (None, None, 401, "token_required"),
            (backend.session_id, None, 401, "token_required"),
            (backend.session_id, backend.client_token[:-4] + "AAAA", 401, "invalid_token"),
            (backend.session_id, "garbage", 401, "invalid_token"),
            (backend.session_id, signer.issue(backend.session_id), 403, "token_expired"),
            (backend.session_id, other.client_token, 403, "token_mismatch"),
            (None, TokenSigner(SECRET, 60).issue("0000000000000000"), 404, "unknown_session"),
        ]
        for sid, token, status, code in cases:
            client = JoiningRtcClient(url, sid, token)
            try:
                with pytest.raises(OfferRefused) as refused:
                    await client.connect()
                assert (refused.value.status, refused.value.body["error"]["code"]) == (status, code), (sid, token)
            finally:
                await client.close()
        # The session survived the refused offers; a valid token joins it.
        async with JoiningRtcClient(url, backend.session_id, backend.client_token) as listener:
            assert listener.session_id == backend.session_id
            state = await backend.state()
            assert state["codec"] == "opus" and state["connected"]["webrtc"] is not None
            second = JoiningRtcClient(url, None, backend.client_token)
            try:
                with pytest.raises(OfferRefused) as refused:
                    await second.connect()
                assert refused.value.status == 409
            finally:
                await second.close()
            outcome = await backend.say("joined")
            assert not outcome.interrupted
            await listener.wait_tail(await listener.wait_for("utterance.done", id=outcome.id))
            assert tone.decode(listener.audio.pcm(), listener.audio.sample_rate) == "joined"


async def test_text_before_the_listener_attaches_is_queued(tone_server):
    async with VoxgateSession(tone_server.url) as backend:
        uid = await backend.say("said early", wait=False)
        queued = await backend.wait_for("utterance.queued", id=uid)
        assert queued["position"] == 0
        state = await backend.state()
        assert state["utterances"]["ids"] == [uid] and state["codec"] is None
        waited_ms = 2500
        await asyncio.sleep(waited_ms / 1000)
        async with JoiningRtcClient(tone_server.url, backend.session_id, backend.client_token) as listener:
            started = await backend.wait_for("audio.started", id=uid)
            done = await backend.wait_for("utterance.done", id=uid)
            await listener.wait_tail(await listener.wait_for("utterance.done", id=uid))
            assert tone.decode(listener.audio.pcm(), listener.audio.sample_rate) == "said early"
        print(f"\nqueued-before-attach TTFA (from attach): {started['ttfa_ms']} ms")
        # TTFA counts from the attach, not from the text: the wait for a listener is not synthesis latency.
        assert started["ttfa_ms"] < waited_ms
        assert done["text"] == "said early"


async def test_writer_watchers_and_bad_frames(tone_server):
    async with JoiningRtcClient(tone_server.url, None, None) as listener:
        sid = listener.session_id
        async with VoxgateSession(tone_server.url, session_id=sid) as writer, VoxgateSession(
            tone_server.url, session_id=sid
        ) as second, VoxgateSession(tone_server.url, session_id=sid, role="watcher") as watcher:
            assert writer.ready["role"] == "writer"
            assert second.ready["role"] == "watcher"  # write access was taken
            assert watcher.ready["role"] == "watcher"
            state = await writer.state()
            assert state["writer"] == writer.ready["writer"] and len(state["watchers"]) == 2
            # A watcher cannot write, but it may ping.
            with pytest.raises(VoxgateError) as refused:
                await second.say("not mine")
            assert refused.value.code == "read_only"
            await watcher.send({"type": "ping", "t": 7})
            assert (await watcher.wait_for("pong"))["t"] == 7
            # Bad frames cost an error event, never the connection.
            ws = writer._ws
            await ws.send_bytes(b'{"type": "ping"}')
            assert (await writer.wait_for("error"))["code"] == "binary_frame"
            await ws.send_frame(b"\xff\xfe{}", aiohttp.WSMsgType.TEXT)
            assert (await writer.wait_for("error"))["code"] == "invalid_utf8"
            await ws.send_str("hello?")
            assert (await writer.wait_for("error"))["code"] == "invalid_json"
            await ws.send_str(json.dumps({"type": "speak"}))
            assert (await writer.wait_for("error"))["code"] == "invalid_field"
            # Every watcher sees the writer's utterance.
            outcome = await writer.say("all of you")
            for backend in (second, watcher):
                done = await backend.wait_for("utterance.done", id=outcome.id)
                assert done["text"] == "all of you"
            # The writer leaves: write access is free again.
        async with VoxgateSession(tone_server.url, session_id=sid) as again:
            assert again.ready["role"] == "writer"


async def test_browser_and_backend_text_are_ordered(tone_server):
    browser_text = "aaaa bbbb cccc dddd "
    backend_text = "WWWW XXXX YYYY ZZZZ "
    async with JoiningRtcClient(tone_server.url, None, None) as listener:
        async with VoxgateSession(tone_server.url, session_id=listener.session_id) as backend:

            async def browser() -> None:
                for word in browser_text.split(" ")[:-1]:
                    listener.send({"type": "text.delta", "text": word + " "})
                    await asyncio.sleep(0.02)
                listener.send({"type": "text.end"})

            async def tokens():
                for word in backend_text.split(" ")[:-1]:
                    yield word + " "
                    await asyncio.sleep(0.02)

            # Word by word, at the same time, from both sources.
            results = await asyncio.gather(browser(), backend.say_stream(tokens()))
            outcome = results[1]
            await listener.wait_for("utterance.done")
            await listener.wait_tail(await listener.wait_for("utterance.done"))
            heard = tone.decode(listener.audio.pcm(), listener.audio.sample_rate)
    assert outcome.text == backend_text
    assert heard in (browser_text + backend_text, backend_text + browser_text), heard
